"""GRPO outcome advantages: one scalar score per episode, normalised within its group.

Mirrors VERL's `compute_grpo_outcome_advantage` (verl/trainer/ppo/core_algos.py) with the
changes of ../shared/specs/grpo.md: invalid members (judge/infrastructure failure, non-finite score)
are left out of the statistics and get 0; a group with fewer than 2 valid members gets 0.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def check_group_sizes(group_ids, group_size: int) -> None:
    """Raise ValueError unless every group id occurs exactly `group_size` times.

    Args:
      group_ids: [B] integer group ids (host values; not a tracer).
      group_size: the declared G of every group.
    """
    ids = np.asarray(group_ids)
    uniq, counts = np.unique(ids, return_counts=True)
    bad = {int(u): int(c) for u, c in zip(uniq, counts) if c != group_size}
    if bad:
        raise ValueError(
            f"groups with a member count other than the declared group size {group_size}: "
            f"{bad} (group id: count)"
        )


def grpo_outcome_advantages(
    scores, group_ids, valid, eps: float = 1e-6, norm_by_std: bool = True, group_size=None
):
    """Per-episode GRPO advantages.

    Args:
      scores: [B] float episode rewards; policy failures (-1) are ordinary values.
      group_ids: [B] integer group ids; the members of a group share one id. The declared
        size of a group is its member count (pass `group_size` to assert it).
      valid: [B] bool; false for judge/infrastructure failures. Non-finite scores are treated
        as invalid too.
      eps: added to the group std (VERL: 1e-6).
      norm_by_std: True: (s - mean) / (std + eps); False: s - mean (Dr. GRPO).
      group_size: optional declared G; every group must have exactly G members (checked on
        host values; raises TypeError if `group_ids` is a tracer).

    Returns:
      [B] float32 advantages. Invalid members get 0. A group of >= 2 members with fewer than
      2 valid ones gets 0. A group declared with one member uses mean 0, std 1:
      A = s / (1 + eps) (s if not norm_by_std), uncentred, as VERL. Otherwise mean and
      unbiased (ddof=1) std over the valid members. Groups whose valid scores are all equal
      get exactly 0 (the mean is taken relative to a member's score, so it is exact).

    Raises:
      ValueError: shapes differ, or (with group_size) a group has the wrong member count.
    """
    scores = jnp.asarray(scores, jnp.float32)
    group_ids = jnp.asarray(group_ids) if not isinstance(group_ids, jax.core.Tracer) else group_ids
    valid = jnp.asarray(valid)
    if not (scores.ndim == 1 and scores.shape == group_ids.shape == valid.shape):
        raise ValueError(
            f"scores {scores.shape}, group_ids {group_ids.shape} and valid {valid.shape} "
            "must all be [B]"
        )
    if group_size is not None:
        if isinstance(group_ids, jax.core.Tracer):
            raise TypeError("group_size check needs concrete group_ids; call it outside jit")
        check_group_sizes(group_ids, group_size)
    return _advantages(scores, group_ids, valid, eps, norm_by_std)


def _advantages(scores, group_ids, valid, eps, norm_by_std):
    ok = valid.astype(bool) & jnp.isfinite(scores)
    s = jnp.where(ok, scores, 0.0)
    b = s.shape[0]
    _, seg = jnp.unique(group_ids, return_inverse=True, size=b)  # dense group index per row
    seg = seg.reshape(b)

    def group_sum(x):  # per row: the sum of x over the row's group
        return jax.ops.segment_sum(x, seg, num_segments=b)[seg]

    members = group_sum(jnp.ones_like(s))  # declared size of each row's group
    n = group_sum(ok.astype(jnp.float32))  # valid members of each row's group
    # shift by the group's first valid score so equal scores centre to exactly 0
    first = jax.ops.segment_min(jnp.where(ok, jnp.arange(b), b), seg, num_segments=b)[seg]
    shift = s[jnp.minimum(first, b - 1)]
    d = jnp.where(ok, s - shift, 0.0)
    mean_d = group_sum(d) / jnp.maximum(n, 1.0)
    dev = jnp.where(ok, d - mean_d, 0.0)
    var = group_sum(dev * dev) / jnp.maximum(n - 1.0, 1.0)
    centred = (s - shift) - mean_d
    if norm_by_std:
        grouped = centred / (jnp.sqrt(var) + eps)
        single = s / (1.0 + eps)
    else:
        grouped = centred
        single = s
    adv = jnp.where(members == 1, single, jnp.where(n >= 2, grouped, 0.0))
    return jnp.where(ok, adv, 0.0).astype(jnp.float32)
