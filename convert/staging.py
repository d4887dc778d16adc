"""Atomic output directories: build under a hidden sibling, rename into place at the end.

A failed conversion leaves nothing at the destination (the temp directory is removed), so a
half-written checkpoint can never be mistaken for a whole one.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np

from convert.errors import ConvertError


@contextlib.contextmanager
def staged_dir(dst: str | Path) -> Iterator[Path]:
    """Yield a temp directory beside `dst`; on success rename it to `dst`, on error delete it.

    Raises ConvertError if `dst` exists and is not an empty directory (never overwrites).
    """
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ConvertError(f"{dst}: already exists and is not empty; choose a new destination")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        yield tmp
        if dst.exists():
            dst.rmdir()
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


class ArraySpill:
    """Arrays staged as .npy files and handed back as read-only memory maps.

    Converting into orbax goes through `CheckpointStore.save`, which takes whole trees; spilling
    each tensor to disk as it is read keeps the process's own memory near one tensor, and the
    mapped pages are file-backed (the kernel can drop them), so a model larger than RAM converts.
    """

    def __init__(self, root: Path):
        self.root = root
        self._n = 0

    def _path(self) -> Path:
        self._n += 1
        return self.root / f"{self._n}.npy"

    def put(self, arr: np.ndarray) -> np.ndarray:
        path = self._path()
        np.save(path, np.ascontiguousarray(arr))
        return np.load(path, mmap_mode="r")

    def zeros(self, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        path = self._path()
        zeros = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=tuple(shape))
        del zeros  # a sparse file: nothing is written but the header
        return np.load(path, mmap_mode="r")


@contextlib.contextmanager
def spill_dir(dst: str | Path) -> Iterator[ArraySpill]:
    """An ArraySpill in a temporary directory beside `dst` (same filesystem), removed after."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=f".{dst.name}.spill-", dir=dst.parent))
    try:
        yield ArraySpill(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
