"""jscenegen/run_lock.py: one process per run directory; stale locks are taken over."""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jscenegen.checkpoint.store import CheckpointStore
from jscenegen.cli import main
from jscenegen.run_lock import LOCK_NAME, RunLock, RunLockedError, read_holder

ROOT = Path(__file__).resolve().parents[1]
HOLD = ("import sys, time; from jscenegen.run_lock import RunLock; "
        "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(120)")


@pytest.fixture
def holder(tmp_path):
    """Another live process holding the lock of tmp_path/run."""
    run_dir = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE,
                             text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert child.stdout.readline() == "held\n"
        yield run_dir, child
    finally:
        child.kill()
        child.wait()


def test_a_second_process_is_refused_with_the_holder_named(holder, capsys):
    run_dir, child = holder
    who = f"pid {child.pid} on host {socket.gethostname()}"
    with pytest.raises(RunLockedError, match=f"in use by {who}"):
        RunLock(run_dir).acquire()
    # the command refuses before it reads or writes anything in the run directory
    assert main(["train", "--run-dir", str(run_dir), "logging.swanlab_mode=disabled"]) == 2
    assert f"in use by {who}" in capsys.readouterr().err
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_NAME]
    # an unfinished orbax save of the live holder is not deleted by a store opened meanwhile
    tmp = run_dir / "checkpoints" / "4.orbax-checkpoint-tmp-1700000000"
    tmp.mkdir(parents=True)
    CheckpointStore(run_dir / "checkpoints").close()
    assert tmp.is_dir()
    child.kill()
    child.wait()
    CheckpointStore(run_dir / "checkpoints").close()  # holder gone: the leftover is cleaned
    assert not tmp.exists()


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_resume_of_a_run_in_use_says_only_that(holder, capsys, caplog, checkpointed):
    """A run resumed while another process holds it: `train --resume` announced it was
    starting the run again (no checkpoint yet), or warned that a model.path override is not
    read on resume, then refused."""
    run_dir, child = holder
    (run_dir / "run.json").write_text(json.dumps({"model_dir": "m", "config_source": "c.yaml"}))
    (run_dir / "config.yaml").write_text("model: {path: m}\n")
    if checkpointed:
        (run_dir / "checkpoints" / "1").mkdir(parents=True)
        (run_dir / "checkpoints" / "1" / "checksums.json").write_text("{}")
    with caplog.at_level("WARNING"):
        assert main(["train", "--resume", str(run_dir), "model.path=other"]) == 2
    assert caplog.messages == []
    assert capsys.readouterr().err == (f"error: {run_dir} is in use by pid {child.pid} on host "
                                       f"{socket.gethostname()} (since {read_holder(run_dir).started_utc}); "
                                       "wait for it to end or use another --run-dir\n")


