"""Batched KV-cache sampling: jit-compiled appends (prefill, environment text, forced tokens) and a
`lax.while_loop` decode over a preallocated cache, in a rollout layout (sharding/rollout.py).

Weights: the sampler decodes on its own copy of the weights in the rollout layout (`replicated`:
whole on every device, `tp`: tensor-parallel, `fsdp`: the training arrays themselves), made by
one jitted reshard after every train step (`set_weights`, generate/reshard.py). Qwen2/Qwen3 run
their layers over their own parameters (Qwen3.5 scans its stacked layer pattern, stacked once
per call outside the decode loop), so a decode step reads every weight in place: under
`replicated` and `tp` no weight byte crosses devices while decoding.

Each step draws with `sampling.sample_tokens` (transformers' logits-processor order; per-row
keys) and checks `stop.stop_string_step`.

Stopping: a row stops at a stop token id (the chat template's end of turn), at a stop string
(matched on bytes, see stop.py), or at its own `max_new` budget.

Shapes are bucketed: appended chunks are left-padded and split into lengths from `buckets`
(padding slots stay invalid and do not advance positions), and a decode call runs a static
`segment` of steps (the smallest bucket), so the compiled programs are one per chunk or segment
length and cache size, not one per token count. A turn longer than a segment is several calls
that continue one another exactly (positions, keys, budgets and the stop-string state carry
over); given `max_slots`, a cache that can grow grows between them to what the turn has
reached, so attention reads about the slots in use, not the slots a whole turn might take.

The cache is the model's own (`create_cache`: `qwen.KVCache` for Qwen2/Qwen3,
`qwen35.HybridCache` with the Gated DeltaNet states for Qwen3.5), placed by its
`partition_specs()` (`sharding.rules` roles, resolved by the layout); padding inside appended
chunks and the masked slots of stopped rows stay invalid (`valid` False, attended by no query),
advance no position and leave the Gated DeltaNet states unchanged, so the sampler is the same
for both; the K/V write does fill those slots (with token 0's keys and values). A cache with a
`grown(extra)` method (KVCache) can grow in place of a rebuild (`grow_cache`).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jscenegen.generate.reshard import Reshard, rollout_dtype
from jscenegen.generate.sampling import SamplingParams, row_keys, sample_tokens, tempered_logprobs
from jscenegen.generate.stop import NO_BYTE, build_stop_table, stop_string_step
from jscenegen.model.dtypes import np_dtype
from jscenegen.model.functional import shared, split_params, structure_key
from jscenegen.model.qwen import CausalLM
from jscenegen.model.weights import column_blocks, param_name
from jscenegen.sharding.constraints import active_spec, constrain, use_specs
from jscenegen.sharding.mesh import host_array
from jscenegen.sharding.rollout import (
    RolloutLayout,
    choose_rollout_layout,
    least_device_memory_bytes,
    least_free_device_memory_bytes,
)
from jscenegen.sharding.rules import ROWS, named, round_up

log = logging.getLogger(__name__)

# what a reshard that does not fit can be given instead (`Sampler._check_reshard_fits`)
_SMALLER_LAYOUTS = {
    "replicated": "rollout.layout=tp (a 1/tp share per device) or fsdp (no copy), or "
                  "rollout.dtype=bfloat16",
    "tp": "a larger rollout.tp or rollout.layout=fsdp (no copy), or rollout.dtype=bfloat16",
    "fsdp": "rollout.dtype null (the training arrays themselves: no copy)"}
STOP_NONE, STOP_TOKEN, STOP_STRING, STOP_LENGTH = 0, 1, 2, 3
STOP_REASONS = {STOP_NONE: "none", STOP_TOKEN: "stop_token", STOP_STRING: "stop_string",
                STOP_LENGTH: "length"}
DEFAULT_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def check_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    """`buckets` as a tuple of ints; raises ValueError unless they are increasing positive
    lengths (at least one), each a multiple of the smallest: then an append of n tokens takes
    n rounded up to the smallest bucket (`split_into_buckets`); (16, 24) made 17 tokens
    24 + 16 slots, more than the cache's one-bucket slack allows for."""
    b = tuple(int(x) for x in buckets)
    if not b or list(b) != sorted(set(b)) or b[0] < 1:
        raise ValueError(f"buckets must be increasing positive lengths, got {list(buckets)}")
    if odd := [x for x in b if x % b[0]]:
        raise ValueError(f"buckets must be multiples of the smallest ({b[0]}); {odd[0]} is not "
                         f"(got {list(b)})")
    return b


