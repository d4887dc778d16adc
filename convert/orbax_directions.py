"""Conversions to and from jscenegen's orbax training checkpoints (jscenegen/checkpoint/store.py).

An orbax output DST is a checkpoint directory (what `CheckpointStore(DST)` manages) holding
one step, `DST/<N>/`, plus `DST/checkpoint-layout.json` and `DST/checksums.json` (the step has
its own checksums.json, which restore verifies). An orbax source is a step directory, or a
checkpoint directory or a training run's directory (its newest complete step is used).

What carries over (../shared/specs/verl-checkpoint.md, "What a converter must guarantee"):
- params {hf_name: array}, logical shapes, the source dtype (fp32 master weights): every
  tensor of the weight table (`tensor_sets.hf_shapes`), Qwen3.5's vision tower and `mtp.*`
  included; `mtp.*`, which VERL files cannot hold, come from `carried_from` or the VERL
  checkpoint's `huggingface/` weights, or are dropped with a warning (convert/carried.py);
- Adam: torch `exp_avg` -> `mu`, `exp_avg_sq` -> `nu`, `step` -> `count` (bitwise), for the
  parameters torch kept state for (`trainable`; a frozen vision tower has none, and the
  store's `training_metadata.json` lists it under `frozen_tensors`); back to VERL, those get
  state again and the frozen ones an index in `param_groups` only, as torch saves them;
- the LR scheduler's `last_epoch` (global steps) -> train_state["lr_schedule_count"], the
  global step -> the checkpoint step and train_state["step"];
- what has no JAX counterpart is kept verbatim in training_metadata.json["source"]["verl"]:
  torch AdamW param_groups, the LambdaLR state, and every rank's RNG state (torch CPU state as
  hex, numpy MT19937, python random). JAX keys cannot continue torch's random streams; going
  back to VERL with the same world size restores them exactly, otherwise rank 0's state is
  used for every rank.
"""
from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np

from convert.directions import VerlState, copy_hf_metadata, sliced, write_verl_run
from convert.errors import ConversionWarning, ConvertError, require_source_dir
from convert.layout import write_layout
from convert.safetensors_io import SafetensorsReader
from convert.tensor_sets import (
    carried_names,
    fix_config_file,
    hf_shapes,
    text_weights_dtype,
    verl_shapes,
    with_tensors,
)
from convert.tensors import cast, lazy_cast, warn_rounded_masters
from convert.verl_read import VerlCheckpoint
from convert.verl_write import AdamSource, adamw_param_groups, lambda_lr_state
from jscenegen.checkpoint.checksums import write_checksums
from jscenegen.lr_schedule import lr_lambda
from jscenegen.model.safetensors_stream import write_safetensors_streaming
from jscenegen.paths import atomic_dir, not_a_file


# ---------------------------------------------------------------- torch extra state <-> JSON
def extra_state_to_json(extra: dict[str, Any]) -> dict[str, Any]:
    """One rank's VERL extra state as JSON-able data (lossless for the types VERL writes)."""
    rng = extra.get("rng") or {}
    out: dict[str, Any] = {"lr_scheduler": extra.get("lr_scheduler"), "rng": {}}
    for dev, state in rng.items():
        if dev == "numpy":
            kind, mt, pos, has_gauss, cached = state
            out["rng"]["numpy"] = {"kind": kind, "mt": np.asarray(mt).astype(int).tolist(),
                                   "pos": int(pos), "has_gauss": int(has_gauss),
                                   "cached_gaussian": float(cached)}
        elif dev == "random":
            version, internal, gauss = state
            out["rng"]["random"] = {"version": version, "internal": list(internal), "gauss": gauss}
        else:  # "cpu", "cuda", ...: torch ByteTensors
            out["rng"][dev] = {"torch_uint8_hex": bytes(state.numpy().tobytes()).hex()}
    if out["lr_scheduler"] is not None:
        out["lr_scheduler"] = {k: (list(v) if isinstance(v, tuple) else v)
                               for k, v in out["lr_scheduler"].items()}
    return out


