"""Continuing a run from its newest complete checkpoint.

`restore_onto_mesh` reads the newest verified step straight into the trainer's FSDP layout;
`check_same_run` refuses a checkpoint whose protocol or reward differ from the resuming run's;
`checkpoint_position` reads where a checkpoint stands (updates done, LR-scheduler count,
skipped optimizer steps), from the trainer's own train state or from one converted from VERL or
HF (`convert --to orbax`, train_state with `source_format`); a converted checkpoint has the
run's identity (`has_run_identity`: schedule position, protocol and schedule hashes, reward)
only when its VERL files came from ours and carry the trainer's train state beside them
(`RUN_STATE_FILE`, written by `export` and `convert --to verl`); `resume_model_dir` finds the
config and tokenizer a resumed run uses.
"""
from __future__ import annotations

import dataclasses
import filecmp
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Literal, Mapping, Sequence

import jax
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, create_model

from jscenegen.checkpoint.checksums import CHECKSUMS_NAME, ChecksumError, verify_checksums, write_checksums
from jscenegen.checkpoint.store import (
    HF_ASSET_FILES,
    HF_DIR,
    TRAIN_STATE_ITEM,
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    moment_shapes,
    padded_target,
    read_train_state,
)
from jscenegen.config import shown_value, validation_message
from jscenegen.model.assets import CHAT_TEMPLATE_FILES, TOKENISATION_FILES
from jscenegen.paths import loads_json, not_a_file, umask_mode
from jscenegen.run_files import RUN_ASSETS, RUN_CHECKPOINTS, RUN_RECORD

log = logging.getLogger(__name__)


class ResumeError(ValueError):
    """A resume that would not continue the same run (protocol, reward or schedule changed)."""


@dataclasses.dataclass(frozen=True)
class CheckpointPosition:
    """Where a checkpoint stands: `step` updates done (VERL's global step: the trainer's update
    attempts), `lr_step` the LR-scheduler count (torch LambdaLR `last_epoch`), `skipped_steps`
    updates whose optimizer step was skipped."""

    step: int
    lr_step: int
    skipped_steps: int


def restore_onto_mesh(store: CheckpointStore, shapes: Mapping[str, tuple[int, ...]],
                      mesh: jax.sharding.Mesh, param_dtype: Any,
                      trainable: Iterable[str] | None = None,
                      check_train_state: Callable[[Path, int, dict], None] | None = None) -> Checkpoint:
    """The newest complete, verified checkpoint of `store`, every array padded and sharded as
    the trainer holds it (`padded_target` on `mesh`): trainable params in `param_dtype`,
    frozen (carried) tensors in their stored dtype, Adam moments for the trainable ones.

    Newer steps that are corrupt (complete once, failing their checksums now) are set aside
    first (`CheckpointStore.set_aside_corrupt`: renamed, with a warning naming the files), so
    the resumed run redoes their updates and saves those steps again.
    shapes: every tensor the run holds (`param_shapes(cfg, carried=True)`); trainable: the
    names the run's optimizer steps (default: all of `shapes`). check_train_state(step_dir,
    step, train_state): called on the chosen step's train state once its files are verified and
    before its arrays are read, so a refusal of a multi-GB step costs no restore.
    Raises CheckpointError when there is none, it does not fit `shapes`, or its Adam state
    covers other tensors than `trainable` (e.g. a tower trained with `model.train_vision:
    true`, resumed without it), naming the tensors that differ (from orbax's metadata, before
    any array is read)."""
    valid = store.set_aside_corrupt()
    if valid is None:
        raise CheckpointError(f"{store.directory}: no complete checkpoint (steps on disk: "
                              f"{store.steps()})")
    step_dir = store.step_path(valid.step)
    if check_train_state is not None:
        check_train_state(step_dir, valid.step, read_train_state(step_dir))
    want = set(shapes if trainable is None else trainable)
    have = set(moment_shapes(step_dir))   # orbax's metadata only: refused before any array
    if want != have:
        extra, missing = sorted(have - want), sorted(want - have)
        raise CheckpointError(
            f"{step_dir}: the checkpoint's Adam state covers other tensors than this run trains: "
            f"state for {len(extra)} tensor(s) this run keeps frozen {extra[:3]}, none for "
            f"{len(missing)} it trains {missing[:3]}; set model.train_vision to what the "
            f"checkpoint was trained with (its training_metadata.json lists frozen_tensors)")
    return store.restore(valid.step, target=padded_target(shapes, mesh, dtype=param_dtype),
                         verified=valid)


