"""Training checkpoints: orbax `CheckpointManager` steps holding params, AdamW state, train state.

One step directory (`CheckpointStore.directory/<step>/`)::

    params/                 orbax PyTree {hf_name: array} at LOGICAL shape (no FSDP padding):
                            EVERY tensor of the weight table, trainable parameters (in the
                            param dtype) and frozen/carried tensors (Qwen3.5's vision tower
                            and mtp.*, in the dtype they were stored in, bit-exact)
    adam/                   orbax PyTree {"count": int32 [], "mu": {hf_name: f32}, "nu": {...}}
                            for the TRAINABLE tensors only (torch AdamW keeps no state for a
                            parameter it never steps)
    train_state/            orbax JSON item: the trainer's JSON-able state
    _CHECKPOINT_METADATA    orbax's own step record
    hf/                     config.json, generation_config.json, tokenizer files, chat template
    training_metadata.json  see jscenegen/checkpoint/metadata.py (credentials redacted)
    checksums.json          SHA-256 + bytes of every other file (jscenegen/checkpoint/checksums.py)

Names are transformers' state-dict keys (`jscenegen.model.weights.param_shapes` lists them in the
model's order; orbax and JAX keep dicts sorted by name, so restored dicts are sorted).
`adam` is torch AdamW's state in optax terms: `count` = optimizer steps actually taken (torch
`state[p]["step"]`, optax `ScaleByAdamState.count`), `mu` = `exp_avg`, `nu` = `exp_avg_sq`.
A tensor in `params/` without moments in `adam/` is frozen: `training_metadata.json` lists
those names (`frozen_tensors`), and `restore` gives them back in their stored dtype.

Atomicity: orbax writes the arrays into `<step>.orbax-checkpoint-tmp-*` and renames it only
when every item is committed; this module then adds `hf/` and `training_metadata.json` and
writes `checksums.json` LAST (temporary file + rename). A step is complete only when orbax
finalised it and `checksums.json` verifies, so a process killed at any point leaves either the
previous complete step or an incomplete one that `latest_valid_step` skips and `save` replaces.
Keep-last-k runs after the new step is complete, so a crash never removes a good checkpoint.
A complete step that later fails its checksums (a flipped byte) is corrupt: a resume sets it
aside as `<step>.corrupt-<UTC time>` (renamed, never deleted; `set_aside_corrupt`) and redoes
the update from the step before, and `save` can write that step number again.

Sharding: the trainer keeps every parameter and moment split on dim 0 over all mesh devices,
padded to a multiple of the device count (torch FSDP2's layout, ../shared/DESIGN.md). JAX cannot
hold an unevenly sharded array, so `save` slices the padding off into a layout that divides the
logical shape (`storage_sharding`), and `restore` reads the logical arrays straight into a
padded, sharded abstract target (orbax fills the padding rows with zeros), on any mesh.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding

from jscenegen.checkpoint.checksums import CHECKSUMS_NAME, ChecksumError, verify_checksums, write_checksums
from jscenegen.checkpoint.lazy_array import LazyArray, cancel_on_interrupt  # noqa: F401  (registers orbax's handler)
from jscenegen.checkpoint.metadata import redact
from jscenegen.model.assets import ASSET_FILES, TOKENIZER_FILES
from jscenegen.model.config import config_with_dtype
from jscenegen.model.dtypes import majority_dtype
from jscenegen.paths import (
    DiskFullError,
    fsync_path,
    is_step_name,
    quoted_storage_limit,
    read_json_object,
    refuse_oversized_json,
    storage_limit,
    write_json,
)
from jscenegen.run_lock import live_holder
from jscenegen.sharding.mesh import bytes_from_primary, max_over_processes
from jscenegen.sharding.rules import PARAM, REPLICATED, named, padded_shape, storage_spec
from jscenegen.text import one_line

log = logging.getLogger(__name__)

PARAMS_ITEM, ADAM_ITEM, TRAIN_STATE_ITEM = "params", "adam", "train_state"
HF_DIR = "hf"
METADATA_NAME = "training_metadata.json"
# Copied from the model directory into `hf/` when present (the one asset list, processor
# files of a Qwen3.5 checkpoint included); config.json and one tokenizer file are required.
# Weights never are (they live in `params/`).
HF_ASSET_FILES = ASSET_FILES
_REQUIRED_ENTRIES = (PARAMS_ITEM, ADAM_ITEM, TRAIN_STATE_ITEM, METADATA_NAME, f"{HF_DIR}/config.json")
# Fields every training_metadata.json has (values may be null, e.g. no protocol for an HF import).
REQUIRED_METADATA = ("git_commit", "protocol_hash", "schedule_hash", "optimizer_step",
                     "effective_updates")
ARRAY_GROUPS = ("params", "mu", "nu")
MAX_ADAM_COUNT = int(np.iinfo(np.int32).max)  # adam/count is int32, as optax's count
# the JSON files orbax parses whole, by item: the JSON item's file (JsonCheckpointHandler's
# default name) and a PyTree item's tree metadata; bounded first (`_item_json_bounded`)
ITEM_JSON_FILE = {TRAIN_STATE_ITEM: "metadata", PARAMS_ITEM: "_METADATA", ADAM_ITEM: "_METADATA"}
CORRUPT_MARK = ".corrupt-"  # `<step>.corrupt-<UTC time>`: a corrupt step set aside, never deleted
DELETING_MARK = ".deleting-"  # `.<step>.deleting-<pid>`: a step being deleted, no longer a step


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the step directory/file."""


