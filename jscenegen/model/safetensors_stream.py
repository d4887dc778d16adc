"""HF safetensors written one tensor at a time.

All shapes and dtypes are known before any data (from the model config), so each file's
header is written first and then every tensor's bytes as it arrives; memory is one tensor.
The byte layout is the safetensors format (github.com/huggingface/safetensors, README
"Format": u64 little-endian header size, JSON header {name: {dtype, shape, data_offsets}} with
`__metadata__`, padded with spaces to 8 bytes, then the raw little-endian data). Shards follow
transformers' naming: `model.safetensors`, or `model-0000i-of-0000n.safetensors` plus
`model.safetensors.index.json` ({"metadata": {"total_size"}, "weight_map"}).
"""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Iterable

import numpy as np

from jscenegen.model.dtypes import SAFETENSORS, dtype_name

INDEX_NAME = "model.safetensors.index.json"


def _st_dtype(dtype: np.dtype) -> str:
    return SAFETENSORS[dtype_name(dtype)]


def plan_shards(specs: dict[str, tuple[tuple[int, ...], np.dtype]],
                max_shard_bytes: int) -> list[list[str]]:
    """Group tensor names (in order) into files of at most `max_shard_bytes` (one tensor may exceed)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, (shape, dtype) in specs.items():
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_safetensors_streaming(out_dir: str | Path,
                                specs: dict[str, tuple[tuple[int, ...], np.dtype]],
                                arrays: Iterable[tuple[str, np.ndarray]],
                                max_shard_bytes: int = 5 << 30) -> list[str]:
    """Write `arrays` (yielded in `specs` order) as HF safetensors under `out_dir`.

    specs: ordered {name: (shape, dtype)} announced before the data; every yielded array must
    match its spec (else ValueError naming the tensor). Returns the written file names
    (shards, then the index when there is more than one shard). Raises ValueError for a dtype
    other than float32/bfloat16/float16 or on a big-endian host.
    """
    if sys.byteorder != "little":
        raise ValueError("writing safetensors needs a little-endian host")
    out_dir = Path(out_dir)
    shards = plan_shards(specs, max_shard_bytes)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [
        f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    it = iter(arrays)
    weight_map = {}
    total = 0
    for fname, members in zip(names, shards):
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in members:
            shape, dtype = specs[name]
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            header[name] = {"dtype": _st_dtype(dtype), "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = fname
        total += offset
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out_dir / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for name in members:
                got_name, a = next(it)
                shape, dtype = specs[name]
                if got_name != name or tuple(a.shape) != tuple(shape) or a.dtype != np.dtype(dtype):
                    raise ValueError(f"tensor {got_name} {a.shape} {a.dtype} arrived where "
                                       f"{name} {tuple(shape)} {np.dtype(dtype)} was announced")
                f.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)  # little-endian host
    if next(it, None) is not None:
        raise ValueError("more tensors arrived than were announced")
    if n > 1:
        (out_dir / INDEX_NAME).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return names + ([INDEX_NAME] if n > 1 else [])
