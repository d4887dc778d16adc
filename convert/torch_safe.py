"""Loading torch `.pt` files without unpickling arbitrary objects.

`torch.load(weights_only=True, mmap=True)` after `import torch.distributed.tensor` (which
registers DTensor, DeviceMesh and placements as safe), plus an explicit allowlist of exactly
the numpy globals that `numpy.random.get_state()` pickles into VERL's extra state
(verl/utils/checkpoint/checkpoint_manager.py::get_rng_state): `ndarray`, `dtype`, the uint32
dtype class (`numpy.dtypes.UInt32DType`, numpy >= 1.25) and `_reconstruct`, under both its numpy 2 (`numpy._core`) and numpy 1 (`numpy.core`) module paths.
Anything else in a pickle (a function, a class, `os.system`) makes torch refuse the file; we
re-raise that as a `ConvertError` naming the file. Loaded numpy arrays are further checked to
hold numbers only (an object-dtype array could smuggle values past the allowlist).
"""
from __future__ import annotations

import logging
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from convert.errors import ConversionWarning, ConvertError
from jscenegen.paths import not_a_file

_TELLING = ("Unsupported global", "but got", "GLOBAL", "zip archive", "central directory")


def _numpy_allowlist() -> list[Any]:
    from numpy._core.multiarray import _reconstruct

    uint32_dtype = type(np.dtype(np.uint32))  # numpy.dtypes.UInt32DType: the MT19937 key array
    return [np.ndarray, np.dtype, uint32_dtype, _reconstruct,
            (_reconstruct, "numpy.core.multiarray._reconstruct")]


def check_torch_zip(path: Path) -> None:
    """Raise ConvertError naming `path` unless it is a regular file holding a complete zip
    archive (what torch.save writes; its central directory is at the end, so a truncated file
    fails). Reads only the archive's end."""
    if why := not_a_file(path):
        raise ConvertError(f"{path}: {why}")
    try:   # is_zipfile reads an unreadable file as "not a zip"
        with open(path, "rb"):
            pass
    except OSError as err:
        raise ConvertError(f"{path}: unreadable ({err.strerror or err})") from None
    if not zipfile.is_zipfile(path):
        raise ConvertError(f"{path}: refused: not a complete torch zip archive "
                           f"({path.stat().st_size} bytes; truncated, or not written by torch.save)")


def load_pt(path: str | Path, *, mmap: bool = True) -> Any:
    """Load one torch file safely, tensors on CPU (memory-mapped when `mmap`).

    Raises ConvertError naming `path` when the file is missing, truncated or not a torch zip
    archive, or when its pickle references any global outside torch's weights-only set plus
    the numpy random-state allowlist.
    """
    import torch
    import torch.distributed.tensor  # noqa: F401  (registers DTensor types as safe globals)

    path = Path(path)
    check_torch_zip(path)
    mesh_log = logging.getLogger("torch.distributed.device_mesh")
    level = mesh_log.level
    mesh_log.setLevel(logging.ERROR)  # "unpickling of the DeviceMesh before the PGs": expected
    try:
        with torch.serialization.safe_globals(_numpy_allowlist()):
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # torch raises RuntimeError/UnpicklingError/EOFError/OSError
        if "ShardedTensor" in str(err):
            raise ConvertError(
                f"{path}: holds torch ShardedTensors: an FSDP1 SHARDED_STATE_DICT checkpoint "
                "(VERL strategy fsdp); only FSDP2 checkpoints (DTensors, strategy fsdp2) convert"
            ) from None
        lines = [m.strip() for m in str(err).splitlines() if m.strip()]
        detail = next((m for m in lines if any(s in m for s in _TELLING)), lines[0] if lines else "")
        raise ConvertError(
            f"{path}: refused (weights_only load failed: {type(err).__name__}: {detail[:300]}); "
            "the file is truncated, not a torch checkpoint, or carries objects other than "
            "tensors, DTensors and a numpy random state"
        ) from None
    finally:
        mesh_log.setLevel(level)
    _check_numpy(obj, path)
    return obj


