"""One process per run directory: `RUN_DIR/run.lock` names the process that writes the run.

`jscenegen train` takes the lock before it reads or writes anything in the run directory
(checkpoints, `metrics.jsonl`, `config.yaml`, swanlab) and removes it when it ends, however it
ends short of SIGKILL. The file (mode 0644, so other users can check it too) is JSON: {"pid",
"host", "started_utc", "start_ticks"} (the kernel's start time of the process, to tell a
reused pid from the holder), "pid_space" (the boot id and PID namespace: a pid means nothing
in another namespace, where the holder's flock on the file, kept while it runs, tells whether
it lives) and a random "token" that tells the `RunLock` that wrote it, so releasing removes
only its own file.

- A second process is refused (`RunLockedError`, exit 2) with the holder's pid and host named.
- A stale lock (on this host, and its pid is gone, a zombie, or now another process, and no
  process holds the file's flock) is taken over with a warning; so is one whose content is
  not the JSON (empty, garbage), whose flock nobody holds and that was last modified
  WRITING_S or more ago (a younger one is being written: refused). Processes that find a
  stale lock at once take turns (an flock on the run directory, where the filesystem gives
  directories one: NFS may not across hosts), so one never sets aside the lock another has
  just taken. A lock whose pid is gone
  while some process still holds its flock (a child the holder forked without exec, which
  outlived it) is refused naming the file to delete once that process is gone. Children a
  holder forks with `os.fork` (multiprocessing's fork) close their copy of the lock's flock
  descriptor (`os.register_at_fork`) and never release the lock. A lock held on another host,
  naming a live pid with no start time to compare (none in the file, or /proc unreadable), or
  that this user cannot read (another user's, written 0600 by an earlier version), cannot be
  checked: it is refused, and the message says which file to delete once that process is
  known to be gone (and, for an unreadable one, who owns it). A start time that is not an
  integer counts as none.
- `live_holder(run_dir)` lets readers (e.g. `CheckpointStore`, which deletes unfinished orbax
  saves it finds) leave the files of a live holder alone.

Multi-host runs take the lock on process 0 only (the run directory is shared).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import fcntl
import json
import logging
import os
import pwd
import secrets
import socket
import stat
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_NAME = "run.lock"
LOCK_MODE = 0o644     # every user can read who holds a run directory
UNREADABLE_PID = -1   # the holder a lock file that is not our JSON reads as
WRITING_S = 10.0      # a lock file not yet the JSON and modified this recently is being written
FLOCK_WAIT_S = 1.0    # how long a new lock file's flock is retried while a reader's probe holds it
TAKEOVER_WAIT_S = 5.0  # how long a takeover waits for another process's takeover (a few file ops)


class RunLockedError(ValueError):
    """The run directory is locked by another live process (named in the message)."""


@dataclasses.dataclass(frozen=True)
class Holder:
    """What a lock file says about the process that holds it."""

    pid: int
    host: str
    started_utc: str = "?"
    start_ticks: int | None = None
    pid_space: str | None = None   # `_pid_space()` where it was written (None: not recorded)
    lock_path: Path | None = dataclasses.field(default=None, compare=False)  # the file read
    unreadable: str | None = None   # why the file could not be read (then the pid is UNREADABLE_PID)

    def on_this_host(self) -> bool:
        """Whether its pid can be looked up here: the same host name and, where the lock
        records it, the same boot and PID namespace (containers sharing a host name, e.g.
        `docker run --net=host`, have their own pids)."""
        return self.host == socket.gethostname() and (
            self.pid_space is None or self.pid_space == _pid_space())

    def is_this_process(self) -> bool:
        """Whether this process wrote the lock: its pid here with this process's start time
        (a restarted container runs again with the same small pid and PID namespace inode:
        the lock of its earlier run is stale, not this process's)."""
        return self.on_this_host() and self.pid == os.getpid() and (
            self.start_ticks == _own_start_ticks())

    def alive(self) -> bool | None:
        """True/False on this host (a zombie or a reused pid is not the holder, nor a process of
        an earlier boot); None when it cannot be told: on another host or in another PID
        namespace, or a live pid whose start time is unknown (no /proc, or a lock without
        `start_ticks`: it may be a later process given the same pid). A pid
        <= 0 (an unreadable lock file) names no process: `os.kill` would signal a whole process
        group or every process. Never False while some process holds the file's flock (its
        holder keeps one while it lives; a child it forks without exec closes its copy), nor
        for a file not yet the JSON that was modified less than WRITING_S ago (a lock created
        where there are no hard links is empty until written, and flocked only just after it
        is created)."""
        verdict = self._alive_by_pid()
        if verdict is False and self.lock_path is not None and (
                _flock_held(self.lock_path) or self.being_written()):
            return True
        return verdict

    def being_written(self) -> bool:
        """Whether the file is not (yet) the JSON and was modified less than WRITING_S ago
        (either way: a clock ahead or behind by that much counts too)."""
        if self.pid != UNREADABLE_PID or self.unreadable is not None or self.lock_path is None:
            return False
        try:
            age = time.time() - os.stat(self.lock_path).st_mtime
        except OSError:
            return False
        return abs(age) < WRITING_S

    def _alive_by_pid(self) -> bool | None:
        if self.unreadable is not None:
            return None   # another user's file, say: nothing tells whether its writer lives
        if self.host != socket.gethostname():
            return None
        here = _pid_space()
        if self.pid_space is not None and here is not None and self.pid_space != here:
            if self.pid_space.split("/")[0] != here.split("/")[0]:
                return False   # another boot of this host has ended, its processes with it
            # another PID namespace of this kernel (a container sharing the host name, or the
            # same container restarted): its pid means nothing here, but its holder keeps an
            # flock on the file for as long as it lives
            return _flock_held(self.lock_path) if self.lock_path is not None else None
        if self.pid <= 0:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # another user's process: alive
        proc = _proc_stat(self.pid)
        if proc is not None and proc[0] in _NOT_RUNNING:
            return False
        if proc is None or self.start_ticks is None:
            return None
        return proc[1] == self.start_ticks

    def describe(self) -> str:
        """The holder in words, for messages."""
        if self.unreadable is not None:
            return (f"the process that wrote {self.lock_path}, which cannot be read here "
                    f"({self.unreadable})")
        if self.pid == UNREADABLE_PID:
            return "an unreadable lock file (not the JSON this code writes)"
        return f"pid {self.pid} on host {self.host} (since {self.started_utc})"


_NOT_RUNNING = ("Z", "X")   # /proc states of a process that has ended (zombie, dead)


def _try_flock(fd: int) -> bool | None:
    """Take an exclusive flock on `fd` without waiting: True when taken, False when another
    descriptor holds it, None where the filesystem gives none."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return None


def _flock_within(fd: int, seconds: float) -> bool | None:
    """`_try_flock` retried for up to `seconds` while another descriptor holds the flock (a
    reader's `_flock_held` probe on a lock file just created, another process's takeover on a
    run directory: each holds it only a moment); False after that, None without flock."""
    deadline = time.monotonic() + seconds
    while True:
        taken = _try_flock(fd)
        if taken is not False or time.monotonic() >= deadline:
            return taken
        time.sleep(0.005)


def _open_lock_file(path: Path) -> int | None:
    """A read-write descriptor of `path` (NFS emulates flock with a write lock, which a
    read-only descriptor refuses; a pipe swapped in does not block), or None."""
    try:
        return os.open(path, os.O_RDWR | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None


def _flock_held(path: Path) -> bool | None:
    """Whether some process holds an flock on `path` (the live holder of a lock this code
    wrote keeps one; the kernel drops it when that process ends, in any PID namespace); None
    when it cannot be told (no file, no flock on this filesystem)."""
    fd = _open_lock_file(path)
    if fd is None:
        return None
    try:
        taken = _try_flock(fd)
        if taken:
            fcntl.flock(fd, fcntl.LOCK_UN)
        return None if taken is None else not taken
    finally:
        os.close(fd)


def _flocked(path: Path) -> int | None:
    """A descriptor of `path` holding an exclusive flock on it, or None."""
    fd = _open_lock_file(path)
    if fd is not None and not _try_flock(fd):
        os.close(fd)
        return None
    return fd


def _own_start_ticks() -> int | None:
    """This process's start time as its lock records it (None without /proc)."""
    proc = _proc_stat(os.getpid())
    return proc[1] if proc else None


def _pid_space() -> str | None:
    """This boot's id and this process's PID namespace ("<boot_id>/<inode>"): pids mean the
    same process only where both match; None without /proc."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of `pid` from /proc, None where there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # after "pid (comm) "
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def read_holder(run_dir: str | Path) -> Holder | None:
    """The holder named by `run_dir/run.lock`; None when there is no lock file.

    A lock file that is not the documented JSON reads as a holder with pid UNREADABLE_PID
    (not alive, so it is taken over as stale, unless some process holds the file's flock).
    One that cannot be read (another user's, made unreadable) reads as a holder with pid
    UNREADABLE_PID and `unreadable` saying why: whether it lives cannot be told (refused).
    """
    return _read(Path(run_dir) / LOCK_NAME)


LOCK_BYTES_MAX = 4096   # far more than the JSON this code writes
PID_MAX = 1 << 22        # Linux's largest pid_max


def _read(path: Path) -> Holder | None:
    """The holder `path` names, None when it does not exist. Raises RunLockedError when it is
    no regular file (a named pipe would block the read forever). A file that cannot be read
    is not known to be stale (`Holder.unreadable`); only one whose content is not the JSON is."""
    _refuse_a_foreign_entry(path)
    try:
        data = _load(path)
        pid, ticks, space = int(data["pid"]), data.get("start_ticks"), data.get("pid_space")
        if not 0 < pid <= PID_MAX:
            raise ValueError(f"pid {pid} out of range")
        return Holder(pid, str(data["host"]), str(data.get("started_utc", "?")),
                      ticks if isinstance(ticks, int) and not isinstance(ticks, bool) else None,
                      space if isinstance(space, str) else None, path)
    except FileNotFoundError:
        return None
    except OSError as err:
        return Holder(UNREADABLE_PID, socket.gethostname(), "?", None, None, path,
                      unreadable=_why_unreadable(path, err))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return Holder(UNREADABLE_PID, socket.gethostname(), "?", None, None, path)


def _why_unreadable(path: Path, err: OSError) -> str:
    """The error reading `path` and, where it can be told, the file's owner."""
    why = err.strerror or str(err)
    try:
        uid = os.stat(path).st_uid
    except OSError:
        return why
    try:
        return f"{why}; owned by uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"{why}; owned by uid {uid}"


def _load(path: Path):
    """The JSON value of the lock file (at most LOCK_BYTES_MAX bytes read). Raises OSError
    (FileNotFoundError when there is none) or ValueError; never waits on a named pipe."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        return json.loads(f.read(LOCK_BYTES_MAX))


def _refuse_a_foreign_entry(path: Path) -> None:
    """A directory, a symbolic link or another non-file named run.lock is not a lock this code
    wrote: taking it over would rename the user's entry aside, a dangling link reads as a lock
    released meanwhile, forever, and reading a named pipe blocks. Raises RunLockedError."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else
                "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file")
        raise RunLockedError(f"{path} is {kind}, not a lock file this code writes; "
                             "move it away, then start again")


def live_holder(run_dir: str | Path) -> Holder | None:
    """The holder of `run_dir`'s lock when it is another process that is (or may be) alive."""
    holder = read_holder(run_dir)
    if holder is None or holder.is_this_process() or holder.alive() is False:
        return None
    return holder


def refuse_if_in_use(run_dir: str | Path) -> None:
    """Raise RunLockedError (naming the process) when another process that is, or may be,
    alive holds `run_dir`'s lock: checked before a command says what it will do there."""
    holder = read_holder(run_dir)
    if holder is not None and not holder.is_this_process():
        _refuse_a_live_holder(Path(run_dir), holder)


def _refuse_a_live_holder(run_dir: Path, holder: Holder) -> None:
    alive = holder.alive()
    if alive is None:
        why = ("whether it lives cannot be checked" if holder.unreadable is not None else
               "it cannot be checked from this host" if holder.host != socket.gethostname() else
               "it runs in another PID namespace of this host (a container sharing the host "
               "name), where its pid cannot be checked, and this filesystem keeps no flock to "
               "tell" if not holder.on_this_host() else
               "the lock gives no start time to tell it from a later process with that pid"
               if holder.start_ticks is None else "its start time cannot be read here (/proc)")
        raise RunLockedError(f"{run_dir} is in use by {holder.describe()}; {why}: wait for it "
                             f"to end, use another --run-dir, or delete {run_dir / LOCK_NAME} "
                             "once that process is gone")
    if alive:
        path = run_dir / LOCK_NAME
        if holder.pid == UNREADABLE_PID:
            if holder.lock_path is not None and _flock_held(holder.lock_path) is not True:
                raise RunLockedError(
                    f"{run_dir} is in use: {path} is not yet the JSON this code writes and was "
                    f"modified less than {WRITING_S:g} s ago (being written); try again in a few "
                    "seconds or use another --run-dir")
            who = (f"the process holding the flock of {path} (not yet the JSON this code "
                   "writes: being written)")
        elif holder._alive_by_pid() is False:
            raise RunLockedError(
                f"{run_dir} is in use: {holder.describe()} has ended, but another process still "
                f"holds the flock of {path} (one it forked, say; `fuser {path}` names it): wait "
                f"for that process to end or stop it, then delete {path}; or use another "
                "--run-dir")
        else:
            who = holder.describe()
        raise RunLockedError(f"{run_dir} is in use by {who}; wait for it to end or use another "
                             "--run-dir")


# what os.link raises where the filesystem has no hard links (ENOSYS: FUSE without link)
_NO_HARD_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EMLINK, errno.ENOSYS)


def _readable_by_all(fd: int) -> None:
    """Give the lock file LOCK_MODE (whatever the umask). A filesystem that refuses chmod
    (some FUSE or SMB mounts) keeps its own permissions: the lock is taken all the same."""
    try:
        os.fchmod(fd, LOCK_MODE)
    except OSError:
        pass


# the run directories' descriptors flocked by takeovers in progress: a child forked meanwhile
# closes its copies, or it would keep every later takeover of that directory waiting
_TAKEOVER_FDS: "set[int]" = set()
# the RunLocks this process holds (or is taking): children it forks close their flock
# descriptors and do not release them (kept here, not weakly: a lock acquired and then
# dropped unreleased still holds its descriptor)
_HOLDING: "set[RunLock]" = set()


def _after_fork_in_child() -> None:
    """In a child forked (without exec) by a process holding a RunLock: close its copy of the
    lock's flock descriptor (the flock stays the parent's: it goes only when every descriptor
    of the open file is closed), so a child outliving the holder does not keep the lock
    alive; the child's copy of the lock no longer releases the parent's file."""
    for lock in list(_HOLDING):
        fd, lock._flock_fd = lock._flock_fd, None
        lock._held = False
        lock._created_dirs = []
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    _HOLDING.clear()
    for fd in list(_TAKEOVER_FDS):
        try:
            os.close(fd)
        except OSError:
            pass
    _TAKEOVER_FDS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def _one_takeover_at_a_time(run_dir: Path):
    """Hold an exclusive flock on the run directory itself while a stale lock is read, checked
    and set aside. Two processes that found the same stale lock took turns at setting it aside,
    so the second could set aside the first's fresh lock; a third then created one in the gap
    and two processes held the run at once (helper-157). A takeover waits for another process's
    (a few file operations) up to TAKEOVER_WAIT_S, then raises RunLockedError; where the
    directory cannot be opened or has no flock, it goes on unguarded (`_put_back` still
    restores a fresh lock set aside by mistake)."""
    try:
        fd = os.open(run_dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        fd = None
    if fd is not None:
        _TAKEOVER_FDS.add(fd)
    try:
        if fd is not None and _flock_within(fd, TAKEOVER_WAIT_S) is False:
            raise RunLockedError(f"{run_dir}: another process has been taking over its stale "
                                 f"{LOCK_NAME} for {TAKEOVER_WAIT_S:g} s; try again")
        yield
    finally:
        if fd is not None:
            _TAKEOVER_FDS.discard(fd)
            os.close(fd)   # drops the flock


def _put_back(aside: Path, path: Path) -> bool:
    """Give the lock file set aside as `aside` its name `path` again, unless `path` exists
    (another process's lock, never replaced); False then. Where the filesystem has no hard
    links, renamed back after a check that `path` is free (a gap of a few instructions)."""
    try:
        os.link(aside, path)
        return True
    except FileExistsError:
        return False
    except OSError as err:
        if err.errno not in _NO_HARD_LINKS:
            raise
        if os.path.lexists(path):
            return False
    os.replace(aside, path)
    return True


class RunLock:
    """The lock on one run directory; `acquire` takes it, `release` (or `with`) gives it back."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._created_dirs: list[Path] = []   # the run directory and parents it made, deepest first
        self._held = False
        self._token = secrets.token_hex(8)
        self._flock_fd: int | None = None

    def acquire(self) -> "RunLock":
        """Take the lock (creating the run directory if needed).

        Raises RunLockedError naming the holder when another live process holds it, or when
        this process already does. Whatever interrupts it (SIGTERM, Ctrl-C) leaves neither a
        lock file of this process nor a run directory it created.
        """
        try:
            return self._acquire()
        except BaseException:
            self._held = True   # release() removes only the file this lock wrote (its token)
            self.release()
            raise

    def _acquire(self) -> "RunLock":
        here = self.run_dir.absolute()
        self._created_dirs = []
        for made in reversed([d for d in (here, *here.parents) if not d.exists()]):
            try:
                made.mkdir()
            except FileExistsError:   # another process made it meanwhile: not this lock's
                if not made.is_dir():
                    raise
                continue
            self._created_dirs.insert(0, made)
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "start_ticks": _own_start_ticks(), "pid_space": _pid_space(),
              "token": self._token}
        for _ in range(3):
            try:
                self._create(json.dumps(me) + "\n")
            except FileExistsError:
                _refuse_a_foreign_entry(self.path)
                self._take_over_if_stale()
                continue
            self._held = True
            _HOLDING.add(self)
            return self
        raise RunLockedError(f"{self.run_dir}: could not take {self.path} (another process "
                             "keeps taking it); try again")

    def _create(self, text: str) -> None:
        """Create the lock file with `text` in one step (written beside it, then hard-linked
        to its name, which fails when the name exists), so it never exists empty or half
        written: a process interrupted at any point can tell it is its own. Where hard links
        are not supported, created exclusively, flocked, then written. The file is flocked
        before it gets its name (`_flock_held`: how another process tells this holder lives
        where its pid cannot: from another PID namespace), and the flock is kept until
        `release` (children forked meanwhile close their copy); where the filesystem has no
        flock, none (such a holder reads as cannot-be-checked from another PID namespace).
        Without hard links the file is flocked just after it is created (retried for up to
        FLOCK_WAIT_S while a reader's momentary probe holds it): in that gap, and until it is
        written, it is empty, which reads as being written (`Holder.being_written`), not
        stale."""
        fd, tmp = tempfile.mkstemp(prefix=f".{LOCK_NAME}.", dir=self.run_dir)
        try:
            _readable_by_all(fd)   # mkstemp's 0600 hid the holder from other users
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            flock_fd = _flocked(Path(tmp))
            try:
                os.link(tmp, self.path)
                self._hold_flock(flock_fd)
                return
            except BaseException as err:
                if flock_fd is not None:
                    os.close(flock_fd)
                if isinstance(err, FileExistsError) or not isinstance(err, OSError) or (
                        err.errno not in _NO_HARD_LINKS):
                    raise
        finally:
            os.unlink(tmp)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, LOCK_MODE)
        taken = _flock_within(fd, FLOCK_WAIT_S)
        if taken is False:
            log.warning("%s: another process keeps an flock on %s, just created by this one; "
                        "the lock is held without one", self.run_dir, self.path)
        self._hold_flock(fd if taken else None)
        _readable_by_all(fd)   # whatever the umask
        with os.fdopen(os.dup(fd), "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if self._flock_fd is None:
            os.close(fd)

    def _hold_flock(self, fd: int | None) -> None:
        self._flock_fd = fd
        if fd is not None:
            _HOLDING.add(self)

    def _take_over_if_stale(self) -> None:
        with _one_takeover_at_a_time(self.run_dir):
            self._take_over_if_stale_now()

    def _take_over_if_stale_now(self) -> None:
        holder = read_holder(self.run_dir)
        if holder is None:
            return  # released meanwhile: try again
        if holder.is_this_process():
            raise RunLockedError(f"{self.run_dir} is already locked by this process "
                                 f"({self.path}); one trainer per run directory")
        _refuse_a_live_holder(self.run_dir, holder)
        # a name no other takeover uses (one in another PID namespace may have this pid)
        stale = self.path.with_name(f"{LOCK_NAME}.stale-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.replace(self.path, stale)
        except FileNotFoundError:
            return
        try:
            taken = _read(stale)
            # another process took it meanwhile: put it back where free
            put_back = taken is not None and taken != holder and _put_back(stale, self.path)
        except OSError as err:   # EACCES, EROFS, ENOSPC...: the file set aside is kept
            raise RunLockedError(
                f"{self.run_dir}: {stale}, the lock set aside while taking over a stale one, "
                f"could not be put back ({err}); it is kept: rename it to {self.path} if its "
                "process may still run, else delete it; then start again") from err
        stale.unlink(missing_ok=True)
        if taken != holder:
            if taken is not None and not put_back:
                # a third process made a lock in the gap: that one is not replaced
                log.warning("%s: the lock of %s, set aside while taking over a stale one, "
                            "could not be put back: %s was made meanwhile", self.run_dir,
                            taken.describe(), self.path)
            return
        proc = _proc_stat(holder.pid) if holder.pid > 0 and holder.on_this_host() else None
        gone = ("" if holder.pid == UNREADABLE_PID else
                " (written in another PID namespace or boot; no process keeps its flock)"
                if not holder.on_this_host() else
                f" (pid {holder.pid} is now another process)"
                if proc and proc[0] not in _NOT_RUNNING and proc[1] != holder.start_ticks
                else " (that process is gone)")
        log.warning("%s: taking over the stale lock of %s%s", self.run_dir, holder.describe(), gone)

    def release(self) -> None:
        """Remove the lock file if it is still the one this lock wrote (its token); remove the
        run directory too, and the parents made for it (`runs/` of a default run directory),
        when this lock created them and nothing else was written there."""
        if not self._held:
            return
        self._held = False
        try:
            try:
                ours = _load(self.path).get("token") == self._token
            except (OSError, ValueError, AttributeError, RecursionError):   # gone, unreadable, not an object
                ours = False
            if ours:
                self.path.unlink(missing_ok=True)
        finally:   # the flock only once the file is gone: until then it tells the holder lives
            _HOLDING.discard(self)
            if self._flock_fd is not None:
                os.close(self._flock_fd)   # drops the flock
                self._flock_fd = None
        for made in self._created_dirs:
            try:
                made.rmdir()  # only when empty
            except OSError:
                break

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
