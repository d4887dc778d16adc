"""What a checkpoint directory holds, without converting it (`jscenegen convert --inspect`).

Recognised: a VERL FSDP2 checkpoint (any layout convert/verl_read.py accepts), a jscenegen
orbax step directory (params/, adam/, train_state/) or a run's checkpoint directory of steps,
an HF safetensors directory, and an export (HF at the root + training_state/global_step_N).
Reads only headers and metadata (DTensor specs, safetensors headers, orbax metadata), no
tensor data.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from convert.errors import ConvertError


def describe(path: str | Path) -> dict[str, Any]:
    """A JSON-able summary: format, layout, world size, placements, dtypes, step.

    Raises ConvertError if `path` is none of the recognised formats.
    """
    path = Path(path)
    if not path.is_dir():
        raise ConvertError(f"{path}: not a directory")
    if (path / "training_state").is_dir() and (path / "config.json").is_file():
        steps = sorted((path / "training_state").glob("global_step_*"))
        return {"format": "export", "hf": describe_hf(path),
                "training_state": [describe_verl(s) for s in steps]}
    if (path / "params").is_dir() and (path / "adam").is_dir():
        return describe_orbax(path)
    steps = [p for p in path.iterdir() if p.name.isdigit() and (p / "params").is_dir()]
    if steps:
        latest = max(steps, key=lambda p: int(p.name))
        return {"format": "orbax-run", "steps": sorted(int(p.name) for p in steps),
                "latest": describe_orbax(latest)}
    if (path / "config.json").is_file() and (
            (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()):
        return describe_hf(path)
    return describe_verl(path)


def describe_verl(path: Path) -> dict[str, Any]:
    """Summary of a VERL checkpoint (rank 0's tensor specs, optimizer step, scheduler step)."""
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
    if ck.has_optimizer():
        out["adam_step"] = ck.adam_step()
        out["adam_state_tensors"] = len(ck.trainable)
        out["no_adam_state"] = len(ck.frozen)  # a frozen vision tower
        g = ck.param_groups()[0]
        out["optimizer"] = {k: g[k] for k in ("lr", "betas", "eps", "weight_decay") if k in g}
    if "extra_state" in layout.kinds:
        out["scheduler_last_epoch"] = ck.scheduler_step()
        out["rng_keys"] = sorted(ck.extra_states()[0].get("rng") or {})
    return out


def describe_hf(path: Path) -> dict[str, Any]:
    """Summary of an HF safetensors directory (from the safetensors headers)."""
    from convert.safetensors_io import SafetensorsReader
    from jscenegen.model.config import QwenConfig

    reader = SafetensorsReader(path)
    cfg = QwenConfig.from_dir(path)
    dtypes = Counter(str(reader._slice(n).get_dtype()) for n in reader.files)
    return {"format": "hf-safetensors", "model_type": cfg.model_type, "tensors": len(reader.files),
            "files": len(set(reader.files.values())), "dtypes": dict(dtypes),
            "tied_embeddings": cfg.tie_word_embeddings}


def describe_orbax(path: Path) -> dict[str, Any]:
    """Summary of a jscenegen orbax step directory (orbax metadata only)."""
    from jscenegen.checkpoint import store as ckpt

    shapes = ckpt.array_shapes(path, "params")
    meta = ckpt.read_metadata(path) if (path / ckpt.METADATA_NAME).is_file() else {}
    return {"format": "orbax", "step": int(path.name) if path.name.isdigit() else None,
            "tensors": len(shapes), "dtypes": dict(Counter(str(d) for _, d in shapes.values())),
            "adam_state_tensors": len(ckpt.array_shapes(path, "mu")),
            "frozen_tensors": len(meta.get("frozen_tensors") or ()),
            "adam_count": ckpt.read_adam_count(path),
            "optimizer_step": meta.get("optimizer_step"),
            "source": meta.get("source")}
