"""What `jscenegen train` runs: model preparation, the GRPO loop, progress and run files."""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Iterator

from jscenegen.checkpoint.checksums import file_sha256
from jscenegen.checkpoint.metadata import redact
from jscenegen.config import dotted_items, dump_yaml
from jscenegen.paths import cache_dir, write_json, write_text
from jscenegen.run_files import (
    EVAL_AFTER,
    EVAL_BEFORE,
    EVAL_CHANGE,
    RUN_CHECKPOINTS,
    RUN_CONFIG,
    RUN_RECORD,
    RUN_REPORTS,
)
from jscenegen.signals import Terminated
from jscenegen.text import terminal_line

log = logging.getLogger(__name__)


def _base_model_dir(cfg) -> Path:
    return cache_dir() / "models" / f"{cfg.warm_start.preset}-{cfg.warm_start.arch}"


# the SFT config's keys the warm start does not read -> what decides instead
UNREAD_SFT_KEYS = {
    "model.path": "which trains the model of warm_start.arch and warm_start.preset (to start "
                  "GRPO from another model, give it as the run's model.path; `jscenegen sft` "
                  "fine-tunes one)",
    "sft.out_dir": "which writes its model into the cache ($JSCENEGEN_CACHE/models)",
    "sft.init_arch": "whose fresh model is warm_start.arch",
    "sft.init_preset": "whose fresh model is warm_start.preset",
}


# the settings the warm start takes from the run, refused among warm_start.sft_overrides:
# (a key, or a section's prefix) -> what to set on the run instead
RUN_SFT_KEYS = {
    "scene.": "the warm start plays in the run's own scene settings; set them on the run (scene.*)",
    "sft.stop_strings": "the warm start's answers stop as the rollouts' do; set them on the run "
                        "(sampling.stop_strings)",
    "sft.max_answer_tokens": "the warm start drops the demonstrations whose answers pass the "
                             "rollouts' per-turn cap; set it on the run (sampling.max_new_tokens)",
    "sft.grade_keys": "the warm start's critic grades what the run's judge grades; set them on "
                      "the run (judge.grade_keys)",
}
SFT_MESH_KEYS = ("mesh.fsdp", "mesh.sp")   # from the run unless sft_overrides sets them


def _warm_start_origin(cfg) -> str:
    """How the warm start's errors begin: `warm_start (sft_config FILE, sft_overrides)`."""
    return f"warm_start (sft_config {cfg.warm_start.sft_config}, sft_overrides)"