def extra_state_from_json(doc: dict[str, Any]) -> dict[str, Any]:
    """Inverse of `extra_state_to_json`: the objects torch.save writes for VERL."""
    import torch

    rng: dict[str, Any] = {}
    for dev, state in (doc.get("rng") or {}).items():
        if dev == "numpy":
            rng["numpy"] = (state["kind"], np.asarray(state["mt"], dtype=np.uint32),
                            int(state["pos"]), int(state["has_gauss"]), float(state["cached_gaussian"]))
        elif dev == "random":
            rng["random"] = (state["version"], tuple(state["internal"]), state["gauss"])
        else:
            raw = bytearray.fromhex(state["torch_uint8_hex"])
            rng[dev] = torch.frombuffer(raw, dtype=torch.uint8).clone()
    out: dict[str, Any] = {"lr_scheduler": doc.get("lr_scheduler")}
    if rng:
        out["rng"] = rng
    return out


# ---------------------------------------------------------------- orbax side
def orbax_step_dir(path: str | Path) -> Path:
    """The complete step directory at `path`: itself, or the newest complete step under it or
    under its `checkpoints/` (a training run's directory); one ConversionWarning names every
    newer step it skips and why.

    Raises ConvertError naming the directory when no complete step (checksums verified) exists,
    naming the file when one of the step's model files is unusable (`check_asset_files`), and
    naming the file and entry when the checkpoint directory's `checksums.json` (a converter's
    output lists the step there) fails or cannot be read (`verify_orbax_step`).
    """
    from convert.dispatch import verify_orbax_step
    from jscenegen.checkpoint import store as ckpt
    from jscenegen.model.assets import check_asset_files
    from jscenegen.run_files import RUN_CHECKPOINTS

    path = Path(path)
    require_source_dir(path)
    if not ckpt.step_numbers(path) and (path / RUN_CHECKPOINTS).is_dir():
        path = path / RUN_CHECKPOINTS
    if ckpt.has_step_entries(path):
        status = ckpt.check_step(path)
    else:
        status, skipped = ckpt.newest_complete_step(path)
        if status is None:
            why = (f"; the newest, step {skipped[0].step}: {skipped[0].reason}" if skipped
                   else " (no numbered step directory)")
            raise ConvertError(f"{path}: no complete orbax checkpoint step here{why}")
        if skipped:
            steps = ", ".join(f"step {bad.step} ({bad.reason})" for bad in skipped)
            warnings.warn(f"{path}: skipping {steps}; converting step {status.step}, the newest "
                          "complete one", ConversionWarning, stacklevel=2)
    if not status.valid:
        raise ConvertError(f"{status.path}: not a complete checkpoint ({status.reason})")
    check_asset_files(status.path / ckpt.HF_DIR, ConvertError)   # carried into every output
    verify_orbax_step(status.path)   # against a converter's DST/checksums.json too
    return status.path


