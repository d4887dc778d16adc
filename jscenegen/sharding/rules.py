"""Every PartitionSpec jscenegen uses, in one table, on the ("fsdp", "sp") mesh.

Parameters and both Adam moments follow torch FSDP2's `Shard(0)` over all devices (dim 0 split
over fsdp x sp, padded to a multiple of the device count: ../shared/DESIGN.md "Parameter
sharding"); activations split batch rows over `fsdp` and sequence positions over `sp`.
Everything else that places an array (the loader, the checkpoint store, the sampler, the
batch layout, the activation constraints) takes its spec from here.
"""
from __future__ import annotations

import math

from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("fsdp", "sp")
FSDP, SP = AXES                    # the axis names, for collectives inside shard_map

PARAM = P(AXES)                    # [n, ...] parameter / Adam moment: dim 0 over every device
STACKED_PARAM = P(None, AXES)      # [L, n, ...] parameters stacked over layers (the layer scan)
GROUPED_PARAM = P(None, None, AXES)  # [G, R, n, ...] stacked over layer groups and runs (hybrid scan)
ACTIVATION = P("fsdp", "sp")       # [B, S, ...] rows over fsdp, positions over sp
SEQ_GATHERED = P("fsdp")           # [B, S, ...] rows over fsdp, every position on each sp shard
ROWS = P("fsdp")                   # [B, ...] per-row arrays (sampler state, per-row vectors)
LAYER_ROWS = P(None, "fsdp")       # [L, B, ...] per-layer per-row arrays (KV cache, GDN states)
REPLICATED = P()                   # whole on every device (gathered weights, scalars)


def padded_shape(shape: tuple[int, ...], multiple: int) -> tuple[int, ...]:
    """`shape` with dim 0 rounded up to a multiple of `multiple`: FSDP2's padding for `PARAM`
    (device r of W holds rows [r*c, (r+1)*c), c = ceil(n / W))."""
    n = shape[0]
    return (-(-n // multiple) * multiple, *shape[1:])


def named(mesh: Mesh, spec: P) -> NamedSharding:
    """`spec` on `mesh` as a NamedSharding."""
    return NamedSharding(mesh, spec)


def batch_spec(ndim: int) -> P:
    """Spec of a host batch array of rank `ndim`: [B, T, ...] -> ACTIVATION, [B] -> ROWS."""
    return ACTIVATION if ndim >= 2 else ROWS


def storage_spec(shape: tuple[int, ...], mesh: Mesh, padded: tuple[int, ...] | None = None) -> P:
    """A spec for a LOGICAL-shape (unpadded) array that JAX accepts on `mesh` (every split even).

    Each mesh axis, in mesh order, joins the lowest dimension whose size (and the size in
    `padded`, when given) it still divides; an axis that divides no dimension replicates. For
    Qwen sizes on 3 x 2 this keeps dim 0 split wherever it divides. Used to write checkpoints,
    which store arrays without FSDP padding.
    """
    dims: list[list[str]] = [[] for _ in shape]
    for axis in mesh.axis_names:
        size = mesh.shape[axis]
        for d, n in enumerate(shape):
            split = math.prod(mesh.shape[a] for a in dims[d]) * size
            if n % split == 0 and (padded is None or padded[d] % split == 0):
                dims[d].append(axis)
                break
    return P(*[None if not a else a[0] if len(a) == 1 else tuple(a) for a in dims])
