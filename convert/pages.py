"""Hints to the kernel about memory-mapped shard data: read ahead in bulk, then drop it.

A local shard read through torch's `mmap=True` storage page-faults in small readahead
windows; `madvise(MADV_WILLNEED)` on its address range first starts one large sequential read,
and `madvise(MADV_DONTNEED)` after copying it out removes the (clean, file-backed, private)
pages from this process, so resident memory stays near one tensor. Both are hints (Linux,
madvise(2)); where unavailable they do nothing, and correctness never depends on them.
"""
from __future__ import annotations

import ctypes
import mmap
import sys

_PAGE = mmap.PAGESIZE
_WILLNEED, _DONTNEED = 3, 4  # <sys/mman.h>, Linux
try:
    _libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
    _madvise = _libc.madvise if _libc is not None else None
    if _madvise is not None:
        _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
except (OSError, AttributeError):
    _madvise = None


def _advise(ptr: int, nbytes: int, advice: int) -> None:
    if _madvise is None or nbytes <= 0:
        return
    start = ptr - ptr % _PAGE
    _madvise(start, nbytes + (ptr - start), advice)


def will_need(ptr: int, nbytes: int) -> None:
    """Ask the kernel to read [ptr, ptr + nbytes) of a file mapping ahead, in bulk."""
    _advise(ptr, nbytes, _WILLNEED)


def dont_need(ptr: int, nbytes: int) -> None:
    """Drop the pages of [ptr, ptr + nbytes) (whole pages inside it) from this process.

    Only for clean private file mappings that are re-readable from the file: the next access
    faults the data in again, unchanged.
    """
    if _madvise is None or nbytes <= 0:
        return
    start = -(-ptr // _PAGE) * _PAGE  # whole pages only: never touch a neighbour's page
    end = (ptr + nbytes) // _PAGE * _PAGE
    if end > start:
        _madvise(start, end - start, _DONTNEED)
