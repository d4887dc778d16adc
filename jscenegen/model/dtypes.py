"""The dtype names jscenegen accepts (configs, command lines, file formats), in one table.

A name is the NumPy/JAX/torch spelling ("float32", "bfloat16", "float16"); bfloat16 is
`ml_dtypes.bfloat16`, the type JAX itself uses, so host arrays need no conversion. The
safetensors codes follow the format's README ("F32", "BF16", "F16").
"""
from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

NUMPY: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}
SAFETENSORS: dict[str, str] = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
# What model parameters and compute may use (float16 is read and written, never computed in).
COMPUTE = ("float32", "bfloat16")


def np_dtype(name: str) -> np.dtype:
    """The NumPy dtype named `name`. Raises ValueError listing the accepted names."""
    try:
        return NUMPY[name]
    except (KeyError, TypeError):
        raise ValueError(f"dtype {name!r} is not supported; choose one of "
                         f"{', '.join(NUMPY)}") from None


def dtype_name(dtype: Any) -> str:
    """The name of a NumPy/JAX dtype (inverse of `np_dtype`). Raises ValueError if unsupported."""
    dt = np.dtype(dtype)
    for name, known in NUMPY.items():
        if known == dt:
            return name
    raise ValueError(f"dtype {dt} is not supported; choose one of {', '.join(NUMPY)}")


def majority_dtype(arrays) -> str:
    """The dtype name (numpy's: "float32", "bfloat16", ...) most elements of `arrays`, an
    iterable of (shape, dtype) pairs, are stored in: what an HF config.json says the weights
    are (a Qwen3.5 release keeps A_log in float32 beside bfloat16 weights and says bfloat16).
    Raises ValueError for no arrays."""
    elements: dict[str, int] = {}
    for shape, dtype in arrays:
        name = np.dtype(dtype).name
        elements[name] = elements.get(name, 0) + int(np.prod(shape))
    if not elements:
        raise ValueError("no arrays to take a dtype from")
    return max(elements, key=elements.get)
