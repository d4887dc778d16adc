"""HF safetensors written one tensor at a time.

All shapes and dtypes are known before any data (from the model config), so each file's
header is written first and then every tensor's bytes as it arrives; memory is one tensor.
The byte layout is the safetensors format (github.com/huggingface/safetensors, README
"Format": u64 little-endian header size, JSON header {name: {dtype, shape, data_offsets}} with
`__metadata__`, padded with spaces to 8 bytes, then the raw little-endian data). Shards follow
transformers' naming: `model.safetensors`, or `model-0000i-of-0000n.safetensors` plus
`model.safetensors.index.json` ({"metadata": {"total_size"}, "weight_map"}).

Reading: `safetensors_files` maps tensor names to files through the index (whatever the shard
files are called: Qwen3.5 releases name them `model.safetensors-0000k-of-0000n.safetensors`)
or the single `model.safetensors`; `read_header` / `stored_tensors` read names, dtypes and
shapes from the headers alone.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import os
import struct
import sys
from pathlib import Path
from typing import Iterable

import numpy as np

from jscenegen.model.dtypes import SAFETENSORS, dtype_name, np_dtype
from jscenegen.model.weights import CheckpointFormatError
from jscenegen.paths import (
    DiskFullError,
    loads_json,
    naming_write_errors,
    not_a_file,
    read_json_object,
    storage_limit,
    write_limit_error,
)
from jscenegen.text import clip_text

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100_000_000   # the safetensors library's limit ("header too large" above it)
_DTYPE_NAMES = {code: name for name, code in SAFETENSORS.items()}
# bytes per element of the safetensors format's whole-byte dtypes (its sub-byte float types,
# F4/F6, are not checked here; no reader of jscenegen's takes them)
_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
               "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
               "F64": 8, "I64": 8, "U64": 8, "C64": 8}


_WARNED_BOTH: set[Path] = set()   # directories already warned about holding both layouts


def safetensors_files(path: str | Path) -> dict[str, Path]:
    """{tensor name: file} for a single-file or index-sharded HF directory.

    `model.safetensors` wins when both it and the index (`model.safetensors.index.json`) are
    present, as in transformers' `from_pretrained` (modeling_utils.py), with a warning naming
    the index it ignores. The index's file names are used as written, never globbed, and must
    name files of `path` itself; the index must describe its shards exactly
    (`_check_index_matches_shards`: each tensor held by one listed shard, the one listed).
    Raises CheckpointFormatError when neither exists, the index is malformed, names a file
    elsewhere, or disagrees with its shards' headers.
    """
    path = Path(path)
    index, single = path / INDEX_NAME, path / SINGLE_NAME
    if index.is_file() and single.is_file():
        if path.resolve() not in _WARNED_BOTH:   # one command reads a directory more than once
            _WARNED_BOTH.add(path.resolve())
            log.warning("%s holds both %s and %s: reading %s, as transformers does (the index and "
                        "its shards are ignored; delete whichever is stale)", path, SINGLE_NAME,
                        INDEX_NAME, SINGLE_NAME)
    elif index.is_file():
        weight_map = read_json_object(index, CheckpointFormatError).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointFormatError(
                f"{index}: malformed index: it needs a 'weight_map' object (tensor name -> "
                f"shard file), got {clip_text(repr(weight_map))}")
        files = dict(weight_map)
        for name, fname in files.items():
            if not isinstance(fname, str):
                raise CheckpointFormatError(
                    f"{index}: weight_map[{name[:200]!r}] is {clip_text(repr(fname))}; a shard is a "
                    "file name (a string)")
            if Path(fname).name != fname or fname in ("", ".", ".."):
                raise CheckpointFormatError(
                    f"{index}: weight_map[{name!r}] is {fname[:200]!r}; a shard is a file name "
                    "in the model's own directory (no path)")
        files = {name: path / fname for name, fname in files.items()}
        _check_index_matches_shards(index, files)
        return files
    if not single.is_file():
        why = not_a_file(single) if single.exists() or single.is_symlink() else None
        raise CheckpointFormatError(f"{single}: {why}" if why else
                                    f"{path}: no {SINGLE_NAME} or {INDEX_NAME}")
    return {name: single for name in read_header(single)}


def _check_index_matches_shards(index: Path, files: dict[str, Path]) -> None:
    """The index's weight_map `files` ({tensor name: shard}) says what its shards hold: every
    tensor of every listed shard's header is listed, for that shard, and held by no other
    listed shard; every listed tensor is held. transformers reads every tensor of every listed
    shard (a second copy in another shard replaces the first, one the index leaves out loads as
    an unexpected key), jscenegen only the listed ones, so the two would load different weights.
    Shard files the index does not list are not read (nor by transformers). Raises
    CheckpointFormatError naming the index, the tensor and the shards (and, as `raw_header`,
    for a listed shard that cannot be read)."""
    holders: dict[str, list[Path]] = {}
    for shard in sorted(set(files.values())):
        for name in raw_header(shard)[1]:
            holders.setdefault(name, []).append(shard)
    for name, shards in holders.items():
        if len(shards) > 1:
            raise CheckpointFormatError(
                f"{index}: tensor {name[:200]!r} is held by {len(shards)} shards "
                f"({', '.join(s.name for s in shards)}); transformers loads every copy (the last "
                "read wins), jscenegen the one weight_map lists: keep it in one shard")
        listed = files.get(name)
        if listed is None:
            raise CheckpointFormatError(
                f"{index}: {shards[0].name} holds tensor {name[:200]!r}, which weight_map does "
                "not list (transformers loads it, as an unexpected key); the index must name "
                "every tensor its shards hold")
        if listed != shards[0]:
            raise CheckpointFormatError(
                f"{index}: weight_map lists tensor {name[:200]!r} in {listed.name}, but "
                f"{shards[0].name} holds it")
    for name, shard in files.items():
        if name not in holders:
            raise CheckpointFormatError(f"{index}: tensor {name[:200]!r} is listed in "
                                        f"{shard.name}, which does not hold it")


def raw_header(file: str | Path) -> tuple[int, dict]:
    """(byte offset of the data section, header dict without `__metadata__`) of one file,
    parsed once per file version (the cache key holds its size and modification time). Every
    entry is {dtype: str, shape: [int >= 0], data_offsets: [begin, end]} with 0 <= begin <=
    end, no two spans overlap, the spans cover the data section without a hole and no byte
    follows them, `__metadata__` maps strings to strings, no key twice. Raises
    CheckpointFormatError naming the file (and the tensor) when the header cannot be read or
    breaks those rules."""
    try:
        st = os.stat(file)
    except OSError as err:
        raise CheckpointFormatError(f"{file}: unreadable safetensors file ({err})") from None
    return _parse_header(str(file), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _parse_header(file: str, size: int, mtime_ns: int) -> tuple[int, dict]:
    try:
        if size < 8:
            raise ValueError(f"{size} bytes: shorter than the 8-byte header length it starts with")
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES:
                raise ValueError(f"a header of {n:,} bytes, above the safetensors library's "
                                 f"limit of {MAX_HEADER_BYTES:,}")
            if 8 + n > size:
                raise ValueError(f"header length past the end of the file: 8 + {n:,} header "
                                 f"bytes, the file has {size:,} (truncated?)")
            header = loads_json(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        _check_metadata(header.pop("__metadata__", None))
        for name, entry in header.items():
            _check_entry(name, entry)
        _check_disjoint(header)
        _check_covered(header, size - 8 - n)
        return 8 + n, header
    except (OSError, ValueError, struct.error) as err:
        raise CheckpointFormatError(f"{file}: unreadable safetensors file ({err})") from None


def _check_disjoint(header: dict) -> None:
    """No two tensors share bytes (the safetensors library refuses such a file; read here,
    one tensor would silently hold another's values)."""
    spans = sorted((e["data_offsets"][0], e["data_offsets"][1], name) for name, e in header.items()
                   if e["data_offsets"][1] > e["data_offsets"][0])
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise ValueError(f"tensors {first[:200]!r} and {second[:200]!r} share bytes "
                             f"(data_offsets overlap at {begin})")


def _check_covered(header: dict, data_bytes: int) -> None:
    """The tensors' spans tile the data section from its first byte with no hole, and no byte
    follows the last (the safetensors library refuses a hole as an invalid offset and trailing
    bytes as "file not fully covered": transformers could not load such a file). A file
    shorter than its spans is left to the readers' truncation checks, which name the tensor."""
    covered = 0
    for begin, end, name in sorted((e["data_offsets"][0], e["data_offsets"][1], name)
                                   for name, e in header.items()):
        if begin > data_bytes:   # past the file's end: the readers' truncation checks name it
            return
        if begin > covered:
            raise ValueError(f"{begin - covered} bytes before tensor {name[:200]!r} belong to no "
                             f"tensor (data_offsets start at {begin}, the previous tensor ends "
                             f"at {covered})")
        if begin < covered:   # an empty tensor (overlaps are refused above) inside another's bytes
            raise ValueError(f"tensor {name[:200]!r} starts at {begin}, inside the bytes of "
                             f"another tensor (which end at {covered})")
        covered = end
    if data_bytes > covered:
        raise ValueError(f"{data_bytes - covered} bytes after the last tensor belong to none (the "
                         f"tensors cover {covered} of the data section's {data_bytes} bytes)"
                         if header else f"{data_bytes} bytes of data and no tensor")


def _check_metadata(metadata: object) -> None:
    """`__metadata__` is a string -> string map (the safetensors format; its library refuses
    anything else)."""
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(v, str) for v in metadata.values())):
        raise ValueError("__metadata__ must map strings to strings")