RUN_STATE_FILE = "jscenegen_train_state.json"
"""Beside VERL rank files written from one of our checkpoints: its train_state item as JSON
(VERL's loader reads only the rank files; a step VERL saves later has none)."""

RUN_IDENTITY_KEYS = ("schedule", "lr_step", "skipped_steps", "num_scenes", "schedule_hash",
                     "protocol_hash", "reward")
SCHEDULE_POSITION_KEYS = ("scene_index", "epoch", "redraw", "effective_updates", "attempts")
"""The fields of `grpo.train.schedule.SchedulePosition`, the train state's `schedule`."""

_Count = Annotated[StrictInt, Field(ge=0, lt=2 ** 31)]   # counters the trainer holds as int32
_SchedulePosition = create_model(
    "schedule", __config__=ConfigDict(extra="forbid"),
    **{k: (_Count, ...) for k in SCHEDULE_POSITION_KEYS})


class _KLReference(BaseModel):
    """The KL reference a run trained against (the train state's `kl_reference`)."""

    model_config = ConfigDict(extra="forbid")
    path: StrictStr | None   # model.reference_path; None: the initial policy (the model directory)
    weights_digest: Annotated[StrictStr, Field(max_length=200)]


class _RunIdentity(BaseModel):
    """The keys of a train state that a resume reads (others, such as `source_format`, pass)."""

    model_config = ConfigDict(extra="allow")
    schedule: _SchedulePosition
    lr_step: _Count
    skipped_steps: _Count
    num_scenes: Annotated[StrictInt, Field(gt=0)]
    schedule_hash: StrictStr
    scenes_hash: StrictStr | None = None   # written since 2026-12-06; older runs have none
    # the judge's and the rollout's failed updates in a row (since 2026-12-06; older: none)
    failure_streaks: dict[Literal["judge", "rollout"], list[Annotated[StrictStr, Field(max_length=400)]]] = {}
    protocol_hash: StrictStr
    reward: dict[str, Annotated[float, Field(allow_inf_nan=False, strict=True)]]
    kl_reference: _KLReference | None = None   # since 2026-12-07, with loss.use_kl_loss


def has_run_identity(train_state: Mapping[str, Any]) -> bool:
    """True when `train_state` holds what a resume checks and continues from (the trainer's
    schedule position, hashes and reward: `RUN_IDENTITY_KEYS`); False for one converted from
    VERL or HF files that did not come from our checkpoints."""
    return all(k in train_state for k in RUN_IDENTITY_KEYS)


def check_run_identity(train_state: Mapping[str, Any]) -> None:
    """Raise ValueError naming the first key of `train_state`'s run identity that is missing
    or not of its type (integer counts and schedule position in [0, 2^31), a positive
    num_scenes, string hashes, a reward of finite numbers): what a train state must hold
    before a resume reads it."""
    try:
        _RunIdentity.model_validate(dict(train_state))
    except ValidationError as err:
        raise ValueError(_first_error(err)) from None


def _first_error(err: ValidationError) -> str:
    """`<key>: <what is wrong> (got <value>)`, or `<key>: missing`, for err's first error."""
    e = err.errors()[0]
    where = ".".join(str(p) for p in e["loc"]) or "train state"
    if e["type"] == "missing":
        return f"{where}: missing"
    return f"{where}: {validation_message(e)} (got {shown_value(e.get('input'))})"


class _ConvertedPosition(BaseModel):
    """The counts of a converted checkpoint's train state (no run identity)."""

    model_config = ConfigDict(extra="allow")
    step: _Count = 0
    lr_schedule_count: _Count | None = None
    optimizer_step: _Count | None = None


