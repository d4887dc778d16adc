"""Batched KV-cache sampling: jit-compiled appends (prefill, environment text, forced tokens) and a
`lax.while_loop` decode over a preallocated cache, in a rollout layout (sharding/rollout.py).

Weights: the sampler decodes on its own copy of the weights in the rollout layout (`replicated`:
whole on every device, `tp`: tensor-parallel, `fsdp`: the training arrays themselves), made by
one jitted reshard per optimizer step (`set_weights`, generate/reshard.py). Qwen2/Qwen3 run
their layers over their own parameters (Qwen3.5 scans its stacked layer pattern, stacked once
per call outside the decode loop), so a decode step reads every weight in place: under
`replicated` and `tp` no weight byte crosses devices while decoding.

Each step draws with `sampling.sample_tokens` (transformers' logits-processor order; per-row
keys) and checks `stop.stop_string_step`.

Stopping: a row stops at a stop token id (the chat template's end of turn), at a stop string
(matched on bytes, see stop.py), or at its own `max_new` budget.

Shapes are bucketed: appended chunks are left-padded and split into lengths from `buckets`
(padding slots stay invalid and do not advance positions), and decode runs up to a static
`max_steps`, so the number of compiled programs is bounded by the bucket list, not by lengths.

The cache is the model's own (`create_cache`: `qwen.KVCache` for Qwen2/Qwen3,
`qwen35.HybridCache` with the Gated DeltaNet states for Qwen3.5), placed by its
`partition_specs()` (`sharding.rules` roles, resolved by the layout); padding inside appended
chunks and the masked slots of stopped rows leave every part of it unchanged, so the sampler is
the same for both. A cache with a `grown(extra)` method (KVCache) can grow in place of a
rebuild (`grow_cache`).
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jscenegen.generate.reshard import Reshard
from jscenegen.generate.sampling import SamplingParams, row_keys, sample_tokens
from jscenegen.generate.stop import NO_BYTE, build_stop_table, stop_string_step
from jscenegen.model.dtypes import np_dtype
from jscenegen.model.functional import split_params
from jscenegen.model.qwen import CausalLM
from jscenegen.sharding.constraints import constrain, use_specs
from jscenegen.sharding.rollout import RolloutLayout, choose_rollout_layout
from jscenegen.sharding.rules import ROWS, named

log = logging.getLogger(__name__)

STOP_NONE, STOP_TOKEN, STOP_STRING, STOP_LENGTH = 0, 1, 2, 3
STOP_REASONS = {STOP_NONE: "none", STOP_TOKEN: "stop_token", STOP_STRING: "stop_string",
                STOP_LENGTH: "length"}
DEFAULT_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


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



# ---- the compiled programs ------------------------------------------------------------------
class DecodeResult(NamedTuple):
    """Output of one decode call (device arrays).

    tokens [B, N] int32 (0 after a row stopped), logprobs [B, N] float32 (0 after a stop),
    lengths [B] int32 tokens generated, reason [B] int32 STOP_* code, cache (the model's cache
    type), last_logits [B, V].
    """

    tokens: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    reason: jax.Array
    cache: object
    last_logits: jax.Array


def _is_spec(x) -> bool:
    return isinstance(x, (str, jax.sharding.PartitionSpec))


def _merge(structure, state):
    """The model from `structure` = (graphdef, frozen: abstract `Carried` state, never read
    while decoding; `functional.split_params`) and the rollout weights `state`."""
    graphdef, frozen = structure
    return nnx.merge(graphdef, state, frozen)


def _forward(structure, state, cache, ids, mask, layers=None):
    model = _merge(structure, state)
    if layers is None:
        layers = model.decode_layers()
    hidden, cache = model.hidden_states(ids, mask, cache, layers)
    return model, hidden, cache


def _logits(model, hidden):
    """Logits [B, S, V] float32, rows split like the batch (a `tp` layout gathers the
    vocabulary shards here: activation bytes, not weights)."""
    return constrain(model.logits(hidden), ROWS)


def _append_impl(structure, state, cache, last_logits, ids, mask):
    model, hidden, cache = _forward(structure, state, cache, ids, mask)
    new_last = _logits(model, hidden[:, -1:])[:, 0]
    keep = jnp.any(mask != 0, axis=1)[:, None]
    return cache, jnp.where(keep, new_last, last_logits)


def _append_logprobs_impl(structure, state, cache, last_logits, ids, mask, temperature):
    model, hidden, cache = _forward(structure, state, cache, ids, mask)
    logits = _logits(model, hidden)                                     # [B, S, V]
    real = mask != 0
    prev_real = jnp.concatenate([jnp.zeros_like(real[:, :1]), real[:, :-1]], axis=1)
    prev = jnp.concatenate([last_logits[:, None], logits[:, :-1]], axis=1)
    prev = jnp.where(prev_real[..., None], prev, last_logits[:, None])
    z = jax.nn.log_softmax(prev.astype(jnp.float32) / temperature, axis=-1)
    logp = jnp.take_along_axis(z, ids[..., None], axis=-1)[..., 0]
    keep = jnp.any(real, axis=1)[:, None]
    new_last = jnp.where(keep, logits[:, -1], last_logits)
    return cache, new_last, jnp.where(real, logp, 0.0)


def _grow_impl(cache, *, extra):
    grown = cache.grown(extra)
    return jax.tree.map(lambda role, a: a if role is None else constrain(a, role),
                        grown.partition_specs(), grown, is_leaf=_is_spec)


def _decode_impl(structure, params, stop_strings, read_per_token, state, cache, last_logits,
                 max_new, keys, stop_ids, stop_table, *, max_steps):
    b = last_logits.shape[0]
    k1 = stop_table.head.shape[1] if stop_table is not None else 1
    layers = _merge(structure, state).decode_layers()   # once, outside the loop (or None)

    def cond(c):
        step, done = c[0], c[5]
        return (step < max_steps) & ~jnp.all(done)

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
        weights = state
        if read_per_token:
            # the fsdp layout reads the training shards every token, as an FSDP engine does:
            # without this XLA hoists the weight all-gathers out of the loop and holds the
            # whole weights on every device for the whole decode
            weights, _ = jax.lax.optimization_barrier((state, step))
        model, hidden, cache = _forward(structure, weights, cache, tok[:, None],
                                        active[:, None].astype(jnp.int32), layers)
        new_logits = _logits(model, hidden)[:, 0]
        logits = jnp.where(active[:, None], new_logits, logits)
        return step + 1, cache, logits, out_tok, out_lp, done, count, reason, tail

    init = (
        jnp.zeros((), jnp.int32), cache, last_logits,
        jnp.zeros((b, max_steps), jnp.int32), jnp.zeros((b, max_steps), jnp.float32),
        max_new <= 0, jnp.zeros((b,), jnp.int32), jnp.full((b,), STOP_NONE, jnp.int32),
        jnp.full((b, k1), NO_BYTE, jnp.int32),
    )
    _, cache, logits, out_tok, out_lp, _, count, reason, _ = jax.lax.while_loop(cond, body, init)
    return DecodeResult(out_tok, out_lp, count, reason, cache, logits)


def tp_divides(cfg) -> tuple[int, ...]:
    """Sizes a tensor-parallel split of `cfg`'s weights must divide: the head counts (a head is
    never split) and the FFN size; Qwen3.5's linear-attention heads where the config has them."""
    names = ("num_key_value_heads", "num_attention_heads", "intermediate_size",
             "linear_num_key_heads", "linear_num_value_heads")
    return tuple(int(getattr(cfg, n)) for n in names if getattr(cfg, n, None))


