"""Two processes x 3 CPU devices with JAX's distributed runtime == one process with 6 devices:
the sharded loss, a process's judge, and a whole GRPO run with a stop and a resume; a process
whose peers never join."""
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from jscenegen.sharding.mesh import make_mesh

from multihost_loss import sharded_loss


def _free_port() -> int:
    """A free TCP port below Linux's ephemeral range (32768-60999): a coordinator port inside
    it can be handed out meanwhile as the local end of an outgoing connection, process 1's own
    early attempts to reach the coordinator included (a TCP self-connect)."""
    for port in random.SystemRandom().sample(range(20000, 32768), 500):   # not a seeded stream
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000..32767")


HERE = Path(__file__).resolve().parent


def _pair(command_of, *, env_of=lambda pid: {}, cwd_of=lambda pid: None) -> tuple[list[int], list[str]]:
    """(exit codes, stderrs) of processes 0 and 1 of a 2 x 3-CPU-device run, process i running
    `command_of(i)` (argv) in `cwd_of(i)` with `env_of(i)` on top of the launch variables."""
    port = _free_port()
    procs = []
    for pid in range(2):
        env = dict(os.environ, JSCENEGEN_COORDINATOR=f"127.0.0.1:{port}",
                   JSCENEGEN_NUM_PROCESSES="2", JSCENEGEN_PROCESS_ID=str(pid), JAX_PLATFORMS="cpu",
                   JAX_NUM_CPU_DEVICES="3", PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]))
        env.pop("XLA_FLAGS", None)
        env.update(env_of(pid))
        procs.append(subprocess.Popen(command_of(pid), env=env, cwd=cwd_of(pid),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    errs = [err for _, err in _outputs(procs, timeout_s=120)]
    return [p.returncode for p in procs], errs


def _workers(*args: str, unset: tuple[str, ...] = ("XLA_FLAGS",)) -> list[subprocess.Popen]:
    """Processes 0 and 1 running `multihost_worker.py ARGS` (the launch variables set, the tests
    and the repository on PYTHONPATH, the variables `unset` removed), their pipes open: read
    them with `_outputs`."""
    port, procs = _free_port(), []
    for pid in range(2):
        env = dict(os.environ, JSCENEGEN_COORDINATOR=f"127.0.0.1:{port}",
                   JSCENEGEN_NUM_PROCESSES="2", JSCENEGEN_PROCESS_ID=str(pid),
                   PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]))
        for name in unset:
            env.pop(name, None)
        procs.append(subprocess.Popen([sys.executable, str(HERE / "multihost_worker.py"), *args],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    return procs


def _outputs(procs, *, timeout_s: float) -> list[tuple[str, str]]:
    """(stdout, stderr) of each process once all have ended, the pipes of all drained at once
    (one process blocked writing to a full pipe would hold up the others). One still running
    after `timeout_s` fails the test with every process's stderr (one that never joined says
    why in its own)."""
    try:
        with ThreadPoolExecutor(len(procs)) as pool:
            waits = [pool.submit(p.communicate, timeout=timeout_s) for p in procs]
            done = [not isinstance(w.exception(), subprocess.TimeoutExpired) for w in waits]
    except BaseException:   # Ctrl-C: no process outlives the test
        for p in procs:
            p.kill()
        raise
    if all(done):
        return [w.result() for w in waits]
    for p in procs:
        p.kill()
    errs = [(w.result() if ok else p.communicate(timeout=10))[1] for p, w, ok in zip(procs, waits, done)]
    tails = [f"process {i} (exit {p.returncode}): ...{err[-2000:]}"
             for i, (p, err) in enumerate(zip(procs, errs))]
    pytest.fail(f"still running after {timeout_s} s:\n" + "\n".join(tails))


def _two_processes(*args: str) -> list[str]:
    """stdout of `multihost_worker.py ARGS` on 2 processes x 3 CPU devices (each must exit 0)."""
    port = _free_port()
    here = Path(__file__).parent
    procs = []
    for pid in range(2):
        env = dict(os.environ, JSCENEGEN_COORDINATOR=f"127.0.0.1:{port}",
                   JSCENEGEN_NUM_PROCESSES="2", JSCENEGEN_PROCESS_ID=str(pid),
                   PYTHONPATH=os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]))
        env.pop("XLA_FLAGS", None)
        env.pop("JAX_NUM_CPU_DEVICES", None)  # an in-process CLI test may have set 6
        procs.append(subprocess.Popen([sys.executable, str(here / "multihost_worker.py"), *args],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = _outputs(procs, timeout_s=300)
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return [out for out, _ in outs]


def _last_json(out: str) -> dict:
    """The last JSON line of a stdout (gloo, the CPU collectives, prints lines of its own)."""
    return next(json.loads(line) for line in reversed(out.splitlines()) if line.startswith("{"))


@pytest.mark.slow
def test_two_process_run_computes_the_single_process_loss(tiny_hf):
    expected = sharded_loss(tiny_hf["qwen3"], make_mesh(3, 2))
    result = _last_json(_two_processes("loss", str(tiny_hf["qwen3"]))[0])
    assert result["processes"] == 2
    assert abs(result["loss"] - expected) <= 1e-5 * abs(expected)


@pytest.mark.slow
def test_every_process_gets_the_grades_of_process_0_and_its_judge_errors():
    outs = [_last_json(out) for out in _two_processes("judge")]
    assert [o["process"] for o in outs] == [0, 1]
    for o in outs:
        assert o["results"] == [[{"layout": 0}, None, {"n": i}] for i in range(3)]
        assert o["raised"] == "the judge raised ConnectionError on process 0"

@pytest.mark.slow
def test_a_sigterm_after_joining_reaches_the_command():
    """JAX's preemption service installs a native SIGTERM handler at `jax.distributed.initialize`:
    a SIGTERM between joining and the trainer's own handlers (model load, evaluation, restore)
    was swallowed and the run trained to its end, exit 0 (helper-71)."""
    outs = [_last_json(out) for out in _two_processes("sigterm")]
    assert outs == [{"process": 0, "unwound": True}, {"process": 1, "unwound": True}]


TIMING_KEYS = ("time/", "rollout/tokens_per_s", "rollout/reshard_s", "judge/latency_s")


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_KEYS)} for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["disk-full", "interrupt"])
def test_a_save_that_fails_on_process_0_fails_on_every_process_at_once(tmp_path, how):
    """Process 0 finishes a checkpoint alone (hf/, metadata, checksums) while the others wait;
    a full disk (or a Ctrl-C) there left them in the barrier until JAX's heartbeat timeout
    (about 100 s, a native abort without the reason): now every process raises within the
    test's 90 s."""
    procs = _workers("save-fails-on-0", str(tmp_path), how, unset=("XLA_FLAGS", "JAX_NUM_CPU_DEVICES"))
    outs = _outputs(procs, timeout_s=90)
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    raised = [_last_json(out)["raised"] for out, _ in outs]
    if how == "disk-full":
        assert raised[0].startswith("DiskFullError") and str(tmp_path / "checkpoints") in raised[0]
    else:
        assert raised[0] == "KeyboardInterrupt: "
    assert raised[1] == (f"CheckpointError: process 0 could not finish checkpoint step 1 in "
                         f"{tmp_path / 'checkpoints'}; its log says why")
    step = tmp_path / "checkpoints" / "1"
    # a full disk's step is removed; an interrupted one is left incomplete for the next save
    assert not step.exists() if how == "disk-full" else not (step / "checksums.json").exists()