MAX_NODES = 1_000_000


def _check_numpy(obj: Any, path: Path) -> None:
    """Refuse numpy arrays of object/void dtype anywhere in `obj` (a nested container), and
    containers nested deeper than 32 levels or holding more than MAX_NODES distinct values.
    A container reached twice is walked once: a pickle can share one list many times over, a
    few KB that would expand exponentially if walked as a tree."""
    seen: set[int] = set()
    stack = [(obj, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > 32:
            raise ConvertError(f"{path}: nesting deeper than 32 levels")
        if isinstance(node, np.ndarray):
            if node.dtype.kind not in "biuf":
                raise ConvertError(f"{path}: numpy array of dtype {node.dtype} refused (numbers only)")
            continue
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        if len(seen) + len(stack) + len(children) > MAX_NODES:
            raise ConvertError(f"{path}: refused: more than {MAX_NODES:,} nested values")
        stack.extend((c, depth + 1) for c in children)


class StorageCrcs:
    """The CRC-32 that a torch file's zip archive records for each tensor storage, checked
    against the bytes of a storage of its memory-mapped load.

    torch maps the whole file and cuts each storage at its record's data offset
    (torch/serialization.py, `get_record_offset`), so storage addresses are record offsets
    plus one base. The lowest storage lies at one of the lowest records: records that no
    reachable tensor uses (a DeviceMesh's own tensors) can come first. Only the central
    directory and each record's local header are read here; `check` reads the storage (the
    bytes a conversion reads anyway). When no base maps every storage onto a record of its
    size (a torch that loads otherwise), nothing is checked.
    """

    def __init__(self, path: Path, obj: Any):
        self.path = path
        storages = {s.data_ptr(): s.nbytes() for s in _storages(obj) if s.nbytes()}
        records = {}
        with open(path, "rb") as f, zipfile.ZipFile(f) as zf:
            for info in zf.infolist():
                if ("/data/" not in info.filename or info.compress_type != zipfile.ZIP_STORED
                        or not info.file_size):   # empty storages have no bytes to map or check
                    continue
                f.seek(info.header_offset + 26)
                name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
                records[info.header_offset + 30 + name_len + extra_len] = (info.CRC, info.file_size,
                                                                           info.filename)
        self.records: dict[int, tuple[int, int, str]] | None = None
        if storages and records:
            lowest = min(storages)
            for offset in sorted(records)[:max(len(records) - len(storages) + 1, 0)]:
                base = lowest - offset
                if all(records.get(p - base, (0, -1))[1] == n for p, n in storages.items()):
                    self.base, self.records = base, records
                    break
            else:
                warnings.warn(f"{path}: its tensors do not lie at its zip records' offsets (a "
                              "torch that loads differently?): their CRC-32 is not checked",
                              ConversionWarning, stacklevel=2)

    def check(self, storage: Any, label: str) -> None:
        """Raise ConvertError naming the file and `label` when `storage`'s bytes differ from
        the CRC-32 its record carries (a bit flipped on disk or in a copy)."""
        import torch

        if self.records is None or not storage.nbytes():
            return
        crc, _, name = self.records[storage.data_ptr() - self.base]
        raw = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
        if zlib.crc32(raw) != crc:
            raise ConvertError(f"{self.path}: {label}: its bytes fail the CRC-32 the file records "
                               f"for them ({name}); the file is corrupt")


def _storages(obj: Any) -> list[Any]:
    """Every tensor storage reachable in a loaded object (DTensors by their local tensor)."""
    import torch
    from torch.distributed.tensor import DTensor

    out, todo, seen = [], [obj], set()
    while todo:
        x = todo.pop()
        if id(x) in seen:       # a pickle can share one container many times over
            continue
        seen.add(id(x))
        if isinstance(x, DTensor):
            out.append(x._local_tensor.untyped_storage())
        elif isinstance(x, torch.Tensor):
            out.append(x.untyped_storage())
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
    return out
