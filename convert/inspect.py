"""What a checkpoint directory holds, without converting it (`jscenegen convert --inspect`).

Recognised: a VERL FSDP2 checkpoint (any layout convert/verl_read.py accepts), a jscenegen
orbax step directory (params/, adam/, train_state/) or a run's checkpoint directory of steps,
an HF safetensors directory, and an export (HF at the root + training_state/global_step_N).
Reads only headers and metadata (DTensor specs, safetensors headers, orbax metadata), no
tensor data.
"""
from __future__ import annotations

import os
from collections import Counter
from itertools import islice
from pathlib import Path
from typing import Any

from convert.errors import ConvertError, require_source_dir
from convert.verl_read import looks_like_verl
from jscenegen.checkpoint.checksums import CHECKSUMS_NAME
from jscenegen.checkpoint.resume import differing_param_group
from jscenegen.paths import is_step_name


def describe(path: str | Path) -> dict[str, Any]:
    """A JSON-able summary: format, layout, world size, placements, dtypes, step.

    Raises ConvertError if `path` is none of the recognised formats (naming the checkpoints
    among its subdirectories, when it holds some).
    """
    path = orbax_steps_dir(path) or Path(path)
    require_source_dir(path)
    kind = checkpoint_format(path)
    if kind == "export":
        steps = sorted((path / "training_state").glob("global_step_*"))
        return {"format": "export", "hf": describe_hf(path),
                "training_state": [describe_verl(s) for s in steps]}
    if kind == "orbax":
        return describe_orbax(path)
    if kind == "orbax-run":
        from jscenegen.checkpoint.store import check_step

        steps = sorted(_orbax_steps(path), key=lambda p: int(p.name))
        status = {int(p.name): check_step(p, hash_files=False) for p in steps}
        complete = [p for p in steps if status[int(p.name)].valid]
        return {"format": "orbax-run", "steps": [int(p.name) for p in steps],
                "incomplete": {s: st.reason for s, st in status.items() if not st.valid},
                "latest": describe_orbax(complete[-1]) if complete else None}
    if kind == "hf":
        return describe_hf(path)
    if kind == "verl":
        return describe_verl(path)
    inside = [p.name for p in islice(sorted(path.iterdir()), _SCAN_LIMIT)
              if p.is_dir() and checkpoint_format(p)]
    hint = (f"; it holds checkpoints ({', '.join(inside[:5])}{', ...' if len(inside) > 5 else ''}):"
            " inspect one of them" if inside else "")
    raise ConvertError(f"{path}: not a checkpoint (recognised: an HF safetensors directory, an "
                       f"orbax step or run directory, an export, VERL FSDP2 rank files){hint}")


_SCAN_LIMIT = 10_000  # directory entries looked at for the hint (a huge directory never hangs)


def orbax_steps_dir(path: str | Path) -> Path | None:
    """The directory of orbax steps that `path` names: itself, or the `checkpoints/` of a run
    directory (one `train` made, or one `convert --to orbax` wrote); None otherwise."""
    from jscenegen.run_files import RUN_CHECKPOINTS

    path = Path(path)
    if not path.is_dir():
        return None
    if not checkpoint_format(path) and (path / RUN_CHECKPOINTS).is_dir():
        path = path / RUN_CHECKPOINTS
    return path if checkpoint_format(path) == "orbax-run" else None


def verify_run(path: Path) -> tuple[list[int], list[int], int]:
    """(steps verified, unfinished steps, files checked) of a directory of orbax steps: every
    step whose save finished (its `checksums.json` written, last) against that manifest
    (SHA-256); unfinished ones, which a run skips and redoes, are only listed. Raises
    ConvertError naming the first finished step that fails, or when no step finished."""
    from jscenegen.checkpoint.checksums import ChecksumError, verify_checksums

    verified, unfinished, files = [], [], 0
    for step in sorted(_orbax_steps(path), key=lambda p: int(p.name)):
        if not (step / CHECKSUMS_NAME).is_file():
            unfinished.append(int(step.name))
            continue
        try:
            files += verify_checksums(step)
        except ChecksumError as err:
            raise ConvertError(str(err)) from None
        verified.append(int(step.name))
    if not verified:
        raise ConvertError(f"{path}: no finished checkpoint step to verify (unfinished: "
                           f"{unfinished})")
    return verified, unfinished, files