@dataclasses.dataclass(frozen=True)
class StepStatus:
    """Whether step directory `path` holds a complete checkpoint; `reason` says why not."""

    step: int
    path: Path
    valid: bool
    reason: str | None = None


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A restored checkpoint.

    params: {hf_name: array} (jax.Array laid out as the target asked, or np.ndarray without one)
    adam: {"count": int32 scalar, "mu": {hf_name: f32 array}, "nu": {hf_name: f32 array}}
    Frozen tensors (in params, not in mu/nu: `frozen`) come in their stored dtype.
    train_state: the JSON dict saved by the trainer; metadata: `training_metadata.json`.
    """

    step: int
    path: Path
    params: dict[str, Any]
    adam: dict[str, Any]
    train_state: dict[str, Any]
    metadata: dict[str, Any]

    @property
    def frozen(self) -> tuple[str, ...]:
        """Names in `params` without Adam state (carried or frozen tensors), sorted."""
        return tuple(n for n in self.params if n not in self.adam["mu"])


# ----------------------------------------------------------------------------- layouts
def storage_sharding(shape: tuple[int, ...], mesh: jax.sharding.Mesh,
                     padded: tuple[int, ...] | None = None) -> NamedSharding:
    """The layout a logical-shape array is written in (`rules.storage_spec` on `mesh`): dim 0
    stays split wherever it divides; otherwise the array is partly replicated while it is
    written, and one whose split moves off dim 0 entirely is gathered whole on each device on
    the way (`reshard_via`; extra memory: up to the array, one array at a time)."""
    return named(mesh, storage_spec(shape, mesh, padded))


@functools.lru_cache(maxsize=None)
def _slice_dim0(rows: int, out_sharding: NamedSharding):
    return jax.jit(lambda x: x[:rows], out_shardings=out_sharding)


def reshard_via(target: NamedSharding) -> NamedSharding:
    """The layout a padded FSDP array (dim 0 split over every device) is moved to on its way
    to the storage layout `target`: `target` itself, or, when `target` leaves dim 0 whole and
    splits another dimension, the whole array on every device. XLA can reach such a target
    only by replicating first, and on a multi-process mesh (where the move is a compiled
    program) it then warns of an "involuntary full rematerialization" on every process; a
    target that still splits dim 0 is an all-to-all it compiles without one."""
    spec = target.spec
    if spec and spec[0] is None and any(p is not None for p in spec[1:]):
        return named(target.mesh, REPLICATED)
    return target


def to_logical(arrays: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]],
               what: str = "params") -> dict[str, Any]:
    """Drop the dim-0 padding: {name: array [>= n, ...]} -> {name: array [n, ...]} per `shapes`.

    Arrays already at logical shape are returned as they are. Padded jax.Arrays with a
    NamedSharding come back laid out by `storage_sharding` on the same mesh; NumPy arrays
    come back as views. Raises CheckpointError naming `what` and the parameter for a missing
    or unexpected name, or a shape that is not the logical shape padded on dim 0.
    """
    _check_names(arrays, shapes, what)
    out = {}
    for name, logical in shapes.items():
        x, logical = arrays[name], tuple(logical)
        if tuple(x.shape) == logical:
            out[name] = x
            continue
        if (len(x.shape) != len(logical) or tuple(x.shape[1:]) != logical[1:]
                or x.shape[0] < logical[0]):
            raise CheckpointError(f"{what}[{name!r}] has shape {tuple(x.shape)}; expected "
                                  f"{logical} or that shape padded on dim 0")
        if isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding):
            target = storage_sharding(logical, x.sharding.mesh, padded=tuple(x.shape))
            # One array at a time: bounds the extra memory, and many collectives in flight at
            # once can stall XLA:CPU's thread pool on small hosts.
            out[name] = jax.block_until_ready(
                _slice_dim0(logical[0], target)(jax.device_put(x, reshard_via(target))))
        else:
            out[name] = x[: logical[0]]
    return out


def padded_target(shapes: Mapping[str, tuple[int, ...]], mesh: jax.sharding.Mesh,
                  dtype: Any = np.float32) -> dict[str, jax.ShapeDtypeStruct]:
    """Abstract restore target in the trainer's FSDP layout.

    Every array is split on dim 0 over all mesh axes (`rules.PARAM`), dim 0 padded to a
    multiple of `mesh.size` (`rules.padded_shape`), dtype `dtype`. `shapes` may list frozen
    (carried) tensors too: they are placed the same way, and `CheckpointStore.restore` gives
    them back in their stored dtype whatever `dtype` says (a frozen tensor is never cast).
    """
    sharding = named(mesh, PARAM)
    return {name: jax.ShapeDtypeStruct(padded_shape(tuple(s), mesh.size), dtype, sharding=sharding)
            for name, s in shapes.items()}


def _trainable_shapes(shapes: Mapping[str, tuple[int, ...]],
                      trainable: Iterable[str] | None) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the trainable names (all of `shapes` when `trainable` is None), in
    `shapes` order. Raises CheckpointError for a trainable name `shapes` does not list."""
    if trainable is None:
        return dict(shapes)
    names = set(trainable)
    unknown = sorted(names - set(shapes))
    if unknown:
        raise CheckpointError(f"trainable names {unknown[:5]} are not in shapes (every tensor "
                              f"saved in params/ must be listed in shapes)")
    return {n: s for n, s in shapes.items() if n in names}


