"""One process of a 2-process x 3-CPU-device run (launched by test_multihost.py).

`multihost_worker.py loss HF_DIR`: print the sharded loss; `multihost_worker.py judge`: print
what `PrimaryJudge` returns for a judge that grades differently on each process;
`multihost_worker.py sigterm`: whether a SIGTERM after joining unwinds the command;
`multihost_worker.py save-fails-on-0 RUN_DIR`: what a save raises on each process when process
0's disk fills up; `multihost_worker.py swanlab-fails-on-0 RUN_DIR MODEL_DIR`: `jscenegen train`
whose swanlab start fails on process 0; `multihost_worker.py async-save-fails-on-1 RUN_DIR
MODEL_DIR`: `jscenegen train` with checkpoint.async_save that fails on process 1 alone with a
save pending."""
import json
import os
import sys

os.environ.pop("XLA_FLAGS", None)
os.environ["JAX_NUM_CPU_DEVICES"] = "3"  # this process's share of the 6-device mesh
os.environ["JAX_PLATFORMS"] = "cpu"
from jscenegen.host_devices import size_cpu_thread_pool  # noqa: E402

size_cpu_thread_pool(3)

import jax  # noqa: E402

from jscenegen.sharding.mesh import initialize_distributed, make_mesh  # noqa: E402


def loss(hf_dir: str) -> None:
    from multihost_loss import sharded_loss

    value = sharded_loss(hf_dir, make_mesh(3, 2))
    if jax.process_index() == 0:
        print(json.dumps({"loss": value, "processes": jax.process_count()}))


class ProcessJudge:
    """Grades each request with this process's index (a judge that samples would differ too);
    raises on process 0 when asked to."""

    def grade(self, requests):
        from jscenegen.scene.judge import JudgeResult

        if requests and requests[0] == "raise" and jax.process_index() == 0:
            raise ConnectionError("judge down")
        return [JudgeResult({"layout": jax.process_index()}, None, {"n": i})
                for i in range(len(requests))]


def judge() -> None:
    from jscenegen.grpo.rollout.primary_judge import for_processes

    graded = for_processes(ProcessJudge())
    results = graded.grade(["a", "b", "c"])
    try:
        graded.grade(["raise"])
        raised = None
    except RuntimeError as err:
        raised = str(err)
    print(json.dumps({"process": jax.process_index(), "raised": raised,
                      "results": [[r.grades, r.failure, r.info] for r in results]}))


def fails_alone(run_dir: str) -> int:
    """`jscenegen train` whose command joins the run, then fails on process 1 only while
    process 0 waits for it in a collective; returns the CLI's exit code."""
    import jscenegen.cli
    import jscenegen.pipeline
    from jscenegen.sharding.mesh import max_over_processes

    def command(cfg, run_dir, **kwargs):
        assert initialize_distributed()
        if jax.process_index() == 1:
            raise ValueError("process 1 fails alone")
        return max_over_processes(1)   # never answered: process 1 has gone

    jscenegen.pipeline.train_command = command
    return jscenegen.cli.main(["train", "--run-dir", run_dir, "model.path=nowhere",
                               "logging.swanlab_mode=disabled"])


def both_refuse(run_dir: str) -> int:
    """`jscenegen train` whose command joins the run, then refuses on both processes, process 1
    a second after process 0 (as a shared refusal does under load); returns the exit code."""
    import time

    import jscenegen.cli
    import jscenegen.pipeline

    def command(cfg, run_dir, **kwargs):
        assert initialize_distributed()
        if jax.process_index() == 1:
            time.sleep(1.0)
        raise ValueError(f"process {jax.process_index()} refuses")

    jscenegen.pipeline.train_command = command
    return jscenegen.cli.main(["train", "--run-dir", run_dir, "model.path=nowhere",
                               "logging.swanlab_mode=disabled"])


def swanlab_fails_on_0(run_dir: str, model_dir: str) -> int:
    """`jscenegen train` of the model MODEL_DIR whose swanlab start fails on process 0 (the only
    process that starts it: a key the cloud refuses, the cloud out of reach); returns the CLI's
    exit code."""
    import swanlab

    import jscenegen.cli

    def out_of_reach(**kwargs):
        raise ConnectionError("the SwanLab cloud is out of reach")

    if os.environ["JSCENEGEN_PROCESS_ID"] == "0":
        swanlab.init = out_of_reach
    return jscenegen.cli.main(["train", "--run-dir", run_dir, f"model.path={model_dir}",
                               "logging.swanlab_mode=offline"])


