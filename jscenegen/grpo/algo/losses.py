"""PPO-clip policy loss, loss aggregation, KL estimators and the combined GRPO objective.

Pure, jit-able functions over [B, T] arrays aligned with the token sequence (entry t
concerns token t; `mask` is 1 on trained tokens). Formulas: ../shared/specs/grpo.md; VERL sources:
verl/trainer/ppo/core_algos.py (`compute_policy_loss_vanilla`, `agg_loss`, `kl_penalty`).

NaN/inf safety: every function that takes a mask replaces masked-out entries by 0 *before*
computing with them, so a NaN or inf outside the mask changes neither values nor gradients.
"""
from __future__ import annotations

from typing import NamedTuple, get_args

import jax
import jax.numpy as jnp

from jscenegen.grpo.algo.config import AggMode, KLType

AGG_MODES: tuple[str, ...] = get_args(AggMode)
KL_TYPES: tuple[str, ...] = tuple(k for k in get_args(KLType) if not k.endswith("+"))  # "+": straight-through


def masked_sum(x, mask):
    """sum(x * mask) with entries outside the mask treated as 0 (NaN-safe). Returns float32 []."""
    m = jnp.asarray(mask, jnp.float32)
    return jnp.sum(jnp.where(m != 0, x * m, 0.0))


def clamp(x, low: float, high: float):
    """min(max(x, low), high) (low <= high) with `torch.clamp`'s gradient: 1 where low <= x <=
    high, bounds included, else 0 (`jnp.clip` passes half of it at a bound: a token whose ratio
    lands exactly on 1 +- clip got 3/4 of VERL's gradient). NaN stays NaN and, unlike torch,
    passes its gradient: a NaN log-prob makes the gradient non-finite, so the update is
    skipped (what a selection-capacity overflow relies on). Any shape and float dtype."""
    return jnp.where(x < low, low, jnp.where(x > high, high, x))