def _check_names(arrays: Mapping[str, Any], expected: Mapping[str, Any], what: str,
                 table: str = "the parameter table") -> None:
    missing = [n for n in expected if n not in arrays]
    unexpected = [n for n in arrays if n not in expected]
    if missing or unexpected:
        raise CheckpointError(f"{what}: names differ from {table}; missing "
                              f"{missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected "
                              f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")


def _json_ready(obj: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(obj, allow_nan=False))
    except (TypeError, ValueError) as err:
        where = first_unserialisable(obj, what)
        raise CheckpointError(f"{what} must be JSON-serialisable (plain dicts, lists, finite "
                              f"numbers, strings): {where or err}") from None


def first_unserialisable(obj: Any, path: str, depth: int = 0) -> str | None:
    """`path[key][...] = value` of the first value JSON cannot hold (NaN, infinity, an
    object), or None."""
    if depth > 64:
        return None
    items = (obj.items() if isinstance(obj, dict) else
             enumerate(obj) if isinstance(obj, (list, tuple)) else None)
    if items is None:
        if isinstance(obj, float) and not math.isfinite(obj):
            return f"{path} = {obj}"
        if obj is None or isinstance(obj, (str, int, float)):
            return None
        return f"{path} is a {type(obj).__name__}"
    for key, value in items:
        found = first_unserialisable(value, f"{path}[{key!r}]", depth + 1)
        if found:
            return found
    return None


def _scalar_count(count: Any) -> np.ndarray:
    if isinstance(count, jax.Array):
        count = count.addressable_data(0)
    arr = np.asarray(count)
    if arr.shape != () or not np.issubdtype(arr.dtype, np.integer) or int(arr) < 0:
        raise CheckpointError(f"adam['count'] must be a non-negative integer scalar; got "
                              f"shape {arr.shape}, dtype {arr.dtype}")
    if int(arr) > MAX_ADAM_COUNT:
        raise CheckpointError(f"adam['count'] is {int(arr)}; the checkpoint stores it as int32 "
                              f"(optax's count), at most {MAX_ADAM_COUNT}")
    return np.asarray(int(arr), dtype=np.int32)


def _adam_to_logical(adam: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> dict:
    if set(adam) != {"count", "mu", "nu"}:
        raise CheckpointError(f"adam must have exactly the keys count, mu, nu; got {sorted(adam)}")
    out: dict[str, Any] = {"count": _scalar_count(adam["count"])}
    for moment in ("mu", "nu"):
        _check_names(adam[moment], shapes, f"adam[{moment!r}]",
                     "the trainable tensors (frozen tensors have no Adam state)")
        arrays = to_logical(adam[moment], shapes, f"adam[{moment!r}]")
        bad = [n for n, x in arrays.items() if np.dtype(x.dtype) != np.float32]
        if bad:
            raise CheckpointError(f"adam[{moment!r}] must be float32 (torch AdamW keeps fp32 "
                                  f"moments); {bad[0]!r} is {arrays[bad[0]].dtype}")
        out[moment] = arrays
    return out


def _barrier(name: str) -> None:
    """Wait for every process of a multi-host run (a no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def _on_process_0(what: str, work: Callable[[], None]) -> None:
    """Run `work` on process 0 alone, then wait for every process (a collective, a no-op with
    one process). What it raises (an Exception, or a stop signal's unwinding) is raised on
    process 0 after the wait, and every other process raises CheckpointError("process 0 could
    not <what>") instead of sitting in a barrier until JAX's heartbeat timeout (about 100 s,
    then a native abort without the reason)."""
    failure = None
    if jax.process_index() == 0:
        try:
            work()
        except BaseException as err:   # Ctrl-C or SIGTERM's Terminated too: the others must know
            failure = err
    failed_somewhere = max_over_processes(int(failure is not None))
    if failure is not None:
        raise failure
    if failed_somewhere:
        raise CheckpointError(f"process 0 could not {what}; its log says why")


def _check_metadata(meta: Mapping[str, Any], count: int) -> None:
    missing = [k for k in REQUIRED_METADATA if k not in meta]
    if missing:
        raise CheckpointError(f"metadata lacks {missing}; build it with "
                              f"run_metadata.training_metadata (fields: {list(REQUIRED_METADATA)})")
    if meta["optimizer_step"] != count:
        raise CheckpointError(f"metadata optimizer_step ({meta['optimizer_step']}) differs from "
                              f"adam['count'] ({count}); both count AdamW steps taken")


def _copy_hf_assets(src: Path, dst: Path, weights_dtype: str) -> None:
    """The HF assets of `src` into `dst`, config.json saying the weights are `weights_dtype`
    (the dtype the step stores them in, which a bf16 run or a cast conversion changes)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in HF_ASSET_FILES:
        if name == "config.json":
            doc = read_json_object(src / name, CheckpointError)
            write_json(dst / name, config_with_dtype(doc, weights_dtype))
        elif (src / name).is_file():
            shutil.copyfile(src / name, dst / name)


def _step_bytes(params: Mapping[str, Any], adam: Mapping[str, Any], hf_dir: Path) -> int:
    """About the bytes one step takes on disk: every array at logical shape plus the HF assets."""
    arrays = [*params.values(), *adam["mu"].values(), *adam["nu"].values()]
    total = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in arrays)
    return total + sum((hf_dir / n).stat().st_size for n in HF_ASSET_FILES if (hf_dir / n).is_file())


def _check_hf_assets(src: Path) -> None:
    """Raise CheckpointError, before a save writes anything, when `src` lacks a config.json
    that is a JSON object (named) or a tokenizer."""
    if not (src / "config.json").is_file():
        raise CheckpointError(f"hf_assets_dir {src}: config.json not found; pass the HF model "
                              f"directory the run started from")
    read_json_object(src / "config.json", CheckpointError)
    if not any((src / f).is_file() for f in TOKENIZER_FILES):
        raise CheckpointError(f"hf_assets_dir {src}: no tokenizer ({' or '.join(TOKENIZER_FILES)})"
                              f"; a checkpoint must carry its tokenizer")


class _RecordsTheStoreReports(logging.Filter):
    """Drops orbax's (and asyncio's, for orbax's writer tasks) records for what the store
    reports itself, in one line: a storage limit hit (error records with tracebacks, one per
    writer thread or task; the store raises DiskFullError) and a step directory without orbax's
    metadata (logged at every listing and restore; the store names the incomplete step and
    what it lacks)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        message = record.getMessage()
        return not (storage_limit(exc) is not None
                    or quoted_storage_limit(message) is not None
                    or message.startswith("Metadata file does not exist"))


for _name in ("absl", "asyncio"):
    _log = logging.getLogger(_name)
    if not any(isinstance(f, _RecordsTheStoreReports) for f in _log.filters):
        _log.addFilter(_RecordsTheStoreReports())


def _quiet_closed_loop_callbacks() -> None:
    """Tensorstore reads and writes still in flight when orbax closes its event loop (a failed
    save on a full disk, a read or write cut short by a stop signal) call back into that loop,
    each printing an 'Event loop is closed' traceback (unraisable: nothing can catch it; hundreds
    of lines for a save). Drop those; every other unraisable exception reaches the hook that was
    in place before. Installed once, when this module is imported."""
    previous = sys.unraisablehook
    if getattr(previous, "_jscenegen_quiet", False):
        return

    def hook(unraisable):
        exc = unraisable.exc_value
        if not (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"):
            previous(unraisable)

    hook._jscenegen_quiet = True
    sys.unraisablehook = hook


_quiet_closed_loop_callbacks()
# a save stopped by a storage limit or a signal leaves orbax's unstarted per-array write tasks,
# each reported when collected (often at exit) as a 'never awaited' RuntimeWarning
warnings.filterwarnings("ignore", message=r"coroutine 'async_serialize_from_host\.", category=RuntimeWarning)


# what removes each kind of leftover of a failed save that `_remove_until_settled` could not
LEFT_BY_A_FAILED_SAVE = {
    "temporary": "orbax's temporary: deleted when a later start opens the checkpoints, unless "
                 "another live process holds the run's lock",
    "step": "an incomplete step: deleted by the cleanup after the next completed save, or "
            "replaced when this step is saved again",
}


# ----------------------------------------------------------------------------- step checks
def _remove_entry(path: Path) -> None:
    """Remove `path`: a directory with everything under it, or a file or symbolic link itself
    (a link's target is kept). Raises OSError when something cannot be removed."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _remove_until_settled(find: Callable[[], list[Path]], *, quiet_s: float = 1.0,
                          limit_s: float = 15.0) -> list[Path]:
    """Remove the directories `find()` returns until it has returned none for `quiet_s`
    seconds, or `limit_s` seconds have passed; return what is left. After a failed save,
    tensorstore writes still in flight recreate the paths they write (an OCDBT manifest
    under the removed temporary directory, milliseconds after the removal)."""
    deadline = time.monotonic() + limit_s
    quiet_since = None
    while True:
        found, now = find(), time.monotonic()
        if found:
            for p in found:
                with contextlib.suppress(OSError):   # what stays is found again next pass
                    _remove_entry(p)
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now
        elif now - quiet_since >= quiet_s:
            return []
        if now >= deadline:
            return find()
        time.sleep(0.02)


def step_numbers(directory: str | Path) -> list[int]:
    """The numbered step directories under `directory` (complete or not), ascending; [] when
    it is not a directory."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(int(p.name) for p in d.iterdir() if is_step_name(p.name) and p.is_dir())


def _warn_skipped(statuses: Iterable[StepStatus]) -> None:
    """Warn about each step passed over on the way to the newest complete one."""
    for status in statuses:
        log.warning("skipping checkpoint step %d: %s", status.step, one_line(status.reason or ""))


def save_finished(step_dir: str | Path) -> bool:
    """Whether the save of `step_dir` finished: its `checksums.json`, written last, is a file
    (the step may be damaged since; `check_step` says). The one rule for every caller."""
    return (Path(step_dir) / CHECKSUMS_NAME).is_file()


def finished_saves(directory: str | Path) -> list[Path]:
    """What a fresh start in a run's checkpoint directory must not overwrite: the step
    directories whose save finished (`checksums.json`, written last; complete or damaged since)
    and the corrupt steps set aside (`<N>.corrupt-*`). Unfinished saves (orbax's
    `<N>.orbax-checkpoint-tmp-*`, steps without `checksums.json`), which the store deletes or
    replaces, and anything else there (a stray file) do not count. [] when `directory` is not a
    directory: a run stopped before its first checkpoint."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if CORRUPT_MARK in p.name
                  or (is_step_name(p.name) and save_finished(p)))


def newest_complete_step(directory: str | Path) -> tuple[StepStatus | None, list[StepStatus]]:
    """(the newest complete step under `directory`, `check_step` with full SHA-256, or None;
    the statuses of the newer steps passed over, newest first): callers report the passed-over
    steps their own way (a warning, a set-aside)."""
    skipped = []
    for step in reversed(step_numbers(directory)):
        status = check_step(Path(directory) / str(step))
        if status.valid:
            return status, skipped
        skipped.append(status)
    return None, skipped


def check_checkpoints_dir(directory: str | Path) -> None:
    """Raise CheckpointError when a run's checkpoint directory cannot hold its steps: a file,
    or a symbolic link to nothing; the run would fail at its first save, after its first
    update."""
    d = Path(directory)
    if d.is_symlink() and not d.exists():
        raise CheckpointError(f"{d}: a symbolic link to {os.readlink(d)}, which does not exist; "
                              "the run saves its checkpoints there: create that directory, or "
                              "remove the link")
    if d.exists() and not d.is_dir():
        raise CheckpointError(f"{d}: not a directory (a run keeps its checkpoint steps there)")


def check_step_entries(directory: str | Path) -> None:
    """Raise CheckpointError naming an entry of `directory` named like a step (`<N>`) that is a
    symbolic link or not a directory: a writing run deletes and replaces its steps (keep_last,
    an incomplete step's redo), which it cannot do to those, and would fail only after the
    update that reaches them. Called before a run's first update."""
    d = Path(directory)
    if not d.is_dir():
        return
    bad = sorted((p for p in d.iterdir() if is_step_name(p.name) and (p.is_symlink() or not p.is_dir())),
                 key=lambda p: int(p.name))
    if bad:
        what = "a symbolic link" if bad[0].is_symlink() else "not a directory"
        raise CheckpointError(
            f"{bad[0]}: {what}, named like a checkpoint step ({len(bad)} such entr"
            f"{'y' if len(bad) == 1 else 'ies'}); a run deletes and replaces its steps, so each "
            "must be a directory of its own: move it away, or move the step it links to back "
            "in its place")


def has_step_entries(path: str | Path) -> bool:
    """True when `path` holds any item of a checkpoint step (params/, adam/, train_state/,
    training_metadata.json, hf/config.json): a step, complete or not, rather than a directory
    of steps (whose `checksums.json` a conversion writes too)."""
    p = Path(path)
    return any((p / e).exists() for e in _REQUIRED_ENTRIES)


def is_checkpoint_dir(path: str | Path) -> bool:
    """True for a training checkpoint step directory (`params/` and `hf/config.json`)."""
    p = Path(path)
    return (p / PARAMS_ITEM).is_dir() and (p / HF_DIR / "config.json").is_file()


def model_assets_dir(path: str | Path) -> Path:
    """The directory holding config.json, tokenizer and chat template: `hf/` of a checkpoint
    step, else `path` itself (an HF model directory)."""
    p = Path(path)
    return p / HF_DIR if is_checkpoint_dir(p) else p


def not_a_model(path: str | Path, option: str = "--model") -> FileNotFoundError:
    """The error for a `--model` directory (or the one `option` names: `judge.model_path`)
    that is neither an HF model nor a checkpoint step (`design`, `eval`, `mesh-report`, the
    model judge), pointing at the newest step when it is a run's `checkpoints/` directory or
    the run itself."""
    from jscenegen.run_files import RUN_CHECKPOINTS

    p = Path(path)
    if not p.exists():
        return FileNotFoundError(f"{option} {p}: no such file or directory")
    hint = ""
    for steps_dir in (p, p / RUN_CHECKPOINTS):
        steps = [s for s in step_numbers(steps_dir) if is_checkpoint_dir(steps_dir / str(s))]
        if steps:
            hint = f"; its newest checkpoint step is {steps_dir / str(steps[-1])}"
            break
    return FileNotFoundError(f"{option} {p}: neither an HF model directory (config.json) nor a "
                             f"checkpoint step directory (params/ and hf/){hint}")


def check_step(path: str | Path, *, hash_files: bool = True) -> StepStatus:
    """Is `path` (a step directory) a complete checkpoint? Never raises for a bad directory.

    Complete = orbax finalised it, params/, adam/, train_state/, training_metadata.json and
    hf/config.json exist, and every file matches `checksums.json` (sizes always; SHA-256 when
    `hash_files`), with no unlisted files. `reason` names the first failing check and files.
    """
    path = Path(path)
    step = int(path.name) if is_step_name(path.name) else -1
    if not path.is_dir():
        return StepStatus(step, path, False, f"{path} is not a directory" if path.exists()
                          else f"{path} does not exist")
    if not ocp.step.is_path_finalized(path):
        return StepStatus(step, path, False, f"{path}: orbax did not finalise this save")
    missing = [e for e in _REQUIRED_ENTRIES if not (path / e).exists()]
    if missing:
        return StepStatus(step, path, False, f"{path}: missing {', '.join(missing)}")
    try:
        verify_checksums(path, hash_files=hash_files)
    except ChecksumError as err:
        return StepStatus(step, path, False, str(err))
    return StepStatus(step, path, True)


# ----------------------------------------------------------------------------- mesh-free reading
def read_metadata(step_dir: str | Path) -> dict[str, Any]:
    """`training_metadata.json` of a step directory. Raises CheckpointError if absent/invalid."""
    path = Path(step_dir) / METADATA_NAME
    try:
        return read_json_object(path, CheckpointError)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read training metadata: {err}") from None


def read_train_state(step_dir: str | Path) -> dict[str, Any]:
    """The trainer's JSON state of a step directory (the orbax `train_state` item). Raises
    CheckpointError naming the item when orbax cannot read it or it is not an object, or
    naming its file when that is larger than `paths.MAX_JSON_OBJECT_BYTES`."""
    path = _item_dir(Path(step_dir), TRAIN_STATE_ITEM)
    _item_json_bounded(path, TRAIN_STATE_ITEM)
    with _orbax_reading(path):
        state = ocp.JsonCheckpointHandler().restore(path, args=ocp.args.JsonRestore())
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: the train state must be a JSON object, got "
                              f"{type(state).__name__}")
    return state