def _save_orbax(dst: Path, *, step: int, cfg: Any, hf_dir: Path,
                params: dict[str, np.ndarray], adam: dict[str, Any], trainable: list[str],
                train_state: dict[str, Any], source: dict[str, Any], layout_files: list,
                source_path: str | Path, source_format: str, layout_extra: dict | None = None) -> Path:
    """One orbax step at DST/<step> holding `params` (every tensor of `hf_shapes(cfg)`) and
    Adam moments for `trainable`; `hf/` from `hf_dir`, its config.json made to agree with the
    MTP layers `cfg` carries (`tensor_sets.config_json`)."""
    import tempfile

    from jscenegen.checkpoint.metadata import training_metadata
    from jscenegen.checkpoint.resume import has_run_identity
    from jscenegen.checkpoint.store import CheckpointError, CheckpointStore
    from jscenegen.model.assets import TOKENIZER_FILES

    # the store checks its assets copy (a temporary directory); name the user's directory
    for name in TOKENIZER_FILES:   # one that is there but cannot be read is named
        if os.path.lexists(hf_dir / name) and (why := not_a_file(hf_dir / name)):
            raise ConvertError(f"{hf_dir / name}: {why}")
    if not any((hf_dir / f).is_file() for f in TOKENIZER_FILES):
        raise ConvertError(f"{hf_dir}: no tokenizer ({' or '.join(TOKENIZER_FILES)}); an "
                           "orbax checkpoint carries the model's tokenizer in hf/")
    with atomic_dir(dst, exists_error=ConvertError) as tmp:
        meta = training_metadata(
            config={}, protocol_hash=train_state.get("protocol_hash"),
            schedule_hash=train_state.get("schedule_hash"),
            optimizer_step=int(adam["count"]),
            effective_updates=int(train_state["schedule"]["effective_updates"]
                                  if has_run_identity(train_state) else train_state.get("step", 0)),
            judge=None, extra={"source": source})
        store = CheckpointStore(tmp, keep_last=1)
        try:
            with tempfile.TemporaryDirectory(prefix="jscenegen-hf-assets-") as assets:
                store.save(step, params=params, adam=adam, train_state=train_state,
                           metadata=meta, hf_assets_dir=hf_assets(hf_dir, cfg, Path(assets)),
                           shapes=hf_shapes(cfg), trainable=trainable)
        except CheckpointError as err:
            raise ConvertError(str(err)) from None
        finally:
            store.close()
        write_layout(tmp, fmt="orbax", source=source_path, source_format=source_format,
                     files=[(f"{step}/{w}", s) for w, s in layout_files], step=step,
                     **(layout_extra or {}))
        write_checksums(tmp)
    return Path(dst) / str(step)


def hf_assets(hf_dir: Path, cfg: Any, scratch: Path) -> Path:
    """`hf_dir`'s asset files copied into `scratch`, config.json saying how many MTP layers
    `cfg` carries (a directory without weights, such as an orbax step's `hf/`, is read by
    that number: `tensor_sets.fix_config_file`). Returns `scratch`."""
    from jscenegen.model.assets import copy_assets

    copy_assets(hf_dir, scratch)
    fix_config_file(scratch / "config.json", cfg)
    return scratch