def test_a_resume_in_one_process_refuses_a_lock_held_on_another_host(tmp_path, capsys):
    """A resume checks the lock once its launch is known (in a multi-host run process 0 takes
    it, and another host's lock cannot be checked from the others): in one process a lock of
    another host is still refused before anything is said about the run."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "1").mkdir(parents=True)
    (run_dir / "checkpoints" / "1" / "checksums.json").write_text("{}")
    (run_dir / "run.json").write_text(json.dumps({"model_dir": "m", "config_source": "c.yaml"}))
    (run_dir / "config.yaml").write_text("model: {path: m}\n")
    (run_dir / LOCK_NAME).write_text(json.dumps({"pid": 4242, "host": "jscenegen-host-0",
                                                 "started_utc": "then"}))
    assert main(["train", "--resume", str(run_dir)]) == 2
    assert capsys.readouterr().err == (
        f"error: {run_dir} is in use by pid 4242 on host jscenegen-host-0 (since then); it cannot "
        f"be checked from this host: wait for it to end, use another --run-dir, or delete "
        f"{run_dir / LOCK_NAME} once that process is gone\n")


def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path, caplog):
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(),
                                                  "started_utc": "then"}))
    with caplog.at_level("WARNING"), RunLock(tmp_path):
        held = read_holder(tmp_path)
        assert (held.pid, held.host) == (os.getpid(), socket.gethostname())
        with pytest.raises(RunLockedError, match="already locked by this process"):
            RunLock(tmp_path).acquire()
    assert f"stale lock of pid {dead.pid}" in caplog.text
    assert not (tmp_path / LOCK_NAME).exists()  # released
    # a live pid that is no longer the holder (its start time differs): stale too
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(),
                                                  "started_utc": "then", "start_ticks": 1}))
    with RunLock(tmp_path):
        assert read_holder(tmp_path).pid == os.getpid()


def _age(path: Path) -> None:
    """Make `path` last modified before a lock being written could be."""
    from jscenegen.run_lock import WRITING_S

    then = time.time() - WRITING_S - 1
    os.utime(path, (then, then))


@pytest.mark.parametrize("text", ["", "garbage{", json.dumps({"pid": 0, "host": socket.gethostname()}),
                                  json.dumps({"pid": -1, "host": socket.gethostname()})])
def test_an_empty_or_unreadable_lock_is_stale(tmp_path, text, caplog):
    """What a kill between creating the lock file and writing it leaves: taken over (pid -1 or
    0 would make `os.kill` signal a process group and read as alive); an unreadable one is
    named as such, not as "pid -1 on host ... (since ?)" (helper-68). One modified less than
    WRITING_S ago may still be being written (where there are no hard links it is empty
    until then, and unflocked for a moment): refused, not taken over from its creator."""
    lock = tmp_path / LOCK_NAME
    lock.write_text(text)
    assert read_holder(tmp_path).alive() is True
    with pytest.raises(RunLockedError, match=f"in use: {lock} is not yet the JSON this code writes "
                       "and was modified less than 10 s ago \\(being written\\); try again"):
        RunLock(tmp_path).acquire()
    assert lock.read_text() == text
    _age(lock)
    assert read_holder(tmp_path).alive() is False
    with caplog.at_level("WARNING"), RunLock(tmp_path):
        assert read_holder(tmp_path).pid == os.getpid()
    if text in ("", "garbage{"):
        assert caplog.messages == [f"{tmp_path}: taking over the stale lock of an unreadable lock "
                                   "file (not the JSON this code writes)"]


@pytest.mark.parametrize("kind", ["a directory", "a symbolic link"])
def test_an_entry_this_code_did_not_write_is_refused_and_left_in_place(tmp_path, kind):
    """A directory named run.lock was renamed aside as run.lock.stale-PID ("Is a directory");
    a dangling link read as a lock released meanwhile ("another process keeps taking it")."""
    lock = tmp_path / LOCK_NAME
    if kind == "a directory":
        lock.mkdir()
        (lock / "keep").write_text("x")
    else:
        lock.symlink_to(tmp_path / "nowhere")
    with pytest.raises(RunLockedError, match=f"^{lock} is {kind}, not a lock file this code "
                                             "writes; move it away"):
        RunLock(tmp_path).acquire()
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]
    assert lock.is_symlink() or (lock / "keep").read_text() == "x"


def test_a_named_pipe_as_the_lock_is_refused_by_every_reader_without_waiting(tmp_path):
    """`train` (refuse_if_in_use) and every CheckpointStore (live_holder) read run.lock without
    the acquire's check: a named pipe blocked them forever."""
    from jscenegen.run_lock import live_holder, refuse_if_in_use

    os.mkfifo(tmp_path / LOCK_NAME)
    for check in (refuse_if_in_use, live_holder, lambda d: RunLock(d).acquire()):
        with pytest.raises(RunLockedError, match="is not a regular file, not a lock file"):
            check(tmp_path)


def test_a_pid_beyond_any_system_reads_as_an_unreadable_lock(tmp_path, caplog):
    """{"pid": 10**30} raised OverflowError from os.kill in every reader."""
    from jscenegen.run_lock import UNREADABLE_PID, refuse_if_in_use

    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 10 ** 30, "host": socket.gethostname()}))
    _age(tmp_path / LOCK_NAME)   # not one being written
    assert read_holder(tmp_path).pid == UNREADABLE_PID
    refuse_if_in_use(tmp_path)                      # stale: not in use
    with RunLock(tmp_path):
        assert read_holder(tmp_path).pid == os.getpid()


def test_a_lock_on_another_host_is_refused_with_the_file_to_delete(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "elsewhere-7"}))
    with pytest.raises(RunLockedError, match=f"pid 1 on host elsewhere-7.*delete {tmp_path / LOCK_NAME}"):
        RunLock(tmp_path).acquire()
    assert read_holder(tmp_path).host == "elsewhere-7"  # left as it was