def _orbax_steps(path: Path) -> list[Path]:
    """Every step-named directory under `path`, whatever it still holds: a finished step
    that lost its `params/` is verified (and fails), an unfinished one listed."""
    return [p for p in islice(path.iterdir(), _SCAN_LIMIT) if is_step_name(p.name) and p.is_dir()]


def _holds_orbax_steps(path: Path) -> bool:
    """Whether `path` is a directory of orbax steps: a step-named directory with `params/`
    or a finished save's `checksums.json`."""
    return any((p / "params").is_dir() or (p / CHECKSUMS_NAME).is_file() for p in _orbax_steps(path))


def checkpoint_format(path: Path) -> str | None:
    """Which recognised layout the directory `path` holds, from its file names only: "export",
    "orbax" (a step), "orbax-run" (step directories), "hf", "verl", or None. A directory with
    HF weight files (`model*.safetensors` or the index) whose `config.json` is missing or not
    a regular file is "hf" too, so that reading it names the config.json at fault."""
    if (path / "training_state").is_dir() and (path / "config.json").is_file():
        return "export"
    if (path / "params").is_dir() and (path / "adam").is_dir():
        return "orbax"
    if _holds_orbax_steps(path):
        return "orbax-run"
    if (path / "config.json").is_file() and (
            (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()):
        return "hf"
    if looks_like_verl(path):
        return "verl"
    if _holds_hf_weights(path):   # its config.json is missing or no file: the HF reader names it
        return "hf"
    return None


def _holds_hf_weights(path: Path) -> bool:
    """Whether `path` holds HF weight files by name: `model.safetensors`, its index or a
    `model*.safetensors` shard (whatever kind of entry each is: the HF reader names a bad one)."""
    return (os.path.lexists(path / "model.safetensors")
            or os.path.lexists(path / "model.safetensors.index.json")
            or any(True for _ in islice(path.glob("model*.safetensors"), 1)))


def source_format(path: str | Path) -> str:
    """The `--from` format of a conversion source, from its file names: "hf", "orbax" (a step,
    a checkpoint directory or a training run's directory) or "verl".

    Raises ConvertError when `path` is not a directory, is an export (an HF model at its root
    and a VERL checkpoint under training_state/: the caller must choose), or is no recognised
    checkpoint.
    """
    path = orbax_steps_dir(path) or Path(path)
    require_source_dir(path)
    kind = checkpoint_format(path)
    if kind == "export":
        steps = sorted((path / "training_state").glob("global_step_*"))
        state = steps[-1] if steps else path / "training_state"
        raise ConvertError(f"{path}: an export; its root is an HF model (--from hf) and its "
                           f"training state a VERL checkpoint (convert {state})")
    if kind is None:
        describe(path)    # raises the not-a-checkpoint error, with its hint
    return {"orbax": "orbax", "orbax-run": "orbax", "hf": "hf", "verl": "verl"}[kind]


def describe_verl(path: Path) -> dict[str, Any]:
    """Summary of a VERL checkpoint (rank 0's tensor specs, optimizer step, scheduler step,
    the run identity our train state beside the rank files carries, else None)."""
    from convert.verl_read import VerlCheckpoint, find_verl

    layout = find_verl(path)
    out: dict[str, Any] = {"format": "verl-fsdp2", "layout": layout.kind,
                           "shard_dir": str(layout.shard_dir), "world_size": layout.world_size,
                           "global_step": layout.global_step, "files": list(layout.kinds)}
    if layout.hf_dir is None:
        out["note"] = "no huggingface/config.json: parameter names cannot be checked"
        return out
    ck = VerlCheckpoint(path)
    info = ck.tensor_info()
    out["model_type"] = ck.config.model_type
    out["tied_embeddings"] = ck.tied
    out["tensors"] = len(info)
    out["dtypes"] = dict(Counter(i.dtype for i in info.values()))
    out["placements"] = dict(Counter("Replicate" if i.shard_dim is None else f"Shard({i.shard_dim})"
                                     for i in info.values()))
    out["sharded_on_dim1"] = sorted(k for k, i in info.items() if i.shard_dim == 1)
    out["mesh"] = ck.mesh()
    out["global_step"] = ck.global_step()   # the directory name's, else the scheduler's or Adam's
    if ck.has_optimizer():
        out["adam_step"] = ck.adam_step()
        out["adam_state_tensors"] = len(ck.trainable)
        out["no_adam_state"] = len(ck.frozen)  # a frozen vision tower
        groups = ck.param_groups(one_setting=False)
        g = groups[0]
        out["optimizer"] = {k: g[k] for k in ("lr", "betas", "eps", "weight_decay") if k in g}
        # groups of their own settings: the weights convert, the AdamW state does not
        out["optimizer_groups_differ"] = differing_param_group(groups)
    if "extra_state" in layout.kinds:
        out["scheduler_last_epoch"] = ck.scheduler_step()
        out["rng_keys"] = sorted(ck.extra_states()[0].get("rng") or {})
    run = ck.run_train_state()   # written from one of our steps: a resume checks the run
    out["run_identity"] = None if run is None else {
        "attempts": run["schedule"]["attempts"],
        "effective_updates": run["schedule"]["effective_updates"],
        "schedule_hash": run["schedule_hash"], "protocol_hash": run["protocol_hash"]}
    return out


def describe_hf(path: Path) -> dict[str, Any]:
    """Summary of an HF safetensors directory (from the safetensors headers)."""
    from convert.safetensors_io import SafetensorsReader
    from jscenegen.model.config import QwenConfig

    reader = SafetensorsReader(path)
    cfg = QwenConfig.from_dir(path)
    dtypes = Counter(reader.stored_dtype(n) for n in reader.files)
    return {"format": "hf-safetensors", "model_type": cfg.model_type, "tensors": len(reader.files),
            "files": len(set(reader.files.values())), "dtypes": dict(dtypes),
            "tied_embeddings": cfg.tie_word_embeddings}


def describe_orbax(path: Path) -> dict[str, Any]:
    """Summary of a jscenegen orbax step directory (orbax metadata only)."""
    from jscenegen.checkpoint import store as ckpt

    shapes = ckpt.array_shapes(path, "params")
    meta = ckpt.read_metadata(path) if (path / ckpt.METADATA_NAME).is_file() else {}
    return {"format": "orbax", "step": int(path.name) if is_step_name(path.name) else None,
            "tensors": len(shapes), "dtypes": dict(Counter(str(d) for _, d in shapes.values())),
            "adam_state_tensors": len(ckpt.array_shapes(path, "mu")),
            "frozen_tensors": len(meta.get("frozen_tensors") or ()),
            "adam_count": ckpt.read_adam_count(path),
            "optimizer_step": meta.get("optimizer_step"),
            "source": _source_summary(meta.get("source"))}


def _source_summary(source: Any) -> Any:
    """A converted step's `source` record, its per-tensor and per-rank parts summarised (a
    VERL source's records every rank's extra state: ~200 lines for 6 ranks); the whole record
    stays in the step's training_metadata.json."""
    if not isinstance(source, dict):
        return source
    out = dict(source)
    if isinstance(dims := source.get("shard_dims"), dict):
        out["shard_dims"] = dict(Counter("replicated" if d is None else f"dim {d}"
                                         for d in dims.values()))
    verl = source.get("verl")
    if isinstance(verl, dict) and isinstance(extras := verl.get("extra_state"), list) and extras:
        schedulers = [e.get("lr_scheduler") if isinstance(e, dict) else None for e in extras]
        rng = extras[0].get("rng") if isinstance(extras[0], dict) else None
        out["verl"] = {**verl, "extra_state": {
            "ranks": len(extras),
            "lr_scheduler": (schedulers[0] if all(x == schedulers[0] for x in schedulers)
                             else "differs between ranks"),
            "rng": sorted(rng) if isinstance(rng, dict) else None}}
    out = _short_lists(out)
    out["full_record"] = "training_metadata.json: source"
    return out


def _short_lists(value: Any, keep: int = 3, longest: int = 8) -> Any:
    """`value` with every list longer than `longest` (parameter indices of each param group,
    the tensors without Adam state or carried from a release) replaced, at any depth, by its
    count and its first `keep` items."""
    if isinstance(value, dict):
        return {k: _short_lists(v, keep, longest) for k, v in value.items()}
    if isinstance(value, list):
        if len(value) > longest:
            return {"count": len(value), "first": [_short_lists(v, keep, longest) for v in value[:keep]]}
        return [_short_lists(v, keep, longest) for v in value]
    return value
