"""Continuing a run from its newest complete checkpoint.

`restore_onto_mesh` reads the newest verified step straight into the trainer's FSDP layout;
`check_same_run` refuses a checkpoint whose protocol or reward differ from the resuming run's;
`converted_position` reads where a checkpoint converted from VERL or HF (`convert --to orbax`,
train_state with `source_format`) stands, which carries no protocol or schedule of ours;
`resume_model_dir` finds the config and tokenizer a resumed run uses.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Mapping

import jax

from jscenegen.checkpoint.store import HF_DIR, Checkpoint, CheckpointError, CheckpointStore, padded_target

log = logging.getLogger(__name__)


class ResumeError(ValueError):
    """A resume that would not continue the same run (protocol, reward or schedule changed)."""


@dataclasses.dataclass(frozen=True)
class ConvertedPosition:
    """Where a converted (VERL/HF) checkpoint stands: `step` updates done, `lr_step` the
    LR-scheduler count, `skipped_steps` updates whose optimizer step was skipped."""

    step: int
    lr_step: int
    skipped_steps: int


def restore_onto_mesh(store: CheckpointStore, shapes: Mapping[str, tuple[int, ...]],
                      mesh: jax.sharding.Mesh, param_dtype: Any) -> Checkpoint:
    """The newest complete, verified checkpoint of `store`, params in `param_dtype` and every
    array padded and sharded as the trainer holds it (`padded_target` on `mesh`).

    Newer steps that are corrupt (complete once, failing their checksums now) are set aside
    first (`CheckpointStore.set_aside_corrupt`: renamed, with a warning naming the files), so
    the resumed run redoes their updates and saves those steps again.
    Raises CheckpointError when there is none or it does not fit `shapes`."""
    store.set_aside_corrupt()
    return store.restore(target=padded_target(shapes, mesh, dtype=param_dtype))


def is_converted(train_state: Mapping[str, Any]) -> bool:
    """True for a checkpoint written by `convert` from VERL or HF (no run identity of ours)."""
    return "source_format" in train_state


def converted_position(train_state: Mapping[str, Any]) -> ConvertedPosition:
    """The step, LR count and skipped steps a converted checkpoint records."""
    step = int(train_state.get("step", 0))
    return ConvertedPosition(step=step, lr_step=int(train_state.get("lr_schedule_count", step)),
                             skipped_steps=max(step - int(train_state.get("optimizer_step", step)), 0))


def check_same_run(train_state: Mapping[str, Any], *, protocol_hash: str,
                   reward: Mapping[str, Any]) -> None:
    """Raise ResumeError when the checkpoint's protocol hash or reward configuration differ
    from the resuming run's (its updates would not mean the same thing)."""
    if train_state["protocol_hash"] != protocol_hash:
        raise ResumeError(f"resume refused: the protocol changed (checkpoint "
                          f"{train_state['protocol_hash']}, now {protocol_hash})")
    if train_state["reward"] != dict(reward):
        raise ResumeError(f"resume refused: the reward configuration changed "
                          f"(checkpoint {train_state['reward']}, now {dict(reward)})")


def resume_model_dir(run_dir: str | Path) -> Path:
    """Config and tokenizer of a run being resumed: the run's model directory (`run.json`),
    or else the `hf/` assets of its newest complete checkpoint (a directory made by
    `convert --to orbax`). Raises CheckpointError when the run has no complete checkpoint."""
    run_dir = Path(run_dir)
    run_json = run_dir / "run.json"
    if run_json.is_file():
        model_dir = Path(json.loads(run_json.read_text())["model_dir"])
        if (model_dir / "config.json").is_file():
            return model_dir
    with CheckpointStore(run_dir / "checkpoints") as store:
        step = store.latest_valid_step()
    if step is None:
        raise CheckpointError(f"{run_dir}/checkpoints holds no complete checkpoint")
    return run_dir / "checkpoints" / str(step) / HF_DIR