@pytest.mark.parametrize("ticks", ["absent", "its own", "text", "another process's"])
def test_a_lock_naming_a_live_pid_is_judged_by_its_start_time(tmp_path, caplog, ticks):
    """A live pid whose lock has no start time may be a later process given that pid: the
    refusal now says so and names the file to delete (it said only 'wait for it to end');
    a start time written as text, compared with the int, never matched (a live holder's lock
    taken over): it counts as none; a pid now another process's was said to be gone."""
    other = subprocess.Popen(["sleep", "60"])
    try:
        entry = {"pid": other.pid, "host": socket.gethostname(), "started_utc": "then"}
        real_ticks = int(Path(f"/proc/{other.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        if ticks == "its own":
            entry["start_ticks"] = real_ticks
        elif ticks == "text":
            entry["start_ticks"] = str(real_ticks)
        elif ticks == "another process's":
            entry["start_ticks"] = real_ticks - 1
        (tmp_path / LOCK_NAME).write_text(json.dumps(entry))
        if ticks in ("absent", "text"):
            with pytest.raises(RunLockedError, match=(
                    rf"in use by pid {other.pid} on host \S+ \(since then\); the lock gives no start "
                    rf"time to tell it from a later process with that pid: wait for it to end, use "
                    rf"another --run-dir, or delete {tmp_path / LOCK_NAME} once that process is gone$")):
                RunLock(tmp_path).acquire()
            return
        if ticks == "its own":
            with pytest.raises(RunLockedError, match=f"in use by pid {other.pid} .*; wait for it to end "
                                                     "or use another --run-dir$"):
                RunLock(tmp_path).acquire()
            return
        with caplog.at_level("WARNING"), RunLock(tmp_path):
            pass
        assert caplog.messages == [f"{tmp_path}: taking over the stale lock of pid {other.pid} on host "
                                   f"{socket.gethostname()} (since then) (pid {other.pid} is now "
                                   "another process)"]
    finally:
        other.kill()
        other.wait()


def test_a_zombie_holder_is_gone_whatever_its_lock_says(tmp_path, caplog):
    """A zombie's lock without a start time was refused as 'cannot be told'; with its start
    time, taken over as 'now another process'."""
    zombie = subprocess.Popen(["true"])
    try:
        for _ in range(200):
            if Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
            time.sleep(0.01)
        ticks = int(Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        for extra in ({}, {"start_ticks": ticks}):
            (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": zombie.pid, "host": socket.gethostname(),
                                                          "started_utc": "then", **extra}))
            caplog.clear()
            with caplog.at_level("WARNING"), RunLock(tmp_path):
                pass
            assert caplog.messages == [f"{tmp_path}: taking over the stale lock of pid {zombie.pid} on "
                                       f"host {socket.gethostname()} (since then) (that process is gone)"]
    finally:
        zombie.wait()


def test_a_lock_that_created_the_run_directory_removes_it_when_nothing_was_written(tmp_path):
    with RunLock(tmp_path / "new"):
        assert (tmp_path / "new" / LOCK_NAME).is_file()
    assert not (tmp_path / "new").exists()
    with RunLock(tmp_path / "kept"):
        (tmp_path / "kept" / "metrics.jsonl").write_text("{}\n")
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["metrics.jsonl"]
    # the parents it made too: a default run stopped in its warm start left an empty runs/
    with RunLock(tmp_path / "runs" / "20261205-083713"):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]
    (tmp_path / "runs" / "other").mkdir(parents=True)
    with RunLock(tmp_path / "runs" / "a" / "b"):
        pass
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["other"]


