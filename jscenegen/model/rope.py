"""Rotary position embedding (rotate-half convention) with default, linear, dynamic-NTK and YaRN scaling.

Partial rotary (Qwen3.5, `partial_rotary_factor`): only the first `cfg.rotary_dim` =
int(head_dim * factor) dims of each head rotate, with frequencies computed for that width;
the rest pass through (transformers' `apply_rotary_pos_emb` in modeling_qwen3_5.py, which
splits `x[..., :rotary_dim]` and applies `rotate_half` to that part only). Dense Qwen models
have factor 1. Qwen3.5's multimodal RoPE (mrope_section) gives every frequency the same
position for text tokens, so it is this plain partial RoPE with 1-D positions; image and
video positions are not built.

Frequencies follow transformers' `modeling_rope_utils.py` (`_compute_default_rope_parameters`,
`_compute_linear_scaling_rope_parameters`, `_compute_dynamic_ntk_parameters`,
`_compute_yarn_parameters`). Angles are computed in fp32 at highest precision; positions are
never cast to a low-precision dtype.
"""
from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np

from jscenegen.model.config import QwenConfig

log = logging.getLogger(__name__)


def _base_exponents(dim: int) -> np.ndarray:
    return np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)


def static_inv_freq(cfg: QwenConfig) -> tuple[np.ndarray, float]:
    """(inv_freq [rotary_dim/2] float32, attention_scaling) for the non-dynamic RoPE types.

    For `dynamic` this returns the unscaled frequencies (used while the sequence fits in
    max_position_embeddings); `inv_freq_for_length` handles longer sequences.
    """
    dim = cfg.rotary_dim
    p = cfg.rope_params
    base = np.float32(cfg.rope_theta)
    inv = (1.0 / (base ** _base_exponents(dim))).astype(np.float32)
    kind = cfg.rope_type
    if kind in ("default", "dynamic"):
        return inv, 1.0
    factor = float(p["factor"])
    if kind == "linear":
        return (inv / np.float32(factor)).astype(np.float32), 1.0
    if kind == "yarn":
        return _yarn(cfg, dim, float(cfg.rope_theta), factor, p)
    raise ValueError(f"unsupported rope type {kind!r}")


def _yarn(cfg: QwenConfig, dim: int, base: float, factor: float, p: dict) -> tuple[np.ndarray, float]:
    orig = p.get("original_max_position_embeddings", cfg.max_position_embeddings)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos_freqs = np.float32(base) ** _base_exponents(dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (np.float32(factor) * pos_freqs)
    extra_factor = (1 - ramp).astype(np.float32)
    inv = interpolation * (1 - extra_factor) + extrapolation * extra_factor
    return inv.astype(np.float32), float(attention_factor)


def inv_freq_for_length(cfg: QwenConfig, seq_len: jax.Array) -> jax.Array:
    """inv_freq [rotary_dim/2] float32 for a traced sequence length (dynamic NTK; else static).

    Dynamic NTK (transformers' `_compute_dynamic_ntk_parameters`): for seq_len beyond
    max_position_embeddings, base' = base * (factor * L / Lmax - (factor - 1)) ** (d / (d - 2)).
    transformers caches the grown frequencies across calls; here they are a pure function of the
    batch's largest position, which is what a single forward pass of transformers computes.
    """
    inv, _ = static_inv_freq(cfg)
    if cfg.rope_type != "dynamic":
        return jnp.asarray(inv)
    dim = cfg.rotary_dim
    factor = float(cfg.rope_params["factor"])
    lmax = cfg.max_position_embeddings
    length = jnp.maximum(seq_len.astype(jnp.float32), float(lmax))
    base = cfg.rope_theta * ((factor * length / lmax) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** jnp.asarray(_base_exponents(dim)))


def warn_dynamic_rope_drift(cfg: QwenConfig, max_episode_tokens: int, source: str) -> bool:
    """Log a warning, and return True, when `cfg`'s RoPE is dynamic NTK and an episode of up to
    `max_episode_tokens` (sampling.max_episode_tokens) can outgrow its max_position_embeddings;
    False, silent, otherwise. `source` names the config.json. The trainer calls it once per run.

    Why: `inv_freq_for_length` takes one base from a forward's largest position, as a single
    forward of transformers does (`dynamic_rope_update`). Past max_position_embeddings the
    sampler's prefill and decode steps use the longest position so far, while the trainer's
    recomputation over the whole episode uses the micro-batch's longest row: every position's
    log-prob differs from the rollout's (the PPO ratio starts away from 1), and a row's
    log-probs depend on the other rows of its micro-batch. vLLM's static form (base for
    max_position_embeddings x factor) would be consistent but is another model than
    transformers'; jscenegen keeps transformers' and warns."""
    limit = cfg.max_position_embeddings
    if cfg.rope_type != "dynamic" or max_episode_tokens <= limit:
        return False
    log.warning("%s: rope_type dynamic with max_position_embeddings %d, and "
                "sampling.max_episode_tokens is %d: an episode past %d tokens gets other RoPE "
                "frequencies in the trainer's recomputed log-probs (one base from the "
                "micro-batch's longest row) than the sampler used (the longest position so far), "
                "at every position, so the PPO ratio starts away from 1 and a row's log-probs "
                "depend on the other rows of its micro-batch; keep sampling.max_episode_tokens "
                "<= %d for log-probs that match", source, limit, max_episode_tokens, limit, limit)
    return True


def rope_cos_sin(cfg: QwenConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, S, rotary_dim] float32 for integer positions [B, S] (attention scaling folded in)."""
    _, scaling = static_inv_freq(cfg)
    inv = inv_freq_for_length(cfg, jnp.max(positions) + 1)
    angles = jnp.einsum(
        "bs,d->bsd", positions.astype(jnp.float32), inv, precision=jax.lax.Precision.HIGHEST
    )
    # the two halves repeat: cos/sin of one half, then concatenated (the same values; fewer
    # transcendentals, and XLA then materialises the tables once for the whole backward pass
    # instead of re-evaluating them inside each layer's RoPE fusions)
    cos, sin = jnp.cos(angles) * scaling, jnp.sin(angles) * scaling
    return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on x [B, S, N, D] with cos/sin [B, S, R], R <= D: the first R dims
    rotate (dim i paired with i + R/2), the other D - R pass through; result in x's dtype."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    half = r // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    c = cos[:, :, None, :].astype(x.dtype)
    s = sin[:, :, None, :].astype(x.dtype)
    out = x_rot * c + rotated * s
    return out if r == x.shape[-1] else jnp.concatenate([out, x_pass], axis=-1)
