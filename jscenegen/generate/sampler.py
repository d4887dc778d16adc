"""Batched KV-cache sampling: jit-compiled appends (prefill, environment text, forced tokens) and a
`lax.while_loop` decode over a preallocated cache, on the ("fsdp", "sp") mesh.

Sampling follows transformers' logits processors in their `generate` order (temperature, then
top-k, then top-p; `TopKLogitsWarper`, `TopPLogitsWarper` in transformers/generation/logits_process.py).
The returned log-prob of a token is log softmax(logits / temperature)[token] in fp32: the
tempered, *untruncated* distribution, which is what the trainer recomputes (VERL divides the
logits by the rollout temperature; top-k/top-p only choose which token is drawn). Greedy picks
argmax(logits) and still reports the tempered log-prob.

Randomness: each row has its own PRNG key; the token at RoPE position p of a row is drawn with
`fold_in(row_key, p)`, so a row's samples depend on its key and its own tokens only, not on the
other rows of the batch, the cache layout or the number of decode calls.

Stopping: a row stops at a stop token id (the chat template's end of turn), at a stop string, or
at its own `max_new` budget. Stop strings are matched on bytes inside the loop: a table gives each
vocabulary entry's first and last K-1 bytes (K = longest stop string) and whether the entry itself
contains a stop string, and each row keeps the last K-1 bytes it generated this turn. A stop
string therefore matches however the tokenizer splits it (`</action>` as one token, as `</`
`action` `>`, or merged with a following newline), which matching token-id sequences would miss.

Shapes are bucketed: appended chunks are left-padded and split into lengths from `buckets`
(padding slots stay invalid and do not advance positions), and decode runs up to a static
`max_steps`, so the number of compiled programs is bounded by the bucket list, not by lengths.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jscenegen.model.qwen import KVCache, QwenForCausalLM

STOP_NONE, STOP_TOKEN, STOP_STRING, STOP_LENGTH = 0, 1, 2, 3
STOP_REASONS = {STOP_NONE: "none", STOP_TOKEN: "stop_token", STOP_STRING: "stop_string",
                STOP_LENGTH: "length"}
DEFAULT_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_NO_BYTE = -1


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a token is drawn from the logits.

    temperature > 0 divides the logits (also for the returned log-probs); top_k > 0 keeps the k
    largest logits (ties with the k-th kept, as transformers); 0 < top_p <= 1 keeps the smallest
    set of most likely tokens whose probability reaches top_p (after top-k); greedy takes argmax.
    Raises ValueError for values outside those ranges.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")


def bucket_length(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n, or the next multiple of the largest bucket beyond it (n >= 0)."""
    for b in buckets:
        if b >= n:
            return b
    top = buckets[-1]
    return -(-n // top) * top


def split_into_buckets(n: int, buckets: Sequence[int]) -> list[int]:
    """Chunk lengths, each a bucket, summing to n rounded up to a multiple of the smallest bucket.

    Greedy largest-first, so a long append costs a few compiled shapes, not one per length.
    """
    step = buckets[0]
    rest = -(-n // step) * step
    out = []
    while rest > 0:
        b = max(x for x in buckets if x <= rest) if rest >= step else step
        out.append(b)
        rest -= b
    return out


# ---- logits processing ---------------------------------------------------------------------
def top_p_threshold(probs: jax.Array, top_p: float, iters: int = 32) -> jax.Array:
    """Per-row probability threshold t of the top-p nucleus: the largest t with
    sum(probs[probs >= t]) >= top_p, found by bisection (no vocabulary sort).

    Keeping probs >= t is transformers' TopPLogitsWarper (keep a token when the probability of
    the tokens ranked above it is < top_p) up to ties. probs [B, V] float32 -> [B, 1].
    """
    lo = jnp.zeros(probs.shape[:1], jnp.float32)
    hi = jnp.max(probs, axis=-1)

    def body(_, bounds):
        lo, hi = bounds
        mid = 0.5 * (lo + hi)
        mass = jnp.sum(jnp.where(probs >= mid[:, None], probs, 0.0), axis=-1)
        ok = mass >= top_p
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, hi = jax.lax.fori_loop(0, iters, body, (lo, hi))
    # hi itself qualifies when the top token alone reaches top_p
    top_alone = jnp.max(probs, axis=-1) >= top_p
    return jnp.where(top_alone, hi, lo)[:, None]


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
            cand, idx = jax.lax.top_k(z, params.top_k)                  # [B, k]
        else:
            cand, idx = z, None
        cand = _nucleus(cand, params.top_p)

        def one(key_data, pos, row):
            key = jax.random.fold_in(jax.random.wrap_key_data(key_data), pos)
            return jnp.argmax(row + jax.random.gumbel(key, row.shape, jnp.float32))

        choice = jax.vmap(one)(keys, positions, cand)
        tok = choice if idx is None else jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0]
        tok = tok.astype(jnp.int32)
    logp = jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), tok[:, None], axis=-1)[:, 0]
    return tok, logp