def test_an_interrupt_while_taking_the_lock_leaves_no_lock_and_no_run_directory(tmp_path,
                                                                               monkeypatch):
    """SIGTERM between creating the lock file and marking it held left run.lock behind (the
    caller's release saw a lock not held; seen under load in the CLI's SIGTERM test)."""
    created = RunLock._create

    def create_then_interrupted(self, text):
        created(self, text)
        assert read_holder(self.run_dir).is_this_process()
        raise KeyboardInterrupt
    monkeypatch.setattr(RunLock, "_create", create_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        RunLock(tmp_path / "new").acquire()
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    with pytest.raises(KeyboardInterrupt):
        RunLock(tmp_path / "kept").acquire()
    assert list((tmp_path / "kept").iterdir()) == []


def test_a_second_lock_of_this_process_is_refused_and_leaves_the_first_ones_file(tmp_path):
    with RunLock(tmp_path) as first:
        with pytest.raises(RunLockedError, match="already locked by this process"):
            RunLock(tmp_path).acquire()
        assert read_holder(tmp_path).is_this_process()   # the refused one removed nothing
        assert (tmp_path / LOCK_NAME).is_file() and first._held
    assert not (tmp_path / LOCK_NAME).exists()


@pytest.mark.parametrize("other", ["namespace, alive", "namespace, gone", "boot"])
def test_a_lock_from_another_pid_namespace_or_boot_of_this_host_name(tmp_path, other, caplog):
    """Containers sharing the host name (docker --net=host, a restarted pod) have their own
    pids: a live holder was taken over as stale (its pid missing here) and both wrote the run.
    Its flock on the lock file says whether it lives; a lock of an earlier boot is stale."""
    import fcntl

    from jscenegen.run_lock import _pid_space, refuse_if_in_use

    boot, ns = _pid_space().split("/")
    space = f"not-{boot}/{ns}" if other == "boot" else f"{boot}/{int(ns) + 1}"
    lock = tmp_path / LOCK_NAME
    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                "start_ticks": 1, "pid_space": space}))
    holder_fd = os.open(lock, os.O_RDONLY)
    try:
        if other == "namespace, alive":   # the holder's flock (this fd stands for it)
            fcntl.flock(holder_fd, fcntl.LOCK_EX)
            assert read_holder(tmp_path).alive() is True
            with pytest.raises(RunLockedError, match="is in use by pid"):
                refuse_if_in_use(tmp_path)
            with pytest.raises(RunLockedError, match="is in use by pid"):
                RunLock(tmp_path).acquire()
            return
        assert read_holder(tmp_path).alive() is False
        with RunLock(tmp_path):
            assert read_holder(tmp_path).pid_space == _pid_space()
            assert _flock_held_by_the_new_lock(tmp_path)
        # its pid names nothing here: the warning does not read this namespace's /proc for it
        assert caplog.messages[-1].endswith(
            "(written in another PID namespace or boot; no process keeps its flock)")
    finally:
        os.close(holder_fd)


def _flock_held_by_the_new_lock(run_dir) -> bool:
    from jscenegen.run_lock import _flock_held

    return _flock_held(run_dir / LOCK_NAME) is True


@pytest.mark.parametrize("code", ["EPERM", "ENOSYS"])
def test_a_filesystem_without_hard_links_gets_the_lock_created_in_place(tmp_path, monkeypatch,
                                                                        code):
    """ENOSYS from os.link (a FUSE filesystem without link) was raised instead of creating
    the lock exclusively in place."""
    import errno

    def no_link(src, dst):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
    monkeypatch.setattr(os, "link", no_link)
    with RunLock(tmp_path):
        assert read_holder(tmp_path).is_this_process()
        assert [p.name for p in tmp_path.iterdir()] == [LOCK_NAME]
    assert list(tmp_path.iterdir()) == []


def test_a_run_directory_made_meanwhile_by_another_process(tmp_path, monkeypatch):
    """Two processes creating a fresh run directory at once: the one that lost the race to
    mkdir failed with a raw FileExistsError; it takes the lock, and its release leaves the
    directory it did not make (the parent it did make goes only when empty)."""
    run_dir = tmp_path / "runs" / "new"
    made = Path.mkdir

    def mkdir_after_another_process(self, *args, **kwargs):
        if self == run_dir and self.parent.is_dir() and not self.exists():
            made(self)   # the other process wins the race
            (self / "metrics.jsonl").write_text("{}\n")
        return made(self, *args, **kwargs)
    monkeypatch.setattr(Path, "mkdir", mkdir_after_another_process)
    with RunLock(run_dir):
        assert read_holder(run_dir).is_this_process()
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]
    (run_dir / "metrics.jsonl").unlink()
    monkeypatch.undo()
    with RunLock(run_dir):
        pass
    assert run_dir.is_dir()   # it was there before this lock: kept though empty


def test_a_stale_lock_naming_this_pid_from_an_earlier_start_is_taken_over(tmp_path, caplog):
    """A container restarted with the same small pid and PID namespace inode: the lock of its
    earlier run names this pid in this pid space, with another start time. It was refused as
    'already locked by this process', forever."""
    from jscenegen.run_lock import _pid_space, _proc_stat, live_holder, refuse_if_in_use

    (tmp_path / LOCK_NAME).write_text(json.dumps({
        "pid": os.getpid(), "host": socket.gethostname(), "started_utc": "earlier",
        "start_ticks": _proc_stat(os.getpid())[1] - 1, "pid_space": _pid_space()}))
    assert not read_holder(tmp_path).is_this_process()
    assert live_holder(tmp_path) is None
    refuse_if_in_use(tmp_path)
    with caplog.at_level("WARNING"), RunLock(tmp_path):
        assert read_holder(tmp_path).is_this_process()
    assert caplog.messages == [f"{tmp_path}: taking over the stale lock of pid {os.getpid()} on host "
                               f"{socket.gethostname()} (since earlier) (pid {os.getpid()} is now "
                               "another process)"]