def _with_specs(fn, specs):
    """`fn` traced under the layout's role -> spec table (read at trace time)."""
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with use_specs(specs):
            return fn(*args, **kwargs)
    return traced


class Sampler:
    """Compiled prefill/append/decode for one model and one set of sampling parameters.

    Args:
      model: a QwenForCausalLM or Qwen35ForCausalLM (its parameters may live on `mesh` in the
        training layout).
      params: SamplingParams.
      stop_token_ids: ids that end a row's turn (the chat template's end-of-turn token).
      stop_strings: strings that end a row's turn (matched on bytes, see module docstring);
        they need `token_bytes`.
      token_bytes: the bytes each vocabulary id decodes to (ChatTokenizer.token_bytes()).
      buckets: increasing chunk lengths for appends.
      mesh: the training ("fsdp", "sp") mesh or None (one device).
      layout: a RolloutLayout, or the `rollout.layout` choice ("auto", "replicated", "tp",
        "fsdp") resolved by `sharding.rollout.choose_rollout_layout` with `tp` and
        `memory_fraction`; rows must be a multiple of `row_multiple`.
      dtype: the rollout weights' dtype name (None: the model's compute dtype).

    Raises ValueError for stop strings without token_bytes, unsorted buckets or a layout that
    does not fit the mesh and the model's heads.
    """

    def __init__(self, model: CausalLM, params: SamplingParams, *,
                 stop_token_ids: Sequence[int] = (), stop_strings: Sequence[str] = (),
                 token_bytes: Sequence[bytes] | None = None,
                 buckets: Sequence[int] = DEFAULT_BUCKETS, mesh=None,
                 layout: RolloutLayout | str = "auto", tp: int | None = None,
                 memory_fraction: float = 0.25, dtype: str | None = None):
        if stop_strings and token_bytes is None:
            raise ValueError("stop_strings need token_bytes (the bytes of every vocabulary id)")
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets must be increasing positive lengths, got {buckets}")
        self.cfg = model.cfg
        self.create_cache = type(model).create_cache
        self._can_grow = hasattr(type(jax.eval_shape(
            lambda: self.create_cache(model.cfg, 1, 1, jnp.float32))), "grown")
        self.params = params
        self.buckets = tuple(int(b) for b in buckets)
        self.weight_dtype = np_dtype(dtype or model.compute_dtype)
        # the rollout weights are the `nnx.Param`s; Carried tensors (Qwen3.5's vision tower,
        # mtp.*) stay abstract: decoding never reads them
        self.graphdef, state, frozen = split_params(model)
        if isinstance(layout, str):
            n_params = sum(int(np.prod((v.get_metadata().get("rows", v.shape[0]), *v.shape[1:])))
                           for v in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
                           if isinstance(v, nnx.Param))
            layout = choose_rollout_layout(
                mesh, layout, weight_bytes=n_params * self.weight_dtype.itemsize,
                divides=tp_divides(self.cfg), tp=tp, memory_fraction=memory_fraction)
        self.layout = layout
        self.mesh = mesh                      # the training mesh; the rollout's is layout.mesh
        log.info("rollout layout: %s", layout.describe())
        self._reshard = Reshard(state, layout, self.weight_dtype)
        self.state, self.reshard_stats = self._reshard(state)
        del state
        self.cache_dtype = np_dtype(model.compute_dtype)
        self.stop_ids = jnp.asarray(sorted(set(int(i) for i in stop_token_ids)) or [-1], jnp.int32)
        self.stop_strings = tuple(s.encode("utf-8") for s in stop_strings)
        self.stop_table = (build_stop_table(self.stop_strings, token_bytes, self.cfg.vocab_size)
                           if stop_strings else None)
        donate = jax.default_backend() != "cpu"
        gd, specs = (self.graphdef, frozen), layout.specs
        self._append = jax.jit(_with_specs(functools.partial(_append_impl, gd), specs),
                               donate_argnums=(1,) if donate else ())
        self._append_lp = jax.jit(_with_specs(functools.partial(_append_logprobs_impl, gd), specs),
                                  static_argnums=(5,), donate_argnums=(1,) if donate else ())
        self._grow = jax.jit(_with_specs(_grow_impl, specs), static_argnames=("extra",),
                             donate_argnums=(0,) if donate else ())
        self._decode = jax.jit(
            _with_specs(functools.partial(_decode_impl, gd, params, self.stop_strings,
                                          layout.name == "fsdp"), specs),
            static_argnames=("max_steps",), donate_argnums=(1,) if donate else ())

    def set_weights(self, weights) -> dict:
        """Sample from new weights (after an optimizer step) without recompiling: one jitted
        reshard from the training layout into the rollout layout (generate/reshard.py).

        weights: a model of the sampler's structure or its `nnx.Param` state (the training
        parameters; `functional.split_params`). The previous
        rollout weights are released first. Returns {"reshard_s", "reshard_bytes"}.
        Raises ValueError when the structure differs from the sampler's model.
        """
        if isinstance(weights, nnx.Module):
            graphdef, weights, _ = split_params(weights)
            if graphdef != self.graphdef:
                raise ValueError("set_weights: the model's structure differs from the sampler's "
                                 "(build a new Sampler for another architecture or padding)")
        self.state = None
        self.state, self.reshard_stats = self._reshard(weights)
        return dict(self.reshard_stats)

    # ---- placement ----------------------------------------------------------------------
    @property
    def row_multiple(self) -> int:
        """Rows must be a multiple of this (the layout's data-parallel size, 1 without a mesh)."""
        return self.layout.row_multiple

    def _put(self, x, role=ROWS):
        x = np.asarray(x)
        if self.layout.mesh is None:
            return jnp.asarray(x)
        return jax.device_put(x, self.layout.sharding(role))

    def _ctx(self):
        mesh = self.layout.mesh
        return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)

    def _check_rows(self, b: int):
        if b % self.row_multiple:
            raise ValueError(f"{b} rows do not split over the rollout layout's "
                             f"{self.row_multiple} data-parallel shards ({self.layout.name}); "
                             "pad the batch with fully masked rows")

    def new_cache(self, batch: int, max_len: int):
        """An empty cache of `max_len` slots for `batch` rows (the model's cache type, placed
        by its `partition_specs()`) and zero last-logits [B, V]."""
        self._check_rows(batch)
        cache = self.create_cache(self.cfg, batch, max_len, self.cache_dtype)
        last = jnp.zeros((batch, self.cfg.vocab_size), jnp.float32)
        if self.layout.mesh is None:
            return cache, last
        cache = jax.tree.map(lambda spec, a: jax.device_put(a, self._sharding(spec)),
                             cache.partition_specs(), cache, is_leaf=_is_spec)
        return cache, jax.device_put(last, self.layout.sharding(ROWS))

    def _sharding(self, spec):
        """A role or PartitionSpec as a NamedSharding on the rollout mesh."""
        if isinstance(spec, str):
            return self.layout.sharding(spec)
        return named(self.layout.mesh, spec)

    @property
    def can_grow(self) -> bool:
        """Whether the model's cache can grow in place (`grow_cache`), else it is rebuilt."""
        return self._can_grow

    def grow_cache(self, cache, max_len: int):
        """`cache` with `max_len` >= its slots, the new slots empty (one compiled program per
        size pair; the rows' contents, positions and length unchanged)."""
        old = cache.valid.shape[1]
        if max_len < old:
            raise ValueError(f"grow_cache: {max_len} slots < the cache's {old}")
        with self._ctx():
            return self._grow(cache, extra=max_len - old)

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

    def append(self, cache, last_logits, rows: Sequence[Sequence[int]],
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

    def decode(self, cache, last_logits, max_new, keys, max_steps: int) -> DecodeResult:
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
