"""torch <-> numpy without copies where possible, bfloat16 included (via ml_dtypes, as JAX uses)."""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, Mapping

import ml_dtypes
import numpy as np

from convert.errors import ConversionWarning
from jscenegen.model.dtypes import COMPUTE, np_dtype

if TYPE_CHECKING:
    from jscenegen.checkpoint.lazy_array import LazyArray

def to_numpy(t: Any) -> np.ndarray:
    """A CPU torch tensor as a numpy array sharing its memory (bfloat16 -> ml_dtypes.bfloat16)."""
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def to_torch(a: np.ndarray) -> Any:
    """A numpy array as a torch tensor sharing its memory (ml_dtypes.bfloat16 -> torch.bfloat16)."""
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def cast(a: np.ndarray, dtype: str | None) -> np.ndarray:
    """`a` in `dtype` ("float32", "bfloat16", or None to keep it). bf16 rounds to nearest even."""
    if dtype is None or a.dtype == np.dtype(_np_dtype(dtype)):
        return a
    return a.astype(_np_dtype(dtype))


def warn_rounded_masters(where: str, source_dtypes: Mapping[str, Any], dtype: str | None) -> None:
    """Warn (ConversionWarning naming `where`) when `dtype` is narrower than the stored dtype of
    a parameter that has Adam state: the output is resumable, and a resumed run trains from the
    rounded master weights, not the source's. source_dtypes: {name: dtype} of those parameters."""
    if dtype is None:
        return
    width = np.dtype(_np_dtype(dtype)).itemsize
    rounded = [n for n, d in source_dtypes.items() if np.dtype(d).itemsize > width]
    if rounded:
        warnings.warn(ConversionWarning(
            f"{where}: --dtype {dtype} rounds the {np.dtype(source_dtypes[rounded[0]])} master "
            f"weights of {len(rounded)} parameters that have Adam state (e.g. {rounded[0]}): a "
            "run resumed from the output trains from the rounded weights (leave --dtype out to "
            "keep them)"), stacklevel=3)


def lazy_cast(name: str, shape: tuple[int, ...], source_dtype: Any, load: Callable[[], np.ndarray],
              dtype: str | None) -> "LazyArray":
    """`cast(load(), dtype)` as a LazyArray: read from the source only when orbax writes it.

    source_dtype: what `load()` returns (an np.dtype or a name such as "bfloat16")."""
    from jscenegen.checkpoint.lazy_array import LazyArray

    out = np.dtype(source_dtype) if dtype is None else np.dtype(_np_dtype(dtype))
    return LazyArray(tuple(shape), out, lambda: cast(load(), dtype), name)


def _np_dtype(name: str) -> Any:
    if name not in COMPUTE:
        raise ValueError(f"dtype {name!r}: choose one of {', '.join(COMPUTE)}")
    return np_dtype(name)