@contextlib.contextmanager
def _orbax_reading(path: Path):
    """Turn an orbax/tensorstore failure while reading `path` into one CheckpointError naming
    it (a step whose checksums verify but whose files another program wrote malformed)."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as err:  # orbax and tensorstore raise anything on a malformed item
        detail = " ".join(str(err).split())[:300]
        raise CheckpointError(f"{path}: orbax cannot read this item ({type(err).__name__}: "
                              f"{detail})") from None


def _item_dir(step_dir: Path, item: str) -> Path:
    path = step_dir.absolute() / item
    if not path.is_dir():
        raise CheckpointError(f"{path}: no {item} item")
    return path


def _item_json_bounded(item_dir: Path, item: str) -> None:
    """Raise CheckpointError naming the file when the JSON file orbax parses whole for `item`
    (`ITEM_JSON_FILE`) is not a regular file or is beyond `paths.MAX_JSON_OBJECT_BYTES`: the
    checksums only say a step is as written, and a step another program wrote with a
    multi-GB one would be read into memory whole."""
    refuse_oversized_json(item_dir / ITEM_JSON_FILE[item], CheckpointError)


def _read_pytree(step_dir: Path, item: str, restore_args: dict) -> dict:
    """Partial restore of the leaves named in `restore_args` from one orbax PyTree item.

    Uses the item's handler directly (a step directory read by a converter need not have
    been written by a CheckpointManager in this process).
    """
    path = _item_dir(step_dir, item)
    _item_json_bounded(path, item)
    handler = ocp.PyTreeCheckpointHandler()
    try:
        with _orbax_reading(path):
            return handler.restore(path, args=ocp.args.PyTreeRestore(
                item=jax.tree.map(lambda _: 0, restore_args), restore_args=restore_args,
                partial_restore=True))
    finally:
        handler.close()


def _item_tree(step_dir: Path, item: str) -> dict:
    path = _item_dir(step_dir, item)
    _item_json_bounded(path, item)
    handler = ocp.PyTreeCheckpointHandler()
    try:
        with _orbax_reading(path):
            tree = handler.metadata(path).tree
    finally:
        handler.close()
    if not isinstance(tree, dict):
        raise CheckpointError(f"{path}: the item's tree is a {type(tree).__name__}, expected a dict")
    return tree


def array_shapes(step_dir: str | Path, group: str = "params") -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{hf_name: (logical shape, dtype)} stored for `group` in {"params", "mu", "nu"}.

    Reads only orbax's metadata (no array data). Raises CheckpointError for an unknown group,
    a missing item, an item whose `_METADATA` is beyond `paths.MAX_JSON_OBJECT_BYTES`, or an
    item that does not hold the group as {name: array} (naming it).
    """
    step_dir = Path(step_dir)
    if group not in ARRAY_GROUPS:
        raise CheckpointError(f"group must be one of {ARRAY_GROUPS}; got {group!r}")
    item = PARAMS_ITEM if group == "params" else ADAM_ITEM
    tree = _item_tree(step_dir, item)
    where = step_dir.absolute() / item
    if group != "params":
        if not isinstance(tree.get(group), dict):
            raise CheckpointError(f"{where}: no {group} (Adam's moments as {{name: array}}); "
                                  f"the item holds {sorted(tree)}")
        tree = tree[group]
    out = {}
    for name, m in tree.items():
        if not hasattr(m, "shape") or not hasattr(m, "dtype"):
            raise CheckpointError(f"{where}: {'' if group == 'params' else group}[{name!r}] is "
                                  f"not an array (a {type(m).__name__})")
        out[name] = (tuple(m.shape), np.dtype(m.dtype))
    return out


