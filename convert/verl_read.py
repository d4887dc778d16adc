"""Reading a VERL FSDP2 checkpoint tensor by tensor (../shared/specs/verl-checkpoint.md).

Layouts accepted (`find_verl`): a run directory holding `latest_checkpointed_iteration.txt`,
a trainer `global_step_N/` with `actor/` inside, the `actor/` directory itself, or the published
flattened layout (`global_step_N/` holding the rank files directly). Each rank file is loaded
with `convert.torch_safe.load_pt` (weights_only, mmap); a tensor is reassembled from the W local
shards along its own `placements[-1].dim` (VERL 0.6 - 0.8 shard some tensors on dim 1), which is
what VERL's model merger does (verl/model_merger/fsdp_model_merger.py) minus its bf16 cast.
Memory: the rank files are memory-mapped; one reassembled tensor is held at a time, and each
shard's mapped pages are read ahead in bulk and released after use (convert/pages.py).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import warnings
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from convert import pages
from convert.errors import ConversionWarning, ConvertError
from convert.sharding import chunk_bounds, placement_of
from convert.tensor_sets import embedding_name, verl_shapes
from convert.tensors import to_numpy
from convert.torch_safe import StorageCrcs, check_torch_zip, load_pt
from convert.verl_write import MAX_WORLD_SIZE
from jscenegen.checkpoint.resume import (
    RUN_IDENTITY_KEYS,
    RUN_STATE_FILE,
    check_run_identity,
    differing_param_group,
    has_run_identity,
)
from jscenegen.config import STEPS_MAX
from jscenegen.paths import finite_number, is_decimal, not_a_file, read_json_object
from jscenegen.text import clip_text

KINDS = ("model", "optim", "extra_state")
MAX_RUN_STATE_BYTES = 1 << 20   # the trainer's train state is about 1 KB
# ASCII digits only (`\d` also matches other scripts' digits, which int() reads); a number with a
# leading zero (`_rank_01.pt`) matches too, and is refused as no name VERL writes
_RANK_FILE = re.compile(r"^(model|optim|extra_state)_world_size_([0-9]+)_rank_([0-9]+)\.pt$")
_CANONICAL = re.compile(r"0|[1-9][0-9]*")
_STEP_DIR = re.compile(r"global_step_(\d+)$")


@dataclasses.dataclass(frozen=True)
class VerlLayout:
    """Where a VERL checkpoint's files are.

    kind: "run" | "step" (trainer global_step_N/actor) | "actor" | "flattened" (published).
    shard_dir: the directory with the rank files. hf_dir: its `huggingface/` (None if absent).
    global_step: N from `global_step_N` (None if the path does not say). world_size: W.
    kinds: which of model/optim/extra_state files are present (all W ranks of each).
    """

    kind: str
    source: Path
    shard_dir: Path
    hf_dir: Path | None
    global_step: int | None
    world_size: int
    kinds: tuple[str, ...]

    def rank_file(self, kind: str, rank: int) -> Path:
        return self.shard_dir / f"{kind}_world_size_{self.world_size}_rank_{rank}.pt"


def find_verl(path: str | Path) -> VerlLayout:
    """Detect the layout at `path` and check its rank files.

    Checks: every kind present has exactly ranks 0..W-1 for one W; `model` files exist;
    `fsdp_config.json` (when present) says FSDP_version 2 and world_size W. Raises
    ConvertError naming the missing/contradicting file.
    """
    src = Path(path)
    if not src.is_dir():
        raise ConvertError(f"{src}: not a directory")
    shard_dir = src
    latest = src / "latest_checkpointed_iteration.txt"
    if not _has_rank_files(src) and os.path.lexists(latest):
        if why := not_a_file(latest):
            raise ConvertError(f"{latest}: {why}")
        with open(latest, "rb") as f:   # VERL writes the number alone
            text = f.read(64).decode("utf-8", "replace").strip()
        if not is_decimal(text) or int(text) > STEPS_MAX:
            raise ConvertError(f"{latest}: expected a step number in 0..{STEPS_MAX}, got "
                               f"{text[:40]!r}")
        step_dir = src / f"global_step_{int(text)}"
        if not step_dir.is_dir():
            raise ConvertError(f"{latest}: names step {text} but {step_dir} does not exist")
        if not (_has_rank_files(step_dir) or _has_rank_files(step_dir / "actor")):
            raise ConvertError(f"{latest}: names step {text} but {step_dir} holds no VERL rank "
                               f"files (model_world_size_W_rank_R.pt), here or in actor/")
        inner = find_verl(step_dir)
        return dataclasses.replace(inner, kind="run", source=src)
    if _has_rank_files(src):
        kind = "actor" if src.name == "actor" else "flattened"
    elif _has_rank_files(src / "actor"):
        kind, shard_dir = "step", src / "actor"
    else:
        hint = (f" ({src} is the model-config folder of the VERL checkpoint {src.parent}: "
                "convert that)" if src.name == "huggingface" and _has_rank_files(src.parent) else "")
        raise ConvertError(
            f"{src}: no VERL rank files (model_world_size_W_rank_R.pt) here or in {src / 'actor'}, "
            f"and no latest_checkpointed_iteration.txt{hint}"
        )
    named = shard_dir.parent if kind in ("step", "actor") else src
    step_match = _STEP_DIR.search(named.name)
    if step_match and int(step_match.group(1)) > STEPS_MAX:
        raise ConvertError(f"{named}: global step {step_match.group(1)} is over {STEPS_MAX} (the "
                           "step counters are int32)")
    world_size, kinds = _check_rank_files(shard_dir)
    _check_fsdp_config(shard_dir / "fsdp_config.json", world_size)
    hf = shard_dir / "huggingface"
    return VerlLayout(kind=kind, source=src, shard_dir=shard_dir,
                      hf_dir=hf if (hf / "config.json").is_file() else None,
                      global_step=int(step_match.group(1)) if step_match else None,
                      world_size=world_size, kinds=kinds)


def looks_like_verl(path: Path) -> bool:
    """Whether `path` holds what `find_verl` starts from: rank files (here or in actor/) or a
    run's latest_checkpointed_iteration.txt (names only; nothing is checked)."""
    return (_has_rank_files(path) or _has_rank_files(path / "actor")
            or os.path.lexists(path / "latest_checkpointed_iteration.txt"))


def _has_rank_files(d: Path) -> bool:
    return d.is_dir() and any(_RANK_FILE.match(p.name) for p in d.iterdir())