def _live_lock(proc) -> dict:
    ticks = int(Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    return {"pid": proc.pid, "host": socket.gethostname(), "started_utc": "now",
            "start_ticks": ticks}


@pytest.mark.parametrize("links", [True, False])
def test_a_takeover_that_set_aside_a_fresh_lock_never_overwrites_a_third_one(tmp_path, caplog,
                                                                             monkeypatch, links):
    """The takeover renames the stale lock aside and re-reads it; when it was another
    process's fresh lock meanwhile (B took the stale one over first), it is put back. That
    put-back was an os.replace, which overwrote the lock a third process (C) had created in
    the gap: C ran on without its file. Now the name is only linked back where it is free
    (checked first where the filesystem has no hard links)."""
    import errno

    from jscenegen import run_lock

    if not links:
        def no_link(src, dst):
            raise OSError(errno.EPERM, "no hard links")
        monkeypatch.setattr(os, "link", no_link)

    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    b, c = subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sleep", "60"])
    read = run_lock._read

    def read_with_b_and_c_meanwhile(path):
        if path.name != LOCK_NAME and not (tmp_path / LOCK_NAME).exists():
            path.write_text(json.dumps(_live_lock(b)))                     # what was set aside
            (tmp_path / LOCK_NAME).write_text(json.dumps(_live_lock(c)))   # C in the gap
        return read(path)
    monkeypatch.setattr(run_lock, "_read", read_with_b_and_c_meanwhile)
    try:
        with caplog.at_level("WARNING"), pytest.raises(RunLockedError, match=f"in use by pid {c.pid} "):
            RunLock(tmp_path).acquire()
        assert caplog.messages == [f"{tmp_path}: the lock of pid {b.pid} on host {socket.gethostname()} "
                                   "(since now), set aside while taking over a stale one, could not "
                                   f"be put back: {tmp_path / LOCK_NAME} was made meanwhile"]
        assert read_holder(tmp_path).pid == c.pid
        assert [p.name for p in tmp_path.iterdir()] == [LOCK_NAME]   # nothing left aside
    finally:
        for proc in (b, c):
            proc.kill()
            proc.wait()


def test_two_takeovers_of_one_stale_lock_take_turns(tmp_path, monkeypatch):
    """B read the stale lock; before B set it aside, A took it over and made its own lock, and
    B then set aside A's fresh one: with a third process creating a lock in that gap, two
    processes held the run at once (helper-157, 3 in ~400 trials of 6 starters). Now a
    takeover holds the run directory's flock from its read to its rename: A, starting while B
    is inside its takeover, waits, and (here, where B stays inside longer than A waits) is
    refused; B takes the lock."""
    from jscenegen import run_lock

    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    monkeypatch.setattr(run_lock, "TAKEOVER_WAIT_S", 0.2)
    read = run_lock.read_holder
    a, outcome = RunLock(tmp_path), {}

    def a_starts_while_b_has_read(run_dir):
        seen = read(run_dir)
        if not outcome:
            try:
                outcome["a"] = a.acquire()
            except RunLockedError as err:
                outcome["a"] = err
        return seen
    monkeypatch.setattr(run_lock, "read_holder", a_starts_while_b_has_read)
    b = RunLock(tmp_path).acquire()
    try:
        assert isinstance(outcome["a"], RunLockedError), outcome
        assert str(outcome["a"]) == (f"{tmp_path}: another process has been taking over its stale "
                                     f"{LOCK_NAME} for 0.2 s; try again")
        assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == b._token
    finally:
        b.release()


def test_a_takeover_leaves_another_takeovers_file_alone(tmp_path):
    """The stale lock was renamed aside as run.lock.stale-PID: a process of another PID
    namespace with the same pid, taking over at the same time, had its file overwritten."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    theirs = tmp_path / f"{LOCK_NAME}.stale-{os.getpid()}"
    theirs.write_text("another takeover's")
    with RunLock(tmp_path):
        assert read_holder(tmp_path).is_this_process()
    assert theirs.read_text() == "another takeover's"
    assert [p.name for p in tmp_path.iterdir()] == [theirs.name]


def test_a_lock_being_written_where_there_are_no_hard_links_is_not_stale(tmp_path, monkeypatch):
    """Without hard links the lock file is created empty, then written: a process reading it
    in between saw an unreadable lock, stale, and took it over from its live creator (which
    already held its flock)."""
    import errno

    from jscenegen.run_lock import live_holder, refuse_if_in_use

    def no_link(src, dst):
        raise OSError(errno.EPERM, "no hard links")
    monkeypatch.setattr(os, "link", no_link)
    opened, seen = os.fdopen, {}

    def fdopen(fd, *args, **kwargs):
        if args[:1] == ("w",) and (tmp_path / LOCK_NAME).exists() and not seen:
            seen["alive"] = read_holder(tmp_path).alive()   # what another process sees now
            seen["live"] = live_holder(tmp_path)
            for check in (refuse_if_in_use, lambda d: RunLock(d).acquire()):
                with pytest.raises(RunLockedError) as refused:
                    check(tmp_path)
                seen.setdefault("refusals", []).append(str(refused.value))
        return opened(fd, *args, **kwargs)
    monkeypatch.setattr(os, "fdopen", fdopen)
    with RunLock(tmp_path):
        assert read_holder(tmp_path).is_this_process()
    assert seen["alive"] is True and seen["live"] is not None
    assert seen["refusals"] == [f"{tmp_path} is in use by the process holding the flock of "
                                f"{tmp_path / LOCK_NAME} (not yet the JSON this code writes: being "
                                "written); wait for it to end or use another --run-dir"] * 2


def test_a_lock_this_user_cannot_read_is_refused_not_taken_over(tmp_path, monkeypatch):
    """Another user's lock file (written 0600) could not be read: it read as an unreadable
    lock, stale, and a second user took over the lock of a live run. It cannot be checked:
    refused, the file and its owner named; a store leaves the run's files alone."""
    import errno
    import pwd

    from jscenegen import run_lock
    from jscenegen.run_lock import live_holder, refuse_if_in_use

    lock = tmp_path / LOCK_NAME
    lock.write_text(json.dumps({"pid": 1, "host": socket.gethostname()}))

    def refused(path):   # what reading another user's 0600 file raises (root reads any file)
        raise PermissionError(errno.EACCES, "Permission denied", str(path))
    monkeypatch.setattr(run_lock, "_load", refused)
    uid = os.stat(lock).st_uid
    owner = f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    assert read_holder(tmp_path).alive() is None
    assert live_holder(tmp_path) is not None
    expected = (f"{tmp_path} is in use by the process that wrote {lock}, which cannot be read here "
                f"(Permission denied; owned by {owner}); whether it lives cannot be checked: wait "
                f"for it to end, use another --run-dir, or delete {lock} once that process is gone")
    for check in (refuse_if_in_use, lambda d: RunLock(d).acquire()):
        with pytest.raises(RunLockedError) as refusal:
            check(tmp_path)
        assert str(refusal.value) == expected
    assert [p.name for p in tmp_path.iterdir()] == [LOCK_NAME]
    assert json.loads(lock.read_text())["pid"] == 1   # left as it was


@pytest.mark.parametrize("links", [True, False])
def test_the_lock_file_is_readable_by_every_user(tmp_path, monkeypatch, links):
    """It was made by mkstemp (0600): another user could not read it, so could not tell its
    holder lives. 0644 whatever the umask, hard links or none."""
    import errno
    import stat

    if not links:
        def no_link(src, dst):
            raise OSError(errno.EPERM, "no hard links")
        monkeypatch.setattr(os, "link", no_link)
    umask = os.umask(0o077)
    try:
        with RunLock(tmp_path):
            assert stat.S_IMODE(os.stat(tmp_path / LOCK_NAME).st_mode) == 0o644
    finally:
        os.umask(umask)

    def no_chmod(fd, mode):   # a filesystem that refuses chmod: the lock is taken all the same
        raise OSError(errno.EPERM, "not permitted")
    monkeypatch.setattr(os, "fchmod", no_chmod)
    with RunLock(tmp_path):
        assert read_holder(tmp_path).is_this_process()


def test_a_lock_created_without_hard_links_keeps_its_flock_and_its_file(tmp_path, monkeypatch,
                                                                      caplog):
    """Without hard links the file is created (O_EXCL), then flocked: a second starter
    arriving in between read the empty, unflocked file as stale and took it over (both ran),
    and a reader's momentary flock probe landing there cost the creator its flock (it read
    as contention, and the holder ran without one)."""
    import errno
    import fcntl
    import threading

    from jscenegen import run_lock

    def no_link(src, dst):
        raise OSError(errno.EPERM, "no hard links")
    monkeypatch.setattr(os, "link", no_link)
    path, real, seen = tmp_path / LOCK_NAME, run_lock._try_flock, {}

    def try_flock(fd):
        if not seen and path.exists() and path.stat().st_size == 0:
            seen["refused"] = None
            with pytest.raises(RunLockedError, match="being written") as refused:
                RunLock(tmp_path).acquire()        # a second starter in the gap
            seen["refused"] = str(refused.value)
            probe = os.open(path, os.O_RDWR)      # a reader's probe holds the flock a moment
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            threading.Timer(0.05, os.close, (probe,)).start()
        return real(fd)
    monkeypatch.setattr(run_lock, "_try_flock", try_flock)
    with caplog.at_level("WARNING"), RunLock(tmp_path) as lock:
        assert seen["refused"]
        assert read_holder(tmp_path).is_this_process() and lock._flock_fd is not None
        monkeypatch.setattr(run_lock, "_try_flock", real)
        assert run_lock._flock_held(path) is True
    assert caplog.messages == [] and list(tmp_path.iterdir()) == []


FORK_KEEPS_NOTHING = """
import os, sys
from pathlib import Path
from jscenegen.run_lock import LOCK_NAME, RunLock, _flock_held, read_holder
d = Path(sys.argv[1])
with RunLock(d) as lock:
    child = os.fork()
    if child == 0:
        code = 1
        try:
            code = 0 if lock._flock_fd is None else 2
            lock.release()
            code = code or (0 if (d / LOCK_NAME).exists() else 3)
        finally:
            os._exit(code)
    assert os.waitpid(child, 0)[1] == 0
    assert read_holder(d).is_this_process() and _flock_held(d / LOCK_NAME) is True
print("ok")
"""
FORK_DURING_A_TAKEOVER = """
import json, os, socket, sys, time
from pathlib import Path
from jscenegen import run_lock
from jscenegen.run_lock import LOCK_NAME, RunLock
d = Path(sys.argv[1])
d.mkdir()
stale = json.dumps({"pid": 4000000, "host": socket.gethostname(), "start_ticks": 1})
(d / LOCK_NAME).write_text(stale)
run_lock.TAKEOVER_WAIT_S = 0.5
read, children = run_lock.read_holder, []
def fork_a_worker_inside(run_dir):
    if not children:
        child = os.fork()
        if child == 0:
            time.sleep(30)
            os._exit(0)
        children.append(child)
    return read(run_dir)
run_lock.read_holder = fork_a_worker_inside
try:
    RunLock(d).acquire().release()
    (d / LOCK_NAME).write_text(stale)
    RunLock(d).acquire().release()   # the worker still runs: its copy of the guard is closed
finally:
    os.kill(children[0], 9)
    os.waitpid(children[0], 0)
print("ok")
"""
HOLD_THEN_DIE_LEAVING_A_WORKER = """
import os, sys, time
from jscenegen.run_lock import RunLock
RunLock(sys.argv[1]).acquire()
worker = os.fork()
if worker == 0:
    os.close(1)   # the test reads stdout to its end
    os.close(2)
    time.sleep(60)
    os._exit(0)
print(worker, flush=True)
os._exit(0)
"""


def test_a_forked_child_neither_keeps_the_lock_alive_nor_releases_it(tmp_path, caplog):
    """A child forked without exec (a multiprocessing fork worker) inherited the flocked
    descriptor: outliving a killed holder, it kept the dead holder's lock alive (refused
    naming a dead pid, with no way out). It closes its copy at fork now, which leaves the
    parent's flock, and its copy of the lock does not remove the parent's file. (Forked in
    a fresh interpreter: pytest's has JAX's threads.)"""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", FORK_KEEPS_NOTHING, str(tmp_path / "a")],
                          capture_output=True, text=True, env=env, timeout=60)
    assert (done.returncode, done.stdout) == (0, "ok\n"), done.stderr

    run_dir = tmp_path / "run"
    holder = subprocess.run([sys.executable, "-c", HOLD_THEN_DIE_LEAVING_A_WORKER, str(run_dir)],
                            capture_output=True, text=True, env=env, timeout=60)
    worker = int(holder.stdout or 0)
    try:
        assert worker > 0, holder.stderr
        dead = read_holder(run_dir)
        assert dead.alive() is False
        with caplog.at_level("WARNING"), RunLock(run_dir):
            assert read_holder(run_dir).is_this_process()
        assert caplog.messages == [f"{run_dir}: taking over the stale lock of {dead.describe()} "
                                   "(that process is gone)"]
    finally:
        if worker > 0:
            os.kill(worker, 9)   # not this process's child: reaped by init


