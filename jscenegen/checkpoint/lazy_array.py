"""Arrays that orbax writes one at a time, read from their source only when written.

Orbax's `NumpyHandler` deep-copies every host array of a save and then writes them all at
once, so saving a tree of NumPy arrays holds the tree about twice. Converters write models
that do not fit in memory (a 7B model in fp32 with Adam moments is ~90 GB), so they pass
`LazyArray` leaves instead: each carries its shape, dtype and a loader, and the handler
registered here loads, writes and releases them sequentially. On disk a LazyArray is exactly
what a NumPy leaf is (type string `np.ndarray`), so restoring needs nothing from this module.

Peak host memory of a save of LazyArray leaves: the largest array plus tensorstore's
buffers for it (measured by bench/convert.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import threading
from typing import Callable, Iterator, Sequence

import numpy as np
from orbax.checkpoint import type_handlers


@dataclasses.dataclass(frozen=True)
class LazyArray:
    """A host array known by shape and dtype, materialised by `load()` when orbax writes it.

    load: returns an np.ndarray of exactly `shape` and `dtype`; called once per save, on
    orbax's writer thread. A mismatching result raises ValueError naming `name`. Converters
    build LazyArrays at the logical shape (checkpoint.to_logical cannot slice padding off them).
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    load: Callable[[], np.ndarray]
    name: str = ""

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def materialize(self) -> np.ndarray:
        """`load()`, checked against the declared shape and dtype."""
        arr = np.asarray(self.load())
        if arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError(f"{self.name or 'LazyArray'}: loader returned {arr.dtype}{list(arr.shape)}, "
                             f"declared {self.dtype}{list(self.shape)}")
        return arr

    @classmethod
    def zeros(cls, shape: Sequence[int], dtype=np.float32, name: str = "") -> "LazyArray":
        """Zeros made only when written (fresh Adam moments)."""
        return cls(tuple(shape), np.dtype(dtype), lambda: np.zeros(tuple(shape), dtype), name)


class _SequentialNumpyHandler(type_handlers.NumpyHandler):
    """Writes LazyArray leaves in the NumPy format, loading and releasing one at a time."""

    def __init__(self):
        super().__init__(deepcopy_host_arrays=False)

    async def _background_serialize(self, values, infos, args=None):
        args = args or [type_handlers.SaveArgs()] * len(values)
        for value, info, arg in zip(values, infos, args):
            # The items of a save (params, adam) are written by different threads, each with its
            # own event loop: a process-wide lock, acquired without blocking this loop.
            await asyncio.get_running_loop().run_in_executor(None, _WRITE_LOCK.acquire)
            try:
                if _CANCELLED.is_set():   # orbax ends a cancelled writer without logging it
                    raise asyncio.CancelledError(f"{info.name}: the save was interrupted")
                await super()._background_serialize([value.materialize()], [info], [arg])
            finally:
                _WRITE_LOCK.release()


_WRITE_LOCK = threading.Lock()
_CANCELLED = threading.Event()


@contextlib.contextmanager
def cancel_on_interrupt() -> Iterator[None]:
    """Within it, an interrupt of the main thread (Ctrl-C, `signals.Terminated`) stops the
    LazyArray writes that have not begun: the writer threads then end after the array in
    hand instead of loading and writing the rest of the model."""
    _CANCELLED.clear()
    try:
        yield
    except BaseException as err:
        if not isinstance(err, Exception):
            _CANCELLED.set()
        raise


def _register() -> None:
    # Sharing NumPy's type string is the point (restores need nothing from here); orbax logs a
    # warning about the collision, which is expected, so it is silenced for this one call.
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        type_handlers.register_type_handler(LazyArray, _SequentialNumpyHandler(), override=True)
    finally:
        absl_logger.setLevel(level)


_register()