def _check_rank_files(d: Path) -> tuple[int, tuple[str, ...]]:
    found: dict[str, dict[int, set[int]]] = {}
    for p in d.iterdir():
        m = _RANK_FILE.match(p.name)
        if m:
            if not all(_CANONICAL.fullmatch(n) for n in m.group(2, 3)):
                raise ConvertError(
                    f"{p}: not a rank file name VERL writes (world size and rank are plain "
                    f"decimals without leading zeros: {m.group(1)}_world_size_{int(m.group(2))}_rank_"
                    f"{int(m.group(3))}.pt); remove or rename it, it would count as that rank")
            found.setdefault(m.group(1), {}).setdefault(int(m.group(2)), set()).add(int(m.group(3)))
    sizes = {w for per_kind in found.values() for w in per_kind}
    if len(sizes) != 1:
        raise ConvertError(f"{d}: rank files for several world sizes {sorted(sizes)}; keep one")
    (world_size,) = sizes
    if world_size > MAX_WORLD_SIZE:   # before anything counts up to W
        kind, per_kind = next(iter(found.items()))
        f = d / f"{kind}_world_size_{world_size}_rank_{min(per_kind[world_size])}.pt"
        raise ConvertError(f"{f}: world size {world_size:,} is above {MAX_WORLD_SIZE:,}, the most "
                           "a VERL checkpoint is written for (three files a rank)")
    if "model" not in found:
        raise ConvertError(f"{d}: no model_world_size_{world_size}_rank_*.pt files")
    for kind, per_kind in found.items():
        ranks = per_kind[world_size]
        inside = sorted(r for r in ranks if r < world_size)
        if len(inside) < world_size:   # the first few absent ranks, found among len(ranks) + 3
            missing = [r for r in range(min(world_size, len(inside) + 3)) if r not in ranks]
            raise ConvertError(
                f"{d / f'{kind}_world_size_{world_size}_rank_{missing[0]}.pt'}: missing "
                f"({world_size - len(inside)} of {world_size} {kind} rank files absent: "
                f"rank{'s' if world_size - len(inside) > 1 else ''} {', '.join(map(str, missing))}{', ...' if world_size - len(inside) > len(missing) else ''})"
            )
        extra = sorted(r for r in ranks if r >= world_size)
        if extra:
            raise ConvertError(
                f"{d / f'{kind}_world_size_{world_size}_rank_{extra[0]}.pt'}: rank {extra[0]} "
                f"is outside world size {world_size}"
            )
    for kind in found:   # complete archives, whichever kinds the direction reads
        for rank in range(world_size):
            check_torch_zip(d / f"{kind}_world_size_{world_size}_rank_{rank}.pt")
    return world_size, tuple(k for k in KINDS if k in found)


SHARD_DTYPES = ("float32", "bfloat16", "float16")   # what a VERL run saves weights and moments in


def _check_float(f: Path, key: str, t: Any, first: Any) -> None:
    """Refuse a shard that is not float32, bfloat16 or float16, or whose dtype differs from
    rank 0's (`first`; None on rank 0): one tensor is saved in one dtype on every rank."""
    if str(t.dtype).removeprefix("torch.") not in SHARD_DTYPES:
        raise ConvertError(f"{f}: {key} has dtype {t.dtype}; weights and AdamW moments are "
                           f"{', '.join(SHARD_DTYPES)}")
    if first is not None and t.dtype != first.dtype:
        raise ConvertError(f"{f}: {key} has dtype {t.dtype} on this rank but {first.dtype} on "
                           "rank 0")


def _check_dense(f: Path, key: str, t: Any) -> None:
    """Refuse a tensor that is not contiguous or whose storage does not hold all of it: an
    expanded view (stride 0) of a few bytes would be read as gigabytes, and torch.save writes
    every saved shard dense (FSDP2's locals, Shard(1) ones included, and replicated tensors)."""
    need = (t.storage_offset() + t.numel()) * t.element_size()
    if not t.is_contiguous():
        raise ConvertError(f"{f}: {key} is not contiguous (strides {tuple(t.stride())} for shape "
                           f"{tuple(t.shape)}); a saved shard holds each element once")
    if t.untyped_storage().nbytes() < need:
        raise ConvertError(f"{f}: {key} needs {need:,} bytes of storage from its offset, the file "
                           f"holds {t.untyped_storage().nbytes():,}")


def _check_optim_structure(f: Path, sd: dict) -> None:
    """Refuse an optimizer file whose `state` / `param_groups` are not torch AdamW's shapes:
    state {int index: {"exp_avg", "exp_avg_sq", "step": a finite number}}, param_groups
    [{"params": [int, ...], ...}] without AMSGrad or `maximize` (their state or sign is not
    AdamW's, which jscenegen keeps)."""
    import torch

    groups, state = sd["param_groups"], sd["state"]
    if not isinstance(groups, list) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list)
            and all(isinstance(i, int) and not isinstance(i, bool) for i in g["params"])
            for g in groups):
        raise ConvertError(f"{f}: param_groups must be a list of dicts, each with a list of "
                           "integer parameter indices under 'params'")
    _check_json_size(f, "param_groups", groups)
    for g, group in enumerate(groups):
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ConvertError(f"{f}: param_groups[{g}].{flag} is {group[flag]!r:.20}; only "
                                   "plain AdamW state (exp_avg, exp_avg_sq, step) converts")
    if not isinstance(state, dict):
        raise ConvertError(f"{f}: state is a {type(state).__name__}, expected a dict of "
                           "parameter index -> AdamW state")
    for i, st in state.items():
        if not isinstance(i, int) or isinstance(i, bool):
            raise ConvertError(f"{f}: state key {i!r} is not a parameter index")
        if not isinstance(st, dict) or not {"exp_avg", "exp_avg_sq", "step"} <= set(st):
            raise ConvertError(f"{f}: state[{i}] lacks exp_avg/exp_avg_sq/step; not a torch "
                               "AdamW state")
        if other := sorted(set(st) - {"exp_avg", "exp_avg_sq", "step"}, key=str):
            raise ConvertError(f"{f}: state[{i}] also holds {str(other)[:80]} (AMSGrad keeps "
                               "max_exp_avg_sq); only plain AdamW state converts")
        step = st["step"]
        if isinstance(step, torch.Tensor):
            step = step.item() if step.numel() == 1 else None
        if not finite_number(step):
            raise ConvertError(f"{f}: state[{i}].step is {st['step']!r:.80}, expected one finite "
                               "number")


