"""How a token is drawn: sampling parameters, top-k / top-p over the logits, per-row keys.

Sampling follows transformers' logits processors in their `generate` order (temperature, then
top-k, then top-p; `TopKLogitsWarper`, `TopPLogitsWarper` in transformers/generation/logits_process.py).
The returned log-prob of a token is log softmax(logits / temperature)[token] in fp32: the
tempered, *untruncated* distribution, which is what the trainer recomputes (VERL divides the
logits by the rollout temperature; top-k/top-p only choose which token is drawn). Greedy picks
argmax(logits) and still reports the tempered log-prob.

Randomness: each row has its own PRNG key; the token at RoPE position p of a row is drawn with
`fold_in(row_key, p)`, so a row's samples depend on its key and its own tokens only, not on the
other rows of the batch, the cache layout or the number of decode calls.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

MIN_TEMPERATURE = 1e-5   # below it float32 logits / T can overflow (vLLM: greedy below 1e-5)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a token is drawn from the logits.

    temperature >= MIN_TEMPERATURE divides the logits (also for the returned log-probs; use
    greedy for argmax); top_k > 0 keeps exactly the k largest logits (of values tied with the
    k-th, the lowest token ids; transformers keeps every tie); 0 < top_p <= 1 keeps the smallest
    set of most likely tokens whose probability reaches top_p (after top-k); greedy takes argmax
    (top_k and top_p then off). Raises ValueError for values outside those ranges.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False

    def __post_init__(self):
        if not self.temperature >= MIN_TEMPERATURE:
            raise ValueError(f"temperature must be >= {MIN_TEMPERATURE} (greedy for argmax), "
                             f"got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.greedy and (self.top_k or self.top_p < 1):
            raise ValueError("greedy sampling ignores top_k/top_p; leave them off")



def top_p_threshold(probs: jax.Array, top_p: float) -> jax.Array:
    """Per-row probability threshold t of the top-p nucleus: the largest float32 t with
    sum(probs[probs < t]) <= 1 - top_p, found by bisection (no vocabulary sort) on the int32 bit
    patterns of the non-negative float32 probabilities, which order as the values do: 31 halvings
    of [0, bits(max prob)] end on that t exactly, the probability of the least likely token the
    nucleus keeps.

    Keeping probs >= t is transformers' TopPLogitsWarper (drop the tokens whose ascending
    cumulative probability is <= 1 - top_p) up to ties at t. The mass compared is the tail's,
    as there: summed in float32, a kept mass near 1 (top_p 0.999) could not tell the tail
    tokens at the boundary apart. probs [B, V] float32 (rows summing to 1) -> [B, 1] float32.
    """
    def tail(bits):
        t = jax.lax.bitcast_convert_type(bits, jnp.float32)
        return jnp.sum(jnp.where(probs < t[:, None], probs, 0.0), axis=-1)

    def body(_, bounds):
        lo, hi = bounds                 # tail(lo) <= 1 - top_p; hi: past the answer
        mid = lo + (hi - lo) // 2
        ok = tail(mid) <= 1.0 - top_p
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    hi = jax.lax.bitcast_convert_type(jnp.max(probs, axis=-1), jnp.int32) + 1
    lo, _ = jax.lax.fori_loop(0, 31, body, (jnp.zeros_like(hi), hi))
    return jax.lax.bitcast_convert_type(lo, jnp.float32)[:, None]


TOP_K_CHUNK = 2048   # chunked_top_k: the vocabulary is cut into chunks of this many logits
TOP_K_BLOCK = 64     # block_max_top_k's block width and spare blocks (H200, 1.7B decode: 64
TOP_K_SPARE = 14     # of 32/64/128 was fastest; bench/gpu/topk.py)


def chunked_top_k(z: jax.Array, k: int, chunk: int = TOP_K_CHUNK) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(z, k)` in two stages: the k largest of each `chunk`-wide slice of the last
    axis, then the k largest of those. Same values, indices and order as `lax.top_k` (descending;
    of equal values the lower index first, since candidates keep their chunks' order), ties
    included.

    XLA:GPU sorts each whole row for a top-k with k > 16 (151,936 logits at Qwen's vocabulary);
    sorting chunks that fit on-chip, then k x chunks candidates, is several times faster there.
    XLA:CPU's top-k is a partial sort per row, faster than this (see `top_k`).
    z [B, V] (k <= chunk <= V) -> (values [B, k] z.dtype, indices [B, k] int32).
    """
    batch, vocab = z.shape
    chunks = -(-vocab // chunk)
    padded = jnp.pad(z, ((0, 0), (0, chunks * chunk - vocab)), constant_values=-jnp.inf)
    values, idx = jax.lax.top_k(padded.reshape(batch, chunks, chunk), k)        # [B, C, k]
    idx = idx + (jnp.arange(chunks, dtype=idx.dtype) * chunk)[None, :, None]
    values, pick = jax.lax.top_k(values.reshape(batch, chunks * k), k)
    return values, jnp.take_along_axis(idx.reshape(batch, chunks * k), pick, axis=-1)


def block_max_top_k(z: jax.Array, k: int, block: int = TOP_K_BLOCK, spare: int = TOP_K_SPARE,
                    fallback=None) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(z, k)` read from the few blocks that can hold the top k.

    The last axis is cut into `block`-wide blocks; each block's maximum is one logit, so the
    k largest maxima are k distinct logits and every top-k logit lies in a block whose maximum
    is at least the k-th largest (a block holding a NaN ranks first, as `lax.top_k` ranks NaN
    above every number). The k + `spare` blocks with the largest maxima are searched
    (in index order, so ties go to the lower index as in `lax.top_k`); the result is exact
    when the next block's maximum is below the k-th value found, i.e. no other block holds a
    logit that could enter. Where that fails in any row (a tie across `spare` + 1 block maxima
    at the threshold: constant or masked logits), the whole batch takes `fallback(z, k)`
    (default `lax.top_k`) through `lax.cond`. One reduce over the logits and two top-k's over
    short rows replace a top-k over the whole vocabulary.

    z [B, V] float -> (values [B, k] z.dtype, indices [B, k] int32). Raises ValueError when
    fewer than k + spare + 1 blocks fit in V.
    """
    batch, vocab = z.shape
    blocks = -(-vocab // block)
    searched = k + spare
    if blocks <= searched:
        raise ValueError(f"block_max_top_k: {blocks} blocks of {block} for {vocab} logits; "
                         f"k + spare = {searched} needs more")
    padded = jnp.pad(z, ((0, 0), (0, blocks * block - vocab)), constant_values=-jnp.inf)
    padded = padded.reshape(batch, blocks, block)
    # a NaN block ranks first, as lax.top_k ranks NaN (XLA:CPU's fused max drops NaNs)
    ranked = jnp.where(jnp.isnan(padded), jnp.inf, padded)
    maxima, order = jax.lax.top_k(jnp.max(ranked, axis=-1), searched + 1)      # [B, k+spare+1]
    picked = jnp.sort(order[:, :searched], axis=-1)
    cand = jnp.take_along_axis(padded, picked[:, :, None], axis=1).reshape(batch, -1)
    ids = (picked[:, :, None] * block + jnp.arange(block, dtype=picked.dtype)).reshape(batch, -1)
    values, pos = jax.lax.top_k(cand, k)
    exact = jnp.all(maxima[:, searched] < values[:, -1])
    fallback = fallback or (lambda z, k: tuple(jax.lax.top_k(z, k)))
    return jax.lax.cond(exact, lambda: (values, jnp.take_along_axis(ids, pos, axis=-1)),
                        lambda: tuple(fallback(z, k)))


def top_k(z: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k largest of z [B, V] along the last axis, as `jax.lax.top_k` returns them.

    On GPU through `block_max_top_k` (falling back to `chunked_top_k`) when the k + spare
    blocks searched are at most a quarter of the row; elsewhere, and on every other platform,
    `lax.top_k` (XLA:CPU's partial sort beats both there). The platform is chosen when the
    computation is lowered (`lax.platform_dependent`).
    """
    blocks = -(-z.shape[-1] // TOP_K_BLOCK)
    if 4 * (k + TOP_K_SPARE) > blocks:
        return tuple(jax.lax.top_k(z, k))
    exact = (chunked_top_k if z.shape[-1] > 2 * TOP_K_CHUNK and k <= TOP_K_CHUNK
             else lambda z, k: tuple(jax.lax.top_k(z, k)))
    return jax.lax.platform_dependent(
        z, cuda=lambda z: block_max_top_k(z, k, fallback=exact),
        default=lambda z: tuple(jax.lax.top_k(z, k)))


def _nucleus(z: jax.Array, top_p: float) -> jax.Array:
    """z [B, n] tempered logits with tokens outside the top-p nucleus set to -inf."""
    if top_p >= 1.0:
        return z
    probs = jax.nn.softmax(z, axis=-1)
    return jnp.where(probs >= top_p_threshold(probs, top_p), z, -jnp.inf)


def sample_tokens(logits: jax.Array, keys: jax.Array, positions: jax.Array,
                  params: SamplingParams) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row and its tempered log-prob.

    logits [B, V] float32; keys [B, 2] uint32 raw PRNG key data (one per row); positions [B]
    int32 (RoPE position of the token being drawn, folded into the row's key).
    Order as transformers' generate: temperature, top-k (`TopKLogitsWarper`, here exactly the
    k largest), top-p (`TopPLogitsWarper`); then a Gumbel-max draw over the survivors.
    Returns (tokens [B] int32, logprobs [B] float32 = log_softmax(logits / T)[token]).
    """
    z = logits.astype(jnp.float32) / params.temperature
    if params.greedy:
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
        if 0 < params.top_k < z.shape[-1]:
            cand, idx = top_k(z, params.top_k)                          # [B, k]
        else:
            cand, idx = z, None
        cand = _nucleus(cand, params.top_p)

        def one(key_data, pos, row):
            key = jax.random.fold_in(jax.random.wrap_key_data(key_data), pos)
            return jnp.argmax(row + jax.random.gumbel(key, row.shape, jnp.float32))

        choice = jax.vmap(one)(keys, positions, cand)
        tok = choice if idx is None else jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0]
        tok = tok.astype(jnp.int32)
    return tok, tempered_logprobs(logits, tok, params.temperature)


def tempered_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float) -> jax.Array:
    """log_softmax(logits / temperature)[token], float32: logits [..., V], tokens [...] int ->
    [...]. Shifted by the row's max as jax.nn.log_softmax is, without materialising the
    [..., V] log-probabilities (the normaliser reads only the logits, so XLA computes it beside
    a draw's top-k). The rollout's log-prob of a drawn (`sample_tokens`) or forced (the
    sampler's append) token; the trainer recomputes the same value (`grpo.algo.logprobs`,
    VERL's `logprobs_from_logits`). The token's gap to the row's maximum is taken on the raw
    logits, then tempered: inside a decode loop XLA can compute z = logits / T differently in
    two fusions, and at T near MIN_TEMPERATURE a few ulps of z ~ 1 / T made near-greedy
    log-probs positive; this way the maximum's gap is exactly 0 and every result <= 0."""
    x = logits.astype(jnp.float32)
    top = jnp.max(x, axis=-1, keepdims=True)
    log_norm = jnp.log(jnp.sum(jnp.exp((x - top) / temperature), axis=-1, keepdims=True))
    gap = jnp.take_along_axis(x, tokens[..., None], axis=-1) - top
    return (gap / temperature - log_norm)[..., 0]



def row_keys(seeds: Sequence[int]) -> np.ndarray:
    """Raw PRNG key data [B, 2] uint32, one threefry key per integer seed (its low 32 bits):
    `jax.random.key(s)` of a 32-bit seed is threefry2x32's [0, s] (jax/_src/prng.py,
    `threefry_seed`), built here on the host, for any number of rows without a compile."""
    low = np.asarray([int(s) & 0xFFFFFFFF for s in seeds], np.uint32).reshape(-1)
    return np.stack([np.zeros_like(low), low], axis=1)
