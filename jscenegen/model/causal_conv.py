"""Qwen3.5's depthwise causal conv over each row's real tokens, and the algebra of its state.

The Gated DeltaNet convolves its [q | k | v] projections with a depthwise causal kernel of K
taps (transformers `causal_conv1d_fn` / `causal_conv1d_update`, activation SiLU). jscenegen
convolves only real tokens: a real token's window holds the previous K-1 *real* tokens of its
row, wherever padding sits (docs/qwen35.md 8.3). The conv state is therefore "the row's last
K-1 real inputs, oldest first" and composes across consecutive segments of a row:

    state after [A | B] = last K-1 of (state after A, then B's real inputs)

which `fold_conv_state` computes from B's own tail (`last_real_inputs`) and real-token count,
so sequence-parallel shards can each summarise their segment, exchange the summaries, and
start their conv from the exact state the unsharded sequence would have there
(`conv_state_prefix`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_conv(u: jax.Array, mask: jax.Array, weight: jax.Array,
                state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv + SiLU over each row's real tokens (T `causal_conv1d_fn` /
    `causal_conv1d_update` with `activation="silu"`).

    u [B, S, C] inputs (values at padding ignored); mask [B, S] bool (True = real token);
    weight [C, K] (`conv1d.weight[:, 0, :]`; column K-1 multiplies the current token, column 0
    the one K-1 real tokens back); state [B, C, K-1]: the row's last K-1 real inputs before
    this chunk, oldest first (zeros at a sequence start).

    Real tokens are packed to the front of each row (stable), convolved after the state, and
    scattered back, so a real token's window skips padding wherever it sits. Computed in fp32.
    Returns (y [B, S, C] in u's dtype, 0 at padding; new state [B, C, K-1] in state's dtype:
    the last K-1 real inputs including this chunk's, unchanged for a row without real tokens).
    """
    b, s, c = u.shape
    k = weight.shape[-1]
    dtype = u.dtype
    u = jnp.where(mask[..., None], u, 0).astype(jnp.float32)
    order = jnp.argsort(~mask, axis=1, stable=True)                      # real tokens first
    packed = jnp.take_along_axis(u, order[..., None], axis=1)            # [B, S, C]
    hist = jnp.concatenate([jnp.swapaxes(state, 1, 2).astype(jnp.float32), packed], axis=1)
    w = weight.astype(jnp.float32)
    y = sum(w[:, j] * hist[:, j: j + s] for j in range(k))               # [B, S, C] packed
    y = jax.nn.silu(y)
    rank = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)
    y = jnp.where(mask[..., None], jnp.take_along_axis(y, rank[..., None], axis=1), 0.0)
    real = jnp.sum(mask.astype(jnp.int32), axis=1)                       # [B]
    tail = real[:, None] + jnp.arange(k - 1)[None, :]                    # hist[n .. n+K-2]
    new_state = jnp.take_along_axis(hist, tail[..., None], axis=1)       # [B, K-1, C]
    return y.astype(dtype), jnp.swapaxes(new_state, 1, 2).astype(state.dtype)


def last_real_inputs(u: jax.Array, mask: jax.Array, taps: int) -> tuple[jax.Array, jax.Array]:
    """A segment's conv summary: (tail [B, C, K-1] float32, count [B] int32).

    u [B, S, C]; mask [B, S] bool; taps = K. `tail` holds the segment's last min(count, K-1)
    real inputs, oldest first, right-aligned (zeros before them): exactly the conv state the
    segment leaves when it starts from zeros. `count` = real tokens in the segment.
    """
    w = taps - 1
    count = jnp.sum(mask.astype(jnp.int32), axis=1)
    order = jnp.argsort(~mask, axis=1, stable=True)
    packed = jnp.take_along_axis(jnp.where(mask[..., None], u, 0).astype(jnp.float32),
                                 order[..., None], axis=1)
    idx = count[:, None] - w + jnp.arange(w)[None, :]                   # ranks of the tail
    tail = jnp.take_along_axis(packed, jnp.maximum(idx, 0)[..., None], axis=1)
    tail = jnp.where((idx >= 0)[..., None], tail, 0.0)                  # [B, K-1, C]
    return jnp.swapaxes(tail, 1, 2), count


def fold_conv_state(state: jax.Array, tail: jax.Array, count: jax.Array) -> jax.Array:
    """The conv state after a segment, from the state before it and the segment's summary.

    state [B, C, K-1] (last K-1 real inputs before the segment, oldest first); tail, count as
    `last_real_inputs`. With n = count: slot j of the result is tail[j] when j >= K-1-n (one
    of the segment's own last inputs), else state[j + n] (an older input shifted left by n).
    A segment with n >= K-1 replaces the state; one with n = 0 leaves it unchanged.
    """
    w = state.shape[-1]
    j = jnp.arange(w)
    keep_old = j[None, :] < (w - count)[:, None]                         # [B, K-1]
    shifted = jnp.take_along_axis(state, jnp.minimum(j[None, :] + count[:, None], w - 1)[:, None, :],
                                  axis=2)
    return jnp.where(keep_old[:, None, :], shifted, tail)


def conv_state_prefix(tails: jax.Array, counts: jax.Array,
                      initial: jax.Array | None = None) -> jax.Array:
    """Conv states entering each of N consecutive segments of the same rows.

    tails [N, B, C, K-1], counts [N, B] (`last_real_inputs` of each segment, in sequence
    order); initial [B, C, K-1] or None (zeros: a sequence start). Returns [N + 1, B, C, K-1]:
    entry j is the state entering segment j, entry N the state after the last one.
    """
    state = jnp.zeros(tails.shape[1:], tails.dtype) if initial is None else initial.astype(tails.dtype)
    out = [state]
    for j in range(tails.shape[0]):
        state = fold_conv_state(state, tails[j], counts[j])
        out.append(state)
    return jnp.stack(out)