def warm_start_sft_config(cfg):
    """The SFT warm start's config (`warm_start.sft_config` with `warm_start.sft_overrides`)
    playing in the run's own protocol: its `scene` section, `sft.stop_strings`,
    `sft.max_answer_tokens` and `sft.grade_keys` are the run's `scene`, `sampling.stop_strings`,
    `sampling.max_new_tokens` and `judge.grade_keys` (what the rollouts will use:
    `RUN_SFT_KEYS`; grade keys the scripted critic cannot give refused), its `mesh.fsdp` and
    `mesh.sp` the run's unless an override sets them (`SFT_MESH_KEYS`), its `model.path` the
    base model it trains; None without one. Raises ConfigError naming the warm_start keys, also
    for an override of the keys the run decides, of one it does not read (`UNREAD_SFT_KEYS`),
    or a multi-host launch key (`LAUNCH_KEYS`: the warm start runs in one process), in the file
    or an override."""
    from jscenegen.config import ConfigError, load_config, override_leaf_keys
    from jscenegen.paths import resolve_data_path
    from jscenegen.sft.config import SFTRunConfig, check_expert_grade_keys
    from jscenegen.sharding.mesh import MeshConfig

    ws = cfg.warm_start
    if ws.sft_config is None:
        return None
    try:
        given = {key for item in ws.sft_overrides for key in override_leaf_keys(item)}
        for key in sorted(given):
            if why := next((w for k, w in RUN_SFT_KEYS.items()
                            if key == k or (k.endswith(".") and key.startswith(k))), None):
                raise ConfigError(f"{key}: {why}")
        if unread := sorted(given & UNREAD_SFT_KEYS.keys()):
            raise ConfigError(f"{unread[0]}: not read by the warm start, "
                              f"{UNREAD_SFT_KEYS[unread[0]]}")
        from_run = [f"{key}={getattr(cfg.mesh, key.split('.')[1])}" for key in SFT_MESH_KEYS
                    if key not in given]
        sft_cfg = load_config(resolve_data_path(ws.sft_config),
                              [*ws.sft_overrides, *from_run, f"model.path={_base_model_dir(cfg)}"],
                              model=SFTRunConfig)
        default = MeshConfig()
        if launch := [f"mesh.{k}={v}" for k in LAUNCH_KEYS
                      if (v := getattr(sft_cfg.mesh, k)) != getattr(default, k)]:
            raise ConfigError(f"{launch[0]}: the warm start runs in one process (a multi-host "
                              "run starts from model.path); the launch keys are the run's "
                              "(mesh.*), not the warm start's: unset it")
        try:
            check_expert_grade_keys(cfg.judge.grade_keys, "judge.grade_keys")
        except ValueError as e:
            raise ConfigError(f"{e} (to train with these, give model.path a model whose critic "
                              "knows them)") from None
    except ConfigError as e:
        raise ConfigError(f"{_warm_start_origin(cfg)}: {e}") from None
    return sft_cfg.model_copy(update={
        "scene": cfg.scene,
        "sft": sft_cfg.sft.model_copy(update={"stop_strings": cfg.sampling.stop_strings,
                                              "max_answer_tokens": cfg.sampling.max_new_tokens,
                                              "grade_keys": cfg.judge.grade_keys})})


def check_warm_start_inputs(cfg):
    """`warm_start_sft_config(cfg)` and the checks of its inputs that need no model
    (`sft.run.check_sft_inputs`: its mesh against the devices, its batch against the
    micro-batches and the row budget, the file of `sampling.chat_template_path`, named so;
    its model.causal_balance against a qwen3_5 warm_start.arch on more than one sp shard), so
    a run is refused before any model is made.
    Returns (the SFT config, its mesh), (None, None) without an SFT. Raises ConfigError, or
    the checks' ValueError (MeshError), beginning `warm_start (sft_config FILE, sft_overrides):`."""
    from jscenegen.config import ConfigError
    from jscenegen.model.qwen35 import check_causal_balance
    from jscenegen.model.tokenizer.chat import TEMPLATE_OPTION
    from jscenegen.sft.run import check_sft_inputs
    from jscenegen.sharding.mesh import MeshError

    sft_cfg = warm_start_sft_config(cfg)
    if sft_cfg is None:
        return None, None
    try:
        mesh = check_sft_inputs(sft_cfg, cfg.sampling.chat_template_path, TEMPLATE_OPTION)
        check_causal_balance(cfg.warm_start.arch, sft_cfg.model.causal_balance, mesh.shape["sp"])
        return sft_cfg, mesh
    except ValueError as e:   # MeshError, ConfigError included: its origin named
        cls = type(e) if type(e) in (ValueError, ConfigError, MeshError) else ValueError
        raise cls(f"{_warm_start_origin(cfg)}: {e}") from None


# settings that change no weight: what the warm start logs, where a standalone SFT writes and
# the fresh model it makes (the warm start's is warm_start.arch and .preset: UNREAD_SFT_KEYS)
KEYLESS_SFT_FIELDS = {"log_every", "out_dir", "init_arch", "init_preset"}
# scene settings naming files whose content the key holds instead: another path to the same
# prompts or catalogue (relative or absolute, a copy) makes the same demonstrations
CONTENT_KEYED_SCENE_FIELDS = {"prompts_dir", "catalogue_path"}