def verl_to_orbax(src: str | Path, dst: str | Path, *, dtype: str | None = None,
                  carried_from: str | Path | None = None) -> Path:
    """A VERL checkpoint as an orbax training checkpoint DST/<global step>/ (resumable).

    params: every tensor the VERL files hold (bitwise, their dtype; `dtype` casts the
    trainable parameters, never carried ones) plus Qwen3.5's `mtp.*` from `carried_from` /
    the checkpoint's `huggingface/` weights (stored dtype) or dropped with a warning. Adam:
    the moments of the parameters torch kept state for; a model-only source gets zero moments
    for the non-carried parameters (warned past global step 0: the updates' moments are lost,
    and `source.adam` in the metadata says so). Streamed: each tensor and moment is
    reassembled from the rank files only when orbax writes it (`LazyArray`), so peak memory is
    about one full tensor, not the model.
    """
    from convert.carried import verl_complement
    from jscenegen.checkpoint.lazy_array import LazyArray
    from jscenegen.checkpoint.resume import RUN_STATE_FILE, has_run_identity

    ck = VerlCheckpoint(src)
    extra = verl_complement(ck, carried_from)
    cfg = extra.config
    info = ck.tensor_info()
    carried = carried_names(cfg)
    params = {}
    for n, shape in hf_shapes(cfg).items():
        if n in extra.names:
            params[n] = LazyArray(shape, extra.dtypes[n], functools.partial(extra.read, n), n)
        else:
            params[n] = lazy_cast(n, shape, info[n].dtype, functools.partial(ck.read_param, n),
                                  None if n in carried else dtype)
    adam: dict[str, Any] = {"count": 0, "mu": {}, "nu": {}}
    if ck.has_optimizer():
        trainable = ck.trainable
        warn_rounded_masters(str(dst), {n: info[n].dtype for n in trainable if n in info}, dtype)
        adam["count"] = ck.adam_step()
        for group, moment in (("mu", "exp_avg"), ("nu", "exp_avg_sq")):
            adam[group] = {n: LazyArray(ck.shapes[n], np.float32,
                                        functools.partial(ck.read_moment, n, moment),
                                        f"{moment} of {n}") for n in trainable}
    else:
        trainable = [n for n in ck.shapes if n not in carried]
        adam["mu"] = {n: LazyArray.zeros(ck.shapes[n], name=n) for n in trainable}
        adam["nu"] = {n: LazyArray.zeros(ck.shapes[n], name=n) for n in trainable}
    extras = ck.extra_states() if "extra_state" in ck.layout.kinds else []
    ck.check_json_ready()
    step = ck.global_step()
    sched = ck.scheduler_step()
    run_state = ck.run_train_state()
    if not ck.has_optimizer() and step > 0:   # trained, saved without "optimizer" in save_contents
        warnings.warn(ConversionWarning(
            f"{ck.layout.shard_dir}: no optim_world_size_{ck.world_size}_rank_*.pt files (the "
            "model was saved without its optimizer): Adam starts afresh (zero moments, count 0)"
            + ("; a resume continues the run's schedule, not its updates bit for bit"
               if run_state else "")), stacklevel=2)
    if sched is None and step > 0 and run_state is None:
        warnings.warn(ConversionWarning(
            f"{ck.layout.shard_dir}: no LR scheduler state (no extra_state_world_size_"
            f"{ck.world_size}_rank_*.pt files, or none holds lr_scheduler): the LR count is "
            f"taken as the global step, {step}"), stacklevel=2)
    train_state = run_state or {
        "step": step, "lr_schedule_count": sched if sched is not None else step,
        "optimizer_step": int(adam["count"])}
    train_state["source_format"] = "verl"
    import torch

    source = {"format": "verl", "path": str(Path(src).resolve()), "layout": ck.layout.kind,
              "world_size": ck.world_size, "global_step": step,
              "torch_version_reading": torch.__version__, "mesh": ck.mesh(),
              "shard_dims": {k: v.shard_dim for k, v in info.items()},
              "no_adam_state": ck.frozen if ck.has_optimizer() else None,
              "adam": "from the optim rank files" if ck.has_optimizer() else "fresh: no optim rank files",
              "carried": extra.layout_fields(),
              "verl": {"param_groups": _json_groups(ck.param_groups()) if ck.has_optimizer() else None,
                       "extra_state": [extra_state_to_json(e) for e in extras]},
              "note": "torch RNG streams cannot be continued by JAX keys; recorded for a return to VERL"}
    files = [str(ck.layout.rank_file(k, r)) for k in ck.layout.kinds for r in range(ck.world_size)]
    layout_files = [("params", [f for f in files if "/model_" in f] + list(extra.files)),
                    ("adam", [f for f in files if "/optim_" in f]),
                    ("train_state", [f for f in files if "/extra_state_" in f]
                     + ([str(ck.layout.shard_dir / RUN_STATE_FILE)] if has_run_identity(train_state) else [])),
                    ("hf/config.json", [str(ck.hf_dir / "config.json")])]
    return _save_orbax(Path(dst), step=step, cfg=cfg, hf_dir=ck.hf_dir, params=params,
                       adam=adam, trainable=trainable, train_state=train_state, source=source,
                       layout_files=layout_files, source_path=src, source_format="verl",
                       layout_extra=extra.layout_fields())


def _json_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in groups]


