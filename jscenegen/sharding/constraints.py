"""Sharding constraints inside jitted code, by role, in the active layout.

The model constrains activations by role (`rules.ACTIVATION`, `HEADS`, `SEQ_GATHERED`, ...);
the active layout maps the role to a spec. By default that is the training layout
(`rules.TRAINING_SPECS`) under a mesh with axes ("fsdp", "sp"); the sampler traces its programs
under `use_specs(rules.ROLLOUT_SPECS)` and the rollout mesh. Without a mesh holding the
layout's axes every constraint is the identity, so the same module runs unsharded.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Iterator

import jax
from jax.sharding import PartitionSpec as P

from jscenegen.sharding.rules import AXES, GROUPED, STACKED, TRAINING_SPECS, WEIGHT, ActivationSpecs

_SPECS: contextvars.ContextVar[ActivationSpecs] = contextvars.ContextVar(
    "jscenegen_activation_specs", default=TRAINING_SPECS)


@contextlib.contextmanager
def use_specs(specs: ActivationSpecs) -> Iterator[None]:
    """Trace the enclosed code with `specs` as the role -> spec table (read at trace time)."""
    token = _SPECS.set(specs)
    try:
        yield
    finally:
        _SPECS.reset(token)


def active_spec(role: str | P) -> P | None:
    """The active layout's PartitionSpec of `role` (a PartitionSpec is returned as it is);
    None when no mesh holding the layout's axes is active or the layout leaves the role free."""
    specs = _SPECS.get()
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(specs.axes) <= set(mesh.axis_names):
        return None
    return role if isinstance(role, P) else specs.specs[role]


def axis_size(name: str) -> int:
    """Size of mesh axis `name` ("fsdp" or "sp") under an active ("fsdp", "sp") mesh, else 1."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(AXES) <= set(mesh.axis_names):
        return 1
    return mesh.shape[name]


def dividing_axes(axes: str | tuple[str, ...] | None, size: int) -> str | tuple[str, ...] | None:
    """A PartitionSpec entry `axes` (a mesh axis name, a tuple of them or None) when the
    product of their sizes in the active mesh divides `size`, else None (that dimension
    whole on every device): what `jax.shard_map`, which needs even splits, can take for a
    dimension of that size."""
    if axes is None:
        return None
    mesh = jax.sharding.get_abstract_mesh()
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    return axes if size % math.prod(mesh.shape[a] for a in names) == 0 else None


def constrain(x: jax.Array, role: str | P) -> jax.Array:
    """with_sharding_constraint(x, the active layout's spec for `role`, padded with None to x's
    rank); the identity when the layout leaves the role free or no matching mesh is active.
    `role` may also be a PartitionSpec (used as it is)."""
    spec = active_spec(role)
    if spec is None:
        return x
    return jax.lax.with_sharding_constraint(x, P(*spec, *([None] * (x.ndim - len(spec)))))


def constrain_stacked(x: jax.Array) -> jax.Array:
    """Keep parameters stacked over layers [L, n, ...] sharded like their layers (`STACKED`)."""
    return constrain(x, STACKED)


def constrain_grouped(x: jax.Array) -> jax.Array:
    """Keep parameters stacked over layer groups and runs [G, R, n, ...] sharded like their
    layers (`GROUPED`; Qwen3.5's scan over its repeating layer pattern)."""
    return constrain(x, GROUPED)


def gather(w: jax.Array) -> jax.Array:
    """A weight as a layer reads it. Training: all-gathered just before use (FSDP), whole on
    every device while activations stay batch/sequence-sharded (without this, XLA may instead
    shard the matmul's output features and reshard activations, by full rematerialisation).
    Rollout: left in its decoding layout (replicated or tensor-parallel), never gathered."""
    return constrain(w, WEIGHT)