# what VERL's BaseCheckpointManager.load_rng_state reads from `rng` without a fallback, besides
# rng[get_device_name()] on a GPU run (verl/utils/checkpoint/checkpoint_manager.py); its
# FSDPCheckpointManager.load_checkpoint skips a missing `rng` altogether
RNG_REQUIRED = ("cpu", "numpy", "random")


def check_extra_state(f: Path, st: dict) -> None:
    """Refuse VERL extra state whose scheduler or RNG states are not the shapes torch, numpy
    and Python write (verl/utils/checkpoint/checkpoint_manager.py: get_rng_state), or whose
    `rng` lacks one of `RNG_REQUIRED` (VERL's resume would raise KeyError). Raises
    ConvertError naming `f` and the key."""
    import torch

    sched = st.get("lr_scheduler")
    if sched is not None:
        if not isinstance(sched, dict):
            raise ConvertError(f"{f}: lr_scheduler is a {type(sched).__name__}, expected a "
                               "scheduler state_dict")
        _check_json_size(f, "lr_scheduler", sched)
        epoch = sched.get("last_epoch")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch <= STEPS_MAX:
            raise ConvertError(f"{f}: lr_scheduler.last_epoch is {epoch!r:.80}, expected an integer "
                               f"in 0..{STEPS_MAX} (the steps a torch scheduler state_dict has "
                               "taken; a train state counts them in int32)")
    rng = st.get("rng")
    if rng is None:
        return
    if not isinstance(rng, dict):
        raise ConvertError(f"{f}: rng is a {type(rng).__name__}, expected a dict")
    for key in RNG_REQUIRED:
        if key not in rng:
            raise ConvertError(f"{f}: rng has no {key!r} state ({', '.join(map(repr, sorted(rng)))} "
                               f"only); VERL saves and, on resume, restores {', '.join(RNG_REQUIRED)} "
                               "(and its device's) without a fallback")
    for dev, state in rng.items():
        if dev == "numpy":
            ok = (isinstance(state, tuple) and len(state) == 5 and state[0] == "MT19937"
                  and isinstance(state[1], np.ndarray) and state[1].dtype.kind in "iu"
                  and state[1].shape == (MT19937_WORDS,)
                  and all(isinstance(x, (int, float)) for x in state[2:]))
            what = (f"numpy.random.get_state()'s 5-tuple ('MT19937', {MT19937_WORDS} key words, "
                    "pos, has_gauss, gauss)")
        elif dev == "random":
            ok = (isinstance(state, tuple) and len(state) == 3 and isinstance(state[1], tuple)
                  and len(state[1]) == MT19937_WORDS + 1 and all(isinstance(x, int) for x in state[1]))
            what = f"random.getstate()'s 3-tuple (version, {MT19937_WORDS + 1} ints, gauss)"
        else:
            size = TORCH_RNG_BYTES.get(dev)
            ok = (isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.ndim == 1
                  and (size is None or state.numel() == size))
            what = (f"a torch uint8 generator state of {size} bytes (torch.{dev}.get_rng_state())"
                    if size else "a torch uint8 generator state")
        if not ok:
            raise ConvertError(f"{f}: rng[{dev!r}] is not {what}")


JSON_VALUES_MAX, JSON_DEPTH_MAX = 100_000, 6
MT19937_WORDS = 624          # numpy's and Python's Mersenne Twister state
# torch generator states by device: CPU a Mersenne Twister (5,056 bytes), CUDA Philox seed and
# offset (16 bytes); torch.set_rng_state refuses any other size, so a resume would fail
TORCH_RNG_BYTES = {"cpu": 5056, "cuda": 16}


def _check_json_size(f: Path, label: str, obj: Any) -> None:
    """Refuse `obj` (the optimizer's param_groups, the scheduler's state: what a conversion
    copies into JSON metadata) when written out as a tree it holds more than JSON_VALUES_MAX
    values or nests deeper than JSON_DEPTH_MAX: a pickle can share one list many times over, a
    few KB that every tree walk (redaction, JSON) would expand exponentially."""
    count, stack = 0, [(obj, 0)]
    while stack:
        node, level = stack.pop()
        count += 1
        if count > JSON_VALUES_MAX or level > JSON_DEPTH_MAX:
            raise ConvertError(f"{f}: {label} holds more than {JSON_VALUES_MAX:,} values or nests "
                               f"deeper than {JSON_DEPTH_MAX} levels when written out; not what "
                               "torch saves")
        if isinstance(node, dict):
            stack.extend((v, level + 1) for v in node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend((v, level + 1) for v in node)


def _same_state(a: Any, b: Any) -> bool:
    """Whether two pickled states (a scheduler's state_dict) are equal: tensors bit for bit
    with their shape and dtype (`==` on a tensor of several values raises), containers item
    by item, other values as printed (a NaN equals a NaN)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(_bits(a), _bits(b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same_state(x, y) for x, y in zip(a, b)))
    return repr(a) == repr(b)


def _impossible_moment(moment: str) -> Callable[[np.ndarray], str | None]:
    """The check of one AdamW moment's values: finite, and exp_avg_sq (a mean of squares)
    never negative; a first update would make NaN of either."""
    def check(a: np.ndarray) -> str | None:
        if not np.isfinite(a).all():
            return f"holds a non-finite value ({a[~np.isfinite(a)].flat[0]})"
        if moment == "exp_avg_sq" and not (a >= 0).all():
            return f"holds a negative value ({a[a < 0].flat[0]}); a mean of squares is >= 0"
        return None
    return check


def _group_difference(groups: list[dict], reference: list[dict]) -> str | None:
    """Where optimizer `param_groups` differ from `reference` ("param_groups[0].lr (0.5 vs
    0.001)"), or None when equal (compared as printed: a NaN equals a NaN; a non-finite
    setting is refused where the settings are recorded)."""
    if len(groups) != len(reference):
        return f"param_groups ({len(groups)} groups vs {len(reference)})"
    for g, (mine, theirs) in enumerate(zip(groups, reference)):
        for key in sorted(set(mine) | set(theirs)):
            if repr(mine.get(key)) != repr(theirs.get(key)):
                return (f"param_groups[{g}].{key} ({clip_text(repr(mine.get(key)), 60)} vs "
                        f"{clip_text(repr(theirs.get(key)), 60)})")
    return None


def _bits(t: Any) -> Any:
    """A tensor's bytes as a flat uint8 tensor (compared bit for bit: unlike values, a NaN
    equals itself and -0.0 differs from 0.0)."""
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def _check_fsdp_config(f: Path, world_size: int) -> None:
    if not os.path.lexists(f):
        return  # checkpoints before VERL 0.4.1 lack it; the file names carry W
    cfg = read_json_object(f, ConvertError)
    if "world_size" not in cfg:
        raise ConvertError(f"{f}: no world_size key (the rank files say {world_size})")
    if type(cfg["world_size"]) is not int:
        raise ConvertError(f"{f}: world_size must be an integer, got {json.dumps(cfg['world_size'])}")
    if cfg["world_size"] != world_size:
        raise ConvertError(
            f"{f}: world_size {cfg['world_size']} contradicts the rank files "
            f"(*_world_size_{world_size}_rank_*.pt)"
        )
    if cfg.get("FSDP_version", 2) != 2:
        raise ConvertError(f"{f}: FSDP_version {cfg.get('FSDP_version')!r}; only FSDP2 is supported")


def mesh_info(mesh: Any) -> dict[str, Any]:
    """{"dim_names", "sizes", "device_type", "rank", "coordinate"} of an unpickled DeviceMesh.

    Read from the pickled `__dict__` so that meshes pickled by other torch versions work:
    torch 2.13 stores `_layout`/`_mesh_dim_names`/`_device_type`, older torch a `mesh` rank
    tensor and plain `mesh_dim_names`/`device_type` attributes. `rank` (the global rank that
    pickled it) and `coordinate` (its place on the mesh) are None where torch did not store them.
    """
    d = mesh.__dict__
    names = d.get("_mesh_dim_names", d.get("mesh_dim_names"))
    device_type = d.get("_device_type", d.get("device_type"))
    old = d.get("mesh")
    if old is not None and hasattr(old, "shape"):
        sizes = tuple(int(n) for n in old.shape)
    else:
        sizes = tuple(int(mesh.size(i)) for i in range(mesh.ndim))
    coord = d.get("_coordinate_on_dim")
    return {"dim_names": tuple(names) if names else None, "sizes": sizes, "device_type": device_type,
            "rank": d.get("_rank"), "coordinate": tuple(int(c) for c in coord) if coord else None}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One state-dict entry: global shape, dtype name, shard dim (None = plain/replicated)."""

    shape: tuple[int, ...]
    dtype: str
    shard_dim: int | None