def hf_to_orbax(src: str | Path, dst: str | Path, *, dtype: str | None = None) -> Path:
    """An HF model as an orbax checkpoint at step 0 with fresh Adam state (zeros, count 0).

    params: every tensor of the directory (Qwen3.5's vision tower and `mtp.*` included), each
    in its stored dtype; `dtype` casts the trainable parameters, never carried ones. Adam:
    zero moments for the trainable parameters (not the carried tower: `model.train_vision`
    is off by default). Streamed: each tensor is read when orbax writes it (`LazyArray`).
    """
    from convert.directions import hf_state
    from jscenegen.checkpoint.lazy_array import LazyArray
    from jscenegen.model.weights import param_shapes

    state = hf_state(src)
    cfg = state.config
    reader = SafetensorsReader(src)
    carried = carried_names(cfg)
    params = {n: lazy_cast(n, s, reader.dtype(n), functools.partial(reader.full, n),
                           None if n in carried else dtype)
              for n, s in hf_shapes(cfg).items()}
    trainable = param_shapes(cfg)
    adam = {"count": 0, "mu": {n: LazyArray.zeros(s, name=n) for n, s in trainable.items()},
            "nu": {n: LazyArray.zeros(s, name=n) for n, s in trainable.items()}}
    files = sorted({str(p) for p in reader.files.values()})
    return _save_orbax(Path(dst), step=0, cfg=cfg, hf_dir=Path(src), params=params,
                       adam=adam, trainable=list(trainable),
                       train_state={"step": 0, "lr_schedule_count": 0,
                                    "optimizer_step": 0, "source_format": "hf"},
                       source={"format": "hf", "path": str(Path(src).resolve())},
                       layout_files=[("params", files)], source_path=src, source_format="hf")


def orbax_reader(step_dir: Path, group: str, order: list[str]) -> Callable[[str], np.ndarray]:
    """name -> full array of `group` ("params", "mu", "nu"), one partial orbax restore each.

    `order`: the names in the order they will be asked for (the writer's parameter order,
    once per rank). Reads stream through one `iter_arrays` pass over `order` (the group's
    metadata is read once per pass, not once per tensor); a name asked out of turn starts a
    new pass there. One array is held at a time.
    """
    from convert.finite import note
    from jscenegen.checkpoint.store import iter_arrays

    position = {n: i for i, n in enumerate(order)}
    cursor: dict[str, Any] = {"it": None, "next": None}

    def full(name: str) -> np.ndarray:
        if cursor["next"] != name:
            cursor["it"] = iter_arrays(step_dir, group, names=order[position[name]:])
        got, arr = next(cursor["it"])
        i = position[got] + 1
        cursor["next"] = order[i] if i < len(order) else None
        arr = np.asarray(arr)
        if group == "params":
            note(got, arr)
        return arr

    return full


def orbax_config(step_dir: Path) -> Any:
    """The model config of an orbax step: `hf/config.json`, with the MTP layers its `params/`
    actually hold (`tensor_sets.with_tensors`), checked against every stored name and shape.
    Raises ConvertError naming the step when they differ."""
    from jscenegen.checkpoint import store as ckpt
    from jscenegen.model.config import ModelConfigError, QwenConfig

    hf = step_dir / ckpt.HF_DIR
    stored = ckpt.array_shapes(step_dir, "params")
    try:
        cfg = with_tensors(QwenConfig.from_dir(hf), stored)
    except ModelConfigError as err:
        raise ConvertError(str(err)) from None
    shapes = hf_shapes(cfg)
    if set(stored) != set(shapes):
        missing, unexpected = sorted(set(shapes) - set(stored)), sorted(set(stored) - set(shapes))
        raise ConvertError(f"{step_dir / ckpt.PARAMS_ITEM}: names differ from {hf / 'config.json'}"
                           f" (missing {missing[:5]}, unexpected {unexpected[:5]})")
    for n, shape in shapes.items():
        if tuple(stored[n][0]) != tuple(shape):
            raise ConvertError(f"{step_dir / ckpt.PARAMS_ITEM}: {n} has shape {stored[n][0]}, "
                               f"{hf / 'config.json'} implies {tuple(shape)}"
                               f"{cfg.assumed_sizes_note()}")
    return cfg