# ---- stop strings ---------------------------------------------------------------------------
class StopTable(NamedTuple):
    """Device arrays for in-loop stop-string matching (see the module docstring).

    head, tail: [V, K-1] int32, first / last K-1 bytes of each vocabulary entry (-1 = none);
    length: [V] int32 bytes per entry; contains: [V] bool, the entry holds a whole stop string.
    """

    head: jax.Array
    tail: jax.Array
    length: jax.Array
    contains: jax.Array


def build_stop_table(stop_strings: Sequence[bytes], token_bytes: Sequence[bytes],
                     vocab_size: int) -> StopTable:
    """StopTable for byte strings `stop_strings` over a vocabulary whose entry i decodes to
    `token_bytes[i]` (entries beyond len(token_bytes), e.g. padded vocabulary rows, are empty).
    Raises ValueError for no or an empty stop string."""
    if not stop_strings or any(len(s) == 0 for s in stop_strings):
        raise ValueError(f"stop strings must be non-empty, got {list(stop_strings)}")
    k1 = max(max(len(s) for s in stop_strings) - 1, 1)
    head = np.full((vocab_size, k1), _NO_BYTE, np.int32)
    tail = np.full((vocab_size, k1), _NO_BYTE, np.int32)
    length = np.zeros(vocab_size, np.int32)
    contains = np.zeros(vocab_size, bool)
    for i, b in enumerate(token_bytes[:vocab_size]):
        length[i] = len(b)
        if b:
            h, t = b[:k1], b[-k1:]
            head[i, :len(h)] = list(h)
            tail[i, k1 - len(t):] = list(t)
            contains[i] = any(s in b for s in stop_strings)
    return StopTable(jnp.asarray(head), jnp.asarray(tail), jnp.asarray(length),
                     jnp.asarray(contains))


