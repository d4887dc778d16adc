"""Per-token log-probs and entropies from final hidden states, chunked over the tokens.

The [B, T, V] fp32 logits of a 152k vocabulary never exist: the token axis is split into
chunks, each chunk's logits are made, reduced to (logprob, entropy) and dropped, under
`jax.checkpoint` so the backward pass recomputes them instead of storing them. When all the
chunks' logits together are small (at most `REMAT_LOGITS_BYTES`, e.g. a small vocabulary on
CPU) the backward pass keeps them instead: one output-projection matmul fewer per step.
Formulas: VERL verl/utils/torch_functional.py (`logprobs_from_logits`, `entropy_from_logits`);
logits are divided by the sampling temperature first (VERL `logits.div_(temperature)`).

Only where they are needed: an update trains a fraction of its tokens (the selected role's
policy tokens; prompts and environment messages never), so `model_token_logprobs` can take
the loss mask and a static per-row capacity and make logits for those tokens only (VERL
computes the response's logits only; Tunix slices the completion's), and ask the model for
those positions' hidden states only. The others get 0.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jscenegen.model.dense import dense
from jscenegen.model.functional import HiddenFn
from jscenegen.sharding.constraints import constrain
from jscenegen.sharding.rules import ACTIVATION

REMAT_LOGITS_BYTES = 256 * 2**20   # above this the chunks' logits are recomputed, not stored


def _chunk_stats(h, w, tok, temperature):
    """h [B, C, H], w [V, H], tok [B, C] -> (logp [B, C], entropy [B, C]) in float32."""
    z = dense(h, w, jnp.float32) / temperature
    lse = jax.nn.logsumexp(z, axis=-1)
    z_tok = jnp.take_along_axis(z, tok[..., None], axis=-1)[..., 0]
    logp_all = z - lse[..., None]
    # = lse - sum(p z) (VERL entropy_from_logits) without cancelling two large terms
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return z_tok - lse, entropy


def token_logprobs(hidden, output_embedding, tokens, temperature: float = 1.0, chunk: int = 256):
    """log p(tokens[b, t] | hidden[b, t]) and the entropy of that distribution.

    Inputs are ALIGNED: row t of `hidden` predicts `tokens[:, t]` (the train step shifts).

    Args:
      hidden: [B, T, H] final normed hidden states (any float dtype).
      output_embedding: [V, H] output embedding / lm_head with exactly the logical V rows
        (padding rows sliced off by the caller).
      tokens: [B, T] int token ids in [0, V).
      temperature: logits are divided by it (> 0).
      chunk: tokens per chunk; T is padded up to a multiple of it internally.

    Returns:
      (logp [B, T] float32, entropy [B, T] float32): fp32 log-softmax of the tempered logits
      at the token, and H = logsumexp(z) - sum softmax(z) z of the tempered distribution.

    Raises:
      ValueError: shapes that do not fit together, temperature <= 0 or chunk < 1.
    """
    if hidden.ndim != 3 or tokens.shape != hidden.shape[:2]:
        raise ValueError(f"hidden {hidden.shape} must be [B, T, H] with tokens {tokens.shape} [B, T]")
    if output_embedding.ndim != 2 or output_embedding.shape[1] != hidden.shape[2]:
        raise ValueError(
            f"output_embedding {output_embedding.shape} must be [V, H] with H = {hidden.shape[2]}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    b, t, h = hidden.shape
    c = min(chunk, t)
    n = -(-t // c)
    pad = n * c - t
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        tokens = jnp.pad(tokens, ((0, 0), (0, pad)))
    hs = hidden.reshape(b, n, c, h).swapaxes(0, 1)  # [n, B, C, H]
    ts = tokens.reshape(b, n, c).swapaxes(0, 1)
    w = output_embedding.astype(hidden.dtype)

    def one(args):
        hc, tc = args
        return _chunk_stats(hc, w, tc, temperature)

    if b * n * c * w.shape[0] * 4 > REMAT_LOGITS_BYTES:
        one = jax.checkpoint(one)

    logp, ent = jax.lax.map(one, (hs, ts))
    logp = logp.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    ent = ent.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    return logp, ent


def selection_capacity(select, multiple: int = 64) -> int:
    """The static per-row capacity `model_token_logprobs` needs for the host mask `select`
    [..., B, T] (any leading micro-batch axes): the largest selected count of a row, rounded up
    to a power-of-two multiple of `multiple` (few compiled shapes), at most T."""
    import numpy as np

    sel = np.asarray(select) != 0
    most = int(sel.sum(axis=-1).max()) if sel.size else 0
    cap = multiple
    while cap < most:
        cap *= 2
    return max(1, min(cap, sel.shape[-1]))


def shifted_token_logprobs(hidden, output_embedding, input_ids, temperature=1.0, chunk=256):
    """Per-token log-probs/entropies aligned with `input_ids`: entry t = log p(id_t | ids_<t).

    hidden [B, T, H] from the model on `input_ids` [B, T]; returns ([B, T], [B, T]) float32
    with column 0 set to 0 (no hidden state predicts the first token).
    """
    logp, ent = token_logprobs(
        hidden[:, :-1], output_embedding, input_ids[:, 1:], temperature, chunk
    )
    zero = jnp.zeros((logp.shape[0], 1), jnp.float32)
    return jnp.concatenate([zero, logp], axis=1), jnp.concatenate([zero, ent], axis=1)


def model_token_logprobs(hidden_fn: HiddenFn, params, input_ids, attention_mask, temperature=1.0,
                         chunk=256, select=None, capacity: int | None = None):
    """`shifted_token_logprobs` of the model `hidden_fn` (`model.functional.hidden_fn`) run on
    `params`, input_ids [B, T] int and attention_mask [B, T]; returns ([B, T], [B, T]) float32.

    With `select` [B, T] (nonzero: needed; column 0 never) and a static `capacity` >= the
    selected count of every row (`selection_capacity`): only the selected entries are
    computed, the others are 0. Each row's selected positions are gathered, in order, into
    [B, capacity], and the model is asked for the hidden states predicting them only
    (`rows=`: the last layer's queries, o_proj, residual and MLP and the final norm run on
    those positions; the output projection runs on them). A row with more selected tokens
    than `capacity` makes every output NaN, so a wrong capacity cannot go unnoticed (the
    train step then skips the update).
    """
    if capacity is None:
        hidden, emb = hidden_fn(params, input_ids, attention_mask)
        return shifted_token_logprobs(hidden, emb, input_ids, temperature, chunk)
    b, t = input_ids.shape
    sel = select != 0
    # each row's selected positions first, in order (stable), then the rest: [B, capacity]
    order = jnp.argsort(jnp.where(sel, 0, 1), axis=1, stable=True)[:, :capacity]
    valid = jnp.take_along_axis(sel, order, axis=1)
    h, emb = hidden_fn(params, input_ids, attention_mask, rows=jnp.maximum(order - 1, 0))
    h = constrain(h, ACTIVATION)
    tok = constrain(jnp.take_along_axis(input_ids, order, axis=1), ACTIVATION)
    logp, ent = token_logprobs(h, emb, tok, temperature, chunk)
    rows = jnp.arange(b)[:, None]
    out_lp = jnp.zeros((b, t), jnp.float32).at[rows, order].set(jnp.where(valid, logp, 0.0))
    out_ent = jnp.zeros((b, t), jnp.float32).at[rows, order].set(jnp.where(valid, ent, 0.0))
    overflow = jnp.any(jnp.sum(sel, axis=1) > capacity)
    poison = jnp.where(overflow, jnp.nan, 0.0)
    return out_lp + poison, out_ent + poison