def orbax_state(step_dir: Path, world_size: int) -> VerlState:
    """Readers over the orbax step `step_dir` (as `orbax_step_dir` returns it: verified), with
    the torch-only state rebuilt for `world_size` ranks.

    Adam state is written for the step's trainable tensors (those with moments); the others
    (a frozen tower) get an index in `param_groups` and no state. `mtp.*` are not VERL
    tensors and are not read. The optimizer groups' `lr` and the scheduler's `_last_lr` are
    initial_lr x the run config's schedule at the step's LR count, what torch's AdamW +
    LambdaLR hold after that many steps (a step without a run config: a converted one keeps its
    VERL source's, an HF one the base lr). Raises ConvertError for moments of a tensor VERL
    files cannot hold, or a run config without the schedule's settings.
    """
    from jscenegen.checkpoint import store as ckpt
    from jscenegen.checkpoint.resume import checkpoint_position, has_run_identity

    hf = step_dir / ckpt.HF_DIR
    cfg = orbax_config(step_dir)
    shapes = verl_shapes(cfg)
    try:
        moments = ckpt.moment_shapes(step_dir)
    except ckpt.CheckpointError as err:
        raise ConvertError(str(err)) from None
    trainable = [n for n in shapes if n in moments]
    stray = sorted(set(moments) - set(shapes))
    if stray:
        raise ConvertError(f"{step_dir / ckpt.ADAM_ITEM}: moments for {stray[:3]}, which VERL "
                           "files cannot hold")
    meta = ckpt.read_metadata(step_dir)
    train_state = ckpt.read_train_state(step_dir)
    count = ckpt.read_adam_count(step_dir)
    verl_src = _metadata_object(step_dir, meta, "source", "verl")
    optim = _metadata_object(step_dir, meta, "config", "optim")
    groups = _param_groups(step_dir, verl_src.get("param_groups"))
    if not groups:
        groups = adamw_param_groups(len(shapes), lr=float(optim.get("lr", 1e-6)),
                                    betas=tuple(optim.get("betas", (0.9, 0.999))),
                                    eps=float(optim.get("eps", 1e-8)),
                                    weight_decay=float(optim.get("weight_decay", 0.01)))
    at = checkpoint_position(train_state, where=step_dir / ckpt.TRAIN_STATE_ITEM)
    if optim:   # the run's schedule: the groups' lr where the checkpoint stands
        m = lr_lambda(_schedule_fields(step_dir, optim), at.lr_step)
        for g in groups:
            g["lr"] = float(g.get("initial_lr", g["lr"])) * m
    extras_json = verl_src.get("extra_state") or []
    if extras_json:
        from convert.verl_read import check_extra_state
        from jscenegen.checkpoint.store import METADATA_NAME

        extras = [extra_state_from_json(e) for e in extras_json]
        for e in extras:
            check_extra_state(step_dir / METADATA_NAME, e)
        if len(extras) != world_size:
            extras = extras[:1]
        for e in extras:
            if e.get("lr_scheduler"):
                e["lr_scheduler"].update(last_epoch=at.lr_step, _step_count=at.lr_step + 1,
                                         _last_lr=[float(g["lr"]) for g in groups])
    else:
        lr = float(groups[0]["lr"])
        extras = [{"lr_scheduler": lambda_lr_state(float(groups[0].get("initial_lr", lr)),
                                                   at.lr_step, lr)}]
    return VerlState(
        config=cfg, hf_dir=hf, params=sliced(orbax_reader(step_dir, "params", list(shapes))),
        adam=AdamSource(exp_avg=sliced(orbax_reader(step_dir, "mu", trainable)),
                        exp_avg_sq=sliced(orbax_reader(step_dir, "nu", trainable)), step=count,
                        param_groups=groups, names=trainable),
        extra_states=extras, global_step=at.step,
        train_state=({k: v for k, v in train_state.items() if k != "source_format"}
                     if has_run_identity(train_state) else None))