def agg_loss(
    per_token, mask, mode: str, global_token_count=None, global_seq_count=None, horizon=None,
    *, legacy: bool = False,
):
    """Aggregate a per-token loss matrix into a scalar (VERL `agg_loss`).

    Args:
      per_token: [B, T] float loss per token.
      mask: [B, T] 0/1 trained-token mask.
      mode: one of AGG_MODES.
      global_token_count: trained tokens of the whole mini-batch (token-mean divisor); None =
        this call's sum(mask).
      global_seq_count: episodes of the whole mini-batch (sequence-mode divisor; rows without
        trained tokens included, padding rows not); None = this call's non-empty rows.
      horizon: seq-mean-token-sum-norm constant divisor; None = T.
      legacy: VERL 0.7-0.8 legacy `seq-mean-token-sum-norm` (sum over rows / horizon, no mean
        over sequences). Other modes are the same formulas with per-call counts.

    Returns:
      float32 [] loss. With counts left out this is VERL 0.9.1's `agg_loss` on one micro-batch
      (dp_size 1), except that an empty mask gives 0 where VERL divides 0 by 0:
        token-mean              sum(L m) / N
        seq-mean-token-sum      sum_rows sum_t(L m) / G
        seq-mean-token-mean     sum_rows [sum_t(L m) / sum_t m] / G   (empty rows add 0)
        seq-mean-token-sum-norm sum_rows sum_t(L m) / G / horizon
        token-sum               sum(L m)

    Raises:
      ValueError: unknown mode, or per_token and mask shapes differ.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode {mode!r} is not one of {AGG_MODES}")
    if per_token.shape != mask.shape or per_token.ndim != 2:
        raise ValueError(f"per_token {per_token.shape} and mask {mask.shape} must both be [B, T]")
    m = jnp.asarray(mask, jnp.float32)
    x = jnp.where(m != 0, per_token.astype(jnp.float32) * m, 0.0)
    if mode == "token-sum":
        return jnp.sum(x)
    if mode == "token-mean":
        n = jnp.sum(m) if global_token_count is None else global_token_count
        return jnp.sum(x) / jnp.maximum(jnp.asarray(n, jnp.float32), 1.0)
    row_sum = jnp.sum(x, axis=-1)
    row_tokens = jnp.sum(m, axis=-1)
    if global_seq_count is None:
        g = jnp.sum((row_tokens > 0).astype(jnp.float32))
    else:
        g = jnp.asarray(global_seq_count, jnp.float32)
    g = jnp.maximum(g, 1.0)
    if mode == "seq-mean-token-sum":
        return jnp.sum(row_sum) / g
    if mode == "seq-mean-token-mean":
        return jnp.sum(row_sum / jnp.maximum(row_tokens, 1.0)) / g
    h = float(per_token.shape[-1] if horizon is None else horizon)
    if legacy:
        return jnp.sum(row_sum) / h
    return jnp.sum(row_sum) / g / h


class ClipTerms(NamedTuple):
    """Per-token pieces of the PPO-clip loss, each [B, T] float32 (bool for the flags)."""

    loss: jax.Array  # per-token clipped (and dual-clipped) loss
    log_ratio: jax.Array  # clamp(logp - old_logp, -20, 20)
    ratio: jax.Array  # exp(log_ratio)
    clipped: jax.Array  # l2 > l1: the clip bound was active
    clipped_lower: jax.Array  # dual clip active (A < 0 and l_clip > -A * clip_c)


def ppo_clip_terms(logp, old_logp, advantages, clip_low, clip_high, clip_c) -> ClipTerms:
    """Per-token PPO-clip loss with dual clip (VERL `compute_policy_loss_vanilla`).

    log_ratio = clamp(logp - old_logp, -20, 20); ratio = exp(log_ratio);
    l1 = -A ratio; l2 = -A clip(ratio, 1 - clip_low, 1 + clip_high); l = max(l1, l2);
    for A < 0: l = min(l, -A clip_c). Inputs are [B, T] float32; no masking here.
    """
    log_ratio = clamp(logp - old_logp, -20.0, 20.0)
    ratio = jnp.exp(log_ratio)
    l1 = -advantages * ratio
    l2 = -advantages * clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    l_clip = jnp.maximum(l1, l2)
    l3 = -advantages * clip_c
    negative = advantages < 0
    loss = jnp.where(negative, jnp.minimum(l_clip, l3), l_clip)
    return ClipTerms(loss, log_ratio, ratio, l2 > l1, negative & (l_clip > l3))


def _masked_clip_terms(logp, old_logp, advantages, mask, clip_low, clip_high, clip_c):
    """(mask float32, mask bool, logp with 0 outside the mask, `ppo_clip_terms` of the masked
    inputs): entries outside `mask` become 0 first, so NaN there never reaches the math."""
    m = jnp.asarray(mask, jnp.float32)
    on = m != 0
    logp = jnp.where(on, logp, 0.0)
    terms = ppo_clip_terms(logp, jnp.where(on, old_logp, 0.0), jnp.where(on, advantages, 0.0),
                           clip_low, clip_high, clip_c)
    return m, on, logp, terms


def kl_penalty(logp, ref_logp, kind: str):
    """Per-token KL estimate between the policy and a frozen reference (VERL `kl_penalty`).

    With d = logp - ref_logp:
      "kl"/"k1": d;  "abs": |d|;  "mse"/"k2": d^2 / 2;
      "low_var_kl"/"k3": x = clamp(-d, -20, 20); clamp(exp(x) - x - 1, -10, 10).
    A trailing "+" (e.g. "k3+") keeps the base estimator's value but takes k2's gradient
    (straight-through, VERL >= 0.6). Inputs [B, T] float32, unmasked: mask NaN positions
    before calling (as `grpo_loss` does). Raises ValueError for an unknown kind.
    """
    if kind.endswith("+"):
        base = kind[:-1]
        if base not in KL_TYPES:
            raise ValueError(f"kl_loss_type {kind!r}: unknown base estimator {base!r}")
        k2 = kl_penalty(logp, ref_logp, "k2")
        return k2 - jax.lax.stop_gradient(k2) + jax.lax.stop_gradient(kl_penalty(logp, ref_logp, base))
    d = logp - ref_logp
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return jnp.sign(d) * d  # |d| with torch's subgradient 0 at d = 0
    if kind in ("mse", "k2"):
        return 0.5 * d * d
    if kind in ("low_var_kl", "k3"):
        x = clamp(-d, -20.0, 20.0)
        return clamp(jnp.exp(x) - x - 1.0, -10.0, 10.0)
    raise ValueError(f"kl_loss_type {kind!r} is not one of {KL_TYPES} (optionally with '+')")


class LossParts(NamedTuple):
    """Result of `grpo_loss`: the scalar objective and masked sums for metrics."""

    loss: jax.Array  # pg_loss - entropy_coeff * entropy_term + kl_coef * kl_term
    pg_loss: jax.Array
    entropy_term: jax.Array  # aggregated entropy (same agg mode); 0 when not needed
    kl_term: jax.Array  # aggregated KL; 0 when use_kl_loss is off
    sums: dict  # masked sums: tokens, clipped, clipped_lower, neg_log_ratio, entropy, kl; max ratio


def grpo_loss(
    logp, entropy, old_logp, advantages, mask, ref_logp, *, clip_low, clip_high, clip_c,
    agg_mode, entropy_coeff=0.0, use_kl_loss=False, kl_coef=0.0, kl_type="low_var_kl",
    global_token_count=None, global_seq_count=None, horizon=None, legacy=False, rollout_logp=None,
) -> LossParts:
    """The actor objective of one (micro-)batch: VERL's pg_loss - c_H agg(H) + beta agg(KL).

    All array inputs are [B, T] float32 (`ref_logp` may be None when use_kl_loss is off;
    `entropy` may be None when entropy_coeff is 0 and no entropy metric is wanted). Entries
    outside `mask` are replaced by 0 before use, so NaN there is harmless. The three terms
    share one aggregation (agg_mode, counts, horizon, legacy), as in VERL's dp_actor.
    With `rollout_logp` (the sampler's log-probs) `sums["drift"]` is the masked sum of
    |rollout_logp - old_logp| (sampler vs trainer log-prob drift; ../shared/specs/grpo.md keeps
    the sampler's log-probs only for this metric), else 0. `token_means(sums)` turns the sums
    into the step's metrics.
    """
    m, on, logp, terms = _masked_clip_terms(logp, old_logp, advantages, mask, clip_low, clip_high,
                                            clip_c)
    agg = lambda x: agg_loss(  # noqa: E731
        x, m, agg_mode, global_token_count, global_seq_count, horizon, legacy=legacy
    )
    pg = agg(terms.loss)
    zero = jnp.zeros((), jnp.float32)
    ent_term, ent_sum = zero, zero
    if entropy is not None:
        ent = jnp.where(on, entropy, 0.0)
        ent_sum = masked_sum(ent, m)
        if entropy_coeff != 0:
            ent_term = agg(ent)
    kl_term, kl_sum = zero, zero
    if use_kl_loss:
        if ref_logp is None:
            raise ValueError("use_kl_loss is on but no reference log-probs were given")
        kl = kl_penalty(logp, jnp.where(on, ref_logp, logp), kl_type)
        kl_term = agg(kl)
        kl_sum = masked_sum(jax.lax.stop_gradient(kl), m)
    loss = pg - entropy_coeff * ent_term + kl_coef * kl_term
    sg = jax.lax.stop_gradient
    drift = zero
    if rollout_logp is not None:
        drift = masked_sum(jnp.abs(jnp.where(on, rollout_logp, 0.0) - jnp.where(on, sg(old_logp), 0.0)), m)
    sums = {
        "tokens": jnp.sum(m),
        "clipped": masked_sum(terms.clipped.astype(jnp.float32), m),
        "clipped_lower": masked_sum(terms.clipped_lower.astype(jnp.float32), m),
        "neg_log_ratio": masked_sum(-sg(terms.log_ratio), m),
        "entropy": sg(ent_sum),
        "kl": kl_sum,
        "ratio_max": jnp.max(jnp.where(on, sg(terms.ratio), 0.0)),
        "drift": drift,
    }
    return LossParts(loss, pg, ent_term, kl_term, sums)


def token_means(sums: dict) -> dict:
    """The per-token metrics of `grpo_loss`'s (accumulated) `sums`, float32 [] each: clipfrac,
    clipfrac_lower, approx_kl (mean -log ratio), entropy, kl and logprob_drift as means over
    the trained tokens (0 when there are none, as VERL's masked means), ratio_max as it is."""
    denom = jnp.maximum(sums["tokens"], 1.0)
    return {"clipfrac": sums["clipped"] / denom, "clipfrac_lower": sums["clipped_lower"] / denom,
            "approx_kl": sums["neg_log_ratio"] / denom, "ratio_max": sums["ratio_max"],
            "entropy": sums["entropy"] / denom, "kl": sums["kl"] / denom,
            "logprob_drift": sums["drift"] / denom}
