"""What `jscenegen train` runs: model preparation, the GRPO loop, progress and run files."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import yaml

from jscenegen.checksums import write_json_atomic
from jscenegen.grpo.run_metadata import redact
from jscenegen.paths import cache_dir

log = logging.getLogger(__name__)


def default_model_dir(cfg) -> Path:
    """The CPU default's tiny model (created once, reused from the cache)."""
    from jscenegen.commands.init_model import tokenizer_corpus
    from jscenegen.model.init_model import init_model_dir

    out = cache_dir() / "models" / "tiny-qwen3"
    if not (out / "config.json").is_file():
        print(f"creating the tiny Qwen3 model in {out} (first use)")
        init_model_dir(out, arch="qwen3", preset="tiny", seed=0, texts=tokenizer_corpus())
    return out


def write_run_files(run_dir: Path, cfg, model_dir: Path, config_source: str) -> None:
    """config.yaml (the resolved config, credentials redacted) and run.json; atomic."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "config.yaml.tmp"
    tmp.write_text(yaml.safe_dump(redact(cfg.model_dump(mode="json")), sort_keys=False))
    tmp.replace(run_dir / "config.yaml")
    write_json_atomic(run_dir / "run.json", {"model_dir": str(model_dir.resolve()),
                                             "config_source": config_source})


class Progress:
    """A rich progress bar with reward, failure rate and tokens/s (process 0 only)."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress
            from rich.progress import TextColumn, TimeElapsedColumn

            self.bar = RichProgress(TextColumn("GRPO"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("{task.fields[info]}"), TimeElapsedColumn())
            self.task = self.bar.add_task("updates", total=total, info="")
            self.bar.start()

    def __call__(self, row: dict) -> None:
        if self.bar is None:
            return
        reward = row.get("reward/mean")
        info = (f"attempt {row['attempt']} {row['role']:<8} reward "
                f"{'n/a' if reward is None else f'{reward:+.3f}'} fail {row['failure_rate']:.2f} "
                f"{row['rollout/tokens_per_s']:.0f} tok/s {'step' if row['stepped'] else 'no-signal'}")
        self.bar.update(self.task, completed=row["effective_updates"], info=info)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def train_command(cfg, run_dir: Path, *, resume: bool, max_updates: int | None,
                  config_source: str) -> int:
    from jscenegen.grpo.trainer import Trainer
    from jscenegen.sharding.mesh import initialize_distributed, is_primary

    initialize_distributed(cfg.mesh.coordinator_address, cfg.mesh.num_processes, cfg.mesh.process_id)
    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    if resume:
        model_dir = Path(json.loads((run_dir / "run.json").read_text())["model_dir"])
    elif cfg.model.path:
        model_dir = Path(cfg.model.path)
    else:
        model_dir = default_model_dir(cfg)
    phases["prepare_model_s"] = time.perf_counter() - t0
    if is_primary() and not resume:
        write_run_files(run_dir, cfg, model_dir, config_source)
    t1 = time.perf_counter()
    trainer = Trainer(cfg, run_dir, model_dir, resume=resume)
    progress = Progress(cfg.schedule.total_updates, cfg.trainer.progress and is_primary())
    try:
        summary = trainer.run(max_updates, progress=progress)
    finally:
        progress.close()
        trainer.close()
    phases["grpo_s"] = time.perf_counter() - t1
    if is_primary():
        out = dict(vars(summary), run_dir=str(run_dir), phases=phases)
        print(json.dumps(out))
    return 0