def test_a_child_forked_during_a_takeover_does_not_keep_the_directory_guarded(tmp_path):
    """The takeover's flock on the run directory was inherited by a child forked (without exec)
    meanwhile: while it lived, every later takeover there waited and was refused ("try
    again", which never helped). The child closes its copy at fork now."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", FORK_DURING_A_TAKEOVER, str(tmp_path / "run")],
                          capture_output=True, text=True, env=env, timeout=60)
    assert (done.returncode, done.stdout) == (0, "ok\n"), done.stderr[-2000:]


def test_a_dead_holder_whose_flock_another_process_keeps_names_the_file_to_delete(tmp_path):
    """The pid is gone, yet some process holds the file's flock (a child the holder forked,
    from a version that did not close it): refused as "in use by pid N ... wait for it to
    end", naming a dead pid with no way out."""
    import fcntl

    dead = subprocess.Popen(["true"])
    dead.wait()
    path = tmp_path / LOCK_NAME
    path.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started_utc": "then"}))
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(RunLockedError) as refused:
            RunLock(tmp_path).acquire()
        assert str(refused.value) == (
            f"{tmp_path} is in use: pid {dead.pid} on host {socket.gethostname()} (since then) has "
            f"ended, but another process still holds the flock of {path} (one it forked, say; "
            f"`fuser {path}` names it): wait for that process to end or stop it, then delete "
            f"{path}; or use another --run-dir")
    finally:
        os.close(fd)
    with RunLock(tmp_path):
        assert read_holder(tmp_path).is_this_process()


