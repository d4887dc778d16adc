"""`jscenegen train`: the GRPO job (the CPU default with no arguments)."""
from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path
from typing import Any

from jscenegen.commands import positive_int_arg
from jscenegen.paths import data_path_arg
from jscenegen.run_files import RUN_CHECKPOINTS, RUN_CONFIG, RUN_RECORD
from jscenegen.run_lock import LOCK_NAME


def register(sub) -> None:
    p = sub.add_parser("train", help="GRPO training (no arguments: the CPU default pipeline)")
    p.add_argument("--config", default=None, type=data_path_arg, help="run config YAML (default: configs/cpu-default.yaml)")
    p.add_argument("--run-dir", default=None, help="output directory (default: runs/<time>)")
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its newest complete checkpoint, with its "
                        "config.yaml and any key=value overrides (written back to config.yaml)")
    p.add_argument("--max-updates", type=positive_int_arg, default=None,
                   help="stop after N update attempts of this invocation (a resumed run counts "
                        "from its resume; smoke runs)")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    p.set_defaults(func=run, intermixed=True)  # overrides anywhere among the options


def run(args) -> int:
    from jscenegen.checkpoint.store import check_checkpoints_dir
    from jscenegen.config import ConfigError, read_yaml
    from jscenegen.grpo.train.metrics import check_run_logs
    from jscenegen.paths import cache_dir, check_output_dir, refuse_overwriting_input, resolve_data_path
    from jscenegen.run_config import DEFAULT_CONFIG, config_inputs, load_run_config
    from jscenegen.run_lock import refuse_if_in_use
    from jscenegen.sharding.mesh import asks_for_multi_host
    from jscenegen.text import terminal_line

    if args.resume:
        run_dir = Path(args.resume)
        config_path, config_source, afresh = _what_to_resume(args, run_dir)
    else:
        afresh = False
        config_path = args.config or resolve_data_path(DEFAULT_CONFIG)
        config_source = str(config_path)
        run_dir = Path(args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    # before any path below it (a name too long)
    label = "--resume" if args.resume else "--run-dir"
    check_output_dir(run_dir, label=label)
    if not args.resume:
        check_checkpoints_dir(run_dir / RUN_CHECKPOINTS)
    cfg = load_run_config(config_path, args.overrides)
    if args.resume and not asks_for_multi_host(cfg.mesh):
        # before anything is said about the run (it is taken again later); in a multi-host run
        # process 0 takes it once every process has joined, refusing on all (`train_command`):
        # a lock process 0 left on its host cannot be checked from the others
        refuse_if_in_use(run_dir)
    settings_notice = None
    if args.resume and args.overrides:
        try:
            saved, only_saved_keys = load_run_config(config_path).model_dump(mode="json"), False
        except ConfigError:   # not valid alone (a redacted judge.base_url): the keys it holds
            saved, only_saved_keys = read_yaml(config_path), True
        if not afresh:   # a new start takes the model it is given
            cfg = _keep_saved_start(saved, cfg)
    trained = _trained_config(run_dir) if args.resume and not afresh else None
    if trained is not None:   # what the run trained with: a hand edit of config.yaml counts too
        from jscenegen.pipeline import LAUNCH_KEYS

        _warn_start_keys_edited(trained, cfg)

        settings_notice = _changed_settings(trained, cfg, only_saved_keys=True, ignored=(
            *START_KEYS, *(f"mesh.{key}" for key in LAUNCH_KEYS)))
    elif args.resume and args.overrides:
        settings_notice = _changed_settings(saved, cfg, only_saved_keys,
                                            "the restart" if afresh else "resume")
    if not args.resume:
        _refuse_a_directory_of_other_files(run_dir)
    check_run_logs(run_dir)
    from jscenegen.pipeline import check_eval_files

    check_eval_files(run_dir, cfg, resume=bool(args.resume) and not afresh)
    # without model.path the run starts from (and may create) a model in the cache
    models = None if cfg.model.path else cache_dir() / "models"
    refuse_overwriting_input(run_dir, label, {"model.path": cfg.model.path,
                                              "the warm-start model cache": models,
                                              **config_inputs(cfg, config_path)})
    if afresh:   # said once the checks above passed
        print(terminal_line(f"{run_dir} has no checkpoint (stopped before its first was saved): "
                            f"starting it again with {args.config or 'its config.yaml'}"),
              file=sys.stderr, flush=True)
    from jscenegen.pipeline import train_command

    return train_command(cfg, run_dir, resume=bool(args.resume) and not afresh,
                         max_updates=args.max_updates, config_source=config_source,
                         settings_notice=settings_notice)


RUN_OWNED = {RUN_CHECKPOINTS, LOCK_NAME}   # what a start leaves before its run.json


def _refuse_a_directory_of_other_files(run_dir: Path) -> None:
    """A new run writes config.yaml, run.json, metrics.jsonl, ... into `run_dir`: refuse one
    that holds other things and no run record (`RUN_RECORD`; a run stopped before its first
    checkpoint has one and starts again there), so that nothing of the user's, a config
    given with --config included, is overwritten."""
    if not run_dir.is_dir() or (run_dir / RUN_RECORD).exists():
        return
    others = sorted(p.name for p in run_dir.iterdir() if p.name not in RUN_OWNED)
    if others:
        shown = ", ".join(others[:5]) + (f", ... ({len(others)} in all)" if len(others) > 5 else "")
        raise ValueError(f"--run-dir {run_dir}: holds files that are not a run's ({shown}); a new "
                         "run starts in a new or empty directory (a run writes config.yaml, "
                         "run.json and metrics.jsonl there)")


def _what_to_resume(args, run_dir: Path) -> tuple[str | Path, str, bool]:
    """(config path, config source for run.json, afresh) of `--resume RUN_DIR`: afresh when
    the run stopped before its first checkpoint was saved (it starts again with its config).
    Raises, naming the file, for what cannot be resumed: no run directory, a `checkpoints`
    that cannot hold steps, a damaged run.json, a config.yaml missing or not a file, a start
    killed before it wrote its run files (only its lock left, held by no live process: the
    `--run-dir` command that starts it again is named). The lock of a run in use is checked by
    `run` once the launch is known."""
    from jscenegen.checkpoint.resume import read_run_record
    from jscenegen.checkpoint.store import check_checkpoints_dir, finished_saves
    from jscenegen.paths import not_a_file
    from jscenegen.run_lock import refuse_if_in_use

    if args.run_dir and Path(args.run_dir).resolve() != run_dir.resolve():
        raise ValueError(f"--run-dir {args.run_dir} with --resume {args.resume}: a resumed run "
                         "stays in its own directory; drop --run-dir")
    if run_dir.exists() and not run_dir.is_dir():
        raise NotADirectoryError(f"--resume {args.resume}: not a directory (a run directory "
                                 "holds config.yaml and checkpoints/)")
    if not os.path.lexists(run_dir):
        raise FileNotFoundError(f"--resume {args.resume}: no such directory")
    checkpoints = run_dir / RUN_CHECKPOINTS
    check_checkpoints_dir(checkpoints)
    record = read_run_record(run_dir)
    left = {p.name for p in run_dir.iterdir()}
    if record is None and LOCK_NAME in left and left <= RUN_OWNED and not finished_saves(checkpoints):
        refuse_if_in_use(run_dir)   # a live start that has not written its run files yet
        # a start killed (SIGKILL: no handler ran) before it wrote run.json
        raise FileNotFoundError(f"--resume {args.resume}: nothing to resume; the run was stopped "
                                f"before it wrote its run files (while it made or loaded its "
                                f"model, in its SFT warm start, say: {run_dir} holds only "
                                f"{', '.join(sorted(left))}); start it "
                                f"again: jscenegen train --run-dir {run_dir} [--config FILE] "
                                "[its key=value overrides]")
    afresh = record is not None and not finished_saves(checkpoints)
    if not afresh and not checkpoints.is_dir():
        from convert.inspect import checkpoint_format

        run = next((p for p in (run_dir, run_dir.parent) if p.name == RUN_CHECKPOINTS), None)
        hint = "" if run is None else f" (--resume takes the run's directory: {run.parent})"
        kind = "" if hint else checkpoint_format(run_dir)
        if kind in ("verl", "export", "hf"):
            hint = (f" ({run_dir} is a {kind} checkpoint: convert it first, `jscenegen convert "
                    f"{run_dir} RUN/checkpoints --to orbax`, then --resume RUN)")
        elif kind == "orbax-run":
            hint = (f" ({run_dir} holds checkpoint steps itself, as `convert --to orbax` writes "
                    f"them into its output: a run keeps them in RUN/{RUN_CHECKPOINTS}; convert "
                    f"into {run_dir / RUN_CHECKPOINTS} instead, or move its contents there)")
        elif kind == "orbax":
            hint = (f" ({run_dir} is one checkpoint step: --resume takes the run directory RUN "
                    f"whose {RUN_CHECKPOINTS}/ holds the steps)")
        raise FileNotFoundError(f"{checkpoints} not found: nothing to resume{hint}")
    saved = run_dir / RUN_CONFIG  # absent in a directory made by `convert --to orbax`
    if args.config:
        if saved.is_file():
            raise ValueError(f"--config {args.config} with --resume {args.resume}: the run "
                             f"continues with its own {saved}; pass changes as key=value overrides")
    elif not os.path.lexists(saved) and record is not None:
        raise ValueError(f"{saved} is missing: the run's config is unknown (a run made by "
                         "`jscenegen train` keeps it there); restore it, or continue with "
                         "another one: --config FILE")
    elif not os.path.lexists(saved):
        raise ValueError(f"{saved} is missing: {run_dir} holds checkpoints without a run's "
                         "config (a directory made by `convert --to orbax`); say what to "
                         "continue with: --config FILE")
    elif why := not_a_file(saved):
        raise ValueError(f"{saved}: {why}; the run's config is a YAML file written when it started")
    elif _is_blank(saved):
        raise ValueError(f"{saved} is empty: the run's config is unknown (`jscenegen train` "
                         "writes it whole when the run starts); restore it, or delete it and "
                         "continue with another one: --config FILE")
    config_path = args.config or saved
    config_source = str(config_path)
    if afresh and not args.config:   # a new start with the run's config
        config_source = record["config_source"] or config_source
    return config_path, config_source, afresh


def _is_blank(path: Path) -> bool:
    """Whether the file at `path` holds nothing but whitespace (read at most 4 KiB)."""
    with open(path, "rb") as f:
        return not f.read(4096).strip()


START_KEYS = ("model.path", "warm_start.")   # the model a run starts from: not read on resume


def _keep_saved_start(saved: dict, cfg):
    """`cfg` with the run's own values of the START_KEYS (`model.path`, `warm_start.*`) that a
    resume's overrides change, with a warning: a resume never reads them (the weights are the
    run's newest checkpoint), so the config.yaml written back keeps the model the run started
    from. Only the changed keys are put back, each only where the run's value is valid (an
    override that mends a broken one is kept). `saved`: the run's config as a mapping."""
    import logging

    from pydantic import ValidationError

    from jscenegen.config import dotted_items, set_dotted

    before, data = dotted_items(saved), cfg.model_dump(mode="json")
    kept = []
    for key in _start_keys_differing(before, cfg):
        trial = copy.deepcopy(data)
        set_dotted(trial, key, before[key])
        try:
            cfg = type(cfg).model_validate(trial)
        except ValidationError:
            continue
        data = trial
        kept.append(key)
    if kept:
        logging.getLogger(__name__).warning(
            "%s not read on resume: the weights are the run's newest checkpoint (config.yaml "
            "keeps %s)", _keys_are(kept), ", ".join(f"{k} {before[k]!r}" for k in kept))
    return cfg


def _warn_start_keys_edited(trained: dict, cfg) -> None:
    """Warn when `cfg` (config.yaml, after `_keep_saved_start`) holds other START_KEYS values
    than the config the run `trained` with: a hand edit of config.yaml's model.path is not read
    on resume either, and went unmentioned."""
    import logging

    from jscenegen.config import dotted_items

    before = dotted_items(trained)
    if edited := _start_keys_differing(before, cfg):
        logging.getLogger(__name__).warning(
            "config.yaml's %s not read on resume: the weights are the run's newest checkpoint "
            "(it trained from %s)", _keys_are(edited), ", ".join(f"{k} {before[k]!r}" for k in edited))


def _start_keys_differing(before: dict[str, Any], cfg) -> list[str]:
    """The dotted START_KEYS that `before` ({dotted key: value}) holds with another value than
    `cfg` has."""
    from jscenegen.config import dotted_items

    return [key for key, value in dotted_items(cfg.model_dump(mode="json")).items()
            if key.startswith(START_KEYS) and key in before and before[key] != value]


def _keys_are(keys: list[str]) -> str:
    return ", ".join(keys) + (" is" if len(keys) == 1 else " are")


def _trained_config(run_dir: Path) -> dict | None:
    """The config the newest finished save of `run_dir` records (its training_metadata.json,
    credentials redacted), or None: no readable record (a step imported by `convert --to
    orbax` records none). The trainer resumes from the newest complete step: when the newest
    finished one is damaged it sets it aside and the record read here is that of a step it
    passes over (of the same run, so it names the same settings unless a resume changed them)."""
    from jscenegen.checkpoint.store import CheckpointError, finished_saves, read_metadata
    from jscenegen.paths import is_step_name

    steps = [p for p in finished_saves(run_dir / RUN_CHECKPOINTS) if is_step_name(p.name)]
    if not steps:
        return None
    try:
        config = read_metadata(max(steps, key=lambda p: int(p.name))).get("config")
    except CheckpointError:   # the trainer names a damaged step itself
        return None
    return config if isinstance(config, dict) and config else None


def _changed_settings(saved: dict, cfg, only_saved_keys: bool = False,
                      what: str = "resume", ignored: tuple[str, ...] = ()) -> str | None:
    """The warning naming the settings `cfg` changes from `saved` (a mapping: the run's
    config.yaml, or the config its newest checkpoint records; only its own keys with
    `only_saved_keys`; none starting with an `ignored` prefix, none whose saved value is a
    redacted credential, which cannot be compared), credentials redacted; None when none
    changes. `train_command` logs it once the trainer has accepted the resume (it
    checks that the schedule and reward stay compatible; the rest is taken as asked), so a
    refused resume does not say it changed anything. `what`: "resume", or "the restart" of a
    run stopped before its first checkpoint."""
    from jscenegen.checkpoint.metadata import config_changes

    changed = config_changes(saved, cfg.model_dump(mode="json"), only_saved_keys=only_saved_keys,
                             ignored=ignored)
    return f"{what} changes {'; '.join(changed)}" if changed else None
