"""Activation sharding constraints, active only under a mesh with axes ("fsdp", "sp").

The model calls `constrain(x, spec)` at block boundaries; without a mesh (or with a mesh that
lacks the axes) it is the identity, so the same module runs unsharded. Batch rows go over
`fsdp`, sequence positions over `sp`; see jscenegen/sharding for the parameter layout.
"""
from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

BATCH_SEQ = P("fsdp", "sp")           # [B, S, ...] activations
BATCH_ONLY = P("fsdp")                # [B, S, ...] with the sequence gathered (K/V for attention)


def constrain(x: jax.Array, spec: P) -> jax.Array:
    """with_sharding_constraint(x, spec padded with None) when a ("fsdp","sp") mesh is set."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not {"fsdp", "sp"} <= set(mesh.axis_names):
        return x
    full = P(*spec, *([None] * (x.ndim - len(spec))))
    return jax.lax.with_sharding_constraint(x, full)


def constrain_stacked(x: jax.Array) -> jax.Array:
    """Keep parameters stacked over layers [L, n, ...] sharded like their layers (dim 1 over all devices)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not {"fsdp", "sp"} <= set(mesh.axis_names):
        return x
    return jax.lax.with_sharding_constraint(x, P(None, ("fsdp", "sp"), *([None] * (x.ndim - 2))))


def gather(w: jax.Array) -> jax.Array:
    """A weight all-gathered just before use (FSDP): whole on every device, activations stay
    batch/sequence-sharded. Without this, XLA may instead shard the matmul's output features
    and reshard activations, which it does by full rematerialisation."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not {"fsdp", "sp"} <= set(mesh.axis_names):
        return w
    return jax.lax.with_sharding_constraint(w, P())