def package_source_digest(root: Path) -> str:
    """Hex SHA-256 over every `*.py` file under `root` (its relative POSIX path and bytes, in
    sorted order): a change to any of the package's code, whichever module it touches (the
    expert, the demonstrations' tokens, the optimizer, the model), changes it."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(file_sha256(path).encode())
    return h.hexdigest()


PACKAGE_DIR = Path(__file__).resolve().parent


def warm_start_key(cfg, sft_cfg, base: Path) -> str:
    """The warm start's cache key (hex SHA-256): what decides its weights. The SFT config (the
    mesh aside: fsdp and sp change only the order of the sums, as padding rows and columns
    carry no loss and micro-batches sum to the batch's gradient; the paths of the base, the
    prompts and the catalogue aside: their content counts; `KEYLESS_SFT_FIELDS` aside), the
    prompts, the catalogue's content (as the protocol hash reads it: a whitespace edit changes
    nothing), the chat template, the base model's files (each hashed whole: its tokenizer,
    config and weights), the package's code (`package_source_digest`: an upgrade that changes
    any module trains it again), and the measuring and grading rules the demonstrations'
    environment messages come from (`RULES_REVISION`)."""

    from jscenegen.checkpoint.checksums import list_files
    from jscenegen.scene.catalogue import load_catalogue
    from jscenegen.scene.prompts import load_templates
    from jscenegen.scene.protocol import RULES_REVISION

    template = cfg.sampling.chat_template_path
    settings = sft_cfg.model_dump(mode="json", exclude={"mesh": True, "model": {"path"},
                                                        "sft": KEYLESS_SFT_FIELDS,
                                                        "scene": CONTENT_KEYED_SCENE_FIELDS})
    return hashlib.sha256(json.dumps([
        settings,
        load_templates(sft_cfg.scene.prompts_dir).digest(),
        load_catalogue(sft_cfg.scene.catalogue_path).raw,
        Path(template).read_text(encoding="utf-8") if template else None,
        {name: file_sha256(base / name) for name in list_files(base, exclude=())},
        package_source_digest(PACKAGE_DIR),
        RULES_REVISION], sort_keys=True).encode()).hexdigest()


def check_warm_start_model(cfg) -> None:
    """Refuse (ValueError, in the model's words) a run the model of `warm_start.arch` cannot
    train, before `default_model_dir` makes it: model.causal_balance over mesh.sp > 1 shards
    with qwen3_5 (its Gated DeltaNet recurrence needs the tokens in order)."""
    from jscenegen.model.qwen35 import check_causal_balance

    check_causal_balance(cfg.warm_start.arch, cfg.model.causal_balance, cfg.mesh.sp)


def default_model_dir(cfg, phases: dict, checked: tuple | None = None) -> Path:
    """The CPU default's policy: a small fresh model (created once) warm-started by SFT on the
    scripted expert's episodes (run once per `warm_start_key`: SFT config, prompt set,
    catalogue content, chat template, base model, the sources that decide the demonstrations
    and objective, and scene rules; cached under `cache_dir()`); a model that another run on
    the same cold cache published first is used (`_or_made_meanwhile`). `checked`: what
    `check_warm_start_inputs(cfg)` returned when the caller ran it already (`train_command`,
    before the run lock); without it it runs here, raising before any model is made."""
    from jscenegen.model.init_model import init_model_dir
    from jscenegen.model.tokenizer.chat import TEMPLATE_OPTION
    from jscenegen.scene.corpus import tokenizer_corpus
    from jscenegen.sft.run import run_sft

    ws = cfg.warm_start
    t0 = time.perf_counter()
    base = _base_model_dir(cfg)
    sft_cfg, mesh = checked if checked is not None else check_warm_start_inputs(cfg)
    if not (base / "config.json").is_file():
        print(terminal_line(f"creating the {ws.preset} {ws.arch} model in {base} (first use)"),
              file=sys.stderr, flush=True)
        with _or_made_meanwhile(base):
            init_model_dir(base, arch=ws.arch, preset=ws.preset, seed=0, texts=tokenizer_corpus())
    phases["init_model_s"] = time.perf_counter() - t0
    if sft_cfg is None:
        return base
    template = cfg.sampling.chat_template_path
    out = base.parent / f"{base.name}-sft-{warm_start_key(cfg, sft_cfg, base)[:12]}"
    if not (out / "config.json").is_file():
        print(terminal_line(f"SFT warm start into {out} ({sft_cfg.sft.steps} steps, first use)"),
              file=sys.stderr, flush=True)
        t1 = time.perf_counter()
        with _or_made_meanwhile(out):
            run_sft(sft_cfg, base, out, chat_template_path=template, mesh=mesh,
                    template_option=TEMPLATE_OPTION,
                    log=_sft_log if cfg.trainer.progress else _no_log)
        phases["sft_s"] = time.perf_counter() - t1
    else:
        print(terminal_line(f"reusing the SFT warm start {out}"), file=sys.stderr, flush=True)
    return out


@contextlib.contextmanager
def _or_made_meanwhile(out: Path) -> Iterator[None]:
    """Let the FileExistsError of a write of the model `out` pass when `out` now holds a
    complete model (its config.json; models are published whole): another run on the same
    cold cache made it meanwhile, which is said and then used."""
    try:
        yield
    except FileExistsError:
        if not (out / "config.json").is_file():
            raise
        log.warning("%s was made meanwhile by another run: using it", out)


def _no_log(row: dict) -> None:
    """The warm start's SFT log under trainer.progress=false: nothing."""