class VerlCheckpoint:
    """A VERL checkpoint opened for streaming reads.

    `param_order`: HF names in `module.parameters()` order (tied head counted once), which is
    the optimizer's integer index order: the model files' key order (`_file_order`), whose names
    must be those of `convert.tensor_sets.verl_shapes` of the config in
    `huggingface/config.json` (or `hf_dir`); `shapes` lists them in that order. For
    Qwen3.5 that includes the vision tower (VERL trains the vision-language class), never
    `mtp.*` (see convert/carried.py for where those come from).

    Adam state may cover only some parameters: torch AdamW keeps `state` entries only for
    parameters it stepped, while VERL builds it over all `module.parameters()`, so a frozen
    vision tower (VERL's `freeze_vision_tower`) has indices in `param_groups` and no state.
    `trainable` lists the parameters with state, `frozen` the others.
    """

    def __init__(self, path: str | Path, hf_dir: str | Path | None = None):
        from jscenegen.model.config import ModelConfigError, QwenConfig

        self.layout = find_verl(path)
        self._crcs: dict[tuple[str, int], StorageCrcs] = {}   # per loaded model/optim file
        hf = Path(hf_dir) if hf_dir is not None else self.layout.hf_dir
        if hf is None:
            where = self.layout.shard_dir / "huggingface"
            if not os.path.lexists(where):
                state = "missing"
            elif where.is_dir():
                config = where / "config.json"
                state = ("no config.json" if not os.path.lexists(config)
                         else f"config.json {not_a_file(config)}")
            else:
                state = f"{not_a_file(where) or 'is a file'}, not a directory"
            raise ConvertError(
                f"{where}: {state}; VERL's checkpoint manager saves the model's config there, "
                "and the parameters are named by it: copy the model's config.json (and "
                "tokenizer) into that directory")
        self.hf_dir = hf
        try:
            self.config = QwenConfig.from_dir(hf)
        except ModelConfigError as err:
            raise ConvertError(str(err)) from None
        self.shapes = verl_shapes(self.config)
        self.tied = self.config.tie_word_embeddings
        self.embedding = embedding_name(self.config)
        self._check_keys()
        self.param_order = self._file_order()
        self.shapes = {n: self.shapes[n] for n in self.param_order}
        self._check_owners()
        self.check_tensors()

    # ---- files -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def _load(self, kind: str, rank: int) -> Any:
        f = self.layout.rank_file(kind, rank)
        obj = load_pt(f)
        if kind in ("model", "optim"):
            self._crcs[(kind, rank)] = StorageCrcs(f, obj)
        return obj

    @cached_property
    def _model_files(self) -> list[dict[str, Any]]:
        files = []
        for r in range(self.world_size):
            sd = self._load("model", r)
            if not isinstance(sd, dict):
                raise ConvertError(f"{self.layout.rank_file('model', r)}: expected a state dict, "
                                   f"got {type(sd).__name__}")
            files.append(sd)
        return files

    def _check_keys(self) -> None:
        expected = set(self.shapes) | ({"lm_head.weight"} if self.tied else set())
        for r, sd in enumerate(self._model_files):
            keys = set(sd)
            if keys != expected:
                missing, unexpected = sorted(expected - keys), sorted(keys - expected)
                raise ConvertError(
                    f"{self.layout.rank_file('model', r)}: keys do not match {self.hf_dir / 'config.json'}"
                    f" (missing {missing[:5]}, unexpected {unexpected[:5]})"
                )

    def _file_order(self) -> list[str]:
        """The parameter names in the order of the model files' keys, the tied `lm_head.weight`
        alias left out: torch's `module.parameters()` order, by which VERL's AdamW state and
        `param_groups` index the parameters (`model.state_dict()` lists each module's parameters
        in that order, and `parameters()` counts a tied one once, at its first name). Every
        rank's file must list the keys in rank 0's order (ConvertError naming the file and the
        first position that differs). When it is not the order of jscenegen's weight table for
        the config (another transformers version, a patched model), the file's order is used and
        a ConversionWarning names the file and the first differing position."""
        orders = [[k for k in sd if not (self.tied and k == "lm_head.weight")]
                  for sd in self._model_files]
        for r, order in enumerate(orders[1:], 1):
            if order != orders[0]:
                i = next(i for i, (a, b) in enumerate(zip(order, orders[0])) if a != b)
                raise ConvertError(
                    f"{self.layout.rank_file('model', r)}: key {i} is {order[i]}, rank 0's "
                    f"{orders[0][i]}; every rank saves the same module's state_dict, in one order")
        table = list(self.shapes)
        if orders[0] != table:
            i = next(i for i, (a, b) in enumerate(zip(orders[0], table)) if a != b)
            warnings.warn(ConversionWarning(
                f"{self.layout.rank_file('model', 0)}: parameter {i} is {orders[0][i]} where "
                f"jscenegen's weight table for this config has {table[i]}: the AdamW state is "
                "indexed in the file's order (torch's module.parameters()), as read here; VERL "
                "files written from an orbax or HF source follow the table's order"), stacklevel=3)
        return orders[0]

    def _check_owners(self) -> None:
        """Before any tensor is read: every rank file's first DTensor (model, and the first
        moment of an optim file) was saved by the rank the file is named for (`_shard_dim`)."""
        from torch.distributed.tensor import DTensor

        for r, sd in enumerate(self._model_files):
            key, t = next(((k, v) for k, v in sd.items() if isinstance(v, DTensor)), (None, None))
            if t is not None:
                self._shard_dim(self.layout.rank_file("model", r), key, t, rank=r)
        if "optim" not in self.layout.kinds:
            return
        for r, sd in enumerate(self._optim_files):
            moments = ((f"state[{i}].{m}", v) for i, st in sd["state"].items()
                       for m, v in (st.items() if isinstance(st, dict) else ())
                       if isinstance(v, DTensor))
            key, t = next(moments, (None, None))
            if t is not None:
                self._shard_dim(self.layout.rank_file("optim", r), key, t, rank=r)

    # ---- reassembly --------------------------------------------------------------------
    def _gather(self, kind: str, key: str, entries: list[Any], shape: tuple[int, ...],
                check: Callable[[np.ndarray], str | None] | None = None) -> np.ndarray:
        """Reassemble one tensor from its per-rank entries (DTensor or plain tensor); `check`
        (a rank's values -> why they are impossible, or None) is applied to each rank's part,
        a failure raising ConvertError naming that rank's file."""
        from torch.distributed.tensor import DTensor

        if not isinstance(entries[0], DTensor):
            return self._gather_plain(kind, key, entries, shape, check)
        dim, locals_ = self._local_shards(kind, key, entries, shape)
        if dim is None:   # Replicate: rank 0's copy is the tensor
            a = self._check_values(kind, key, 0, entries[0]._local_tensor, check)
            self._check_replicas(kind, key, [e._local_tensor for e in entries])
            return np.array(a)
        full = np.empty(shape, dtype=to_numpy(locals_[0]).dtype)
        start = 0
        for r, t in enumerate(locals_):  # shard by shard: one sequential bulk read each, then release it
            storage = t.untyped_storage()
            pages.will_need(storage.data_ptr(), storage.nbytes())
            a = self._check_values(kind, key, r, t, check)
            stop = start + a.shape[dim]
            full[(slice(None),) * dim + (slice(start, stop),)] = a
            start = stop
            pages.dont_need(storage.data_ptr(), storage.nbytes())
        return full

    def _local_shards(self, kind: str, key: str, entries: list[Any],
                      shape: tuple[int, ...]) -> tuple[int | None, list[Any]]:
        """(shard dim or None, the local tensors to reassemble) of one DTensor's per-rank
        entries, every rank's placement, global and local shape, dtype, strides and storage
        size checked (metadata only: no data is read)."""
        from torch.distributed.tensor import DTensor

        first = entries[0]
        dim = self._shard_dim(self.layout.rank_file(kind, 0), key, first, rank=0)
        n_shards = mesh_info(first.device_mesh)["sizes"][-1] if dim is not None else 1
        locals_ = []
        for r, t in enumerate(entries):
            f = self.layout.rank_file(kind, r)
            if not isinstance(t, DTensor):
                raise ConvertError(f"{f}: {key} is a plain tensor on this rank but a DTensor on rank 0")
            if tuple(t.shape) != shape:
                raise ConvertError(f"{f}: {key} has global shape {tuple(t.shape)}, expected {shape}"
                                   f"{self.config.assumed_sizes_note()}")
            if self._shard_dim(f, key, t, rank=r) != dim:
                raise ConvertError(f"{f}: {key} placement {t.placements} differs from rank 0's")
            _check_dense(f, key, t._local_tensor)
            if r >= n_shards and dim is None:
                continue   # Replicate(): every copy is compared bit for bit as it is read
            local = t._local_tensor
            want = shape
            if dim is not None:
                lo, hi = chunk_bounds(shape[dim], n_shards, r % n_shards)
                want = shape[:dim] + (hi - lo,) + shape[dim + 1:]
            if tuple(local.shape) != want:
                raise ConvertError(f"{f}: {key} local shard {tuple(local.shape)}, expected {want} "
                                   f"({t.placements} of {shape} over {n_shards} ranks)")
            _check_float(f, key, local, locals_[0] if locals_ else None)
            if r < n_shards:   # HSDP: ranks beyond the first fsdp group hold replicas, not read
                locals_.append(local)
        return dim, locals_

    def check_tensors(self) -> None:
        """Every model entry and AdamW moment checked as reading it would check it, from the
        files' metadata alone (`_local_shards`; plain tensors: type, shape, dtype, strides), and a tied
        `lm_head.weight` equal to the embedding (both read once): a writer that reads lazily
        (orbax) then meets no malformed entry half-way. Raises ConvertError."""
        from torch.distributed.tensor import DTensor

        names = dict(self.shapes)
        if self.tied:
            names["lm_head.weight"] = self.shapes[self.embedding]
        entries = [("model", key, [sd[key] for sd in self._model_files], shape)
                   for key, shape in names.items()]
        if self.has_optimizer():
            for name in self.trainable:
                i = self.param_order.index(name)
                states = [sd["state"].get(i) for sd in self._optim_files]
                for r, st in enumerate(states):
                    if not isinstance(st, dict):
                        raise ConvertError(f"{self.layout.rank_file('optim', r)}: no AdamW "
                                           f"state for index {i} ({name})")
                entries += [("optim", f"state[{i}].{m} ({name})", [st[m] for st in states],
                             self.shapes[name]) for m in ("exp_avg", "exp_avg_sq")]
        for kind, key, values, shape in entries:
            if isinstance(values[0], DTensor):
                self._local_shards(kind, key, values, tuple(shape))
                continue
            for r, t in enumerate(values):
                self._check_plain(self.layout.rank_file(kind, r), key, t, tuple(shape),
                                  values[0] if r else None)
        if self.tied:  # a converted checkpoint keeps one of the two: they must be equal
            from jscenegen.model.hf_io import CheckpointFormatError, check_tied_head

            shape = tuple(self.shapes[self.embedding])
            try:
                check_tied_head(self._read_entry("lm_head.weight", shape),
                                self._read_entry(self.embedding, shape),
                                self.layout.rank_file("model", 0), self.embedding)
            except CheckpointFormatError as err:
                raise ConvertError(str(err)) from None

    def _shard_dim(self, f: Path, key: str, t: Any, rank: int) -> int | None:
        """Shard dim of DTensor `t` (None = Replicate) read from rank file `f` of `rank`.

        Checks the mesh's names and size, and that the DTensor was saved by `rank`: its mesh
        records the rank (and mesh coordinate) that pickled it, and a rank file copied or
        renamed over another holds another rank's shard at another offset.
        """
        from torch.distributed.tensor import Replicate, Shard

        mesh = mesh_info(t.device_mesh)
        names = mesh["dim_names"]
        if names not in (("fsdp",), ("ddp", "fsdp")):
            raise ConvertError(f"{f}: {key} lives on a mesh with dims {names}; only ('fsdp',) "
                               "or HSDP ('ddp', 'fsdp') are supported")
        if math.prod(mesh["sizes"]) != self.world_size:
            raise ConvertError(f"{f}: {key} mesh has {math.prod(mesh['sizes'])} ranks but the "
                               f"checkpoint has {self.world_size} rank files")
        saved_by = mesh["rank"]
        if saved_by is None and mesh["coordinate"] is not None:  # torch without `_rank`
            saved_by = int(np.ravel_multi_index(mesh["coordinate"], mesh["sizes"]))
        if saved_by is not None and saved_by != rank:
            raise ConvertError(
                f"{f}: holds the shard of rank {saved_by} (its DTensor {key} was saved on mesh "
                f"coordinate {mesh['coordinate']}), not of rank {rank}: a rank file copied or "
                f"renamed over another; the set of rank files is inconsistent")
        if len(t.placements) != len(names):
            raise ConvertError(f"{f}: {key} has {len(t.placements)} placements on a mesh of "
                               f"{len(names)} dims")
        if len(t.placements) == 2 and not isinstance(t.placements[0], Replicate):
            raise ConvertError(f"{f}: {key} HSDP placement {t.placements} is not (Replicate, Shard)")
        p = t.placements[-1]
        if isinstance(p, Shard):
            if not 0 <= p.dim < t.ndim:
                raise ConvertError(f"{f}: {key} placement Shard({p.dim}) is outside its "
                                   f"{t.ndim} dimensions")
            return p.dim
        if isinstance(p, Replicate):
            return None
        raise ConvertError(f"{f}: {key} placement {p} is not supported (Shard or Replicate only)")

    def _gather_plain(self, kind: str, key: str, entries: list[Any], shape: tuple[int, ...],
                      check: Callable[[np.ndarray], str | None] | None = None) -> np.ndarray:
        first = entries[0]
        for r, t in enumerate(entries):
            self._check_plain(self.layout.rank_file(kind, r), key, t, shape, first if r else None)
        a = self._check_values(kind, key, 0, first, check)
        self._check_replicas(kind, key, entries)
        return np.array(a)

    def _check_values(self, kind: str, key: str, rank: int, tensor: Any,
                      check: Callable[[np.ndarray], str | None] | None) -> np.ndarray:
        """`tensor` (one rank's local data) as an array, after its CRC-32 and `check`; raises
        ConvertError naming the rank file."""
        self._crcs[(kind, rank)].check(tensor.untyped_storage(), key)
        a = to_numpy(tensor)
        if check is not None and (why := check(a)):
            raise ConvertError(f"{self.layout.rank_file(kind, rank)}: {key} {why}")
        return a

    def _check_replicas(self, kind: str, key: str, copies: list[Any]) -> None:
        """Refuse a replicated tensor (a plain one, or a Replicate() DTensor's local copies)
        whose copy on some rank differs from rank 0's in any bit (a NaN equals the same NaN,
        -0.0 differs from 0.0); when one of the two fails its CRC-32, that file is named
        instead."""
        first, reference = copies[0], _bits(copies[0])
        for r, t in enumerate(copies[1:], 1):
            if (t.dtype, tuple(t.shape)) != (first.dtype, tuple(first.shape)):
                raise ConvertError(f"{self.layout.rank_file(kind, r)}: replicated {key} is "
                                   f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)} where "
                                   f"rank 0's copy is {str(first.dtype).removeprefix('torch.')} "
                                   f"{tuple(first.shape)}")
            if not _bits(t).equal(reference):
                for rank, copy in ((0, copies[0]), (r, t)):
                    self._crcs[(kind, rank)].check(copy.untyped_storage(), key)
                raise ConvertError(f"{self.layout.rank_file(kind, r)}: replicated {key} differs "
                                   "from rank 0's copy")

    @staticmethod
    def _check_plain(f: Path, key: str, t: Any, shape: tuple[int, ...], first: Any) -> None:
        import torch

        if not isinstance(t, torch.Tensor):
            raise ConvertError(f"{f}: {key} is a {type(t).__name__}, expected a tensor")
        if tuple(t.shape) != shape:
            raise ConvertError(f"{f}: {key} has shape {tuple(t.shape)}, expected {shape} "
                               "(plain tensors must be replicated whole on every rank)")
        _check_float(f, key, t, first)
        _check_dense(f, key, t)

    # ---- model -------------------------------------------------------------------------
    def tensor_info(self) -> dict[str, TensorInfo]:
        """{state-dict key: TensorInfo} from rank 0's file (no tensor data read)."""
        from torch.distributed.tensor import DTensor

        out = {}
        for k, t in self._model_files[0].items():
            dim = (self._shard_dim(self.layout.rank_file("model", 0), k, t, rank=0)
                   if isinstance(t, DTensor) else None)
            out[k] = TensorInfo(tuple(t.shape), str(t.dtype).removeprefix("torch."), dim)
        return out

    def placement(self) -> tuple[str, ...]:
        """The VERL placements the files' shard dims fit (`sharding.placement_of` over the
        mesh's fsdp size): "dim0" (VERL 0.9), "first-divisible" (VERL 0.6 - 0.8), both when
        every tensor is on dim 0 and divides by the fsdp size, () when neither explains them or
        every entry is replicated."""
        from torch.distributed.tensor import DTensor

        first = next((t for t in self._model_files[0].values() if isinstance(t, DTensor)), None)
        if first is None:
            return ()
        dims = {k: v.shard_dim for k, v in self.tensor_info().items()}
        return placement_of(self.shapes, dims, mesh_info(first.device_mesh)["sizes"][-1])

    def mesh(self) -> dict[str, Any] | None:
        """The device mesh of rank 0's first DTensor: {"dim_names", "device_type"}, None when
        every entry is a plain tensor."""
        from torch.distributed.tensor import DTensor

        first = next((t for t in self._model_files[0].values() if isinstance(t, DTensor)), None)
        if first is None:
            return None
        info = mesh_info(first.device_mesh)
        return {"dim_names": list(info["dim_names"] or ()), "device_type": info["device_type"]}

    def iter_params(self, *, include_tied_alias: bool = False) -> Iterator[tuple[str, np.ndarray]]:
        """Yield (hf_name, full array) in parameter order, one tensor in memory at a time.

        Arrays keep the file's dtype (fp32 master weights; bf16 as ml_dtypes.bfloat16) and the
        HF shape. With tied embeddings the `lm_head.weight` alias is yielded last only when
        `include_tied_alias` (checked equal to the embedding). Raises ConvertError on any
        shape, placement or shard-size mismatch, naming the rank file.
        """
        for name, shape in self.shapes.items():
            yield name, self.read_param(name, shape)
        if self.tied and include_tied_alias:
            yield "lm_head.weight", self._read_entry("lm_head.weight", self.shapes[self.embedding])

    def read_param(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The full array of one model entry."""
        shape = tuple(shape or self.shapes[name])
        return self._read_entry(name, shape)

    def _read_entry(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        from convert.finite import note

        array = self._gather("model", name, [sd[name] for sd in self._model_files], shape)
        note(name, array)
        return array

    # ---- optimizer ---------------------------------------------------------------------
    @cached_property
    def _optim_files(self) -> list[dict[str, Any]]:
        if "optim" not in self.layout.kinds:
            raise ConvertError(f"{self.layout.shard_dir}: no optim_world_size_*_rank_*.pt files")
        files = []
        for r in range(self.world_size):
            f = self.layout.rank_file("optim", r)
            sd = self._load("optim", r)
            if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
                raise ConvertError(f"{f}: not a torch optimizer state_dict (needs state, param_groups)")
            _check_optim_structure(f, sd)
            n = len(self.param_order)
            params = [i for g in sd["param_groups"] for i in g.get("params", [])]
            if sorted(params) != list(range(n)):
                raise ConvertError(f"{f}: param_groups cover indices {sorted(params)[:5]}..., "
                                   f"expected 0..{n - 1} for the {n} parameters of the config")
            outside = sorted(set(sd["state"]) - set(range(n)))
            if outside:
                raise ConvertError(f"{f}: optimizer state has index {outside[0]}, outside "
                                   f"0..{n - 1} for the {n} parameters of the config")
            if files and sorted(sd["state"]) != sorted(files[0]["state"]):
                raise ConvertError(f"{f}: optimizer state covers other parameters than rank 0's "
                                   f"({len(sd['state'])} vs {len(files[0]['state'])} entries)")
            if files and (where := _group_difference(sd["param_groups"], files[0]["param_groups"])):
                raise ConvertError(f"{f}: {where} differs from rank 0's (every rank's optimizer "
                                   "holds the same settings; only rank 0's would be kept)")
            files.append(sd)
        return files

    @property
    def trainable(self) -> list[str]:
        """Parameters with AdamW state (all of them unless some were frozen), in index order."""
        return [self.param_order[i] for i in sorted(self._optim_files[0]["state"])]

    @property
    def frozen(self) -> list[str]:
        """Parameters in `param_groups` without AdamW state (a frozen vision tower)."""
        have = set(self._optim_files[0]["state"])
        return [n for i, n in enumerate(self.param_order) if i not in have]

    def has_optimizer(self) -> bool:
        return "optim" in self.layout.kinds

    def iter_adam(self) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
        """Yield (hf_name, exp_avg, exp_avg_sq) of the `trainable` parameters in parameter
        order, full arrays (fp32).

        Index i of torch's AdamW state maps to `param_order[i]` (module.parameters() order).
        """
        for name in self.trainable:
            yield (name, *self.read_adam(name))

    def read_adam(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(exp_avg, exp_avg_sq) of one parameter, reassembled from every optim rank file."""
        return self.read_moment(name, "exp_avg"), self.read_moment(name, "exp_avg_sq")

    def read_moment(self, name: str, moment: str) -> np.ndarray:
        """One AdamW moment ("exp_avg" or "exp_avg_sq") of one parameter, from every optim
        rank file, as float32 (bfloat16 and float16 moments widen exactly)."""
        if moment not in ("exp_avg", "exp_avg_sq"):
            raise ValueError(f"moment must be exp_avg or exp_avg_sq, got {moment!r}")
        i = self.param_order.index(name)
        if i not in self._optim_files[0]["state"]:
            raise ConvertError(f"{self.layout.rank_file('optim', 0)}: {name} (index {i}) has no "
                               "AdamW state (a frozen parameter)")
        states = [sd["state"][i] for sd in self._optim_files]
        for r, st in enumerate(states):
            if not isinstance(st, dict) or not {"exp_avg", "exp_avg_sq", "step"} <= set(st):
                raise ConvertError(f"{self.layout.rank_file('optim', r)}: state {i} ({name}) lacks "
                                   "exp_avg/exp_avg_sq/step; not a torch AdamW state")
        return self._gather("optim", f"state[{i}].{moment} ({name})", [s[moment] for s in states],
                            self.shapes[name], _impossible_moment(moment)).astype(np.float32, copy=False)

    def adam_step(self) -> int:
        """AdamW's `step` (optimizer steps taken), checked equal on every rank and parameter and
        within 0..MAX_ADAM_COUNT (the orbax store's int32 count)."""
        from jscenegen.checkpoint.store import MAX_ADAM_COUNT

        step = None
        for r, sd in enumerate(self._optim_files):
            for i, st in sd["state"].items():
                this = float(st["step"])   # one finite number (_check_optim_structure)
                if step is None:
                    step, first = this, f"rank 0's state[{i}]"
                elif this != step:
                    raise ConvertError(f"{self.layout.rank_file('optim', r)}: state[{i}].step "
                                       f"({self.param_order[i]}) is {this:g}, {first} {step:g}; "
                                       "every parameter of every rank takes the same AdamW steps")
        if step is None:
            raise ConvertError(f"{self.layout.rank_file('optim', 0)}: no AdamW state (no "
                               "parameter has taken an optimizer step)")
        if step != int(step):
            raise ConvertError(f"{self.layout.rank_file('optim', 0)}: step {step} is not an integer")
        if not 0 <= step <= MAX_ADAM_COUNT:
            raise ConvertError(f"{self.layout.rank_file('optim', 0)}: step {int(step)} is outside "
                               f"0..{MAX_ADAM_COUNT} (an orbax checkpoint stores AdamW's count "
                               "as int32)")
        return int(step)

    def param_groups(self, *, one_setting: bool = True) -> list[dict[str, Any]]:
        """Rank 0's `param_groups` (lr, betas, eps, weight_decay, ..., initial_lr, params).
        With `one_setting` (what converting the AdamW state needs) raises ConvertError naming
        the file and key when the groups differ in anything but their params: jscenegen trains
        every parameter with one AdamW setting. The weights alone (`--to hf`) never ask."""
        groups = [dict(g) for g in self._optim_files[0]["param_groups"]]
        if one_setting and (where := differing_param_group(groups)):
            raise ConvertError(f"{self.layout.rank_file('optim', 0)}: {where}; jscenegen trains "
                               "every parameter with one AdamW setting, so groups that differ in "
                               "anything but their params cannot be converted (--to hf takes "
                               "the weights alone)")
        return groups

    def check_json_ready(self) -> None:
        """Refuse, naming the rank file and key path, a value JSON cannot hold (a tensor, a
        NaN) in `param_groups` or the scheduler state: what `--to orbax` copies into
        training_metadata.json (rank 0's; every rank's equal it, checked as they are read).
        The directions that carry them by pickle (`--to verl`) or not at all (`--to hf`) take
        them as torch saved them."""
        from jscenegen.checkpoint.store import first_unserialisable

        held = []
        if self.has_optimizer():
            held.append((self.layout.rank_file("optim", 0), "param_groups", self.param_groups()))
        if "extra_state" in self.layout.kinds:
            held.append((self.layout.rank_file("extra_state", 0), "lr_scheduler",
                         self.extra_states()[0].get("lr_scheduler")))
        for f, label, obj in held:
            if where := first_unserialisable(obj, label):
                raise ConvertError(f"{f}: {where}; a conversion to orbax copies {label} into "
                                   "JSON metadata (plain dicts, lists, finite numbers, strings)")

    # ---- extra state -------------------------------------------------------------------
    def extra_states(self) -> list[dict[str, Any]]:
        """Per-rank `{"lr_scheduler": state_dict or None, "rng": {...}}` (checked structure)."""
        if "extra_state" not in self.layout.kinds:
            raise ConvertError(f"{self.layout.shard_dir}: no extra_state_world_size_*_rank_*.pt files")
        out = []
        for r in range(self.world_size):
            f = self.layout.rank_file("extra_state", r)
            st = self._load("extra_state", r)
            if not isinstance(st, dict) or not set(st) <= {"lr_scheduler", "rng"}:
                raise ConvertError(f"{f}: expected keys lr_scheduler, rng; got "
                                   f"{sorted(st) if isinstance(st, dict) else type(st).__name__}")
            check_extra_state(f, st)
            if out and not _same_state(st.get("lr_scheduler"), out[0].get("lr_scheduler")):
                raise ConvertError(f"{f}: lr_scheduler differs from rank 0's (every rank steps "
                                   "the same schedule)")
            out.append(st)
        return out

    def scheduler_step(self) -> int | None:
        """The LR scheduler's `last_epoch` (= global steps taken), None without extra state
        files or scheduler state."""
        if "extra_state" not in self.layout.kinds:
            return None
        sched = self.extra_states()[0].get("lr_scheduler")
        if not sched:
            return None
        return int(sched["last_epoch"])

    def run_train_state(self) -> dict[str, Any] | None:
        """Our trainer's train state of this step, from `RUN_STATE_FILE` beside the rank files
        (written by `export` and `convert --to verl` from one of our checkpoints), or None when
        there is none or it names another global step or LR count than these files (a step
        VERL trained on from it: warned). Raises ConvertError naming the file and key when it
        is not a regular file, over 1 MiB, not JSON or not a train state
        (`checkpoint.resume.check_run_identity`)."""
        f = self.layout.shard_dir / RUN_STATE_FILE
        if not os.path.lexists(f):
            return None
        if not f.is_file():
            raise ConvertError(f"{f}: not a regular file (the run's train state is a JSON file)")
        if f.stat().st_size > MAX_RUN_STATE_BYTES:
            raise ConvertError(f"{f}: {f.stat().st_size:,} bytes; a train state is about 1 KB")
        doc = read_json_object(f, ConvertError)
        if not has_run_identity(doc):
            raise ConvertError(f"{f}: not a jscenegen train state (an object with keys "
                               f"{', '.join(RUN_IDENTITY_KEYS)})")
        try:
            check_run_identity(doc)
        except ValueError as err:
            raise ConvertError(f"{f}: {err}") from None
        step, sched = self.global_step(), self.scheduler_step()
        lr_step = step if sched is None else sched
        if (doc["schedule"]["attempts"], doc["lr_step"]) != (step, lr_step):
            warnings.warn(ConversionWarning(
                f"{f}: names step {doc['schedule']['attempts']} (LR count {doc['lr_step']}), not "
                f"this checkpoint's {step} ({lr_step}); ignored: the run's identity (hashes, "
                "schedule position) is not carried and a resume starts the schedule at the "
                "global step"), stacklevel=2)
            return None
        return doc

    def global_step(self) -> int:
        """The trainer's global step: N of a `global_step_N` directory, else the scheduler's
        `last_epoch`, else AdamW's step (VERL takes one of each per update), else 0."""
        if self.layout.global_step is not None:
            return self.layout.global_step
        sched = self.scheduler_step()
        if sched is not None:
            return sched
        return self.adam_step() if self.has_optimizer() else 0
