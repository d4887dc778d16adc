"""What a training run keeps in its directory (RUN_DIR), by name: the one place for the run's
layout, read by the trainer, the resume, the converters and the output checks."""
from __future__ import annotations

import re

from jscenegen.run_lock import LOCK_NAME

RUN_CHECKPOINTS = "checkpoints"
"""A training run's checkpoint directory, `RUN_DIR/checkpoints/<step>/` (the store's root)."""

RUN_RECORD = "run.json"
"""`RUN_DIR/run.json`, written by each start of `jscenegen train` (`pipeline.write_run_files`):
{"model_dir": the model the run started from, "config_source": the config it was given}."""

RUN_CONFIG = "config.yaml"
"""`RUN_DIR/config.yaml`: the run's resolved config (credentials redacted), written at each start."""

EVAL_BEFORE, EVAL_AFTER, EVAL_CHANGE = "eval_before", "eval_after", "eval_change"
RUN_REPORTS = (EVAL_BEFORE, EVAL_AFTER, EVAL_CHANGE)
"""The evaluation reports `jscenegen train` writes into RUN_DIR (`<stem>.json`, and its plot
`<stem>.png`) with `trainer.eval_before_after`; `trainer.eval_every` writes
`eval_update_stem(N)`."""

_EVAL_UPDATE = "eval_update_"

RUN_ASSETS = "hf_assets"
"""`RUN_DIR/hf_assets/`: a resumed run's config and tokenizer when it has no model directory of
its own (a run made by `convert --to orbax`): copied once from the newest step's `hf/`, which
the store deletes when newer steps replace it (`checkpoint.resume.resume_model_dir`)."""

RUN_SWANLAB = "swanlab"
"""`RUN_DIR/swanlab/`: swanlab's own files with `logging.swanlab_mode` other than disabled
(`grpo.train.metrics.MetricsLogger` makes it, masks credentials in it, and removes the one it
made when swanlab could not start or the start ended before it wrote the run's files)."""

METRICS_LOG = "metrics.jsonl"
TRAJECTORIES_LOG = "trajectories.jsonl"   # with trainer.dump_trajectories
RUN_LOGS = (METRICS_LOG, TRAJECTORIES_LOG)


def eval_update_stem(update: int) -> str:
    """The stem of the report (`<stem>.json`, plot `<stem>.png`) of the `trainer.eval_every`
    evaluation after effective update `update`: `eval_update_<update>`."""
    return f"{_EVAL_UPDATE}{update}"


def run_file_kind(parts: tuple[str, ...]) -> str | None:
    """What a training run keeps at `parts` (a path relative to its directory, as parts): its
    evaluation reports and plots (`RUN_REPORTS`, `eval_update_stem(N)`, .json and .png), its run
    record, config, lock and JSONL logs, its checkpoints/, hf_assets/ and swanlab/ directories
    and anything under them; None for a path the run does not write."""
    if not parts:
        return None
    if parts[0] in (RUN_CHECKPOINTS, RUN_ASSETS, RUN_SWANLAB):
        return f"{parts[0]}/ directory"
    if len(parts) > 1:
        return None
    name = parts[0]
    stem, dot, ext = name.rpartition(".")
    if dot and ext in ("json", "png") and (stem in RUN_REPORTS
                                           or re.fullmatch(re.escape(_EVAL_UPDATE) + "[0-9]+", stem)):
        return "evaluation report" if ext == "json" else "evaluation plot"
    return {RUN_RECORD: "run record", RUN_CONFIG: "config", LOCK_NAME: "lock",
            METRICS_LOG: "log", TRAJECTORIES_LOG: "log"}.get(name)