def checkpoint_position(train_state: Mapping[str, Any],
                        where: str | Path = TRAIN_STATE_ITEM) -> CheckpointPosition:
    """Where the checkpoint whose orbax `train_state` item this is stands: the trainer's own
    (`schedule.attempts`, `lr_step`, `skipped_steps`) or a converted one without the run's
    identity (`step`, `lr_schedule_count`, `optimizer_step`: integers in [0, 2^31)). Raises
    CheckpointError naming `where` (the item: its path when known) and the missing or
    malformed key."""
    try:
        if not has_run_identity(train_state):
            try:
                at = _ConvertedPosition.model_validate(dict(train_state))
            except ValidationError as err:
                raise CheckpointError(f"{where}: {_first_error(err)}") from None
            step = at.step
            lr = step if at.lr_schedule_count is None else at.lr_schedule_count
            taken = step if at.optimizer_step is None else at.optimizer_step
            return CheckpointPosition(step=step, lr_step=lr, skipped_steps=max(step - taken, 0))
        return CheckpointPosition(step=int(train_state["schedule"]["attempts"]),
                                  lr_step=int(train_state["lr_step"]),
                                  skipped_steps=int(train_state["skipped_steps"]))
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: no usable {err} (neither the trainer's position "
                              "nor a converted checkpoint's)") from None


def check_step_number(step_dir: Path, step: int, train_state: Mapping[str, Any]) -> CheckpointPosition:
    """`checkpoint_position` of a step directory's train state, whose `step` (the trainer's
    `schedule.attempts`, a converted checkpoint's `step`) must be the number of the step
    directory it was read from: a step directory copied or renamed (`cp -r checkpoints/8
    checkpoints/12`) would resume at the directory's number with the train state's position,
    and the run's next save would not fit. Raises CheckpointError naming the directory and the
    train state's value, or the item (`step_dir/train_state`) and the key that is missing or
    malformed (`checkpoint_position`)."""
    at = checkpoint_position(train_state, where=step_dir / TRAIN_STATE_ITEM)
    if at.step != step:
        key = "schedule.attempts" if has_run_identity(train_state) else "step"
        raise CheckpointError(f"{step_dir}: a step directory numbered {step} whose train_state "
                              f"{key} is {at.step}; a step keeps the number it was saved under "
                              f"(was it copied or renamed?): name it {at.step}, or remove it")
    return at


def differing_param_group(groups: Sequence[Any]) -> str | None:
    """Where torch optimizer `param_groups` (dicts) differ from the first group in anything but
    `params` ("param_groups[1].lr (0.002 vs param_groups[0]'s 0.001)", compared as printed), or
    None when they agree. jscenegen trains with one AdamW setting for every parameter: groups
    of their own lr, weight_decay, betas or eps cannot be carried into one optax optimizer, nor
    back into torch from one group's record."""
    if not groups or not all(isinstance(g, Mapping) for g in groups):
        return None
    first = groups[0]
    for i, group in enumerate(groups[1:], 1):
        for key in sorted(set(group) | set(first), key=str):
            if key != "params" and repr(group.get(key)) != repr(first.get(key)):
                return (f"param_groups[{i}].{key} ({repr(group.get(key))[:60]} vs param_groups[0]'s "
                        f"{repr(first.get(key))[:60]})")
    return None


