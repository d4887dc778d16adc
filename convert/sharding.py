"""FSDP2's shard arithmetic, shared by the VERL reader and writer.

torch.chunk semantics (torch/distributed/fsdp/_fully_shard/_fsdp_param.py): along the shard
dimension of size n, c = ceil(n / W) and rank r holds [r*c, min((r+1)*c, n)); trailing ranks
can hold fewer rows or none (n = 13, W = 6: 3, 3, 3, 3, 1, 0).
"""
from __future__ import annotations

from typing import Mapping

PLACEMENTS = ("dim0", "first-divisible")


def chunk_bounds(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of `rank`'s slice of a dimension of size `n` split over `world_size`."""
    c = -(-n // world_size) if n else 0
    start = min(rank * c, n)
    return start, min(start + c, n)


def shard_dim(shape: tuple[int, ...], world_size: int, placement: str) -> int:
    """The dimension FSDP2 shards a tensor of `shape` on.

    "dim0": VERL 0.9 / FSDP2's default `Shard(0)`. "first-divisible": VERL 0.6 - 0.8
    (verl/utils/fsdp_utils.py::get_shard_placement_fn): the first dimension whose size is
    divisible by `world_size`, else 0. Raises ValueError for another placement name.
    """
    if placement == "dim0":
        return 0
    if placement == "first-divisible":
        return next((d for d, n in enumerate(shape) if n % world_size == 0), 0)
    raise ValueError(f"placement {placement!r}: choose one of {', '.join(PLACEMENTS)}")


def placement_of(shapes: Mapping[str, tuple[int, ...]], dims: Mapping[str, int | None],
                 fsdp_size: int) -> tuple[str, ...]:
    """The placements whose rule gives the shard dims `dims` ({name: dim, None = replicated})
    of tensors of `shapes` over `fsdp_size` shards, in `PLACEMENTS` order: both when every
    sharded tensor is on dim 0 and first-divisible puts it there too (its dim 0 divides by
    `fsdp_size`, or no dim does): then the files cannot tell VERL 0.9 from 0.6 - 0.8; one
    when only its rule fits, () when neither (or no sharded tensor) explains them."""
    sharded = {n: d for n, d in dims.items() if d is not None and n in shapes}
    if not sharded or fsdp_size < 1:
        return ()
    return tuple(p for p in PLACEMENTS
                 if all(d == shard_dim(tuple(shapes[n]), fsdp_size, p) for n, d in sharded.items()))
