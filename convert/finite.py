"""Model weights holding NaN or Inf, noticed while a conversion reads them.

`convert.dispatch.convert` runs every direction inside `watching()`; the readers of model
weights (HF safetensors, VERL rank files, orbax steps) `note` each array they read. A
conversion copies such values faithfully, so they are warned about (ConversionWarning), not
refused: loading the output warns again (`jscenegen.model.loader`), and every update from those
weights would be skipped for a non-finite gradient. Adam moments are refused where they are
read (convert/verl_read.py).
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Iterator

import numpy as np

from convert.errors import ConversionWarning

BLOCK_VALUES = 1 << 24   # values checked at a time
# process-wide, not a context variable: orbax reads the arrays it writes in its own threads
_LOCK = threading.Lock()
_seen: dict[str, None] | None = None


def note(name: str, array: np.ndarray) -> None:
    """Record `name` when `array` (any dtype; bf16 as ml_dtypes) holds a NaN or an infinity,
    inside `watching()`; outside it, nothing."""
    if _seen is None or name in _seen:
        return
    a = np.asarray(array)
    floating = np.issubdtype(a.dtype, np.floating) or a.dtype.name in ("bfloat16", "float8_e4m3fn",
                                                                       "float8_e5m2")
    if not floating or a.size == 0:
        return
    rows = a.reshape(len(a), -1) if a.ndim > 1 else a.reshape(1, -1)
    block = max(1, BLOCK_VALUES // rows.shape[1])   # a bool temporary per block, not per tensor
    if any(not np.isfinite(rows[i:i + block]).all() for i in range(0, len(rows), block)):
        with _LOCK:
            if _seen is not None:
                _seen[name] = None


@contextlib.contextmanager
def watching(source: str) -> Iterator[None]:
    """Collect the `note`s of one conversion of `source`; warn once, naming up to five
    tensors, when any held NaN or Inf (also when the conversion fails after reading them)."""
    global _seen
    with _LOCK:
        outer, _seen = _seen, {}
    try:
        yield
    finally:
        with _LOCK:
            names, _seen = list(_seen or ()), outer
        if names:
            warnings.warn(ConversionWarning(
                f"{source}: {len(names)} tensor(s) hold NaN or Inf values: "
                f"{', '.join(names[:5])}{' ...' if len(names) > 5 else ''} (copied as they are; "
                "every update from these weights would be skipped for a non-finite gradient)"))