@pytest.mark.slow
def test_a_two_process_grpo_run_stops_together_resumes_and_equals_one_process(tmp_path):
    """`jscenegen train` on 2 processes x 3 devices: a SIGTERM that reaches one process only
    stops both after the same update (exit 143, one checkpoint); the resumed run's metrics, train
    state (the cosine LR's position included) and final parameters equal a 6-device
    single-process run's (the judge graded once, on process 0)."""
    import jax
    import numpy as np

    from jscenegen.checkpoint.store import CheckpointStore

    from chat_fixtures import chat_model_dir

    base = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]),
                JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir)
    base.pop("XLA_FLAGS", None)
    overrides = [f"model.path={chat_model_dir()}", "sampling.max_new_tokens=8",
                 "sampling.max_episode_tokens=2560", "sampling.buckets=[64,256,1024,2048,4096]",
                 "schedule.num_scenes=3", "schedule.group_size=2", "schedule.roles=PPC",
                 "schedule.zero_spread=count", "schedule.total_updates=4", "loss.entropy_coeff=0.01",
                 "optim.lr=1e-3", "optim.lr_schedule=cosine", "optim.total_steps=4",   # lr_step matters
                 "checkpoint.save_every=1", "trainer.eval_before_after=false",
                 "trainer.progress=false", "logging.swanlab_mode=disabled"]

    def train(run_dir, *flags, processes=1):
        port, procs = _free_port(), []
        for pid in range(processes):
            env = dict(base, JAX_NUM_CPU_DEVICES=str(6 // processes))
            if processes > 1:
                env.update(JSCENEGEN_COORDINATOR=f"127.0.0.1:{port}",
                           JSCENEGEN_NUM_PROCESSES=str(processes), JSCENEGEN_PROCESS_ID=str(pid))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "jscenegen", "train", "--run-dir", str(run_dir), *flags,
                 *overrides], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True))
        return procs

    def finish(procs):
        outs = _outputs(procs, timeout_s=600)
        # the saves reshard arrays stored off dim 0 (the tiny vocabulary's [1153, 64]
        # embedding) without XLA's "Involuntary full rematerialization" warning on each process
        assert not any("rematerialization" in err for _, err in outs), [e[-3000:] for _, e in outs]
        return [(p.returncode, _last_json(out) if "{" in out else None, err[-3000:])
                for p, (out, err) in zip(procs, outs)]

    [(rc, single, err)] = finish(train(tmp_path / "single"))
    assert rc == 0 and single["effective_updates"] == 4, err

    multi = tmp_path / "multi"
    procs = train(multi, processes=2)
    try:
        deadline = time.monotonic() + 600
        while not (multi / "checkpoints" / "1" / "checksums.json").is_file():
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGTERM)      # process 0 is never signalled
        stopped = finish(procs)
    finally:
        for p in procs:
            p.kill()
    assert [rc for rc, _, _ in stopped] == [128 + signal.SIGTERM] * 2, stopped[0][2] + stopped[1][2]
    summary = stopped[0][1]              # process 0 prints the summary and the resume line
    assert summary["stopped_by_signal"] == "SIGTERM" and summary["attempts"] < 4
    step = multi / "checkpoints" / str(summary["attempts"])
    assert summary["checkpoint"] == str(step) and (step / "checksums.json").is_file()
    assert stopped[0][2].strip().splitlines()[-1].startswith(
        f"stopped by SIGTERM after {summary['attempts']} update attempt{'' if summary['attempts'] == 1 else 's'}")
    assert stopped[1][2].strip().splitlines()[-1].startswith(   # the other process says so too
        f"process 1: stopped by SIGTERM after {summary['attempts']} update attempt{'' if summary['attempts'] == 1 else 's'}; checkpoint {step}")

    resumed = finish(train(multi, "--resume", str(multi), processes=2))
    assert [rc for rc, _, _ in resumed] == [0, 0], resumed[0][2] + resumed[1][2]
    ours, theirs = _metrics(multi), _metrics(tmp_path / "single")
    assert len(ours) == len(theirs) == 4
    for a, b in zip(ours, theirs):    # gloo's all-reduce may sum in another order: fp32 ulps
        assert a == pytest.approx(b, rel=1e-5, nan_ok=True), {
            k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    ours, theirs = (CheckpointStore(d / "checkpoints").restore() for d in (multi, tmp_path / "single"))
    assert ours.train_state == theirs.train_state and ours.train_state["lr_step"] == 4
    assert ours.params.keys() == theirs.params.keys()
    for name in ours.params:
        np.testing.assert_allclose(np.asarray(ours.params[name]), np.asarray(theirs.params[name]),
                                   rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.slow
def test_a_process_that_fails_alone_after_joining_ends_both_without_jax_shutdown_barrier(tmp_path):
    """One process of a joined run that failed (or was stopped at once by a second SIGTERM)
    sat in JAX's shutdown barrier for 5 minutes after its error line, its peer blocked in a
    collective with it, and both then died with native stack traces."""
    port, here, procs = _free_port(), Path(__file__).parent, []
    for pid in range(2):
        env = dict(os.environ, JSCENEGEN_COORDINATOR=f"127.0.0.1:{port}",
                   JSCENEGEN_NUM_PROCESSES="2", JSCENEGEN_PROCESS_ID=str(pid),
                   PYTHONPATH=os.pathsep.join([str(here), str(here.parent)]))
        env.pop("JAX_NUM_CPU_DEVICES", None)
        procs.append(subprocess.Popen([sys.executable, str(here / "multihost_worker.py"),
                                       "fails-alone", str(tmp_path / "run")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    t0 = time.monotonic()
    try:
        err1 = procs[1].communicate(timeout=400)[1]
        ended1 = time.monotonic() - t0
        err0 = procs[0].communicate(timeout=400)[1]
        ended0 = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == 2 and ended1 < 60, (ended1, err1[-3000:])
    assert err1.strip().splitlines()[-1] == "error: process 1 fails alone"
    # process 0, blocked in the collective, is ended by JAX's heartbeat timeout (about 100 s;
    # its own native abort, documented) instead of waiting out both barriers
    assert procs[0].returncode != 0 and ended0 < 150, (ended0, err0[-3000:])


@pytest.mark.slow
def test_process_0_ends_after_peers_that_refuse_for_the_same_reason(tmp_path):
    """Process 0 hosts JAX's coordination service: when it ended first (os._exit) a peer still
    on its way out lost the service and was aborted by JAX's fatal error (exit -6, a native stack
    trace after its error line), seen under load in the device-count refusal."""
    codes, errs = _pair(lambda pid: [sys.executable, str(HERE / "multihost_worker.py"),
                                     "both-refuse", str(tmp_path / "run")])
    assert codes == [2, 2], errs
    for pid, err in enumerate(errs):
        assert err.strip().splitlines()[-1] == f"error: process {pid} refuses", err[-2000:]


def _train_waiting_alone(run_dir: Path, *overrides: str, process_id: int = 1,
                         host: str = "127.0.0.1") -> subprocess.Popen:
    """`jscenegen train` as one process of 2 whose other process never starts (process 1: its
    coordinator is missing; process 0: it runs the coordination service itself)."""
    env = dict(os.environ, JSCENEGEN_COORDINATOR=f"{host}:{_free_port()}",
               JSCENEGEN_NUM_PROCESSES="2", JSCENEGEN_PROCESS_ID=str(process_id), JAX_PLATFORMS="cpu",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    return subprocess.Popen([sys.executable, "-m", "jscenegen", "train", "--run-dir", str(run_dir),
                             *overrides], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.parametrize("process_id", [0, 1])
def test_a_process_waiting_for_the_others_says_so_and_ends_on_sigterm(tmp_path, process_id):
    """JAX's initialization blocks the main thread in native code for minutes: the first
    SIGTERM of a scheduler used to wait for it, with nothing printed; process 0 then went on
    logging the coordination service's aborted barrier after its error line."""
    proc = _train_waiting_alone(tmp_path / "run", process_id=process_id)
    try:
        line = proc.stderr.readline()
        assert line.startswith(f"process {process_id} of 2: waiting for the others at 127.0.0.1:")
        assert line.rstrip().endswith("(at most 300 s)")
        time.sleep(1)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM and time.monotonic() - t0 < 10
    assert err.strip().splitlines()[-1] == "error: terminated (SIGTERM)"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("process_id", [0, 1])
def test_processes_that_never_join_end_the_wait_with_one_line_after_init_timeout_s(tmp_path,
                                                                                    process_id):
    """Process 0 used to go on for seconds after its error: the interpreter's clean-up waited
    for the coordination service's aborted barrier and printed four native log lines."""
    proc = _train_waiting_alone(tmp_path / "run", "mesh.init_timeout_s=2", process_id=process_id)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 2
    waiting, error = err.strip().splitlines()
    assert waiting.startswith(f"process {process_id} of 2: waiting for the others at 127.0.0.1:")
    assert re.fullmatch(r"error: multi-host launch: the 2 processes did not all join at "
                        r"127\.0\.0\.1:\d+ within 2 s \(mesh\.init_timeout_s\); one that was not "
                        r"started or failed before joining says so in its own output", error)


def test_process_0_given_an_address_not_of_its_host_says_so_when_no_one_joins(tmp_path):
    """Process 0 serves the coordinator: an address of another machine (192.0.2.1, TEST-NET)
    waited out init_timeout_s and said only that the processes did not all join (helper-71)."""
    proc = _train_waiting_alone(tmp_path / "run", "mesh.init_timeout_s=2", process_id=0,
                                host="192.0.2.1")
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 2
    assert re.fullmatch(r"error: multi-host launch: the 2 processes did not all join at "
                        r"192\.0\.2\.1:(\d+) within 2 s \(mesh\.init_timeout_s\); one that was "
                        r"not started or failed before joining says so in its own output; process "
                        r"0 serves the coordinator, and 192\.0\.2\.1 is not an address of this "
                        r"host: check that 192\.0\.2\.1:\1 reaches it",
                        err.strip().splitlines()[-1]), err


@pytest.mark.slow
@pytest.mark.parametrize("differ, named", [
    ({"argv": ["schedule.group_size=4"]}, "schedule.group_size"),
    ({"argv": ["--run-dir", "other"]}, "--run-dir"),
    ({"env": {"JSCENEGEN_NUM_PROCESSES": "3"}}, "num_processes"),
    ({"env": {"JAX_NUM_CPU_DEVICES": "4"}}, None),
])
def test_processes_given_other_settings_are_refused_before_any_model(tmp_path, differ, named):
    """Another group size deadlocked in the first differing collective; another run directory
    in the first checkpoint save (SIGTERM could not end either); another process count went
    unnoticed."""
    codes, errs = _pair(lambda pid: [sys.executable, "-m", "jscenegen", "train", "--run-dir", "run",
                                     "model.path=nowhere", *(differ.get("argv", []) if pid else [])],
                        env_of=lambda pid: differ.get("env", {}) if pid else {},
                        cwd_of=lambda pid: tmp_path)
    assert codes == [2, 2], errs
    if named is None:   # another device count: a numpy reshape error named nothing
        for err in errs:
            assert err.strip().splitlines()[-1] == (
                "error: multi-host launch: the processes have different numbers of devices "
                "(process 0: 3, process 1: 4); give each the same (on CPU, JSCENEGEN_CPU_DEVICES)")
        assert sorted(p.name for p in tmp_path.iterdir()) == []
        return
    assert errs[1].strip().splitlines()[-1].startswith(
        f"error: multi-host launch: process 1 was given another {named}")
    assert errs[0].strip().splitlines()[-1] == (
        "error: multi-host launch: another process was given other settings than this one (its "
        "error names them); start every process with the same command and settings (only "
        "JSCENEGEN_PROCESS_ID differs)")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_host_whose_copy_of_the_weights_differs_is_refused_before_any_model(tmp_path):
    """Each host read the initial policy from its own disk: one with another fine-tune of the
    same architecture (same config.json, header and sizes) loaded its shards of it into the one
    model."""
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    from chat_fixtures import chat_model_dir

    for pid in (0, 1):
        shutil.copytree(chat_model_dir(), tmp_path / f"host{pid}" / "model")
    weights = tmp_path / "host1" / "model" / "model.safetensors"
    tensors = load_file(weights)
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = (tensors[name] * np.float32(1.01)).astype(tensors[name].dtype)
    save_file(tensors, weights, metadata={"format": "pt"})
    run = tmp_path / "run"   # one run directory; model.path is read on each host's own disk
    codes, errs = _pair(lambda pid: [sys.executable, "-m", "jscenegen", "train", "--run-dir", str(run),
                                     "model.path=model", "schedule.group_size=2"],
                        cwd_of=lambda pid: tmp_path / f"host{pid}")
    assert codes == [2, 2], errs
    assert errs[1].strip().splitlines()[-1] == (
        "error: multi-host launch: process 1 was given another initial policy's weights "
        "(model.path) than process 0; give every host the same files (one shared filesystem, or "
        "identical copies)")
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


@pytest.mark.slow
def test_a_run_directory_in_use_is_refused_on_every_process_however_it_is_spelled(tmp_path):
    """Process 0 alone took run.lock: when it was held, process 0 refused and process 1 went on
    into a collective and ended in JAX's fatal error; and the same directory given as a
    relative path from another working directory was refused as "another --run-dir"
    (helper-71)."""
    from jscenegen.run_lock import RunLock

    from chat_fixtures import chat_model_dir

    run = tmp_path / "a" / "run"
    (tmp_path / "b").mkdir()
    held = RunLock(run).acquire()          # this test's process holds it
    model = chat_model_dir()
    try:
        codes, errs = _pair(lambda pid: [sys.executable, "-m", "jscenegen", "train", "--run-dir",
                                         ["run", "../a/run"][pid], f"model.path={model}",
                                         "logging.swanlab_mode=disabled"],
                            cwd_of=lambda pid: tmp_path / "ab"[pid])
    finally:
        held.release()
    assert codes == [2, 2], errs
    lines = [err.strip().splitlines()[-1] for err in errs]
    assert lines[0] == lines[1], lines
    assert lines[0].startswith(f"error: run is in use by pid {os.getpid()} "), lines  # process 0's


@pytest.mark.slow
def test_a_check_of_process_0_alone_that_refuses_ends_every_process_with_its_reason(tmp_path):
    """check_swanlab_mode and the judge's reachability ran on process 0 only: when process 0
    refused, process 1 was already waiting in the next collective and died in a native abort
    (exit 134, ~60 lines of C++) without the reason (helper-154)."""
    import importlib.util

    from chat_fixtures import chat_model_dir

    if importlib.util.find_spec("swanboard") is not None:   # what makes `local` refused here
        pytest.skip("swanboard is installed: logging.swanlab_mode=local would start")
    model = chat_model_dir()
    codes, errs = _pair(lambda pid: [sys.executable, "-m", "jscenegen", "train", "--run-dir",
                                     str(tmp_path / "run"), f"model.path={model}",
                                     "logging.swanlab_mode=local"])
    assert codes == [2, 2], errs
    lines = [err.strip().splitlines()[-1] for err in errs]
    assert lines[0] == lines[1], lines
    assert lines[0].startswith("error: logging.swanlab_mode=local needs swanlab's dashboard"), lines


@pytest.mark.slow
def test_a_swanlab_start_that_fails_on_process_0_ends_every_process_with_its_reason(tmp_path):
    """Process 0 alone starts swanlab (the trainer's MetricsLogger): when that failed (a key the
    cloud refuses, the cloud out of reach), process 1 went on into the next collective and
    ended without the reason (a JaxRuntimeError, or JAX's native abort once process 0 and its
    coordination service had gone)."""
    from chat_fixtures import chat_model_dir

    model = chat_model_dir()
    codes, errs = _pair(lambda pid: [sys.executable, str(HERE / "multihost_worker.py"),
                                     "swanlab-fails-on-0", str(tmp_path / "run"), str(model)])
    assert codes == [2, 2], errs
    lines = [err.strip().splitlines()[-1] for err in errs]
    assert lines[0] == lines[1], lines
    assert lines[0] == ("error: logging.swanlab_mode=offline: swanlab could not start "
                        "(ConnectionError: the SwanLab cloud is out of reach); JSCENEGEN_DEBUG=1 "
                        "shows where"), lines


@pytest.mark.slow
def test_a_resume_takes_over_the_lock_process_0_left_whichever_host_a_process_runs_on(tmp_path):
    """Processes killed together (JAX's heartbeat abort) leave process 0's run.lock. On resume
    every process checked it before joining: process 1, on another host, could not check that
    pid there and refused, while process 0 waited out mesh.init_timeout_s. Process 0, which
    takes the lock once every process has joined, now takes the stale one over."""
    from jscenegen.config import dump_yaml
    from jscenegen.run_config import load_run_config

    run = tmp_path / "run"   # stopped before its first checkpoint: a resume starts it again
    run.mkdir()
    cfg = load_run_config(None, ["model.path=nowhere", "logging.swanlab_mode=disabled"])
    (run / "config.yaml").write_text(dump_yaml(cfg.model_dump(mode="json")))
    (run / "run.json").write_text(json.dumps({"model_dir": "nowhere", "config_source": "c.yaml"}))
    dead = subprocess.Popen(["true"])
    dead.wait()
    (run / "run.lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(),
                                              "started_utc": "then"}))
    elsewhere = tmp_path / "host1"   # process 1 runs on another host
    elsewhere.mkdir()
    (elsewhere / "sitecustomize.py").write_text(
        "import socket\nsocket.gethostname = lambda: 'jscenegen-host-1'\n")
    paths = [str(HERE), str(HERE.parent)]
    codes, errs = _pair(lambda pid: [sys.executable, "-m", "jscenegen", "train", "--resume", str(run),
                                     "mesh.init_timeout_s=60"],
                        env_of=lambda pid: {"PYTHONPATH": os.pathsep.join([str(elsewhere)] * pid + paths)})
    lines = [err.strip().splitlines()[-1] for err in errs]
    assert lines[0] == lines[1], lines
    assert f"taking over the stale lock of pid {dead.pid}" in errs[0], errs[0][-2000:]
    assert codes == [2, 2] and lines[0] == ("error: nowhere/config.json: no such file; model "
                                            "directory nowhere needs its config.json"), lines


@pytest.mark.slow
def test_a_host_running_another_version_of_jscenegen_is_refused_before_any_model(tmp_path):
    """Each host runs its own install: one with another version of the package (a stale
    checkout, an upgrade on one host) joined, and would play and train with other code in one
    run (another bucket or rule: a deadlock in the first collective that differs). The install
    is compared before the settings: this version also has another default of a config key,
    which the settings check would name as if the command differed."""
    import shutil

    root = HERE.parent
    other = tmp_path / "host1"
    for name in ("jscenegen", "convert", "configs", "data"):
        shutil.copytree(root / name, other / name, ignore=shutil.ignore_patterns("__pycache__"))
    run_config = other / "jscenegen" / "run_config.py"
    source = run_config.read_text()
    assert source.count("async_save: bool = Field(False") == 1   # checkpoint.async_save
    run_config.write_text(source.replace("async_save: bool = Field(False", "async_save: bool = Field(True"))
    (tmp_path / "run").mkdir()
    codes, errs = _pair(lambda pid: [sys.executable, "-m", "jscenegen", "train", "--run-dir", "run",
                                     "model.path=nowhere"],
                        env_of=lambda pid: {"PYTHONPATH": str(other)} if pid else {},
                        cwd_of=lambda pid: tmp_path)
    assert codes == [2, 2], errs
    assert errs[1].strip().splitlines()[-1] == (
        "error: multi-host launch: process 1 was given another jscenegen code (the package's *.py "
        "files) than process 0; install the same jscenegen and jax on every host"), errs[1][-2000:]
    assert errs[0].strip().splitlines()[-1] == (
        "error: multi-host launch: another process was given other settings than this one (its "
        "error names them); install the same jscenegen and jax on every host")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == []


@pytest.mark.slow
def test_a_process_that_fails_alone_with_an_async_save_pending_ends_with_its_error(tmp_path):
    """With checkpoint.async_save the trainer's close finished the pending save, a collective:
    process 1, failing alone, met process 0's next rollout collective instead and gloo aborted
    it (a size mismatch, exit 134) before its error line."""
    from chat_fixtures import chat_model_dir

    model = chat_model_dir()
    procs = _workers("async-save-fails-on-1", str(tmp_path / "run"), str(model))
    outs = _outputs(procs, timeout_s=400)
    errs = [err for _, err in outs]
    assert procs[1].returncode == 2, errs[1][-3000:]
    assert errs[1].strip().splitlines()[-1] == "error: process 1 fails alone", errs[1][-3000:]
    assert procs[0].returncode != 0, errs[0][-3000:]   # its collective lost process 1