def torch_optimizer_changes(metadata: Mapping[str, Any], optim: Any, lr_step: int) -> list[str]:
    """The AdamW settings of `optim` (an `OptimConfig`) that differ from those of the torch run
    a checkpoint converted from VERL files recorded (training_metadata.json
    `source.verl.param_groups[0]`): `initial_lr` (LambdaLR's base; `lr` without a scheduler),
    `betas`, `eps`, `weight_decay`, and the learning rate this run's schedule gives at `lr_step`
    (`optim.lr` x `lr_schedule.lr_lambda`) against the group's `lr` (torch's after its last
    scheduler step: the rate of its next update, which a warmup or schedule of other lengths
    changes). Each as "optim.lr 5e-05 (the torch run's 0.001)"; [] when nothing differs by more
    than a relative 1e-6 or the metadata records no torch optimizer (not a VERL conversion,
    or one without optimizer files). A recorded value of another shape than the setting's (a
    hand-edited file) is listed as differing, never raised."""
    import math

    from jscenegen.lr_schedule import lr_lambda

    source = metadata.get("source")
    verl = source.get("verl") if isinstance(source, Mapping) else None
    groups = verl.get("param_groups") if isinstance(verl, Mapping) else None
    if not isinstance(groups, list) or not groups or not isinstance(groups[0], Mapping):
        return []
    group = groups[0]
    # a record of several groups: conversions refuse it now, earlier ones kept it unread
    where = differing_param_group(groups)
    notes = [f"the torch run's {where}: only param_groups[0] is compared"] if where else []

    def differs(ours, theirs) -> bool:
        if isinstance(ours, list):
            return not (isinstance(theirs, (list, tuple)) and len(theirs) == len(ours)
                        and not any(differs(a, b) for a, b in zip(ours, theirs)))
        return not (isinstance(theirs, (int, float)) and not isinstance(theirs, bool)
                    and math.isclose(ours, theirs, rel_tol=1e-6))

    pairs = [("optim.lr", optim.lr, group.get("initial_lr", group.get("lr"))),
             ("optim.betas", list(optim.betas), group.get("betas")),
             ("optim.eps", optim.eps, group.get("eps")),
             ("optim.weight_decay", optim.weight_decay, group.get("weight_decay")),
             (f"the LR at count {lr_step}:", optim.lr * lr_lambda(optim, lr_step), group.get("lr"))]
    return notes + [f"{key} {shown_value(ours)} (the torch run's {shown_value(theirs)})"
                    for key, ours, theirs in pairs if theirs is not None and differs(ours, theirs)]


def check_same_run(train_state: Mapping[str, Any], *, protocol_hash: str,
                   reward: Mapping[str, Any], protocol_settings: Sequence[str] | None = None) -> None:
    """Raise ResumeError when the checkpoint's protocol hash or reward configuration differ
    from the resuming run's (its updates would not mean the same thing). `protocol_settings`:
    the settings the hash reads (`scene.protocol.protocol_settings`) that differ from the
    checkpoint's recorded config, as `metadata.config_changes` lists them, named in the
    refusal; empty means the protocol's files or this jscenegen's rules changed; None that the
    checkpoint records no config to compare."""
    if train_state["reward"] != dict(reward):   # also in the protocol hash: named first
        changed = sorted(k for k in set(train_state["reward"]) | set(reward)
                         if train_state["reward"].get(k) != reward.get(k))
        raise ResumeError("resume refused: the reward configuration changed ("
                          + ", ".join(f"scene.reward.{k}: {train_state['reward'].get(k)!r} in the "
                                      f"checkpoint, now {reward.get(k)!r}" for k in changed[:3])
                          + ")")
    if train_state["protocol_hash"] != protocol_hash:
        if protocol_settings is None:
            what = ("prompts, action grammar, operation costs, budget, caps, metrics, catalogue, "
                    "grade keys or the judge: the checkpoint records no config to say which")
        elif protocol_settings:
            what = "; ".join(protocol_settings[:5]) + (
                f" and {len(protocol_settings) - 5} more" if len(protocol_settings) > 5 else "")
        else:
            what = ("no scene or judge setting did: the prompt template or catalogue files, or "
                    "this jscenegen's measuring and grading rules (scene.protocol.RULES_REVISION), "
                    "differ from the run's")
        raise ResumeError(f"resume refused: the scene protocol changed ({what}; checkpoint "
                          f"protocol hash {train_state['protocol_hash'][:16]}, now "
                          f"{protocol_hash[:16]})")


def compared_tokenisation_files(template_override: bool) -> tuple[str, ...]:
    """The files of a run's model directory that `check_same_tokenizer` compares:
    `model.assets.TOKENISATION_FILES`, less the chat template files (`CHAT_TEMPLATE_FILES`)
    with `template_override` (`sampling.chat_template_path` set: they are not read)."""
    return tuple(name for name in TOKENISATION_FILES
                 if not (template_override and name in CHAT_TEMPLATE_FILES))