def bucket_length(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n, or the next multiple of the largest bucket beyond it (n >= 0)."""
    for b in buckets:
        if b >= n:
            return b
    top = buckets[-1]
    return round_up(n, top)


def grown_slots(need: int, capacity: int, max_slots: int, buckets: Sequence[int]) -> int:
    """Slots a cache of `capacity` grows to when it must hold `need`: at least doubling (few
    grows, few compiled sizes), a bucket length, at most `max_slots`."""
    return min(max_slots, bucket_length(max(need, 2 * capacity), buckets))


def split_into_buckets(n: int, buckets: Sequence[int]) -> list[int]:
    """Chunk lengths, each a bucket, summing to n rounded up to a multiple of the smallest
    bucket (every bucket is one: `check_buckets`).

    Greedy largest-first, so a long append costs a few compiled shapes, not one per length.
    """
    step = buckets[0]
    rest = round_up(n, step)
    out = []
    while rest > 0:
        b = max(x for x in buckets if x <= rest)
        out.append(b)
        rest -= b
    return out



# ---- the compiled programs ------------------------------------------------------------------
class DecodeResult(NamedTuple):
    """Output of one decode call (device arrays).

    tokens [B, N] int32 (0 after a row stopped), logprobs [B, N] float32 (0 after a stop),
    lengths [B] int32 tokens generated, reason [B] int32 STOP_* code, cache (the model's cache
    type), last_logits [B, V], tail [B, K-1] int32 (each row's last generated bytes, the
    stop-string matcher's state, carried from one segment of a turn to the next).
    """

    tokens: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    reason: jax.Array
    cache: object
    last_logits: jax.Array
    tail: jax.Array


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
    logp = tempered_logprobs(prev, ids, temperature)
    keep = jnp.any(real, axis=1)[:, None]
    new_last = jnp.where(keep, logits[:, -1], last_logits)
    return cache, new_last, jnp.where(real, logp, 0.0)


def _sample_own_rows(logits, keys, positions, params: SamplingParams):
    """`sampling.sample_tokens` computed by each device on its own rows (the layout's ROWS
    split; replicas over `tp` draw the same tokens from the same keys). Left to the
    partitioner, a top-k over row-split logits all-gathered every row's logits to every
    device at each step ([B, V] float32: 39 MB for 64 rows of Qwen's vocabulary)."""
    spec = active_spec(ROWS)
    if spec is None:
        return sample_tokens(logits, keys, positions, params)
    return jax.shard_map(functools.partial(sample_tokens, params=params),
                         in_specs=(spec, spec, spec), out_specs=(spec, spec))(logits, keys, positions)


def _grow_impl(cache, *, extra):
    grown = cache.grown(extra)
    return jax.tree.map(lambda role, a: a if role is None else constrain(a, role),
                        grown.partition_specs(), grown, is_leaf=_is_spec)


def _decode_impl(structure, params, stop_strings, read_per_token, state, cache, last_logits,
                 max_new, keys, stop_ids, stop_table, tail, *, max_steps):
    b = last_logits.shape[0]
    layers = _merge(structure, state).decode_layers()   # once, outside the loop (or None)

    def cond(c):
        step, done = c[0], c[5]
        return (step < max_steps) & ~jnp.all(done)

    def body(c):
        step, cache, logits, out_tok, out_lp, done, count, reason, tail = c
        active = ~done
        tok, lp = _sample_own_rows(logits, keys, cache.next_pos, params)
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
        weights, stack = state, layers
        if read_per_token:
            # the fsdp layout reads the training shards every token, as an FSDP engine does:
            # without this XLA hoists the weight all-gathers out of the loop and holds the
            # whole weights on every device for the whole decode
            weights, stack, _ = jax.lax.optimization_barrier((state, layers, step))
        model, hidden, cache = _forward(structure, weights, cache, tok[:, None],
                                        active[:, None].astype(jnp.int32), stack)
        new_logits = _logits(model, hidden)[:, 0]
        logits = jnp.where(active[:, None], new_logits, logits)
        return step + 1, cache, logits, out_tok, out_lp, done, count, reason, tail

    init = (
        jnp.zeros((), jnp.int32), cache, last_logits,
        jnp.zeros((b, max_steps), jnp.int32), jnp.zeros((b, max_steps), jnp.float32),
        max_new <= 0, jnp.zeros((b,), jnp.int32), jnp.full((b,), STOP_NONE, jnp.int32), tail,
    )
    _, cache, logits, out_tok, out_lp, _, count, reason, tail = jax.lax.while_loop(cond, body, init)
    return DecodeResult(out_tok, out_lp, count, reason, cache, logits, tail)


def donates_buffers() -> bool:
    """Whether the sampler donates its cache buffers to the calls that replace them: not on
    XLA:CPU, where a call's input and output caches are then alive together (so making a
    cache takes twice its bytes there: `Sampler._cache_need`)."""
    return jax.default_backend() != "cpu"


def rollout_weight_bytes(state, weight_dtype) -> int:
    """Bytes of a rollout copy of `state` (the `nnx.Param` state of the parameters decoding
    reads, `decode_params`; real or abstract arrays): unpadded (each parameter's logical
    `rows`), matmul and embedding weights in `weight_dtype`, the rest in their own
    (`reshard.rollout_dtype`). What `choose_rollout_layout` weighs, whole, before any split."""
    return sum(
        int(np.prod((v.get_metadata().get("rows", v.shape[0]), *v.shape[1:])))
        * rollout_dtype(param_name(path), v.dtype, weight_dtype).itemsize
        for path, v in jax.tree_util.tree_flatten_with_path(
            state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
        if isinstance(v, nnx.Param))


def tp_divides(cfg) -> tuple[int, ...]:
    """Sizes a tensor-parallel split of `cfg`'s weights must divide: the head counts (a head is
    never split) and the FFN size; Qwen3.5's linear-attention heads where the config has them."""
    names = ("num_key_value_heads", "num_attention_heads", "intermediate_size",
             "linear_num_key_heads", "linear_num_value_heads")
    return tuple(int(getattr(cfg, n)) for n in names if getattr(cfg, n, None))


def _with_specs(fn, specs):
    """`fn` traced under the layout's role -> spec table (read at trace time); named after the
    function under `fn`'s partials, so dumps and profiles name its module (`jit__decode_impl`)."""
    def traced(*args, **kwargs):
        with use_specs(specs):
            return fn(*args, **kwargs)
    inner = fn
    while isinstance(inner, functools.partial):
        inner = inner.func
    traced.__name__ = traced.__qualname__ = inner.__name__
    return traced


class Sampler:
    """Compiled prefill/append/decode for one model and one set of sampling parameters.
    Samplers of equally structured models with the same sampling parameters, stop strings and
    layout share these compiled functions (`model.functional.shared`); each holds its own
    weights.

    Args:
      model: a QwenForCausalLM or Qwen35ForCausalLM (its parameters may live on `mesh` in the
        training layout).
      params: SamplingParams.
      stop_token_ids: ids that end a row's turn (`ChatTokenizer.end_ids`: the template's
        end-of-turn token and the model's end-of-generation ids).
      stop_strings: strings that end a row's turn (matched on bytes, see module docstring);
        they need `token_bytes`.
      token_bytes: the bytes each vocabulary id decodes to (ChatTokenizer.token_bytes()).
      buckets: increasing chunk lengths for appends.
      mesh: the training ("fsdp", "sp") mesh or None (one device).
      layout: a RolloutLayout, or the `rollout.layout` choice ("auto", "replicated", "tp",
        "fsdp") resolved by `sharding.rollout.choose_rollout_layout` with `tp` and
        `memory_fraction`; rows must be a multiple of `row_multiple`.
      dtype: the dtype name of the rollout weights the model reads in the compute dtype
        (`rules.rollout_casts`: matmul and embedding weights; the others keep theirs; None: the
        model's compute dtype).
      segment: decode steps per compiled call (None: the smallest bucket; see `decode`).

    Raises ValueError for stop strings without token_bytes, buckets that are not increasing
    multiples of the smallest (`check_buckets`), a segment < 1 or
    a layout that does not fit the mesh and the model's heads.
    """

    def __init__(self, model: CausalLM, params: SamplingParams, *,
                 stop_token_ids: Sequence[int] = (), stop_strings: Sequence[str] = (),
                 token_bytes: Sequence[bytes] | None = None,
                 buckets: Sequence[int] = DEFAULT_BUCKETS, mesh=None,
                 layout: RolloutLayout | str = "auto", tp: int | None = None,
                 memory_fraction: float = 0.25, dtype: str | None = None,
                 segment: int | None = None):
        if stop_strings and token_bytes is None:
            raise ValueError("stop_strings need token_bytes (the bytes of every vocabulary id)")
        if segment is not None and segment < 1:
            raise ValueError(f"segment must be >= 1 decode steps, got {segment}")
        self.cfg = model.cfg
        self.create_cache = type(model).create_cache
        self._can_grow = hasattr(type(jax.eval_shape(
            lambda: self.create_cache(model.cfg, 1, 1, jnp.float32))), "grown")
        self.params = params
        self.buckets = check_buckets(buckets)
        self.segment = int(segment or self.buckets[0])
        self.cache_grows = 0                  # grow_cache calls, for the rollout's stats
        self.weight_dtype = np_dtype(dtype or model.compute_dtype)
        # the rollout weights are the parameters decoding reads (`decode_params`); Carried
        # tensors (Qwen3.5's vision tower, mtp.*) and a trainable vision tower stay abstract
        self._decode_params = model.decode_params()
        self.graphdef, state, frozen = split_params(model, self._decode_params)
        # the dtype(s) the parameters are held in (model.param_dtype): bfloat16-held weights
        # read in float32 are other numbers than float32-held ones (evaluation reports record it)
        self.param_dtypes = tuple(sorted({str(np.dtype(v.dtype)) for v in jax.tree_util.tree_leaves(
            state, is_leaf=lambda x: isinstance(x, nnx.Variable)) if isinstance(v, nnx.Param)}))
        self.device_bytes = least_device_memory_bytes()   # a collective: every process, here
        if isinstance(layout, str):
            # the rollout copy's bytes: unpadded, matmul weights in the rollout dtype, the rest
            # in their own (reshard.rollout_dtype)
            weight_bytes = rollout_weight_bytes(state, self.weight_dtype)
            layout = choose_rollout_layout(
                mesh, layout, weight_bytes=weight_bytes,
                divides=tp_divides(self.cfg), tp=tp, memory_fraction=memory_fraction,
                device_bytes=self.device_bytes)
        self.layout = layout
        self.mesh = mesh                      # the training mesh; the rollout's is layout.mesh
        log.info("rollout layout: %s", layout.describe())
        self._reshard = Reshard(state, layout, self.weight_dtype, column_blocks(self.cfg))
        self._check_reshard_fits()
        self.state, self.reshard_stats = self._reshard(state)
        del state
        self.cache_dtype = np_dtype(model.compute_dtype)
        self.stop_ids = jnp.asarray(sorted(set(int(i) for i in stop_token_ids)) or [-1], jnp.int32)
        self.stop_strings = tuple(s.encode("utf-8") for s in stop_strings)
        self.stop_table = (build_stop_table(self.stop_strings, token_bytes, self.cfg.vocab_size)
                           if stop_strings else None)
        self._tail_width = self.stop_table.head.shape[1] if self.stop_table is not None else 1
        donate = self._donate = donates_buffers()
        self._cache_makers: dict[tuple[int, int], Callable] = {}   # see _cache_maker
        self._cache_shape_memo: dict[tuple[int, int], Any] = {}     # see _cache_shapes
        gd, specs = (self.graphdef, frozen), layout.specs
        # Samplers of one model structure, layout and sampling options share their traces
        structure = structure_key(self.graphdef, frozen)
        key = None if structure is None else (
            "sampler", structure, params, self.stop_strings, layout.name, layout.mesh,
            layout.tp, layout.transposed, donate)
        self._append, self._append_lp, self._grow, self._decode = shared(key, lambda: (
            jax.jit(_with_specs(functools.partial(_append_impl, gd), specs),
                    donate_argnums=(1,) if donate else ()),
            jax.jit(_with_specs(functools.partial(_append_logprobs_impl, gd), specs),
                    static_argnums=(5,), donate_argnums=(1,) if donate else ()),
            # not donated: every slot-sized array changes shape, so XLA could reuse no buffer
            # (and said so in a warning on GPU at each growth)
            jax.jit(_with_specs(_grow_impl, specs), static_argnames=("extra",)),
            jax.jit(_with_specs(functools.partial(_decode_impl, gd, params, self.stop_strings,
                                                  layout.name == "fsdp"), specs),
                    static_argnames=("max_steps",), donate_argnums=(1,) if donate else ())))

    def _check_reshard_fits(self) -> None:
        """Log the reshard's peak per device (the rollout weights plus XLA's temporaries, the
        gathered arrays in flight: `Reshard.memory`) and raise ValueError, before it runs, when
        that exceeds the least free device memory over the processes
        (`least_free_device_memory_bytes`, a collective: every process decides alike). No check
        where either is unknown (a device that reports no free memory; `fsdp` without a cast makes no
        copy; XLA:CPU reports the host's). Later reshards need the same: the previous rollout
        weights go first."""
        free = self._free_device_bytes()
        memory = self._reshard.memory
        if memory is None:
            return
        weights, temps = memory["output_bytes"], memory["temp_bytes"]
        log.info("rollout reshard: %.3f GiB of rollout weights + %.3f GiB of XLA temporaries per "
                 "device", weights / 2**30, temps / 2**30)
        if free is not None and weights + temps > free:
            raise ValueError(
                f"rollout.layout={self.layout.name}: resharding the weights into the rollout "
                f"layout needs {(weights + temps) / 2**30:.2f} GiB per device ({weights / 2**30:.2f} "
                f"GiB of rollout weights, {temps / 2**30:.2f} GiB of temporaries); "
                f"{free / 2**30:.2f} GiB is free. Choose {_SMALLER_LAYOUTS[self.layout.name]}")

    def set_weights(self, weights) -> dict:
        """Sample from new weights (after a train step, skipped or not) without recompiling: one jitted
        reshard from the training layout into the rollout layout (generate/reshard.py).

        weights: a model of the sampler's structure or its `nnx.Param` state (the training
        parameters; `functional.split_params`): the parameters decoding reads are taken from
        it (`decode_params`). The structure is checked first; then the previous rollout
        weights are released and the new ones made. Under `fsdp` without a cast the rollout
        weights are `weights`' arrays themselves: after they are donated (a train step), call
        this again with the step's output. Returns {"reshard_s", "reshard_bytes"}.
        Raises ValueError when the structure differs from the sampler's model (the sampler
        keeps its weights).
        """
        if isinstance(weights, nnx.Module):
            graphdef, weights, _ = split_params(weights, self._decode_params)
            if graphdef != self.graphdef:
                raise ValueError("set_weights: the model's structure differs from the sampler's "
                                 "(build a new Sampler for another architecture or padding)")
        else:
            weights = nnx.split_state(weights, self._decode_params, ...)[0]
        self._reshard.check(weights)
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
        by its `partition_specs()`) and zero last-logits [B, V]. Raises ValueError when the
        cache cannot fit the rollout devices' memory (`_check_cache_fits`)."""
        self._check_rows(batch)
        make = self._cache_maker(batch, max_len)
        last = jnp.zeros((batch, self.cfg.vocab_size), jnp.float32)
        if self.layout.mesh is None:
            return make(), last
        return make(), jax.device_put(last, self.layout.sharding(ROWS))

    def _empty_cache(self, batch: int, max_len: int) -> Callable:
        """The unjitted maker of an empty cache of `batch` rows x `max_len` slots."""
        return functools.partial(self.create_cache, self.cfg, batch, max_len, self.cache_dtype)

    def _cache_shapes(self, batch: int, max_len: int):
        """The ShapeDtypeStructs of an empty cache of `batch` rows x `max_len` slots (traced
        once per shape)."""
        if (batch, max_len) not in self._cache_shape_memo:
            self._cache_shape_memo[batch, max_len] = jax.eval_shape(self._empty_cache(batch, max_len))
        return self._cache_shape_memo[batch, max_len]

    def _cache_maker(self, batch: int, max_len: int) -> Callable:
        """The function that makes an empty cache of `batch` rows x `max_len` slots, checked to
        fit (`_check_cache_fits`) once per shape; on a mesh jitted to make it in place (built
        whole on one device first, a cache sized for every row's episode would have to fit
        that one device)."""
        if (batch, max_len) not in self._cache_makers:
            make = self._empty_cache(batch, max_len)
            shapes = self._cache_shapes(batch, max_len)
            self._check_cache_fits(shapes, batch, max_len)
            if self.layout.mesh is not None:
                make = jax.jit(make, out_shardings=self._cache_shardings(shapes))
            self._cache_makers[batch, max_len] = make
        return self._cache_makers[batch, max_len]

    def _cache_shardings(self, shapes):
        """The NamedSharding of each array of a cache (`shapes`: the cache or its
        ShapeDtypeStructs) on the rollout mesh, from its `partition_specs()` roles."""
        return jax.tree.map(lambda spec, _: self._sharding(spec), shapes.partition_specs(),
                            shapes, is_leaf=_is_spec)

    def _cache_device_bytes(self, shapes) -> int:
        """Bytes one rollout device holds of a cache (`shapes`: the cache or its
        ShapeDtypeStructs): each array's shard under the sharding it gets (`_cache_shardings`;
        arrays replicated over an axis, e.g. the per-row slot masks over `tp` or CACHED_KV over
        `sp` under `fsdp`, count whole on each of its devices), summed; all of it without a
        mesh. The cache's rows divide over the data-parallel devices (`_check_rows`), so every
        device holds the same."""
        leaves = jax.tree.leaves(shapes)
        if self.layout.mesh is None:
            return sum(x.size * x.dtype.itemsize for x in leaves)
        return sum(math.prod(sh.shard_shape(x.shape)) * x.dtype.itemsize
                   for x, sh in zip(leaves, jax.tree.leaves(self._cache_shardings(shapes))))

    def _check_cache_fits(self, shapes, batch: int, max_len: int, alive=None) -> None:
        """Raise ValueError when a cache of `batch` rows x `max_len` slots (`shapes`: its
        ShapeDtypeStructs) cannot fit in what one rollout device has free now
        (`least_free_device_memory_bytes`: the least over the processes; the weights, optimizer
        state and `alive` already hold their part): the bytes one device holds of it
        (`_cache_device_bytes`) must fit, and so must twice that without buffer donation (CPU:
        a call's input and output caches are alive together), less what `alive` (the cache a
        grow copies from) frees once copied. Without it such a cache is allocated until the
        process is killed for memory, with no message. No check when the free memory is unknown."""
        need = self._cache_need(self._cache_device_bytes(shapes), alive)
        free = self._free_device_bytes()
        if free is not None and need > free:
            raise ValueError(f"a KV cache of {batch} rows x {max_len:,} slots needs "
                             f"{need / 2**30:,.1f} GiB per device, more than the "
                             f"{free / 2**30:,.1f} GiB one has free: lower the episode and turn caps "
                             "(sampling.max_episode_tokens, max_new_tokens, cache_tokens) or the rows")

    def _cache_need(self, new: int, alive=None) -> int:
        """What making a cache of `new` bytes per device takes of a device's free memory
        (`_check_cache_fits`' rule): twice it without buffer donation, less what `alive` frees."""
        old = 0 if alive is None else self._cache_device_bytes(alive)
        return max(new, new * (1 if self._donate else 2) - old)

    def cache_bytes_needed(self, batch: int, max_len: int) -> int:
        """Bytes of free memory per rollout device that making a cache of `batch` rows x
        `max_len` slots takes (the rule `_check_cache_fits` refuses by), for a caller that must
        budget its largest cache ahead (the model judge)."""
        return self._cache_need(self._cache_device_bytes(self._cache_shapes(batch, max_len)))

    def weight_device_bytes(self) -> int:
        """Bytes one rollout device holds of the rollout weights (each array's shard under its
        sharding; all of it without a mesh)."""
        return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                   if hasattr(x, "sharding") else x.size * x.dtype.itemsize
                   for x in jax.tree.leaves(self.state))

    def _free_device_bytes(self) -> int | None:
        """Bytes one rollout device can still take (a collective: `least_free_device_memory_bytes`)."""
        return least_free_device_memory_bytes()

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
        size pair; the rows' contents, positions and length unchanged). Raises ValueError when
        max_len is below its slots or the grown cache, with `cache` alive beside it while it
        is copied, cannot fit (`_check_cache_fits`)."""
        rows, old = cache.valid.shape
        if max_len < old:
            raise ValueError(f"grow_cache: {max_len} slots < the cache's {old}")
        self._check_cache_fits(self._cache_shapes(rows, max_len), rows, max_len, alive=cache)
        self.cache_grows += 1
        with self._ctx():
            return self._grow(cache, extra=max_len - old)

    # ---- operations ---------------------------------------------------------------------
    def left_pad(self, rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Left-pad token rows to a multiple of the smallest bucket -> (ids, mask) [B, L] int32."""
        length = self.appended_slots(rows)
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
        The caller must leave room: cache slots needed = `appended_slots(rows)`. Raises
        ValueError, before any write, when the cache lacks them (a write past its end would
        land on earlier slots).
        """
        self._check_rows(len(rows))
        ids, mask = self.left_pad(rows)
        length, capacity = int(cache.length), cache.valid.shape[1]
        if length + ids.shape[1] > capacity:
            raise ValueError(f"append: {ids.shape[1]} slots at slot {length} need "
                             f"{length + ids.shape[1]}; the cache has {capacity} (grow_cache "
                             "or a new cache first)")
        lps = []
        start = 0
        with self._ctx():
            for size in split_into_buckets(ids.shape[1], self.buckets) if ids.shape[1] else []:
                chunk = slice(start, start + size)
                args = (self.state, cache, last_logits, self._put(ids[:, chunk]),
                        self._put(mask[:, chunk]))
                if with_logprobs:
                    cache, last_logits, lp = self._append_lp(*args, self.params.temperature)
                    lps.append(host_array(lp))
                else:
                    cache, last_logits = self._append(*args)
                start += size
        if not with_logprobs:
            return cache, last_logits
        lp = np.concatenate(lps, axis=1) if lps else np.zeros((len(rows), 0), np.float32)
        return cache, last_logits, [lp[i, lp.shape[1] - len(r):] if len(r) else lp[i, :0]
                                    for i, r in enumerate(rows)]

    def appended_slots(self, rows: Sequence[Sequence[int]]) -> int:
        """Cache slots an `append` of these rows takes: the chunks `split_into_buckets` cuts
        the longest row into (the one rule `left_pad` pads to)."""
        n = max((len(r) for r in rows), default=0)
        return sum(split_into_buckets(n, self.buckets))

    def decode(self, cache, last_logits, max_new, keys, max_steps: int, *,
               max_slots: int | None = None) -> DecodeResult:
        """Sample up to `max_steps` tokens per row (one turn), `segment` steps per compiled call.

        max_new [B] int: per-row budget (0 = the row takes no part; a row still running after
        max_steps keeps reason STOP_NONE); keys [B, 2] uint32 raw key data per row. Each step
        samples every running row, records token and tempered log-prob, stops rows (stop id,
        stop string, budget) and appends the sampled tokens with one forward (stopped rows
        append a masked slot). A call of the compiled `lax.while_loop` runs at most `segment`
        steps and ends when every row has stopped; the next call continues where it ended, so
        the tokens are those of one loop.

        Slots: a call takes as many slots as it runs steps. The cache must have room for
        max_steps more, or (with `max_slots` and a cache that can grow, `can_grow`) be able to
        grow to them: it then grows before a call that would pass its end (`grown_slots`), so
        it holds about the slots the turn has reached. Returns the turn's DecodeResult
        (tokens, logprobs [B, max_steps]). Raises ValueError, before any step, when the
        max_steps slots fit neither, or a row with a budget has no token in the cache.
        """
        self._check_rows(len(max_new))
        budget = np.asarray(max_new, np.int64)
        b = len(budget)
        self._check_room(cache, max_steps, max_slots)
        if (empty := np.flatnonzero((budget > 0) & (host_array(cache.next_pos) == 0))).size:
            raise ValueError(f"decode: row {empty[0]} has a budget of {budget[empty[0]]} tokens "
                             "and no token in the cache to condition on (its first token would "
                             "be drawn from no logits); append its prompt first or give it 0")
        lengths = np.zeros(b, np.int64)
        reason = np.full(b, STOP_NONE, np.int32)
        keys, tail = self._put(np.asarray(keys, np.uint32)), self._fresh_tail(b)
        tokens, logprobs, steps_run = [], [], 0
        with self._ctx():
            while steps_run < max_steps:
                left = np.where(reason == STOP_NONE, budget - lengths, 0)
                if not (left > 0).any():
                    break
                steps = min(self.segment, max_steps - steps_run)
                need, capacity = int(cache.length) + steps, cache.valid.shape[1]
                if need > capacity:
                    cache = self.grow_cache(cache, grown_slots(need, capacity, max_slots, self.buckets))
                out = self._decode(*self._decode_inputs(cache, last_logits, left, keys, tail),
                                   max_steps=steps)
                cache, last_logits, tail = out.cache, out.last_logits, out.tail
                tokens.append(out.tokens)
                logprobs.append(out.logprobs)
                lengths += host_array(out.lengths)
                seg_reason = host_array(out.reason)
                reason = np.where(seg_reason != STOP_NONE, seg_reason, reason)
                steps_run += steps
            tokens.append(self._put(np.zeros((b, max_steps - steps_run), np.int32)))
            logprobs.append(self._put(np.zeros((b, max_steps - steps_run), np.float32)))
            tokens, logprobs = jnp.concatenate(tokens, axis=1), jnp.concatenate(logprobs, axis=1)
        return DecodeResult(tokens, logprobs, self._put(lengths.astype(np.int32)),
                            self._put(reason), cache, last_logits, tail)

    def decode_hlo(self, rows: int, slots: int, steps: int) -> str:
        """The compiled program of one decode call (HLO text) for `rows` rows, an empty cache
        of `slots` slots and `steps` steps: what the collective checks of
        `sharding.hlo.loop_collectives` parse."""
        cache, last = self.new_cache(rows, slots)
        with self._ctx():
            inputs = self._decode_inputs(cache, last, np.full(rows, steps), np.zeros((rows, 2)),
                                         self._fresh_tail(rows))
            return self._decode.lower(*inputs, max_steps=steps).compile().as_text()

    def _fresh_tail(self, rows: int) -> jax.Array:
        """The stop-string matcher's state at a turn's start: no bytes yet, [B, K-1] int32."""
        return self._put(np.full((rows, self._tail_width), NO_BYTE, np.int32))

    def _decode_inputs(self, cache, last_logits, left, keys, tail) -> tuple:
        """The compiled decode's positional inputs (left [B] int32 budgets, keys [B, 2] uint32,
        tail [B, K-1] int32); host arrays are placed by rows."""
        def rows(x, dtype):
            return x if isinstance(x, jax.Array) else self._put(np.asarray(x, dtype))
        return (self.state, cache, last_logits, rows(left, np.int32), rows(keys, np.uint32),
                self.stop_ids, self.stop_table, tail)

    def _check_room(self, cache, steps: int, max_slots: int | None):
        """Raise ValueError, before any step, when `steps` more slots fit neither the cache nor
        (with `max_slots` and a cache that can grow) its grown size."""
        length, capacity = int(cache.length), cache.valid.shape[1]
        need = length + steps
        grows = max_slots is not None and self._can_grow
        if need <= capacity or (grows and need <= max_slots):
            return
        limit = f" and may grow to {max_slots}" if grows else ""
        raise ValueError(f"decode: {steps} steps need {need} cache slots; the cache has "
                         f"{capacity}{limit} (make room first: grow_cache or a new cache)")

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, seeds: Sequence[int],
                 cache_len: int | None = None) -> dict[str, np.ndarray]:
        """Prefill `prompts` and decode up to max_new_tokens each; the cache starts at the
        prompt plus one segment and grows as the decode goes (`cache_len`: one fixed size).

        Returns host arrays: tokens [B, N] int32, logprobs [B, N] float32, lengths [B], reason [B].
        Raises ValueError for an empty prompt (its first token would be drawn from no
        logits), a count of seeds other than of prompts, and when `cache_len` is below the
        prompts' slots plus max_new_tokens.
        """
        if len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(seeds)} seeds for {len(prompts)} prompts; give one "
                             "seed per prompt")
        if empty := [i for i, p in enumerate(prompts) if len(p) == 0]:
            raise ValueError(f"generate: prompt {empty[0]} is empty; every row needs at least "
                             "one token to condition on")
        prompt = self.appended_slots(prompts)
        need = prompt + max_new_tokens
        if cache_len is not None and cache_len < need:
            raise ValueError(f"generate: prompts of {prompt} slots and {max_new_tokens} new "
                             f"tokens need {need} cache slots; cache_len is {cache_len}")
        start = min(need, prompt + self.segment) if self._can_grow else need
        cache, last = self.new_cache(len(prompts), cache_len or start)
        cache, last = self.append(cache, last, prompts)
        keys = row_keys(seeds)
        out = self.decode(cache, last, [max_new_tokens] * len(prompts), keys, max_new_tokens,
                          max_slots=cache_len or need)
        return {"tokens": host_array(out.tokens), "logprobs": host_array(out.logprobs),
                "lengths": host_array(out.lengths), "reason": host_array(out.reason)}