def stop_string_step(table: StopTable, stop_strings: Sequence[bytes], tail_bytes: jax.Array,
                     tok: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Did appending token `tok` [B] complete one of `stop_strings`?

    tail_bytes [B, K-1] int32: the row's last K-1 generated bytes, right-aligned, -1 where the
    turn has fewer. A match either lies inside the token (`contains`) or ends in the token's
    first K-1 bytes and starts in the tail; -1 never equals a byte, so absent bytes never match.
    Returns (hit [B] bool, new tail_bytes = last K-1 bytes of tail ++ token).
    """
    k1 = tail_bytes.shape[1]
    n = table.length[tok]
    window = jnp.concatenate([tail_bytes, table.head[tok]], axis=1)      # [B, 2(K-1)]
    hit = table.contains[tok]
    for s in stop_strings:
        want = jnp.asarray(list(s), jnp.int32)
        for end in range(k1, 2 * k1):                                      # ends inside the token
            start = end - len(s) + 1
            hit = hit | jnp.all(window[:, start:end + 1] == want, axis=1)
    pos = jnp.clip(n[:, None] + jnp.arange(k1)[None, :], 0, 2 * k1 - 1)
    short = jnp.take_along_axis(window, pos, axis=1)
    new_tail = jnp.where((n >= k1)[:, None], table.tail[tok], short)
    return hit, new_tail


# ---- the compiled programs ------------------------------------------------------------------
class DecodeResult(NamedTuple):
    """Output of one decode call (device arrays).

    tokens [B, N] int32 (0 after a row stopped), logprobs [B, N] float32 (0 after a stop),
    lengths [B] int32 tokens generated, reason [B] int32 STOP_* code, cache, last_logits [B, V].
    """

    tokens: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    reason: jax.Array
    cache: KVCache
    last_logits: jax.Array


def _forward(graphdef, state, cache, ids, mask, layers=None):
    model = nnx.merge(graphdef, state)
    hidden, cache = model.hidden_states(ids, mask, cache, layers)
    return model, hidden, cache


def _append_impl(graphdef, state, cache, last_logits, ids, mask):
    model, hidden, cache = _forward(graphdef, state, cache, ids, mask)
    new_last = model.logits(hidden[:, -1:])[:, 0]
    keep = jnp.any(mask != 0, axis=1)[:, None]
    return cache, jnp.where(keep, new_last, last_logits)


def _append_logprobs_impl(graphdef, state, cache, last_logits, ids, mask, temperature):
    model, hidden, cache = _forward(graphdef, state, cache, ids, mask)
    logits = model.logits(hidden)                                       # [B, S, V]
    real = mask != 0
    prev_real = jnp.concatenate([jnp.zeros_like(real[:, :1]), real[:, :-1]], axis=1)
    prev = jnp.concatenate([last_logits[:, None], logits[:, :-1]], axis=1)
    prev = jnp.where(prev_real[..., None], prev, last_logits[:, None])
    z = jax.nn.log_softmax(prev.astype(jnp.float32) / temperature, axis=-1)
    logp = jnp.take_along_axis(z, ids[..., None], axis=-1)[..., 0]
    keep = jnp.any(real, axis=1)[:, None]
    new_last = jnp.where(keep, logits[:, -1], last_logits)
    return cache, new_last, jnp.where(real, logp, 0.0)


def _decode_impl(graphdef, params, stop_strings, state, cache, last_logits, max_new, keys,
                 stop_ids, stop_table, *, max_steps):
    b = last_logits.shape[0]
    k1 = stop_table.head.shape[1] if stop_table is not None else 1

    def cond(c):
        step, done = c[0], c[5]
        return (step < max_steps) & ~jnp.all(done)

    layers = nnx.merge(graphdef, state).stacked_layers()   # once, outside the loop

    def body(c):
        step, cache, logits, out_tok, out_lp, done, count, reason, tail = c
        active = ~done
        tok, lp = sample_tokens(logits, keys, cache.next_pos, params)
        tok = jnp.where(active, tok, 0)
        lp = jnp.where(active, lp, 0.0)
        out_tok = jax.lax.dynamic_update_slice_in_dim(out_tok, tok[:, None], step, axis=1)
        out_lp = jax.lax.dynamic_update_slice_in_dim(out_lp, lp[:, None], step, axis=1)
        count = count + active.astype(jnp.int32)
        hit_tok = jnp.isin(tok, stop_ids) & active
        if stop_table is not None:
            hit_str, tail = stop_string_step(stop_table, stop_strings, tail, tok)
            hit_str = hit_str & active & ~hit_tok
        else:
            hit_str = jnp.zeros_like(active)
        hit_len = active & (count >= max_new) & ~hit_tok & ~hit_str
        reason = jnp.where(hit_tok, STOP_TOKEN, jnp.where(hit_str, STOP_STRING,
                                                          jnp.where(hit_len, STOP_LENGTH, reason)))
        done = done | hit_tok | hit_str | hit_len
        model, hidden, cache = _forward(graphdef, state, cache, tok[:, None],
                                        active[:, None].astype(jnp.int32), layers)
        new_logits = model.logits(hidden)[:, 0]
        logits = jnp.where(active[:, None], new_logits, logits)
        return step + 1, cache, logits, out_tok, out_lp, done, count, reason, tail

    init = (
        jnp.zeros((), jnp.int32), cache, last_logits,
        jnp.zeros((b, max_steps), jnp.int32), jnp.zeros((b, max_steps), jnp.float32),
        max_new <= 0, jnp.zeros((b,), jnp.int32), jnp.full((b,), STOP_NONE, jnp.int32),
        jnp.full((b, k1), _NO_BYTE, jnp.int32),
    )
    _, cache, logits, out_tok, out_lp, _, count, reason, _ = jax.lax.while_loop(cond, body, init)
    return DecodeResult(out_tok, out_lp, count, reason, cache, logits)


class Sampler:
    """Compiled prefill/append/decode for one model and one set of sampling parameters.

    Args:
      model: a QwenForCausalLM (its parameters may already live on `mesh`).
      params: SamplingParams.
      stop_token_ids: ids that end a row's turn (the chat template's end-of-turn token).
      stop_strings: strings that end a row's turn (matched on bytes, see module docstring);
        they need `token_bytes`.
      token_bytes: the bytes each vocabulary id decodes to (ChatTokenizer.token_bytes()).
      buckets: increasing chunk lengths for appends.
      mesh: a ("fsdp", "sp") mesh or None; rows must then be a multiple of its fsdp size.

    Raises ValueError for stop strings without token_bytes or unsorted buckets.
    """

    def __init__(self, model: QwenForCausalLM, params: SamplingParams, *,
                 stop_token_ids: Sequence[int] = (), stop_strings: Sequence[str] = (),
                 token_bytes: Sequence[bytes] | None = None,
                 buckets: Sequence[int] = DEFAULT_BUCKETS, mesh=None):
        if stop_strings and token_bytes is None:
            raise ValueError("stop_strings need token_bytes (the bytes of every vocabulary id)")
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets must be increasing positive lengths, got {buckets}")
        self.cfg = model.cfg
        self.params = params
        self.buckets = tuple(int(b) for b in buckets)
        self.mesh = mesh
        self.graphdef, self.state = nnx.split(model)
        self.cache_dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[model.compute_dtype]
        self.stop_ids = jnp.asarray(sorted(set(int(i) for i in stop_token_ids)) or [-1], jnp.int32)
        self.stop_strings = tuple(s.encode("utf-8") for s in stop_strings)
        self.stop_table = (build_stop_table(self.stop_strings, token_bytes, self.cfg.vocab_size)
                           if stop_strings else None)
        donate = jax.default_backend() != "cpu"
        gd = self.graphdef
        self._append = jax.jit(functools.partial(_append_impl, gd),
                               donate_argnums=(1,) if donate else ())
        self._append_lp = jax.jit(functools.partial(_append_logprobs_impl, gd),
                                  static_argnums=(5,), donate_argnums=(1,) if donate else ())
        self._decode = jax.jit(functools.partial(_decode_impl, gd, params, self.stop_strings),
                               static_argnames=("max_steps",),
                               donate_argnums=(1,) if donate else ())

    def set_weights(self, model: QwenForCausalLM) -> None:
        """Sample from `model`'s current weights (after an optimizer step) without recompiling.

        Raises ValueError when `model` is not the same architecture/layout as the sampler's.
        """
        graphdef, state = nnx.split(model)
        if graphdef != self.graphdef:
            raise ValueError("set_weights: the model's structure differs from the sampler's "
                             "(build a new Sampler for another architecture or padding)")
        self.state = state

    # ---- placement ----------------------------------------------------------------------
    @property
    def row_multiple(self) -> int:
        """Rows must be a multiple of this (the mesh's fsdp size, 1 without a mesh)."""
        return 1 if self.mesh is None else self.mesh.shape["fsdp"]

    def _put(self, x, spec=P("fsdp")):
        x = np.asarray(x)
        if self.mesh is None:
            return jnp.asarray(x)
        return jax.device_put(x, NamedSharding(self.mesh, spec))

    def _ctx(self):
        import contextlib
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def _check_rows(self, b: int):
        if b % self.row_multiple:
            raise ValueError(f"{b} rows do not split over the mesh's fsdp={self.row_multiple}; "
                             "pad the batch with fully masked rows")

    def new_cache(self, batch: int, max_len: int) -> tuple[KVCache, jax.Array]:
        """An empty cache of `max_len` slots for `batch` rows and zero last-logits [B, V]."""
        self._check_rows(batch)
        cache = KVCache.create(self.cfg, batch, max_len, self.cache_dtype)
        last = jnp.zeros((batch, self.cfg.vocab_size), jnp.float32)
        if self.mesh is None:
            return cache, last
        row = NamedSharding(self.mesh, P("fsdp"))
        kv = NamedSharding(self.mesh, P(None, "fsdp"))
        cache = KVCache(jax.device_put(cache.k, kv), jax.device_put(cache.v, kv),
                        jax.device_put(cache.valid, row), jax.device_put(cache.next_pos, row),
                        jax.device_put(cache.length, NamedSharding(self.mesh, P())))
        return cache, jax.device_put(last, row)

    # ---- operations ---------------------------------------------------------------------
    def left_pad(self, rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Left-pad token rows to a multiple of the smallest bucket -> (ids, mask) [B, L] int32."""
        n = max((len(r) for r in rows), default=0)
        length = sum(split_into_buckets(n, self.buckets)) if n else 0
        ids = np.zeros((len(rows), length), np.int32)
        mask = np.zeros((len(rows), length), np.int32)
        for i, r in enumerate(rows):
            if len(r):
                ids[i, length - len(r):] = r
                mask[i, length - len(r):] = 1
        return ids, mask

    def append(self, cache: KVCache, last_logits, rows: Sequence[Sequence[int]],
               with_logprobs: bool = False):
        """Append each row's tokens (left-padded, in bucket-sized chunks) to the cache.

        rows: B token lists (an empty list leaves that row unchanged). Returns (cache,
        last_logits [B, V] float32 = logits after each row's last token, and with
        `with_logprobs` a list of B float32 arrays: log p(token | preceding tokens) at the
        sampling temperature for each appended token, the first one from `last_logits`).
        The caller must leave room: cache slots needed = `appended_slots(rows)`.
        """
        self._check_rows(len(rows))
        ids, mask = self.left_pad(rows)
        lps = []
        start = 0
        with self._ctx():
            for size in split_into_buckets(ids.shape[1], self.buckets) if ids.shape[1] else []:
                chunk = slice(start, start + size)
                args = (self.state, cache, last_logits, self._put(ids[:, chunk]),
                        self._put(mask[:, chunk]))
                if with_logprobs:
                    cache, last_logits, lp = self._append_lp(*args, self.params.temperature)
                    lps.append(np.asarray(lp))
                else:
                    cache, last_logits = self._append(*args)
                start += size
        if not with_logprobs:
            return cache, last_logits
        lp = np.concatenate(lps, axis=1) if lps else np.zeros((len(rows), 0), np.float32)
        return cache, last_logits, [lp[i, lp.shape[1] - len(r):] if len(r) else lp[i, :0]
                                    for i, r in enumerate(rows)]

    def appended_slots(self, rows: Sequence[Sequence[int]]) -> int:
        """Cache slots an `append` of these rows takes (max length rounded to the smallest bucket)."""
        n = max((len(r) for r in rows), default=0)
        return sum(split_into_buckets(n, self.buckets)) if n else 0

    def decode(self, cache: KVCache, last_logits, max_new, keys, max_steps: int) -> DecodeResult:
        """Sample up to `max_steps` tokens per row, in one compiled `lax.while_loop`.

        max_new [B] int: per-row budget (0 = the row takes no part); keys [B, 2] uint32 raw
        key data per row. Each step samples every running row, records token and tempered
        log-prob, stops rows (stop id, stop string, budget) and appends the sampled tokens with
        one forward (stopped rows append a masked slot). The loop ends when every row has
        stopped or after max_steps; the cache must have max_steps free slots.
        """
        self._check_rows(len(max_new))
        with self._ctx():
            return self._decode(self.state, cache, last_logits,
                                self._put(np.asarray(max_new, np.int32)),
                                self._put(np.asarray(keys, np.uint32)), self.stop_ids,
                                self.stop_table,
                                max_steps=int(max_steps))

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, seeds: Sequence[int],
                 cache_len: int | None = None) -> dict[str, np.ndarray]:
        """Prefill `prompts` and decode up to max_new_tokens each (one call of each program).

        Returns host arrays: tokens [B, N] int32, logprobs [B, N] float32, lengths [B], reason [B].
        """
        need = self.appended_slots(prompts) + max_new_tokens
        cache, last = self.new_cache(len(prompts), cache_len or need)
        cache, last = self.append(cache, last, prompts)
        keys = row_keys(seeds)
        out = self.decode(cache, last, [max_new_tokens] * len(prompts), keys, max_new_tokens)
        return {"tokens": np.asarray(out.tokens), "logprobs": np.asarray(out.logprobs),
                "lengths": np.asarray(out.lengths), "reason": np.asarray(out.reason)}


def row_keys(seeds: Sequence[int]) -> np.ndarray:
    """Raw PRNG key data [B, 2] uint32, one threefry key per integer seed."""
    return np.stack([np.asarray(jax.random.key_data(jax.random.key(int(s) & 0xFFFFFFFF)))
                     for s in seeds]).astype(np.uint32)
