"""Sharding constraints inside jitted code, active only under a mesh with axes ("fsdp", "sp").

The model calls these at block boundaries; without such a mesh they are the identity, so the
same module runs unsharded. Specs come from `sharding.rules`.
"""
from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jscenegen.sharding.rules import AXES, GROUPED_PARAM, REPLICATED, STACKED_PARAM


def _active() -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and set(AXES) <= set(mesh.axis_names)


def axis_size(name: str) -> int:
    """Size of mesh axis `name` ("fsdp" or "sp") under an active ("fsdp", "sp") mesh, else 1."""
    if not _active():
        return 1
    return jax.sharding.get_abstract_mesh().shape[name]


def constrain(x: jax.Array, spec: P) -> jax.Array:
    """with_sharding_constraint(x, spec padded with None to x's rank) under an ("fsdp","sp") mesh."""
    if not _active():
        return x
    return jax.lax.with_sharding_constraint(x, P(*spec, *([None] * (x.ndim - len(spec)))))


def constrain_stacked(x: jax.Array) -> jax.Array:
    """Keep parameters stacked over layers [L, n, ...] sharded like their layers (`STACKED_PARAM`)."""
    return constrain(x, STACKED_PARAM)


def constrain_grouped(x: jax.Array) -> jax.Array:
    """Keep parameters stacked over layer groups and runs [G, R, n, ...] sharded like their
    layers (`GROUPED_PARAM`; Qwen3.5's scan over its repeating layer pattern)."""
    return constrain(x, GROUPED_PARAM)


def gather(w: jax.Array) -> jax.Array:
    """A weight all-gathered just before use (FSDP): whole on every device, activations stay
    batch/sequence-sharded. Without this, XLA may instead shard the matmul's output features
    and reshard activations, which it does by full rematerialisation."""
    return constrain(w, REPLICATED)