def _sft_log(row: dict) -> None:
    """The warm start's SFT progress: a stderr line per logged step."""
    if "step" in row:
        print(f"  sft step {row['step']}: loss {row['loss']:.4f}", file=sys.stderr, flush=True)


def write_run_files(run_dir: Path, cfg, model_dir: Path, config_source: str, *,
                    resume: bool) -> None:
    """config.yaml (the resolved config, credentials redacted: on a resume the config it
    continues with, overrides such as an extension included; `mesh.process_id` null, as each
    process of a multi-host run has its own and process 0 writes the file) and run.json (the
    run's origin, written by each start; a resume keeps its config_source and records the
    model directory it resumed with, `resume_model_dir`, relative to the run when inside it);
    atomic."""
    from jscenegen.checkpoint.resume import read_run_record

    saved = cfg.model_dump(mode="json")
    saved["mesh"]["process_id"] = None   # a resume of every process took process 0's over its own
    write_text(run_dir / RUN_CONFIG, dump_yaml(redact(saved)))
    record = read_run_record(run_dir) if resume else None
    model, run = model_dir.resolve(), run_dir.resolve()
    if model.is_relative_to(run):   # the run's own assets: a copy of the run uses its own
        model = model.relative_to(run)
    if record is None or record["model_dir"] != str(model):
        write_json(run_dir / RUN_RECORD, {
            "model_dir": str(model),
            "config_source": record["config_source"] if record else config_source})


def _outcome(row: dict) -> str:
    """An update row's outcome for the progress line: step, skipped (a non-finite gradient) or
    no-signal."""
    if row["stepped"]:
        return "step"
    return "skipped" if row.get("train/skipped") else "no-signal"


