"""HF safetensors read one tensor (or slice) at a time; writing is jscenegen.model.safetensors_stream."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np

from convert.errors import ConvertError


class SafetensorsReader:
    """Slices of tensors from an HF safetensors directory, read without loading whole files.

    `read(name, dim, start, stop)` is a `SliceReader` (convert/verl_write.py); `full(name)`
    reads one whole tensor. Arrays are numpy (bf16 as ml_dtypes.bfloat16). Whole tensors and
    dim-0 slices are read with plain file reads at the offsets of the file's header, not through
    a memory map, so the file's pages never count towards this process's resident memory.
    """

    def __init__(self, hf_dir: str | Path):
        from jscenegen.model.hf_io import CheckpointFormatError, safetensors_files

        self.hf_dir = Path(hf_dir)
        try:
            self.files = safetensors_files(hf_dir)
        except CheckpointFormatError as err:
            raise ConvertError(str(err)) from None
        self._open: dict[Path, object] = {}
        self._headers: dict[Path, tuple[int, dict]] = {}

    def _slice(self, name: str):
        from safetensors import safe_open

        path = self._entry(name)[0]
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path].get_slice(name)

    def _entry(self, name: str) -> tuple[Path, int, dict]:
        """(file, byte offset of its data section, header entry {dtype, shape, data_offsets})."""
        if name not in self.files:
            raise ConvertError(f"{self.hf_dir}: tensor {name} not found in the safetensors files")
        path = self.files[name]
        if path not in self._headers:
            from jscenegen.model.safetensors_stream import raw_header
            from jscenegen.model.weights import CheckpointFormatError

            try:
                header = raw_header(path)
            except CheckpointFormatError as err:
                raise ConvertError(str(err)) from None
            _check_header(path, *header)
            self._headers[path] = header
        data_start, header = self._headers[path]
        return path, data_start, header[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of `name` (from the file header; no data read)."""
        return tuple(self._entry(name)[2]["shape"])

    def stored_dtype(self, name: str) -> str:
        """The dtype of `name` as the file's header spells it (F32, BF16, ...)."""
        return self._entry(name)[2]["dtype"]

    def dtype(self, name: str) -> np.dtype:
        """The stored dtype of `name` (from the file header; no data read)."""
        path, _, entry = self._entry(name)
        return _entry_dtype(path, name, entry)

    def _read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of dim 0 of `name` (a scalar is one row), read into a fresh array."""
        path, data_start, entry = self._entry(name)
        shape, dtype = self.shape(name), self.dtype(name)
        row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        begin = entry["data_offsets"][0]   # the span holds shape x dtype (`raw_header`)
        buf = np.empty((stop - start) * row, np.uint8)
        with open(path, "rb", buffering=0) as f:
            f.seek(data_start + begin + start * row)
            view, got = memoryview(buf), 0
            while got < buf.nbytes:
                n = f.readinto(view[got:])
                if not n:
                    raise ConvertError(f"{path}: truncated inside {name}")
                got += n
        return buf.view(dtype).reshape((stop - start, *shape[1:]) if shape else ())

    def read(self, name: str, dim: int, start: int, stop: int) -> np.ndarray:
        """Indices [start, stop) of dimension `dim` of `name` (noted by convert/finite.py)."""
        from convert.finite import note
        from convert.tensors import to_numpy

        if dim == 0:
            out = self._read_rows(name, start, stop)
        else:
            idx = (slice(None),) * dim + (slice(start, stop),)
            out = to_numpy(self._slice(name)[idx]).copy()
        note(name, out)
        return out

    def full(self, name: str) -> np.ndarray:
        """The whole array of `name` (noted by convert/finite.py)."""
        from convert.finite import note

        shape = self.shape(name)
        out = self._read_rows(name, 0, shape[0] if shape else 1)
        note(name, out)
        return out

    def names(self) -> Iterator[str]:
        return iter(self.files)


def _entry_dtype(path: Path, name: str, entry: dict) -> np.dtype:
    from jscenegen.model.safetensors_stream import entry_np_dtype
    from jscenegen.model.weights import CheckpointFormatError

    try:
        return entry_np_dtype(path, name, entry)
    except CheckpointFormatError as err:
        raise ConvertError(str(err)) from None


def _check_header(path: Path, data_start: int, header: dict) -> None:
    """Refuse a header (entries well-formed, each spanning its shape x dtype, and disjoint:
    `safetensors_stream.raw_header`) whose tensors use a dtype jscenegen does not read or lie
    outside the file (a cut file fails here, before any tensor is written out)."""
    size = path.stat().st_size
    for name, entry in header.items():
        _entry_dtype(path, name, entry)
    short = sorted(name for name, entry in header.items()
                   if data_start + entry["data_offsets"][1] > size)
    if short:
        raise ConvertError(f"{path}: truncated: {len(short)} tensor(s) end beyond the file's "
                           f"{size} bytes, e.g. {short[0]}")