def moment_shapes(step_dir: str | Path,
                  stored: Mapping[str, tuple[tuple[int, ...], np.dtype]] | None = None,
                  ) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{hf_name: (logical shape, dtype)} of the Adam moments a step directory stores, checked
    against its parameters: `adam/mu` and `adam/nu` name the same tensors, each one that
    `params/` stores (`stored`: its `array_shapes`, read when None), at that parameter's shape.

    Reads only orbax's metadata. Raises CheckpointError naming `adam/mu[name]` (or nu) and
    both shapes, or the names that differ.
    """
    step_dir = Path(step_dir).absolute()
    stored = array_shapes(step_dir, "params") if stored is None else stored
    adam = step_dir / ADAM_ITEM
    mu, nu = array_shapes(step_dir, "mu"), array_shapes(step_dir, "nu")
    if set(mu) != set(nu):
        raise CheckpointError(f"{adam}: mu and nu name different tensors (only in mu: "
                              f"{sorted(set(mu) - set(nu))[:5]}, only in nu: "
                              f"{sorted(set(nu) - set(mu))[:5]})")
    extra = [n for n in mu if n not in stored]
    if extra:
        raise CheckpointError(f"{adam}: moments for {extra[:5]}, which params/ does not store")
    for group, moments in (("mu", mu), ("nu", nu)):
        for name, (shape, _) in moments.items():
            if shape != stored[name][0]:
                raise CheckpointError(f"{adam}: {group}[{name!r}] has shape {shape}; its "
                                      f"parameter params/[{name!r}] has {stored[name][0]}")
    return mu


def iter_arrays(step_dir: str | Path, group: str = "params",
                names: list[str] | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (hf_name, array) for `group`, one at a time: NumPy at logical shape, stored dtype.

    Each array is read by its own partial orbax restore, so host memory holds one array at a
    time (what a converter streaming a 7B model needs). `names` defaults to every stored name,
    sorted (JAX's dict order; `model.weights.param_shapes` gives the model's order). No mesh or
    device is involved. Raises CheckpointError for an unknown name.
    """
    step_dir = Path(step_dir).absolute()
    stored = array_shapes(step_dir, group)
    unknown = [n for n in names or () if n not in stored]
    if unknown:
        raise CheckpointError(f"{step_dir}: {group} has no array {unknown[0]!r}")
    for name in names if names is not None else list(stored):
        leaf = {name: ocp.RestoreArgs(restore_type=np.ndarray)}
        if group == "params":
            yield name, _read_pytree(step_dir, PARAMS_ITEM, leaf)[name]
        else:
            yield name, _read_pytree(step_dir, ADAM_ITEM, {group: leaf})[group][name]


def read_adam_count(step_dir: str | Path) -> int:
    """AdamW steps taken (torch `step`, optax `count`) stored in a step directory."""
    out = _read_pytree(Path(step_dir), ADAM_ITEM,
                       {"count": ocp.RestoreArgs(restore_type=np.ndarray)})
    return int(out["count"])


WRITER_WAIT_S = 30.0


def _wait_for_writers(before: set[threading.Thread], timeout_s: float = WRITER_WAIT_S) -> None:
    """After an orbax save failed or was interrupted: wait, up to `timeout_s` in all, for the
    non-daemon threads the save started (orbax writes each item on its own thread, creating
    directories as it goes), so the caller's cleanup of the unfinished directory does not
    race them and leave part of it behind."""
    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if thread not in before and not thread.daemon and thread is not threading.current_thread():
            # the plain wait: orbax's threads override join() to re-raise their own error
            threading.Thread.join(thread, max(0.0, deadline - time.monotonic()))


