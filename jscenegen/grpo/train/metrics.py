"""Per-update metrics: one JSON line per attempt in `RUN_DIR/metrics.jsonl`, and swanlab.

swanlab runs `offline` by default (files under `RUN_DIR/swanlab`, no network; open them with
`swanlab watch RUN_DIR/swanlab`, which needs `pip install "swanlab[dashboard]"`), `local`,
`online` (cloud, only when configured; the API key comes from swanlab's own login/environment)
or `disabled`. Only process 0 logs. The config handed to swanlab is the redacted one.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Literal

from pydantic import Field

from jscenegen.config import Section
from jscenegen.paths import write_text


class LoggingConfig(Section):
    swanlab_mode: Literal["offline", "local", "online", "disabled"] = "offline"
    project: str = "jscenegen"
    experiment: str | None = Field(None, description="run name (default: the run directory's name)")


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Append metrics rows to JSONL (flushed per row) and forward numbers to swanlab."""

    def __init__(self, run_dir: str | Path, cfg: LoggingConfig, config_dict: dict, *,
                 primary: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.primary = primary
        self._swanlab = None
        if not primary:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if cfg.swanlab_mode != "disabled":
            import swanlab

            self._swanlab = swanlab.init(
                project=cfg.project, name=cfg.experiment or Path(run_dir).name,
                mode=cfg.swanlab_mode, log_dir=str(Path(run_dir) / "swanlab"),
                config=config_dict, reinit=True,
            )

    def log(self, row: dict, step: int) -> None:
        if not self.primary:
            return
        row = {k: _clean(v) for k, v in row.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self._swanlab is not None:
            numbers = {k: v for k, v in row.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None}
            self._swanlab.log(numbers, step=step)

    def close(self) -> None:
        if self._swanlab is not None:
            self._swanlab.finish()
            self._swanlab = None


def truncate_metrics(run_dir: str | Path, attempts: int) -> None:
    """Drop the rows of attempts >= `attempts` (written after the checkpoint a run resumes
    from), so a resumed log equals a straight one."""
    path = Path(run_dir) / "metrics.jsonl"
    if path.is_file():
        rows = [line for line in path.read_text().splitlines()
                if line.strip() and json.loads(line)["attempt"] < attempts]
        write_text(path, "".join(r + "\n" for r in rows))


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
