"""Rematerialisation of a decoder layer in the backward pass (`jax.checkpoint`), by policy.

Policies, named as MaxText's `remat_policy`: `full` recomputes the whole layer's forward;
`minimal` keeps the outputs of the projections (every `dense.dense`, named PROJECTION: q/k/v/o,
gate/up/down, the linear-attention ones) and of any other matmul without batch dimensions
(`jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims`), and recomputes the rest (norms,
RoPE, activations, attention's batched products): the backward pass repeats no projection, at
the memory of their outputs.
"""
from __future__ import annotations

from typing import Callable

import jax

from jscenegen.model.dense import PROJECTION

REMAT_POLICIES = ("full", "minimal")


def remat_policy(remat: bool | str) -> str | None:
    """The policy `remat` names: None (False: no rematerialisation), "full" (True or "full"),
    "minimal". Raises ValueError for any other value."""
    if remat is False or remat is None:
        return None
    if remat is True:
        return "full"
    if remat in REMAT_POLICIES:
        return remat
    raise ValueError(f"remat {remat!r}: choose False, True or one of {', '.join(REMAT_POLICIES)}")


def checkpointed(fn: Callable, remat: bool | str, **kwargs) -> Callable:
    """`fn` under `jax.checkpoint` with `remat`'s policy (`kwargs` to jax.checkpoint), or
    `fn` itself without rematerialisation."""
    policy = remat_policy(remat)
    if policy is None:
        return fn
    saved = None
    if policy == "minimal":
        saved = jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
            jax.checkpoint_policies.save_only_these_names(PROJECTION))
    return jax.checkpoint(fn, policy=saved, **kwargs)