def _metadata_object(step_dir: Path, meta: dict[str, Any], *keys: str) -> dict[str, Any]:
    """`meta[keys[0]][keys[1]]...` of the step's training_metadata.json, {} where a key is
    absent or null. Raises ConvertError naming the file and key when one is not an object."""
    from jscenegen.checkpoint.store import METADATA_NAME

    value: Any = meta
    for i, key in enumerate(keys):
        value = value.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConvertError(f"{step_dir / METADATA_NAME}: {'.'.join(keys[:i + 1])} is a "
                               f"{type(value).__name__}, expected an object")
    return value


def _param_groups(step_dir: Path, groups: Any) -> list[dict[str, Any]] | None:
    """The torch AdamW `param_groups` kept in training_metadata.json's source.verl (betas as
    tuples), None when absent or empty. Raises ConvertError naming the file and key when they
    are not a list of groups with `lr` and two `betas`."""
    from jscenegen.checkpoint.resume import differing_param_group
    from jscenegen.checkpoint.store import METADATA_NAME

    if not groups:
        return None
    where = f"{step_dir / METADATA_NAME}: source.verl.param_groups"
    if not isinstance(groups, list):
        raise ConvertError(f"{where} is a {type(groups).__name__}, expected a list")
    out = []
    for i, g in enumerate(groups):
        if not isinstance(g, dict):
            raise ConvertError(f"{where}[{i}] is a {type(g).__name__}, expected an object")
        for key in ("lr", "betas"):
            if key not in g:
                raise ConvertError(f"{where}[{i}] has no {key}")
        if not isinstance(g["betas"], (list, tuple)) or len(g["betas"]) != 2:
            raise ConvertError(f"{where}[{i}].betas is {g['betas']!r}, expected two numbers")
        out.append(dict(g, betas=tuple(g["betas"])))
    if why := differing_param_group(out):
        raise ConvertError(f"{where}{why.removeprefix('param_groups')}; one AdamW setting "
                           "holds for every parameter (a conversion from VERL refuses groups "
                           "that differ)")
    return out


def _schedule_fields(step_dir: Path, optim: dict[str, Any]) -> Any:
    """The LR schedule settings of the run config's `optim` section (training_metadata.json),
    as attributes for `lr_schedule.lr_lambda`. Raises ConvertError naming the file and key."""
    from types import SimpleNamespace

    from jscenegen.checkpoint.store import METADATA_NAME

    keys = ("lr_schedule", "warmup_steps", "total_steps", "min_lr_ratio", "num_cycles")
    if missing := [k for k in keys if k not in optim]:
        raise ConvertError(f"{step_dir / METADATA_NAME}: config.optim has no {missing[0]}; the "
                           "LR a VERL resume starts at is computed from the run's schedule")
    return SimpleNamespace(**{k: optim[k] for k in keys})


def orbax_to_verl(src: str | Path, dst: str | Path, *, world_size: int, placement: str | None = None,
                  dtype: str | None = None, device_type: str = "cuda") -> Path:
    """An orbax step as a VERL run directory that torch FSDP2 on `world_size` ranks resumes.

    `placement` None: the placement of the VERL checkpoint the step was converted from, as its
    metadata's `source.shard_dims` record it (`source_placement`), else "dim0"; another than
    that one is warned (`directions.output_placement`)."""
    from convert.directions import output_placement

    step_dir = orbax_step_dir(src)
    state = orbax_state(step_dir, world_size)
    placement = output_placement(placement, source_placement(step_dir, state.config),
                                 verl_shapes(state.config), world_size, src, dst)
    return write_verl_run(dst, state, world_size=world_size, placement=placement, dtype=dtype,
                          device_type=device_type, source=src, source_format="orbax",
                          source_files={"model": [str(step_dir / "params")],
                                        "optim": [str(step_dir / "adam")],
                                        "extra_state": [str(step_dir / "train_state"),
                                                        str(step_dir / "training_metadata.json")],
                                        "train_state": [str(step_dir / "train_state")]})