def test_a_lock_set_aside_that_cannot_be_put_back_is_kept_and_named(tmp_path, monkeypatch):
    """The takeover set aside another process's fresh lock, and putting it back failed with
    an error other than "no hard links" (EACCES, EROFS, ENOSPC): the set-aside live lock was
    deleted."""
    import errno

    from jscenegen import run_lock

    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    b = subprocess.Popen(["sleep", "60"])
    read = run_lock._read

    def read_with_b_meanwhile(path):
        if path.name != LOCK_NAME and not (tmp_path / LOCK_NAME).exists():
            path.write_text(json.dumps(_live_lock(b)))   # B took the stale one over first
        return read(path)

    def refused(aside, path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    monkeypatch.setattr(run_lock, "_read", read_with_b_meanwhile)
    monkeypatch.setattr(run_lock, "_put_back", refused)
    try:
        with pytest.raises(RunLockedError) as err:
            RunLock(tmp_path).acquire()
        [aside] = tmp_path.iterdir()
        assert json.loads(aside.read_text())["pid"] == b.pid
        assert str(err.value) == (
            f"{tmp_path}: {aside}, the lock set aside while taking over a stale one, could not be "
            f"put back ([Errno {errno.EROFS}] {os.strerror(errno.EROFS)}); it is kept: rename it "
            f"to {tmp_path / LOCK_NAME} if its process may still run, else delete it; then start "
            "again")
    finally:
        b.kill()
        b.wait()


def test_release_removes_the_file_before_it_drops_the_flock(tmp_path, monkeypatch):
    """The flock was dropped first: in between, a starter in another PID namespace (where
    the flock is all that tells the holder lives) saw a stale lock and took it over."""
    from jscenegen.run_lock import _flock_held

    unlink, flocked = Path.unlink, []

    def recording_unlink(self, *args, **kwargs):
        if self.name == LOCK_NAME:
            flocked.append(_flock_held(self))
        return unlink(self, *args, **kwargs)
    monkeypatch.setattr(Path, "unlink", recording_unlink)
    with RunLock(tmp_path):
        pass
    assert flocked == [True] and not (tmp_path / LOCK_NAME).exists()