def async_save_fails_on_1(run_dir: str, model_dir: str) -> int:
    """`jscenegen train` of the model MODEL_DIR with checkpoint.async_save whose second update
    fails on process 1 alone, the first update's save still pending, while process 0 plays
    that update; returns the CLI's exit code."""
    import jscenegen.cli
    from jscenegen.grpo.train.trainer import Trainer

    update = Trainer.update

    def fails_on_1(self):
        if self.pos.attempts == 1 and os.environ["JSCENEGEN_PROCESS_ID"] == "1":
            raise ValueError("process 1 fails alone")
        return update(self)

    Trainer.update = fails_on_1
    return jscenegen.cli.main([
        "train", "--run-dir", run_dir, f"model.path={model_dir}", "checkpoint.async_save=true",
        "checkpoint.save_every=1", "sampling.max_new_tokens=8", "sampling.max_episode_tokens=2560",
        "sampling.buckets=[64,256,1024,2048,4096]", "schedule.num_scenes=3",
        "schedule.group_size=2", "schedule.total_updates=4", "trainer.eval_before_after=false",
        "trainer.progress=false", "logging.swanlab_mode=disabled"])


def sigterm() -> None:
    """The CLI's signal handlers installed, then the run joined (as `jscenegen train` does),
    then a SIGTERM to this process: print whether the command unwound (JAX's preemption
    notifier, installed natively by `jax.distributed.initialize`, caught it and the run went
    on)."""
    import signal
    import time

    from jscenegen.signals import Terminated, UnwindOnSignals

    unwound = False
    try:
        with UnwindOnSignals():
            assert initialize_distributed()
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    except Terminated:
        unwound = True
    print(json.dumps({"process": jax.process_index(), "unwound": unwound}))


def save_fails_on_0(run_dir: str, how: str = "disk-full") -> None:
    """Both processes save checkpoint step 1 into RUN_DIR/checkpoints; process 0's disk fills
    up (`how` disk-full) or a Ctrl-C arrives (interrupt) while it finishes the step
    (checksums.json): print what each process raised."""
    import errno
    from pathlib import Path

    import numpy as np

    import jscenegen.checkpoint.store as store_module
    from jscenegen.checkpoint.store import CheckpointStore

    hf = Path(run_dir) / f"hf-{jax.process_index()}"
    hf.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (hf / name).write_text('{"model_type": "qwen2"}' if name == "config.json" else "{}")

    def disk_full(path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    def interrupt(path):
        raise KeyboardInterrupt

    if jax.process_index() == 0:
        store_module.write_checksums = disk_full if how == "disk-full" else interrupt
    shapes = {"w": (4, 2)}
    weights = {"w": np.arange(8, dtype=np.float32).reshape(4, 2)}
    store = CheckpointStore(Path(run_dir) / "checkpoints")
    try:
        store.save(1, params=weights, adam={"count": np.int32(1), "mu": weights, "nu": weights},
                   train_state={"update": 1},
                   metadata={"git_commit": "0", "protocol_hash": "p", "schedule_hash": "s",
                             "optimizer_step": 1, "effective_updates": 1, "judge": {}},
                   hf_assets_dir=hf, shapes=shapes)
        raised = None
    except BaseException as err:
        raised = f"{type(err).__name__}: {err}"
    print(json.dumps({"process": jax.process_index(), "raised": raised}))


def main(mode: str, *args: str) -> None:
    assert initialize_distributed()  # from JSCENEGEN_* environment variables
    assert jax.device_count() == 6 and jax.local_device_count() == 3
    {"loss": loss, "judge": judge, "save-fails-on-0": save_fails_on_0}[mode](*args)


if __name__ == "__main__":
    if sys.argv[1] == "fails-alone":
        sys.exit(fails_alone(*sys.argv[2:]))
    if sys.argv[1] == "both-refuse":
        sys.exit(both_refuse(*sys.argv[2:]))
    if sys.argv[1] == "swanlab-fails-on-0":
        sys.exit(swanlab_fails_on_0(*sys.argv[2:]))
    if sys.argv[1] == "async-save-fails-on-1":
        sys.exit(async_save_fails_on_1(*sys.argv[2:]))
    if sys.argv[1] == "sigterm":
        sys.exit(sigterm())
    main(*sys.argv[1:])