def _is_index(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_entry(name: str, entry: object) -> None:
    """One tensor's header entry: exactly dtype (a string), shape (non-negative integers) and
    data_offsets (two non-negative integers) spanning exactly shape x the dtype's bytes (as the
    safetensors library requires; read otherwise, a tensor would take too few bytes or
    another's)."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(f"tensor {name[:200]!r}: an entry holds exactly dtype, shape and "
                         "data_offsets")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(entry["dtype"], str) or not isinstance(shape, list) or not all(
            map(_is_index, shape)):
        raise ValueError(f"tensor {name[:200]!r}: dtype must be a string and shape a list of "
                         "non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_index, offsets))
            and offsets[0] <= offsets[1]):
        raise ValueError(f"tensor {name[:200]!r}: data_offsets must be [begin, end] byte "
                         "offsets, 0 <= begin <= end")
    if entry["dtype"] in _ITEM_BYTES:
        nbytes = math.prod(shape) * _ITEM_BYTES[entry["dtype"]]
        if offsets[1] - offsets[0] != nbytes:
            raise ValueError(f"tensor {name[:200]!r} spans {offsets[1] - offsets[0]} bytes; "
                             f"{entry['dtype'][:40]}{shape} needs {nbytes}")


def entry_dtype_name(file: str | Path, name: str, entry: dict) -> str:
    """The dtype name (`dtypes.NUMPY`'s: "float32", "bfloat16", "float16") of tensor `name`'s
    header entry (as `raw_header` returns it). Raises CheckpointFormatError naming the file
    and tensor for a dtype code jscenegen does not handle."""
    code = entry["dtype"]
    if code not in _DTYPE_NAMES:
        raise CheckpointFormatError(f"{file}: tensor {name!r} has dtype {code[:40]}; supported: "
                                    f"{', '.join(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[code]


def entry_np_dtype(file: str | Path, name: str, entry: dict) -> np.dtype:
    """The NumPy dtype tensor `name`'s bytes decode as: `entry_dtype_name`'s, little-endian
    whatever the host (the safetensors format stores little-endian data). Raises as
    `entry_dtype_name`."""
    return np_dtype(entry_dtype_name(file, name, entry)).newbyteorder("<")


def read_header(file: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype name, shape)} of one safetensors file, from its header only.

    Dtype names are `dtypes.NUMPY`'s ("float32", "bfloat16", "float16"). Raises
    CheckpointFormatError naming the file for an unreadable header, and naming the tensor
    for a dtype jscenegen does not handle.
    """
    _, header = raw_header(file)
    return {name: (entry_dtype_name(file, name, e), tuple(e["shape"])) for name, e in header.items()}


def read_tensor(file: str | Path, name: str, expected_shape: tuple[int, ...] | None = None,
                shape_note: str = "") -> np.ndarray:
    """Tensor `name` of one safetensors file as a NumPy array in its stored dtype (bfloat16 as
    `ml_dtypes.bfloat16`, which safetensors' own NumPy reader cannot give), read with one
    plain file read at the header's offsets straight into the returned array (memory: the
    tensor once), decoded little-endian (`entry_np_dtype`) and returned in the host's byte
    order. Raises CheckpointFormatError naming the file and
    tensor when it is absent, its header shape is not `expected_shape` (when given; checked
    before any byte is read, `shape_note` appended), its byte range does not fit its shape, or
    the file is short (checked against the file's size before the read: a header claiming
    2^60 bytes asked for that much memory)."""
    data_start, header = raw_header(file)
    if name not in header:
        raise CheckpointFormatError(f"{file}: no tensor {name!r}")
    entry = header[name]
    dtype = entry_np_dtype(file, name, entry)
    shape, begin = tuple(entry["shape"]), entry["data_offsets"][0]
    if expected_shape is not None and shape != tuple(expected_shape):
        raise CheckpointFormatError(f"{file}: tensor {name!r} has shape {shape}, expected "
                                    f"{tuple(expected_shape)}{shape_note}")
    nbytes = math.prod(shape) * dtype.itemsize   # the span's length (`raw_header`)
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if data_start + begin + nbytes > size:
            raise CheckpointFormatError(
                f"{file}: tensor {name!r} is cut short: it ends at byte "
                f"{data_start + begin + nbytes:,}, the file has {size:,} (truncated?)")
        arr = np.empty(shape, dtype)
        got = 0
        if nbytes:   # through a uint8 view: a bfloat16 array exports no buffer of its own
            f.seek(data_start + begin)
            got = f.readinto(memoryview(arr.reshape(-1).view(np.uint8)))
    if got != nbytes:
        raise CheckpointFormatError(f"{file}: tensor {name!r} is cut short ({got} of "
                                    f"{nbytes} bytes)")
    return arr.astype(dtype.newbyteorder("="), copy=False)


def stored_tensors(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """{tensor name: (dtype name, shape)} of an HF directory's weights, or None when it holds
    no safetensors weights (no index, no model.safetensors). Headers only; raises
    CheckpointFormatError as `safetensors_files` / `read_header`."""
    path = Path(path)
    if not (path / INDEX_NAME).is_file() and not (path / SINGLE_NAME).is_file():
        return None
    files = safetensors_files(path)
    headers = {f: read_header(f) for f in sorted(set(files.values()))}
    return {name: headers[f][name] for name, f in files.items()}


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
    files = []   # (name, members, header bytes, file bytes)
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
        files.append((fname, members, raw, 8 + len(raw) + offset))
    arrived = 0
    for fname, members, raw, size in files:
        try:
            with naming_write_errors(out_dir / fname), open(out_dir / fname, "wb") as f:
                f.write(struct.pack("<Q", len(raw)))
                f.write(raw)
                for name in members:
                    item = next(it, None)
                    if item is None:
                        raise ValueError(f"{out_dir}: the tensors ended before {name} (announced "
                                         f"{len(specs)}, {arrived} arrived)")
                    arrived += 1
                    got_name, a = item
                    shape, dtype = specs[name]
                    if got_name != name or tuple(a.shape) != tuple(shape) or a.dtype != np.dtype(dtype):
                        raise ValueError(f"tensor {got_name} {a.shape} {a.dtype} arrived where "
                                         f"{name} {tuple(shape)} {np.dtype(dtype)} was announced")
                    f.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)  # little-endian host
        except OSError as err:
            code = None if isinstance(err, DiskFullError) else storage_limit(err)
            if code is None:
                raise
            raise write_limit_error(code, out_dir / fname, size, sum(x[3] for x in files),
                                    "writing the safetensors weights") from None
    if next(it, None) is not None:
        raise ValueError("more tensors arrived than were announced")
    if n > 1:
        (out_dir / INDEX_NAME).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return names + ([INDEX_NAME] if n > 1 else [])