# ----------------------------------------------------------------------------- the store
class CheckpointStore:
    """Saves and restores training checkpoints under `directory` (one sub-directory per step).

    keep_last: complete checkpoints to keep (>= 1); older ones and incomplete leftovers
        below the newest step are deleted after each complete save.
    async_save: orbax writes arrays in the background after `save` returns; the step is
        completed (hf/, metadata, checksums, keep-last-k) by the next `save`,
        `wait_until_finished` or `close`. Call `close` before the process exits.

    Every process of a multi-host run calls every method; only process 0 writes hf/, the
    metadata and checksums, and the others wait for it (the directory must be shared).
    `directory` is created by the first save, not before. Unfinished orbax saves
    (`*.orbax-checkpoint-tmp-*`) and steps a killed deletion left (`.<step>.deleting-*`) found
    at start are deleted, unless another live process holds the run directory's lock
    (`jscenegen.run_lock`; the directory's parent is the run).
    Raises CheckpointError when `directory` is a file or a link to nothing
    (`check_checkpoints_dir`).
    """

    def __init__(self, directory: str | Path, *, keep_last: int = 3, async_save: bool = False):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (got {keep_last})")
        check_checkpoints_dir(directory)
        self.directory = Path(directory).absolute()
        self.keep_last = keep_last
        self.async_save = async_save
        self._pending: tuple | None = None  # an async save to finish (`wait_until_finished`)
        if self.directory.is_dir() and jax.process_index() == 0:
            holder = live_holder(self.directory.parent)
            for tmp in sorted(self.directory.glob(f"*{ocp.step.TMP_DIR_SUFFIX}*")):
                if holder is not None:  # maybe the save it is writing now: leave it alone
                    log.warning("not deleting %s: the run is locked by %s", tmp, holder.describe())
                    continue
                log.warning("deleting %s: an orbax save that never finished", tmp)
                _remove_entry(tmp)
            if holder is None:
                self._remove_deleting()
        self._manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
            enable_async_checkpointing=async_save, create=False))  # made by the first save

    def step_path(self, step: int) -> Path:
        """Directory of `step` (whether or not it exists)."""
        return self.directory / str(int(step))

    def steps(self) -> list[int]:
        """Every step directory on disk, complete or not, ascending."""
        return step_numbers(self.directory)

    def scan(self, *, hash_files: bool = True) -> list[StepStatus]:
        """`check_step` of every step directory, newest first."""
        return [check_step(self.step_path(s), hash_files=hash_files) for s in reversed(self.steps())]

    def latest_valid_step(self, *, say_skipped: bool = True) -> int | None:
        """Newest step whose checkpoint is complete and verifies (full SHA-256), or None.

        Incomplete or corrupted newer steps are skipped, with a logged warning giving the
        reason unless `say_skipped` is False (a caller whose later `restore` or
        `set_aside_corrupt` reports the same steps).
        """
        valid, skipped = newest_complete_step(self.directory)
        if say_skipped:
            _warn_skipped(skipped)
        return None if valid is None else valid.step

    def set_aside_corrupt(self) -> StepStatus | None:
        """Set aside every corrupt step newer than the newest valid one; return that valid
        step's status (hashed in full: `restore(verified=...)` need not hash it again), None
        when there is none.

        Corrupt = its save completed (`checksums.json` was written, last) but it no longer
        verifies (SHA-256 of every file): a flipped byte, a truncated or edited file. Such a
        step is renamed `<step>.corrupt-<UTC time>` (kept for inspection, never deleted, no
        longer a step), with a warning naming the failing files, so that a resumed run can
        redo the update and save that step again. Incomplete steps (a save cut off before
        `checksums.json`) are left for the next save of that number to replace (warned
        about). Called by
        the resuming trainer (`checkpoint.resume.restore_onto_mesh`), never by readers.
        Raises CheckpointError, moving nothing, when no valid step precedes the corrupt ones.
        In a multi-process run process 0 alone hashes and decides (`_steps_as_process_0_sees`).
        """
        valid, skipped, corrupt = self._steps_as_process_0_sees()
        if valid is None and corrupt:   # no valid step to go back to: leave everything in place
            raise CheckpointError(
                f"{self.directory}: no valid checkpoint to resume from; corrupt: "
                + "; ".join(f"step {s.step} ({one_line(s.reason or '')})" for s in corrupt)
                + " (left in place: restore the files or start a new run)")
        _warn_skipped([s for s in skipped if s not in corrupt])
        for s in corrupt:
            self._set_aside(s.step, s.reason)
        return valid

    def _steps_as_process_0_sees(self) -> tuple[StepStatus | None, list[StepStatus],
                                                 list[StepStatus]]:
        """(newest complete step, the newer steps passed over, those of them whose save had
        finished: corrupt) as process 0 finds them (`newest_complete_step`, hashed there alone),
        on every process (`_from_process_0`): hosts may list a shared filesystem differently (a
        client's cache just after a kill) and would resume from different steps or move
        different ones; each host hashing multi-GB steps would also read them once per host.
        Every other process checks by sizes that it sees the chosen step complete. Raises
        CheckpointError on every process when process 0 could not read the steps or another
        process does not see that step."""
        def scan() -> dict:
            valid, skipped = newest_complete_step(self.directory)
            return {"valid": valid and [valid.step, valid.reason],
                    "skipped": [[s.step, s.reason, save_finished(s.path)] for s in skipped]}
        doc = self._from_process_0("read the checkpoint steps", scan)
        valid = doc["valid"] and StepStatus(doc["valid"][0], self.step_path(doc["valid"][0]),
                                            True, doc["valid"][1])
        skipped = [StepStatus(step, self.step_path(step), False, why)
                   for step, why, _ in doc["skipped"]]
        corrupt = [s for s, (_, _, finished) in zip(skipped, doc["skipped"]) if finished]
        unseen = valid is not None and not check_step(valid.path, hash_files=False).valid
        if max_over_processes(int(unseen)):
            raise CheckpointError(f"{self.directory}: process 0 resumes from step {valid.step}, "
                                  "which another process does not see complete: every process "
                                  "must see the same checkpoint directory (a shared filesystem)")
        return valid, skipped, corrupt

    def _from_process_0(self, what: str, work: Callable[[], Any]) -> Any:
        """`work()`'s result (JSON-able) computed on process 0 alone, on every process: one
        collective (`bytes_from_primary`); with one process, `work()`. Raises on every process
        when `work` raised on process 0: its CheckpointError (a refusal) in its words, another
        error as CheckpointError("DIR: process 0 could not <what>: <error>")."""
        if jax.process_count() == 1:
            return work()
        doc = None
        if jax.process_index() == 0:
            try:
                doc = {"result": work()}
            except CheckpointError as err:
                doc = {"refused": str(err)}
            except Exception as err:   # the others wait for the verdict: they must hear of it
                log.exception("process 0 could not %s", what)
                doc = {"error": f"{type(err).__name__}: {one_line(str(err))}"}
        doc = json.loads(bytes_from_primary(json.dumps(doc).encode() if doc else None))
        if "refused" in doc:
            raise CheckpointError(doc["refused"])
        if "error" in doc:
            raise CheckpointError(f"{self.directory}: process 0 could not {what}: {doc['error']}")
        return doc["result"]

    def _set_aside(self, step: int, reason: str | None) -> Path:
        """Every process: rename corrupt step `step` aside (process 0 moves it); its new path."""
        _barrier(f"jscenegen-checkpoint-checked-{step}")  # every process has read it: now move it
        dest = self._aside_path(step)
        _on_process_0(f"set corrupt checkpoint step {step} aside in {self.directory}",
                      lambda: self._rename_aside(step, dest, reason,
                                                 "it will be redone from an earlier step"))
        self._manager.reload()
        return dest

    def _aside_path(self, step: int) -> Path:
        path = self.step_path(step)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        dest = path.with_name(f"{path.name}{CORRUPT_MARK}{stamp}")
        n = 1
        while dest.exists():
            dest = path.with_name(f"{path.name}{CORRUPT_MARK}{stamp}-{n}")
            n += 1
        return dest

    def _rename_aside(self, step: int, dest: Path, reason: str | None, then: str) -> None:
        """Process 0 only: move corrupt step `step` to `dest`, with a warning."""
        os.replace(self.step_path(step), dest)
        log.warning("checkpoint step %d is corrupt (%s); set aside as %s (kept, never deleted); "
                    "%s", step, one_line(reason or ""), dest, then)

    def save(self, step: int, *, params: Mapping[str, Any], adam: Mapping[str, Any],
             train_state: Mapping[str, Any], metadata: Mapping[str, Any],
             hf_assets_dir: str | Path, shapes: Mapping[str, tuple[int, ...]],
             trainable: Iterable[str] | None = None) -> Path:
        """Write checkpoint `step`; returns its directory.

        params: {hf_name: array [n or padded n, ...]} (jax.Array on any mesh, NumPy, or
        `LazyArray`: loaded only when written, one at a time, so a converter's peak memory is
        one array, not the model);
        shapes: {hf_name: logical shape} of EVERY tensor in `params`
        (`model.weights.param_shapes(cfg, carried=True)` for a Qwen3.5 model with its vision
        tower and mtp.*); padding beyond it on dim 0 is dropped, never stored. Each array is
        stored in its own dtype (frozen tensors bit-exact).
        trainable: the names AdamW steps (default: every name of `shapes`); the others are
        frozen: they have no Adam state and `training_metadata.json` lists them under
        `frozen_tensors`.
        adam: {"count": int scalar, "mu": {...}, "nu": {...}}, mu/nu float32 for exactly the
        trainable names;
        train_state, metadata: JSON-able dicts (metadata is
        passed through `run_metadata.redact`, must have the `REQUIRED_METADATA` fields, and its
        `optimizer_step` must equal adam["count"]). hf_assets_dir: the HF model directory whose
        config, tokenizer and chat template are copied into `hf/`.
        Raises CheckpointError for a bad name/shape/dtype (a trainable name not in `shapes`,
        moments for a frozen tensor or none for a trainable one), non-JSON state, incomplete metadata,
        missing HF assets, or a complete checkpoint at `step` or after it (an incomplete one
        at `step` is replaced, a corrupt one set aside as `set_aside_corrupt` does; complete
        later ones mean this run already went further).
        """
        self.wait_until_finished()
        step = int(step)
        if step < 0:
            raise CheckpointError(f"step must be >= 0 (got {step})")
        hf_dir = Path(hf_assets_dir)
        state = _json_ready(dict(train_state), "train_state")
        meta = redact(_json_ready(dict(metadata), "metadata"))
        _check_metadata(meta, int(_scalar_count(adam.get("count", -1))))
        trainable_shapes = _trainable_shapes(shapes, trainable)
        meta["frozen_tensors"] = [n for n in shapes if n not in trainable_shapes]
        status, finished = self._step_as_process_0_sees(step, hf_dir)
        path = self.step_path(step)
        logical_params = to_logical(params, shapes, "params")
        logical_adam = _adam_to_logical(adam, trainable_shapes)
        if status is not None and finished:
            self._set_aside(step, status.reason)  # corrupt: kept, never deleted
        elif status is not None:
            # every process has looked at the step (and so takes this branch) before it goes
            _barrier(f"jscenegen-checkpoint-replacing-{step}")

            def replace() -> None:
                log.warning("replacing incomplete checkpoint step %d: %s", step,
                            one_line(status.reason or ""))
                self._delete(step)
            _on_process_0(f"remove incomplete checkpoint step {step} in {self.directory}", replace)
            self._manager.reload()
        if not self.directory.is_dir():  # a run that fails before its first save leaves none
            self.directory.mkdir(parents=True, exist_ok=True)
            self._manager.reload()
        needed = _step_bytes(logical_params, logical_adam, hf_dir)
        before = set(threading.enumerate())
        try:
            with cancel_on_interrupt():
                saved = self._manager.save(step, force=True, args=ocp.args.Composite(**{
                    PARAMS_ITEM: ocp.args.PyTreeSave(logical_params),
                    ADAM_ITEM: ocp.args.PyTreeSave(logical_adam),
                    TRAIN_STATE_ITEM: ocp.args.JsonSave(state)}))
        except BaseException as err:   # a failed write, Ctrl-C or SIGTERM: orbax's threads may still write
            _wait_for_writers(before)
            if isinstance(err, Exception):
                self._raise_if_disk_full(err, step, needed)
            raise
        if not saved:
            raise CheckpointError(f"orbax declined to save step {step} in {self.directory}")
        stored_dtype = majority_dtype((x.shape, x.dtype) for x in logical_params.values())
        self._pending = (step, meta, hf_dir, needed, stored_dtype)
        if not self.async_save:
            self.wait_until_finished()
        return path

    def _step_as_process_0_sees(self, step: int, hf_dir: Path) -> tuple[StepStatus | None, bool]:
        """(`check_step` of step `step`, fully hashed, or None when absent; whether its save had
        finished) before `save` writes it, as process 0 finds them, on every process
        (`_from_process_0`): the save's branches (set aside, replace, write) hold collectives,
        so hosts that list a shared filesystem differently must not take different ones. Raises
        CheckpointError on every process when `hf_dir` lacks the model's assets, a complete step
        comes after `step`, or `step` itself is complete (process 0's refusal, in its words)."""
        def verdict() -> list | None:
            _check_hf_assets(hf_dir)
            newer = [s for s in self.steps()
                     if s > step and check_step(self.step_path(s), hash_files=False).valid]
            if newer:
                raise CheckpointError(f"{self.directory} already holds complete checkpoints after "
                                      f"step {step} ({newer}); continue from the newest, or use a "
                                      f"new run directory to branch from an older step")
            path = self.step_path(step)
            # full hashes: a complete step that no longer verifies must not block its redo
            status = check_step(path) if path.exists() else None
            if status is not None and status.valid:
                raise CheckpointError(f"{path} already holds a complete checkpoint; "
                                      f"refusing to overwrite step {step}")
            return None if status is None else [status.reason, save_finished(path)]
        doc = self._from_process_0(f"look at step {step}", verdict)
        if doc is None:
            return None, False
        return StepStatus(step, self.step_path(step), False, doc[0]), doc[1]

    def wait_until_finished(self) -> None:
        """Block until the last save is complete: arrays written, hf/, metadata, checksums, GC.

        Raises DiskFullError (the directory and the bytes the step needs) when the disk filled
        up during the save; the save's temporary and incomplete directories are removed then.
        """
        pending, self._pending = self._pending, None
        try:
            self._manager.wait_until_finished()
            if pending is None:
                return
            step, meta, hf_dir, _, weights_dtype = pending
            path = self.step_path(step)

            def finish() -> None:
                if not ocp.step.is_path_finalized(path):
                    raise CheckpointError(f"{path}: orbax did not finalise the save of step {step}")
                _copy_hf_assets(hf_dir, path / HF_DIR, weights_dtype)
                write_json(path / METADATA_NAME, meta)
                write_checksums(path)
                self._collect_garbage(step)
            _on_process_0(f"finish checkpoint step {step} in {self.directory}", finish)
            self._manager.reload()
        except Exception as err:
            if pending is not None:
                self._raise_if_disk_full(err, pending[0], pending[3])
            raise

    def _raise_if_disk_full(self, err: Exception, step: int, needed: int) -> None:
        """After a failed save of `step`: when a storage limit stopped it (STORAGE_LIMITS: a
        full disk, a quota, the file-size limit), remove what the save left (orbax's temporary
        directory, an incomplete step) and raise DiskFullError; else return."""
        code = storage_limit(err)
        if code is None:
            return
        if jax.process_index() == 0:
            path = self.step_path(step)

            def left_over() -> list[Path]:
                found = list(self.directory.glob(f"{step}{ocp.step.TMP_DIR_SUFFIX}*"))
                return found + [path] if path.exists() and not save_finished(path) else found
            for stays in _remove_until_settled(left_over):
                log.warning("could not remove %s, left by the failed save of step %d (%s)", stays,
                            step, LEFT_BY_A_FAILED_SAVE["step" if stays == path else "temporary"])
        self._manager.reload()
        raise DiskFullError(self.directory, needed, f"checkpoint step {step}", code) from None

    def close(self, finish: bool = True) -> None:
        """Finish any pending save and release orbax's resources. Without `finish` a pending
        save is left unfinished (its arrays written, no hf/, metadata or checksums: an
        incomplete step, which a resume passes over and the next save of its step replaces):
        finishing it is a collective, which a process leaving a multi-process run alone must
        not enter."""
        if finish:
            self.wait_until_finished()
        else:
            self._pending = None
        self._manager.close()

    def __enter__(self) -> "CheckpointStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _delete(self, step: int) -> None:
        """Remove step `step`'s directory. Process 0 alone calls this (orbax's own `delete` is
        a collective); every process reloads the manager after `_on_process_0`'s collective.
        The step is first renamed to a hidden `.<step>.deleting-<pid>` (durably: the directory
        is synced), then removed: a kill or an error inside the removal leaves no half-deleted
        step that still holds its checksums.json (it would read as a corrupt complete step);
        `_remove_deleting` removes such leftovers."""
        path = self.step_path(step)
        if not path.exists():
            return
        doomed = path.with_name(f".{path.name}{DELETING_MARK}{os.getpid()}")
        if doomed.exists():
            shutil.rmtree(doomed)
        os.replace(path, doomed)
        fsync_path(self.directory)
        self._remove_deleting()   # the step is out of the way: what cannot go now is a warning

    def _remove_deleting(self) -> None:
        """Process 0 only: remove what a killed or failed `_delete` left (`.<step>.deleting-*`);
        one that cannot be removed now is named in a warning and tried again at the next save."""
        for doomed in sorted(self.directory.glob(f".*{DELETING_MARK}*")):
            try:
                _remove_entry(doomed)
            except OSError as err:
                log.warning("could not remove %s, a checkpoint step being deleted: %s", doomed,
                            one_line(str(err)))

    def _collect_garbage(self, newest: int) -> None:
        """Process 0 only (inside the save's `_on_process_0`). Keep the newest `keep_last` complete
        steps <= `newest`; delete the older ones and unfinished saves; set aside (never delete)
        a finished step that fails its size check, as `set_aside_corrupt` does. Sizes only, no
        hashes (the other processes wait at the save's collective): a step damaged without a
        size change still counts as complete here (docs/checkpoints-training.md).
        Runs after step `newest` is complete, so an error here (a step that cannot be deleted
        or moved) is a warning naming the step, not a failed save; it is tried again at the next
        save."""
        self._remove_deleting()
        kept = 0
        for step in reversed([s for s in self.steps() if s <= newest]):
            status = check_step(self.step_path(step), hash_files=False)
            if status.valid and kept < self.keep_last:
                kept += 1
                continue
            try:
                if not status.valid and save_finished(self.step_path(step)):
                    self._rename_aside(step, self._aside_path(step), status.reason,
                                       f"a newer step ({newest}) is saved")
                    continue
                log.info("deleting checkpoint step %d (%s)", step, f"keep_last={self.keep_last}"
                         if status.valid else "an unfinished save")
                self._delete(step)
            except OSError as err:
                log.warning("checkpoint step %d is saved, but step %d in %s could not be removed "
                            "(tried again at the next save): %s", newest, step, self.directory,
                            one_line(str(err)))

    def restore(self, step: int | None = None,
                target: Mapping[str, jax.ShapeDtypeStruct] | None = None,
                verified: StepStatus | None = None) -> Checkpoint:
        """Verify and read checkpoint `step` (default: `latest_valid_step()`).

        target: {hf_name: jax.ShapeDtypeStruct(shape, dtype, sharding=...)} for every tensor
        in params/, e.g. `padded_target(shapes, mesh)`. `shape` is the logical shape or that
        shape padded on dim 0 (padding rows are zero); trainable params come back with the
        target's dtype and sharding, frozen ones (no Adam state) with the target's shape and
        sharding in their STORED dtype (bit-exact), `mu`/`nu` (trainable names only) with
        their param's shape and sharding in float32, `count` replicated on the target's mesh.
        Without a target every array comes back as NumPy at logical shape, stored dtype.
        verified: `step`'s status as a full check just returned it (`set_aside_corrupt`): not
        hashed again. Raises CheckpointError if no complete step exists, the step fails verification
        (naming the failing files), its moments do not fit its params (`moment_shapes`), an
        item's JSON file is beyond `paths.MAX_JSON_OBJECT_BYTES` (naming it), or the target's
        names or shapes do not fit.
        """
        self.wait_until_finished()
        if step is None:
            status, skipped = newest_complete_step(self.directory)
            _warn_skipped(skipped)
            if status is None:
                raise CheckpointError(f"{self.directory}: no complete checkpoint "
                                      f"(steps on disk: {self.steps()})")
            step = status.step
        elif verified is not None and verified.step == step and verified.valid:
            status = verified   # hashed by the caller (`set_aside_corrupt`) just before
        else:
            status = check_step(self.step_path(step))
        path = self.step_path(step)
        if not status.valid:
            raise CheckpointError(f"checkpoint step {step} is not usable: {status.reason}")
        stored = array_shapes(path, "params")
        moments = moment_shapes(path, stored)
        if target is None:
            p_args = {n: ocp.RestoreArgs(restore_type=np.ndarray) for n in stored}
            m_args = {n: p_args[n] for n in moments}
            count_sharding = None
        else:
            p_args, m_args, count_sharding = _target_restore_args(target, stored, moments, path)
        # the arrays' items were bounded by array_shapes
        _item_json_bounded(_item_dir(path, TRAIN_STATE_ITEM), TRAIN_STATE_ITEM)
        self._manager.reload()
        try:
            out = self._restore_items(step, p_args, m_args)
        except (ValueError, TypeError, KeyError, RecursionError) as err:
            # a malformed item that passed its checksums (another program wrote it); other
            # failures (device memory, I/O) pass as they are
            raise CheckpointError(f"{path}: orbax cannot read this step ({type(err).__name__}: "
                                  f"{' '.join(str(err).split())[:300]})") from err
        state = out[TRAIN_STATE_ITEM]
        if not isinstance(state, dict):
            raise CheckpointError(f"{path / TRAIN_STATE_ITEM}: the train state must be a JSON "
                                  f"object, got {type(state).__name__}")
        adam = dict(out[ADAM_ITEM])
        adam["count"] = np.asarray(adam["count"], np.int32)
        if count_sharding is not None:
            adam["count"] = jax.device_put(adam["count"], count_sharding)
        order = list(stored)
        trained = [n for n in order if n in moments]
        return Checkpoint(step=step, path=path,
                          params={n: out[PARAMS_ITEM][n] for n in order},
                          adam={"count": adam["count"], "mu": {n: adam["mu"][n] for n in trained},
                                "nu": {n: adam["nu"][n] for n in trained}},
                          train_state=dict(state), metadata=read_metadata(path))

    def _restore_items(self, step: int, p_args, m_args):
        return self._manager.restore(step, args=ocp.args.Composite(**{
            PARAMS_ITEM: ocp.args.PyTreeRestore(item=jax.tree.map(lambda _: 0, p_args),
                                                restore_args=p_args),
            ADAM_ITEM: ocp.args.PyTreeRestore(
                item={"count": 0, "mu": jax.tree.map(lambda _: 0, m_args),
                      "nu": jax.tree.map(lambda _: 0, m_args)},
                restore_args={"count": ocp.RestoreArgs(restore_type=np.ndarray),
                              "mu": m_args, "nu": m_args}),
            TRAIN_STATE_ITEM: ocp.args.JsonRestore()}))