def check_same_tokenizer(model_dir: Path, step_dir: Path, *, template_override: bool) -> None:
    """Raise ResumeError when a tokenizer, chat-template or generation-config file
    (`model.assets.TOKENISATION_FILES`) of the run's model directory `model_dir` is not the
    copy in the chosen step's `hf/` (other bytes, or present in only one of them): the copy is
    what the run trained with (verified by the step's checksums), and the resumed run reads
    the directory's, so it would tokenise and render its prompts otherwise. With
    `template_override` (`sampling.chat_template_path` set, the documented way to change the
    template) the directory's chat template files (`CHAT_TEMPLATE_FILES`) are not read and not
    compared. The error names both files and what would be right."""
    hf = step_dir / HF_DIR
    for name in compared_tokenisation_files(template_override):
        ours, saved = model_dir / name, hf / name
        if not ours.is_file() and not saved.is_file():
            continue
        if ours.is_file() and saved.is_file():
            if filecmp.cmp(ours, saved, shallow=False):
                continue
            what, cure = f"differs from {saved}, the copy the run trained with", f"copy {saved} over it"
        elif saved.is_file():
            what, cure = f"is missing; the run trained with {saved}", f"copy {saved} there"
        else:
            what, cure = f"is new: the run trained without it ({hf} has none)", "remove it"
        also = (", or set sampling.chat_template_path to render with another template on "
                "purpose" if name in CHAT_TEMPLATE_FILES else "")
        raise ResumeError(f"resume refused: {ours} {what}; the run's model directory (model.path "
                          f"when it started, recorded in run.json) must keep the tokenizer and chat "
                          f"template it trained with: {cure}{also}")


def check_same_reference(train_state: Mapping[str, Any], reference: Mapping[str, Any],
                         reference_dir: Path, where: Path) -> None:
    """Raise ResumeError when the KL reference's weights in `reference_dir` differ from those
    the run trained against: `reference` ({"path": model.reference_path or None, for the
    initial policy in the model directory; "weights_digest": the directory's sampled digest})
    against the train state's `kl_reference`, recorded at the run's fresh start, when both
    name the same `path` (a changed model.reference_path is a setting changed on purpose,
    which the resume's config warning names). A train state that records none (saved before
    this check, or by a run started without loss.use_kl_loss; `where` is its item) is
    accepted with a warning. The error names the config key and the directory."""
    saved = train_state.get("kl_reference")
    if saved is None:
        log.warning("%s records no digest of the KL reference's weights (saved before resumes "
                    "checked it, or by a run started without loss.use_kl_loss): %s is taken "
                    "unchecked", where, reference_dir)
        return
    if saved["path"] != reference["path"] or saved["weights_digest"] == reference["weights_digest"]:
        return
    key = "model.reference_path" if reference["path"] is not None else "model.path"
    raise ResumeError(f"resume refused: the KL reference's weights in {reference_dir} ({key}) are "
                      f"not those the run trained against (sampled digest "
                      f"{reference['weights_digest'][:16]}, the checkpoint's "
                      f"{saved['weights_digest'][:16]}); put the reference's weights back there, "
                      "or give the HF directory of the reference to train against as "
                      "model.reference_path")


MAX_RUN_RECORD_BYTES = 1 << 20


class _RunRecord(BaseModel):
    model_config = ConfigDict(extra="allow")
    model_dir: StrictStr
    config_source: StrictStr | None = None


def read_run_record(run_dir: str | Path) -> dict[str, Any] | None:
    """The run record (`RUN_RECORD`) of `run_dir`, or None when it has none (a directory made
    by `convert --to orbax`). Raises CheckpointError naming the file when it is not a readable
    regular file of at most 1 MiB holding {"model_dir": str, "config_source": str}."""
    path = Path(run_dir) / RUN_RECORD
    if not os.path.lexists(path):
        return None
    try:
        if why := not_a_file(path):
            raise OSError(why)
        with open(path, "rb") as f:
            raw = f.read(MAX_RUN_RECORD_BYTES + 1)
        if len(raw) > MAX_RUN_RECORD_BYTES:
            raise ValueError(f"more than {MAX_RUN_RECORD_BYTES} bytes")
        return _RunRecord.model_validate(loads_json(raw)).model_dump()
    except ValidationError as err:
        first = err.errors()[0]
        reason = f"{'.'.join(map(str, first['loc'])) or 'the record'}: {validation_message(first)}"
    except (OSError, ValueError, RecursionError) as err:
        reason = f"{type(err).__name__}: {getattr(err, 'strerror', None) or err}"
    raise CheckpointError(f"{path}: not the run's record ({reason}); it holds "
                          "{\"model_dir\": ..., \"config_source\": ...}, written when the run started "
                          "(repair it, or delete it: a resume then takes the config and tokenizer "
                          "of the newest checkpoint)")


