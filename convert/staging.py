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

from convert.errors import ConvertError
from jscenegen.paths import umask_mode


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
        umask_mode(tmp)
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