def _target_restore_args(target: Mapping[str, jax.ShapeDtypeStruct],
                         stored: Mapping[str, tuple[tuple[int, ...], np.dtype]],
                         moments: Mapping[str, Any], path: Path):
    """Orbax restore args for params (trainable: target dtype; frozen: stored dtype) and for
    the moments of the trainable names (float32), each at its target shape and sharding."""
    _check_names(target, stored, f"restore target for {path}", f"the tensors {path} stores")
    p_args, m_args = {}, {}
    for name, (shape, stored_dtype) in stored.items():
        t = target[name]
        if t.sharding is None:
            raise CheckpointError(f"restore target {name!r} has no sharding")
        tshape = tuple(t.shape)
        if len(tshape) != len(shape) or tshape[1:] != shape[1:] or tshape[0] < shape[0]:
            raise CheckpointError(f"restore target {name!r} has shape {tshape}; {path} stores "
                                  f"{shape} (the target may only pad dim 0)")
        dtype = t.dtype if name in moments else stored_dtype
        # strict=False lets orbax pad dim 0 only: the target's shape was checked above, and
        # each moment's stored shape is its parameter's (`moment_shapes`)
        p_args[name] = ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=tshape,
                                            dtype=dtype, strict=False)
        if name in moments:
            m_args[name] = ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=tshape,
                                                dtype=np.float32, strict=False)
    first = next(iter(target.values())).sharding
    if isinstance(first, NamedSharding):
        count_sharding = named(first.mesh, REPLICATED)
    else:
        count_sharding = jax.sharding.SingleDeviceSharding(next(iter(first.device_set)))
    return p_args, m_args, count_sharding