class Progress:
    """GRPO progress on stderr (process 0 only): a rich progress bar with reward, failure rate
    and tokens/s on a terminal; one line per update attempt otherwise (a log file, a pipe):
    `GRPO 7/50 attempt 6 designer reward +0.627 fail 0.00 1040 tok/s, step, 63 s elapsed`
    (the attempt's outcome, `_outcome`, then the seconds since GRPO began)."""

    def __init__(self, total: int, enabled: bool, stream=None):
        self.total, self.stream, self.bar = total, stream or sys.stderr, None
        self.lines = enabled and not self.stream.isatty()
        self.t0 = time.perf_counter()
        if enabled and not self.lines:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(TextColumn("GRPO"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                    console=Console(file=self.stream))
            self.task = self.bar.add_task("updates", total=total, info="")
            self.bar.start()

    def __call__(self, row: dict) -> None:
        reward, failed = row.get("reward/mean"), row.get("failure_rate")   # None: every episode masked
        info = (f"attempt {row['attempt']} {row['role']:<8} reward "
                f"{'n/a' if reward is None else f'{reward:+.3f}'} "
                f"fail {'n/a' if failed is None else f'{failed:.2f}'} "
                f"{row['rollout/tokens_per_s']:.0f} tok/s, {_outcome(row)}")
        if self.bar is not None:
            self.bar.update(self.task, completed=row["effective_updates"], info=info)
        elif self.lines:
            # the outcome word, then the time since GRPO began (not the update's own time)
            print(f"GRPO {row['effective_updates']}/{self.total} {info}, "
                  f"{time.perf_counter() - self.t0:.0f} s elapsed", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def check_run_inputs(cfg) -> None:
    """Read the run's own input files before any model is made: the train scene set (and the
    dev set when the run evaluates: its report must name each scene once, `report_scene_ids`,
    and hold at most MAX_REPORT_EPISODES episodes, `check_report_episodes`, with
    `evaluation_samples` per scene), the scene runtime's prompt templates and catalogue, and
    the replacement chat template (a scene requesting what the catalogue does not know is
    refused, and one whose room does not fit scene.metrics' measuring grid: `check_records_usable`), and the judge (an http judge's API key, read from the
    environment, must fit an HTTP header, and the server must not refuse it:
    `Judge.check_reachable`); a wrong path or more scenes asked than the set holds fails
    in seconds, not after the SFT warm start; a `rollout.tp` that does not divide the mesh's
    devices too. Raises the readers' errors (naming the file and key) and
    `trainer.train_scenes`'."""
    import jax

    from jscenegen.eval.evaluate import evaluation_samples, report_scene_ids
    from jscenegen.eval.report import check_report_episodes
    from jscenegen.grpo.rollout.judges import build_judge
    from jscenegen.grpo.train.metrics import check_swanlab_mode
    from jscenegen.grpo.train.trainer import train_scenes
    from jscenegen.model.tokenizer.chat import TEMPLATE_OPTION, read_template
    from jscenegen.paths import resolve_data_path
    from jscenegen.run_config import warn_inert_settings
    from jscenegen.scene.catalogue import load_catalogue
    from jscenegen.scene.prompts import load_templates
    from jscenegen.scene.sceneset import check_records_usable, read_scene_set
    from jscenegen.sharding.mesh import on_primary
    from jscenegen.sharding.rollout import check_tp_divides

    train_scenes(cfg)
    if cfg.rollout.tp is not None and cfg.rollout.layout != "fsdp":   # what the sampler reads
        check_tp_divides(cfg.rollout.tp, jax.device_count())   # the mesh's devices: all
    every, total = cfg.trainer.eval_every, cfg.schedule.total_updates

    def logging_checks():   # the process that logs to swanlab and warns
        check_swanlab_mode(cfg.logging)
        warn_inert_settings(cfg)
        if every > total:
            log.warning("trainer.eval_every=%d is more than schedule.total_updates=%d: no "
                        "evaluation during training", every, total)

    on_primary(logging_checks)
    catalogue = load_catalogue(cfg.scene.catalogue_path)
    sets = [(cfg.schedule.train_set, False)]
    if cfg.trainer.eval_before_after or cfg.trainer.eval_every:
        sets.append((cfg.schedule.dev_set, True))
    for name, evaluated in sets:
        path = resolve_data_path(name)
        records = read_scene_set(path)
        if evaluated:   # what `evaluate` refuses, and what a report that `eval --compare` and
            # a resume's before/after comparison read may hold, before the SFT warm start
            check_report_episodes(len(records), evaluation_samples(cfg), str(path))
            report_scene_ids(records, str(path))
        check_records_usable(records, catalogue, cfg.scene.metrics, str(path),
                             max_objects=cfg.scene.max_objects)
    load_templates(cfg.scene.prompts_dir)
    judge = build_judge(cfg)   # a model judge: its files read and digested, no weights loaded
    on_primary(judge.check_reachable)   # the process that grades takes the run's key
    read_template(cfg.sampling.chat_template_path, TEMPLATE_OPTION)   # its file; with the tokenizer later


def check_eval_files(run_dir: Path, cfg, *, resume: bool) -> None:
    """Refuse, before the model loads (as `check_run_logs` does the JSONL logs), what would
    fail or be lost only after an evaluation, with `trainer.eval_before_after`: one of the
    reports and plots the run writes (eval_before.* on a start, eval_after.* and
    eval_change.*) that exists but is no regular file (a directory, a pipe, a symbolic link:
    the writers replace only files), and on a resume an eval_before.json that is not a
    readable report (its eval_after would be compared with nothing, and the last start's
    eval_change.*, the only intact record of the before numbers then, would be dropped). A
    missing eval_before.json is what a run that did not evaluate first leaves: allowed."""
    from jscenegen.paths import not_a_file

    if not cfg.trainer.eval_before_after:
        return
    for stem in (EVAL_AFTER, EVAL_CHANGE) if resume else RUN_REPORTS:
        for path in (run_dir / f"{stem}.json", run_dir / f"{stem}.png"):
            if not os.path.lexists(path):
                continue
            why = not_a_file(path) or ("is a symbolic link" if path.is_symlink() else None)
            if why:
                raise ValueError(f"{path}: {why}; the run writes its {stem} evaluation there "
                                 "(move it away, or set trainer.eval_before_after=false)")
    before = run_dir / f"{EVAL_BEFORE}.json"
    if resume and os.path.lexists(before):
        from jscenegen.eval.report import check_report, read_report

        try:
            check_report(read_report(before), str(before))
        except ValueError as err:
            raise ValueError(f"{err}; the resumed run compares its {EVAL_AFTER} with this report "
                             f"({EVAL_CHANGE}.json): restore it, or move it away to resume "
                             "without the comparison") from None


def _saved_report(path: Path) -> dict | None:
    """The evaluation report at `path` (a resumed run's `eval_before.json`), or None with a
    warning when it is missing or not a report: the run then writes no eval_change."""
    from jscenegen.eval.report import check_report, read_report

    if not path.is_file():
        log.warning("no before/after comparison: %s is missing (the run's first start did not "
                    "evaluate before GRPO)", path)
        return None
    try:
        report = read_report(path)
        check_report(report, str(path))
    except ValueError as err:
        log.warning("no before/after comparison: %s", err)
        return None
    return report


# the `mesh` keys that say how one process joins a run, not how the run trains
LAUNCH_KEYS = ("process_id", "num_processes", "coordinator_address", "init_timeout_s")


def _launch_settings(cfg, run_dir: Path, resume: bool, max_updates: int | None) -> dict[str, str]:
    """What every process of a multi-host run must agree on besides the process count: each
    config key (the launch keys aside: given as keys or environment variables), the run
    directory, --resume and --max-updates."""
    settings = {key: json.dumps(value, sort_keys=True) for key, value in
                dotted_items(cfg.model_dump(mode="json", exclude={"mesh": set(LAUNCH_KEYS)})).items()}
    settings.update({"--run-dir": os.path.normpath(run_dir.absolute()), "--resume": str(resume),
                     "--max-updates": str(max_updates)})
    return settings


def _install(cfg) -> dict[str, str] | None:
    """What every host of a multi-host run must run alike (another version would play and train
    with other code in one run: a deadlock in the first collective that differs): a digest of
    jscenegen's *.py files (`package_source_digest`) and the jax and jaxlib versions; None for
    a one-process launch (nothing to compare, and no files to hash)."""
    import jax
    import jaxlib

    from jscenegen.sharding.mesh import asks_for_multi_host

    if not asks_for_multi_host(cfg.mesh):
        return None
    return {"jscenegen code (the package's *.py files)": package_source_digest(PACKAGE_DIR),
            "jax version": f"jax {jax.__version__}, jaxlib {jaxlib.__version__}"}


def train_command(cfg, run_dir: Path, *, resume: bool, max_updates: int | None,
                  config_source: str, settings_notice: str | None = None) -> int:
    """Run the GRPO job in `run_dir` (see the module docstring); holds `run_dir/run.lock`
    throughout. `settings_notice`: a warning (the settings a resume's overrides change) logged
    once the trainer has accepted the run. Raises RunLockedError when another process holds it."""
    import jax

    from jscenegen.sharding.mesh import initialize_distributed, mesh_shape, on_primary

    initialize_distributed(cfg.mesh.coordinator_address, cfg.mesh.num_processes, cfg.mesh.process_id,
                           timeout_s=cfg.mesh.init_timeout_s,
                           announce=lambda line: print(line, file=sys.stderr, flush=True),
                           same=_launch_settings(cfg, run_dir, resume, max_updates),
                           same_install=_install(cfg))
    mesh_shape(jax.device_count(), cfg.mesh.fsdp, cfg.mesh.sp)  # refused before any model or file
    if jax.process_count() > 1 and not resume and not cfg.model.path:
        raise ValueError("model.path: a multi-host run starts from a model directory every host "
                         "can read; the SFT warm start runs in one process (jscenegen sft, or "
                         "jscenegen train once on one host), then give its model as model.path")
    check_run_inputs(cfg)
    warm_start = None   # what default_model_dir takes, checked once
    if not resume and not cfg.model.path:
        warm_start = check_warm_start_inputs(cfg)
        check_warm_start_model(cfg)
    from jscenegen.run_lock import RunLock, RunLockedError

    lock = RunLock(run_dir)
    try:   # one process per run directory (the holder is named to a second one)
        on_primary(lock.acquire, RunLockedError)
        return _train_locked(cfg, run_dir, resume=resume, max_updates=max_updates,
                             config_source=config_source, settings_notice=settings_notice,
                             warm_start=warm_start)
    finally:
        lock.release()


def _train_locked(cfg, run_dir: Path, *, resume: bool, max_updates: int | None,
                  config_source: str, settings_notice: str | None,
                  warm_start: tuple | None = None) -> int:
    import jax

    from jscenegen.checkpoint.store import finished_saves
    from jscenegen.grpo.train.trainer import Trainer
    from jscenegen.sharding.mesh import is_primary, on_primary

    if not resume and finished_saves(run_dir / RUN_CHECKPOINTS):  # unfinished saves are replaced
        raise ValueError(f"{run_dir} already holds checkpoints; pass --resume {run_dir} to "
                         "continue it, or choose a new --run-dir")
    phases: dict[str, float] = {}
    if resume:
        from jscenegen.checkpoint.resume import resume_model_dir

        model_dir = resume_model_dir(run_dir)
    elif cfg.model.path:
        from jscenegen.model.assets import check_asset_files

        model_dir = Path(cfg.model.path)
        check_asset_files(model_dir)   # carried into every checkpoint: refused now, not at export
    else:
        model_dir = default_model_dir(cfg, phases, warm_start)
    evals, run_files_written = {}, False
    trainer = Trainer(cfg, run_dir, model_dir, resume=resume)  # refuses an incompatible resume
    failed = True   # until the block below ends without an exception
    try:   # from here on trainer.close() finishes swanlab's run, however the command ends
        layout = trainer.engine.sampler.layout.describe()

        def announce():
            if settings_notice:
                log.warning("%s", settings_notice)
            print(f"rollout layout: {layout}", file=sys.stderr, flush=True)
            write_run_files(run_dir, cfg, model_dir, config_source, resume=resume)

        on_primary(announce)   # every process raises if the run files could not be written
        run_files_written = True   # (the --resume hint)
        if cfg.trainer.eval_before_after and not resume:
            t2 = time.perf_counter()
            evals["before"] = trainer.evaluate_dev(EVAL_BEFORE)
            phases["eval_before_s"] = time.perf_counter() - t2
        t1 = time.perf_counter()
        progress = Progress(cfg.schedule.total_updates, cfg.trainer.progress and is_primary())
        try:
            summary = trainer.run(max_updates, progress=progress)
        finally:
            progress.close()
        phases["grpo_s"] = time.perf_counter() - t1
        if cfg.trainer.eval_before_after and not summary.stopped_by_signal:
            t3 = time.perf_counter()
            evals["after"] = trainer.evaluate_dev(EVAL_AFTER)
            phases["eval_after_s"] = time.perf_counter() - t3
            saved = _saved_report(run_dir / f"{EVAL_BEFORE}.json") if resume else None
            if saved is not None:  # the run's first start evaluated "before"
                evals["before"] = saved
        failed = False
    except (KeyboardInterrupt, Terminated):   # outside the updates: before them or the last evaluation
        if run_files_written:   # config.yaml holds this invocation's settings
            where = "" if is_primary() else f"process {jax.process_index()}: "
            print(terminal_line(f"{where}stopped; continue with: jscenegen train --resume "
                                f"{run_dir}"), file=sys.stderr, flush=True)
        raise
    finally:
        # a start that wrote nothing leaves nothing
        trainer.close(discard_logs=not run_files_written, failed=failed)
    if is_primary():
        out = dict(vars(summary), run_dir=str(run_dir.absolute()), rollout_layout=layout,
                   phases=phases)
        for when, report in evals.items():
            s = report["overall"]["model"]
            out[f"dev_{when}"] = {k: s.get(k) for k in ("reward", "failure_rate", "units", "reachable")}
        if "after" in evals:   # an earlier start's comparison describes another eval_after
            for name in (f"{EVAL_CHANGE}.json", f"{EVAL_CHANGE}.png"):
                (run_dir / name).unlink(missing_ok=True)
        if len(evals) == 2:
            from jscenegen.eval.plots import plot_or_warn
            from jscenegen.eval.report import check_same_episodes, compare_reports

            try:   # what `eval --compare` checks: a resume may have changed the sampling
                check_same_episodes(evals["before"], evals["after"],
                                    (f"{EVAL_BEFORE}.json", f"{EVAL_AFTER}.json"))
                change = compare_reports(evals["before"], evals["after"])
            except ValueError as err:  # e.g. every episode masked by judge failures
                log.warning("no before/after comparison: %s", err)
            else:
                write_json(run_dir / f"{EVAL_CHANGE}.json", change)
                plot_or_warn(evals["after"], run_dir / f"{EVAL_CHANGE}.png", before=evals["before"],
                             labels=("before GRPO", "after GRPO"))
                out["dev_change"] = {k: change[k] for k in ("pairs", "scenes", "diff", "diff_ci95")}
        print(json.dumps(out))
    if summary.stopped_by_signal:  # a scheduler must not read a stop as "finished"
        stopped = signal.Signals[summary.stopped_by_signal]
        # every process says so: a peer of the signalled one otherwise ends with 143, silent
        where = "" if is_primary() else f"process {jax.process_index()}: "
        made = f"{summary.attempts} update attempt{'' if summary.attempts == 1 else 's'}"
        print(terminal_line(f"{where}stopped by {stopped.name} after {made}; "
                            f"checkpoint {summary.checkpoint}; continue with: jscenegen "
                            f"train --resume {run_dir}"), file=sys.stderr, flush=True)
        return 128 + stopped
    return 0
