"""Per-token log-probs and entropies from final hidden states, chunked over the tokens.

The [B, T, V] fp32 logits of a 152k vocabulary never exist: the token axis is split into
chunks, each chunk's logits are made, reduced to (logprob, entropy) and dropped, under
`jax.checkpoint` so the backward pass recomputes them instead of storing them.
Formulas: VERL verl/utils/torch_functional.py (`logprobs_from_logits`, `entropy_from_logits`);
logits are divided by the sampling temperature first (VERL `logits.div_(temperature)`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _chunk_stats(h, w, tok, temperature):
    """h [B, C, H], w [V, H], tok [B, C] -> (logp [B, C], entropy [B, C]) in float32."""
    logits = jnp.einsum("bch,vh->bcv", h, w, preferred_element_type=jnp.float32)
    z = logits.astype(jnp.float32) / temperature
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

    @jax.checkpoint
    def one(args):
        hc, tc = args
        return _chunk_stats(hc, w, tc, temperature)

    logp, ent = jax.lax.map(one, (hs, ts))
    logp = logp.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    ent = ent.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    return logp, ent


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