def source_placement(step_dir: Path, cfg: Any) -> tuple[str, ...]:
    """The placements of the VERL checkpoint an orbax step was converted from: the rules the
    shard dims its training_metadata.json records (`source.shard_dims`, over
    `source.world_size`) fit (`sharding.placement_of`); () for a step of another origin or a
    record that says nothing usable."""
    from convert.sharding import placement_of
    from jscenegen.checkpoint.store import read_metadata

    src = _metadata_object(step_dir, read_metadata(step_dir), "source")
    dims, w = src.get("shard_dims"), src.get("world_size")
    if src.get("format") != "verl" or not isinstance(dims, dict) or type(w) is not int:
        return ()
    if not all(d is None or type(d) is int for d in dims.values()):
        return ()
    mesh = src.get("mesh") if isinstance(src.get("mesh"), dict) else {}
    if len(mesh.get("dim_names") or ()) > 1:   # HSDP: the fsdp size is not recorded
        return ()
    return placement_of(verl_shapes(cfg), dims, w)


def orbax_to_hf(src: str | Path, dst: str | Path, *, dtype: str | None = None) -> list[str]:
    """The orbax step's params as an HF safetensors directory (streamed, atomic)."""
    step_dir = orbax_step_dir(src)
    with atomic_dir(dst, exists_error=ConvertError) as tmp:
        files = write_hf_into(step_dir, tmp, dtype=dtype)
        write_layout(tmp, fmt="hf-safetensors", source=src, source_format="orbax", files=files,
                     dtype=dtype or "source")
        write_checksums(tmp)
    return [w for w, _ in files if w.endswith((".safetensors", ".index.json"))]


def write_hf_into(step_dir: Path, out: Path, *, dtype: str | None) -> list[tuple[str, list[str]]]:
    """Safetensors (streamed, one array at a time) + the step's hf/ files into `out`.

    Every tensor of the step (Qwen3.5's vision tower and `mtp.*` included) in its stored
    dtype; `dtype` casts the trainable parameters, never carried tensors. Returns [(written
    name, [sources])] for the layout file.
    """
    from convert.finite import note
    from jscenegen.checkpoint import store as ckpt

    hf = step_dir / ckpt.HF_DIR
    cfg = orbax_config(step_dir)
    shapes, carried = hf_shapes(cfg), carried_names(cfg)
    stored = ckpt.array_shapes(step_dir, "params")
    out_dtype = {n: None if n in carried else dtype for n in shapes}
    specs = {n: (s, np.dtype(cast(np.zeros(1, stored[n][1]), out_dtype[n]).dtype))
             for n, s in shapes.items()}
    def arrays():
        for n, a in ckpt.iter_arrays(step_dir, "params", names=list(shapes)):
            a = np.asarray(a)
            note(n, a)
            yield n, cast(a, out_dtype[n])

    names = write_safetensors_streaming(out, specs, arrays())
    assets = copy_hf_metadata(hf, out)
    fix_config_file(out / "config.json", cfg, text_weights_dtype(specs, cfg))
    return [(n, [str(step_dir / ckpt.PARAMS_ITEM)]) for n in names] + assets


DIRECTIONS: dict[tuple[str, str], Callable[..., Any]] = {
    ("verl", "orbax"): lambda src, dst, o: verl_to_orbax(src, dst, dtype=o["dtype"],
                                                         carried_from=o["carried_from"]),
    ("hf", "orbax"): lambda src, dst, o: hf_to_orbax(src, dst, dtype=o["dtype"]),
    ("orbax", "verl"): lambda src, dst, o: orbax_to_verl(
        src, dst, world_size=o["world_size"], placement=o["placement"], dtype=o["dtype"],
        device_type=o["mesh_device"]),
    ("orbax", "hf"): lambda src, dst, o: orbax_to_hf(src, dst, dtype=o["dtype"]),
}
__all__ = ["verl_to_orbax", "hf_to_orbax", "orbax_to_verl", "orbax_to_hf", "DIRECTIONS",
           "extra_state_to_json", "extra_state_from_json"]