def resume_model_dir(run_dir: str | Path) -> Path:
    """Config and tokenizer of a run being resumed: the run's model directory (`run.json`)
    when it still holds a config.json, lies outside the run's checkpoints and is no run's
    `RUN_ASSETS` (an absolute path in a copied run's record names the other run's), else this
    run's `RUN_ASSETS`, verified against its checksums (copied from the `hf/` assets of the
    newest complete checkpoint when it does not exist yet: a directory made by `convert --to
    orbax`, or a model directory deleted since). A step's own `hf/` is never used: the store
    deletes it once `checkpoint.keep_last` newer steps exist, and the run's later saves copy
    their assets from this directory.
    Raises CheckpointError when the run needs the copy and has no complete checkpoint, or its
    record is damaged (`read_run_record`)."""
    run_dir = Path(run_dir)
    record = read_run_record(run_dir)
    recorded = None if record is None else run_dir / record["model_dir"]   # relative: in the run
    assets = run_dir / RUN_ASSETS
    if recorded is not None and (recorded / "config.json").is_file() \
            and not _inside(recorded, run_dir / RUN_CHECKPOINTS) \
            and recorded.name != RUN_ASSETS:
        return recorded    # a run's copy is verified below: its own, never another run's
    if os.path.lexists(assets):
        try:
            verify_checksums(assets)
        except ChecksumError as err:
            raise CheckpointError(f"{err} ({assets} is the run's copy of a checkpoint's hf/ "
                                  "assets: delete it, and the resume copies them again from the "
                                  "newest complete checkpoint)") from None
        return assets
    with CheckpointStore(run_dir / RUN_CHECKPOINTS) as store:   # the restore names skipped steps
        step = store.latest_valid_step(say_skipped=False)
    if step is None:
        raise CheckpointError(f"{run_dir / RUN_CHECKPOINTS} holds no complete checkpoint")
    _copy_assets(run_dir / RUN_CHECKPOINTS / str(step) / HF_DIR, assets)
    log.info("resume: config and tokenizer copied from checkpoint step %d to %s", step, assets)
    return assets


CONVERTED_MANIFEST = "checksums.converted.json"


def retire_converted_manifest(checkpoints: str | Path) -> None:
    """Rename the `checksums.json` that `convert --to orbax` wrote at the root of a checkpoint
    directory (covering the steps it wrote), if any, to CONVERTED_MANIFEST, when a run resumes
    there. The run deletes those steps once `checkpoint.keep_last` newer ones exist, and each
    of its steps carries its own checksums.json: left in place, the root manifest named the
    deleted files as missing, so `convert --verify` and every `convert` of the run refused it."""
    root = Path(checkpoints)
    manifest = root / CHECKSUMS_NAME
    if not manifest.is_file():
        return
    os.replace(manifest, root / CONVERTED_MANIFEST)
    log.info("resume: %s renamed %s (each step keeps its own checksums.json)", manifest,
             CONVERTED_MANIFEST)


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def _copy_assets(src: Path, dst: Path) -> None:
    """The HF asset files of `src` into a new directory `dst` with their `checksums.json`
    (a resume verifies the copy), atomically: copied into a temporary sibling, then renamed
    (another process of a multi-host run that renamed its copy first wins; the contents are
    the same)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        for name in HF_ASSET_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)
        write_checksums(tmp)
        umask_mode(tmp)
        try:
            os.rename(tmp, dst)
        except OSError:
            if not (dst / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
