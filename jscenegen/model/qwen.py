"""Qwen2/2.5 and Qwen3 decoders as Flax NNX modules (one family; differences are config flags).

Mirrors transformers' `modeling_qwen2.py` / `modeling_qwen3.py`: RMSNorm, rotate-half RoPE,
grouped-query attention (Qwen2: q/k/v biases; Qwen3: q_norm/k_norm over head_dim before RoPE),
SwiGLU MLP, pre-norm decoder layers, optional tied output embedding.

Parameters are `nnx.Param`s whose dotted paths are the HF names (`model.layers.0.mlp.up_proj.weight`)
in HF orientation ([out, in]), made from the one weight table (model/weights.py). Dim 0 of every
parameter may be zero-padded to a multiple of `pad_multiple` (FSDP2-style sharding over all
devices); `logical` slices the padding off right after the all-gather (the row count is the
parameter's `rows` metadata), so padded rows never reach the math and get zero gradients.

Positions come from the attention mask (cumulative sum), so left- and right-padded rows give
the same logits as unpadded ones. One forward handles a full sequence, a prefill into a KV
cache, a multi-token append (environment turns) and single-token decode.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jscenegen.model.attention import attention
from jscenegen.model.config import QwenConfig
from jscenegen.model.dense import dense
from jscenegen.model.dtypes import np_dtype
from jscenegen.model.remat import checkpointed, remat_policy
from jscenegen.model.rope import apply_rope, rope_cos_sin
from jscenegen.model.weights import ParamFactory, weight_table
from jscenegen.sharding.constraints import constrain, constrain_stacked, gather
from jscenegen.sharding.rules import ACTIVATION, CACHED_KV, HEADS, READ_KV, REPLICATED, ROWS


def logical(p: nnx.Param, dtype) -> jax.Array:
    """A parameter in HF orientation at its logical rows, cast to `dtype`: read as the active
    layout wants it (`sharding.constraints.gather`: all-gathered under FSDP training, as placed
    in a rollout layout), the dim-0 padding (beyond the `rows` metadata) sliced off. A rollout
    copy stored [in, out] (metadata `transposed`) is read transposed; XLA folds that into the
    matmul that consumes it."""
    w = p[...]
    if p.get_metadata().get("transposed", False):
        w = w.T
    w = gather(w)
    if w.shape[0] != p.rows:
        w = w[: p.rows]
    return w.astype(dtype)


class Linear(nnx.Module):
    """y = x W^T (+ b), W [out, in] as torch.nn.Linear stores it; `name` is the HF prefix
    (`model.layers.0.mlp.up_proj`), the bias exists when the weight table lists one."""

    def __init__(self, make: ParamFactory, name: str):
        self.weight = make(f"{name}.weight")
        self.bias = make.optional(f"{name}.bias")

    def __call__(self, x: jax.Array) -> jax.Array:
        y = dense(x, logical(self.weight, x.dtype))
        if self.bias is not None:
            y = y + logical(self.bias, x.dtype)
        return y


def rms_normalized(x: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) over the last axis, in fp32: x [..., D] any float dtype ->
    [..., D] float32 (the normalisation every Qwen RMSNorm variant shares, transformers'
    `Qwen3RMSNorm` / `Qwen3_5RMSNorm` / `Qwen3_5RMSNormGated`)."""
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """weight * (x / sqrt(mean(x^2) + eps)), normalised in fp32 and cast back before the weight (as HF)."""

    def __init__(self, make: ParamFactory, name: str, eps: float):
        self.eps = eps
        self.weight = make(f"{name}.weight")

    def __call__(self, x: jax.Array) -> jax.Array:
        return logical(self.weight, x.dtype) * rms_normalized(x, self.eps).astype(x.dtype)


class Embedding(nnx.Module):
    """`model.embed_tokens`: ids [B, S] int -> rows of weight [V, H] as [B, S, H] in `dtype`
    (transformers' `nn.Embedding`); a rollout copy stored [H, V] (metadata `transposed`) reads
    columns. `logical(dtype)` is the [V, H] table without FSDP padding (the tied LM head).

    pad_id (`QwenConfig.pad_token_id`, or None): the lookup of that id passes no gradient to
    its row, as torch's `nn.Embedding(padding_idx=pad_id)` (transformers' Qwen2/Qwen3/Qwen3.5
    models); its value is still read, and the tied LM head's gradient still reaches the row.

    ids must lie in [0, vocab_size): nothing here checks them (it runs inside jit); the
    tokenizer check (`tokenizer.chat`, ChatTemplateError) keeps the commands' ids in range. An
    id past the stored rows reads NaN, a negative one wraps, one in the FSDP padding reads zeros.
    """

    def __init__(self, make: ParamFactory, name: str, pad_id: int | None = None):
        self.weight = make(f"{name}.weight")
        self.pad_id = pad_id

    def __call__(self, ids: jax.Array, dtype) -> jax.Array:
        if self.weight.get_metadata().get("transposed", False):   # a rollout copy [H, V]
            x = jnp.moveaxis(jnp.take(self.weight[...], ids, axis=1), 0, -1).astype(dtype)
        else:
            x = jnp.take(self.weight[...], ids, axis=0).astype(dtype)
        if self.pad_id is None:
            return x
        return jnp.where((ids == self.pad_id)[..., None], jax.lax.stop_gradient(x), x)

    def logical(self, dtype) -> jax.Array:
        return logical(self.weight, dtype)


def check_rows_without_cache(rows, cache) -> None:
    """Raise ValueError when `hidden_states` gets both `rows` (positions of a full forward) and
    a cache (a cached step has no such positions)."""
    if rows is not None and cache is not None:
        raise ValueError("rows selects positions of a full forward; a cached step has none")


def balanced_order(s: int, shards: int) -> jax.Array:
    """Token order for causal load balance: the sequence cut into 2 x shards chunks, shard i
    holding chunks i and 2 x shards - 1 - i, so every shard gets equal causal attention work.
    [s] int32 permutation (entry p: the original index of reordered position p); s must be a
    multiple of 2 x shards. Computed from an iota, so inside jit the program holds no
    [s]-sized constant (and no [s, s] one where the mask compares it)."""
    chunks = 2 * shards
    c = s // chunks
    p = jnp.arange(s, dtype=jnp.int32)
    shard, second, offset = p // (2 * c), (p // c) % 2, p % c
    return jnp.where(second == 1, chunks - 1 - shard, shard) * c + offset


def full_sequence_inputs(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(positions [B, S] int32, attention mask [B, S, S] bool) of a full sequence, from its
    token mask [B, S] bool: positions count real tokens (cumsum - 1, pads 0), so left- and
    right-padded rows get the unpadded positions; a query attends to real keys at or before it."""
    s = mask.shape[1]
    positions = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)
    causal = jnp.tril(jnp.ones((s, s), bool))
    return positions, causal[None] & mask[:, None, :]


def cache_step_inputs(mask: jax.Array, cache) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(positions [B, S], attention mask [B, S, Smax], valid [B, Smax]) of S tokens appended at
    slot `cache.length` of a cache with `valid` [B, Smax] and `next_pos` [B] (KVCache or
    qwen35.HybridCache). mask [B, S] bool; padding slots stay invalid and take no position."""
    s = mask.shape[1]
    steps = jnp.cumsum(mask.astype(jnp.int32), axis=1)
    positions = jnp.maximum(cache.next_pos[:, None] + steps - 1, 0)
    valid = jax.lax.dynamic_update_slice_in_dim(cache.valid, mask, cache.length, axis=1)
    smax = cache.valid.shape[1]
    q_slot = cache.length + jnp.arange(s)
    causal = jnp.arange(smax)[None, :] <= q_slot[:, None]
    return positions, causal[None] & valid[:, None, :], valid


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Preallocated keys/values, one array per layer.

    k: tuple of L arrays [B, Nkv, D, Smax], v: tuple of L arrays [B, Nkv, Smax, D], compute
    dtype. Head-major, keys transposed: both attention products then read the cache as it
    lies, in the plain [M, K] x [K, N] form every matmul backend reads without repacking; one
    array per layer: no slice of a whole-model cache is copied per layer and token.
    valid: [B, Smax] bool (slot holds a real token);
    next_pos: [B] int32 (RoPE position of the row's next real token); length: [] int32 (slots
    written so far; all rows write in lockstep, padding slots stay invalid).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    valid: jax.Array
    next_pos: jax.Array
    length: jax.Array

    @classmethod
    def create(cls, cfg: QwenConfig, batch: int, max_len: int, dtype=jnp.float32) -> "KVCache":
        k_shape = (batch, cfg.num_key_value_heads, cfg.head_dim, max_len)
        v_shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        n = cfg.num_hidden_layers
        return cls(
            k=tuple(jnp.zeros(k_shape, dtype) for _ in range(n)),
            v=tuple(jnp.zeros(v_shape, dtype) for _ in range(n)),
            valid=jnp.zeros((batch, max_len), bool),
            next_pos=jnp.zeros((batch,), jnp.int32), length=jnp.zeros((), jnp.int32),
        )

    def partition_specs(self) -> "KVCache":
        """Where each array lives (`sharding.rules` roles, resolved by the active layout): the
        layers' arrays CACHED_KV (rows, and heads under tensor parallelism), per-row arrays
        ROWS, the slot counter REPLICATED."""
        return KVCache(k=tuple(CACHED_KV for _ in self.k), v=tuple(CACHED_KV for _ in self.v),
                       valid=ROWS, next_pos=ROWS, length=REPLICATED)

    def grown(self, extra: int) -> "KVCache":
        """This cache with `extra` more empty slots (contents, positions and length kept)."""
        return KVCache(tuple(with_empty_slots(k, 3, extra) for k in self.k),
                       tuple(with_empty_slots(v, 2, extra) for v in self.v),
                       with_empty_slots(self.valid, 1, extra), self.next_pos, self.length)


def with_empty_slots(x: jax.Array, axis: int, extra: int) -> jax.Array:
    """`x` with `extra` zero entries appended along its slot axis `axis` (a cache's growth:
    zero K/V and `valid` False are empty slots)."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


class Attention(nnx.Module):
    """Qwen2/Qwen3 grouped-query self-attention (transformers' `Qwen3Attention`): q/k/v
    projections (with biases on Qwen2), Qwen3's per-head RMSNorm of q and k, RoPE, attention
    (`cached_attention`), o_proj. Weights `{name}.{q,k,v,o}_proj.weight` [out, in]."""

    def __init__(self, cfg: QwenConfig, make: ParamFactory, name: str, attn_impl: str):
        self.nq, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.attn_impl = attn_impl
        self.q_proj = Linear(make, f"{name}.q_proj")
        self.k_proj = Linear(make, f"{name}.k_proj")
        self.v_proj = Linear(make, f"{name}.v_proj")
        self.o_proj = Linear(make, f"{name}.o_proj")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(make, f"{name}.q_norm", cfg.rms_norm_eps)
            self.k_norm = RMSNorm(make, f"{name}.k_norm", cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x, cos, sin, mask, kv=None, rows=None):
        """x [B,S,H]; mask [B,S,Sk] -> (out, kv).

        kv = (k_cache [B,Nkv,D,Smax], v_cache [B,Nkv,Smax,D], offset) or None: the S new keys/values are
        written into this layer's cache at slot `offset` (in place) and attention reads its
        slots; the updated (k_cache, v_cache) are returned. Without a cache the keys/values of
        x are used and returned as (k, v). rows [B, C] int (no cache): queries at those
        positions only, out [B, C, H] (keys/values of every position).
        """
        b, s, _ = x.shape
        xq, cos_q, sin_q, mask = query_inputs(x, cos, sin, mask, rows)
        q = self.q_proj(xq).reshape(b, xq.shape[1], self.nq, self.hd)
        k = self.k_proj(x).reshape(b, s, self.nkv, self.hd)
        v = self.v_proj(x).reshape(b, s, self.nkv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos_q, sin_q), apply_rope(k, cos, sin)
        out, new_kv = cached_attention(q, k, v, mask, kv, self.attn_impl)
        return self.o_proj(out.reshape(b, xq.shape[1], self.nq * self.hd)), new_kv


def cached_attention(q, k, v, mask, kv, attn_impl: str):
    """Attention of q [B,S,Nq,D] over the keys/values of k, v [B,S,Nkv,D] (no cache) or over
    a cache after writing k, v into it.

    kv = None, or (k_cache [B,Nkv,D,Smax], v_cache [B,Nkv,Smax,D], offset): one layer's
    head-major cache (`KVCache`, keys transposed): the S new keys/values are written at slot
    `offset` and attention reads the slots as they lie; or (k_all [L,B,Smax,Nkv,D], v_all,
    layer, offset): a whole-model cache (Qwen3.5's `HybridCache`, inside its layer scan), layer
    `layer` written and read. mask [B,S,Sk] bool. Returns (out [B,S,Nq,D] in q's dtype, the
    updated cache arrays, or (k, v) without a cache).
    """
    q = constrain(q, HEADS)
    if kv is not None and len(kv) == 3:
        k_cache, v_cache, offset = kv
        k = jax.lax.dynamic_update_slice(k_cache, k.transpose(0, 2, 3, 1).astype(k_cache.dtype),
                                         (0, 0, 0, offset))
        v = jax.lax.dynamic_update_slice(v_cache, v.swapaxes(1, 2).astype(v_cache.dtype),
                                         (0, 0, offset, 0))
        k, v = constrain(k, CACHED_KV), constrain(v, CACHED_KV)
        out = attention(q, k.astype(q.dtype), v.astype(q.dtype), mask, attn_impl, cached=True)
        return out, (k, v)
    if kv is not None:
        k_all, v_all, layer, offset = kv
        start = (layer, 0, offset, 0, 0)
        k_all = jax.lax.dynamic_update_slice(k_all, k[None].astype(k_all.dtype), start)
        v_all = jax.lax.dynamic_update_slice(v_all, v[None].astype(v_all.dtype), start)
        k = jax.lax.dynamic_index_in_dim(k_all, layer, keepdims=False)
        v = jax.lax.dynamic_index_in_dim(v_all, layer, keepdims=False)
        new_kv = (k_all, v_all)
    else:
        new_kv = (k, v)
    # sequence parallelism: queries stay sharded over sp, keys/values are gathered over sp;
    # tensor parallelism: the kv heads stay split as their projections made them
    k, v = constrain(k, READ_KV), constrain(v, READ_KV)
    out = attention(q, k.astype(q.dtype), v.astype(q.dtype), mask, attn_impl)
    return out, new_kv


class MLP(nnx.Module):
    """SwiGLU feed-forward: down_proj(silu(gate_proj(x)) * up_proj(x)) (transformers'
    `Qwen3MLP`); x [..., H] -> [..., H]."""

    def __init__(self, make: ParamFactory, name: str):
        self.gate_proj = Linear(make, f"{name}.gate_proj")
        self.up_proj = Linear(make, f"{name}.up_proj")
        self.down_proj = Linear(make, f"{name}.down_proj")

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def take_rows(x: jax.Array, rows: jax.Array) -> jax.Array:
    """x [B, S, ...] at positions rows [B, C] int -> [B, C, ...]."""
    return jnp.take_along_axis(x, rows.reshape(rows.shape + (1,) * (x.ndim - 2)), axis=1)


def query_inputs(x, cos, sin, mask, rows):
    """What an attention's queries read, at positions `rows` [B, C] int (None: every position):
    x [B, S, H] -> [B, C, H], cos/sin [B, S, D] -> [B, C, D], mask [B, S, Sk] -> [B, C, Sk];
    the keys and values keep reading every position."""
    if rows is None:
        return x, cos, sin, mask
    return tuple(take_rows(a, rows) for a in (x, cos, sin, mask))


class DecoderLayer(nnx.Module):
    """Pre-norm residual block (transformers' `Qwen3DecoderLayer`):
    x + attn(norm(x)), then + mlp(norm(.)); x [B, S, H] -> ([B, S, H], the layer's kv).
    With `rows` [B, C] int (the last layer of a forward whose caller needs C positions only):
    queries, residual and MLP at those positions only (keys/values from every position), so
    the layer returns [B, C, H]."""

    def __init__(self, cfg: QwenConfig, make: ParamFactory, name: str, attn_impl: str):
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(make, f"{name}.input_layernorm", eps)
        self.self_attn = Attention(cfg, make, f"{name}.self_attn", attn_impl)
        self.post_attention_layernorm = RMSNorm(make, f"{name}.post_attention_layernorm", eps)
        self.mlp = MLP(make, f"{name}.mlp")

    def __call__(self, x, cos, sin, mask, kv=None, rows=None):
        attn_out, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, kv, rows)
        if rows is not None:
            x = take_rows(x, rows)
        x = constrain(x + attn_out, ACTIVATION)
        x = constrain(x + self.mlp(self.post_attention_layernorm(x)), ACTIVATION)
        return x, new_kv


class QwenModel(nnx.Module):
    """`model.*` of a Qwen2/Qwen3 checkpoint: embed_tokens, the decoder layers, the final norm
    (transformers' `Qwen3Model`); `QwenForCausalLM` runs them."""

    def __init__(self, cfg: QwenConfig, make: ParamFactory, attn_impl: str):
        self.embed_tokens = Embedding(make, "model.embed_tokens", cfg.pad_token_id)
        self.layers = nnx.List([DecoderLayer(cfg, make, f"model.layers.{i}", attn_impl)
                                for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(make, "model.norm", cfg.rms_norm_eps)


class CausalLM(nnx.Module):
    """The output side every decoder shares (QwenForCausalLM, qwen35.Qwen35ForCausalLM).

    Subclasses provide `text` (the module holding `embed_tokens` and `norm`), `lm_head`
    (None when tied), `compute_dtype`, `hidden_states(input_ids, attention_mask, cache,
    layers, rows=None)` ([B, S, H], or [B, C, H] at the positions `rows` [B, C] of a full
    forward), `stacked_layers()` and `create_cache(cfg, batch, max_len, dtype)`.
    """

    def decode_params(self) -> nnx.filterlib.Filter:
        """The nnx filter of the parameters a decode reads: every `nnx.Param` (Qwen3.5 leaves
        out a trainable vision tower: text decoding never runs it)."""
        return nnx.Param

    def decode_layers(self):
        """What `hidden_states(..., layers=)` takes in a decode loop, computed once outside it:
        `stacked_layers()` (Qwen3.5's scan), or None where the cached path runs the layers
        over their own weights (Qwen2/Qwen3)."""
        return self.stacked_layers()

    def output_embedding(self) -> jax.Array:
        """The output projection [V, H] at logical size (padding rows sliced off), compute dtype."""
        dt = np_dtype(self.compute_dtype)
        if self.lm_head is None:
            return self.text.embed_tokens.logical(dt)
        return logical(self.lm_head.weight, dt)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [B, S, H] -> logits [B, S, V] float32 (logical vocabulary)."""
        return dense(hidden, self.output_embedding(), jnp.float32)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array,
                 cache=None):
        """Logits [B, S, V] float32 (and the updated cache when one is given)."""
        if cache is None:
            return self.logits(self.hidden_states(input_ids, attention_mask))
        hidden, cache = self.hidden_states(input_ids, attention_mask, cache)
        return self.logits(hidden), cache


class QwenForCausalLM(CausalLM):
    """A Qwen2/Qwen3 causal LM.

    Args:
      cfg: the architecture (from `QwenConfig.from_dir` / `from_hf_dict`).
      rngs: initialisation PRNGs (random weights; `load_hf` replaces them).
      pad_multiple: pad dim 0 of every parameter to a multiple of this (the mesh's device count).
      param_dtype / compute_dtype: "float32" or "bfloat16".
      remat: rematerialise each decoder layer in the backward pass: False, True ("full") or
        "minimal" (the projections' outputs kept; `model.remat`).
      scan_layers: a full forward (training) runs the layers as a `lax.scan` over stacked
        parameters (the compiled step holds one layer's gathered weights: needed under FSDP),
        else as a Python loop over their own parameters (one device: no stacking, no
        zero-filled per-layer residual buffers, no slicing; faster on CPU).
      attn_impl: "xla" (reference, CPU) or "cudnn" (GPU, bf16).
      balance_shards: > 1 reorders a full sequence for causal load balance over that many
        sequence shards (`balanced_order`); results are returned in the original order.
      train_vision: only for Qwen3.5 (ValueError here: these models have no vision tower).
    """

    def __init__(self, cfg: QwenConfig, *, rngs: nnx.Rngs, pad_multiple: int = 1,
                 param_dtype: str = "float32", compute_dtype: str = "float32",
                 remat: bool | str = False, attn_impl: str = "xla", balance_shards: int = 1,
                 train_vision: bool = False, scan_layers: bool = True):
        self.cfg = cfg
        self.balance_shards = balance_shards
        self.compute_dtype = compute_dtype
        self.remat = remat_policy(remat)
        self.scan_layers = scan_layers
        make = ParamFactory(weight_table(cfg, train_vision=train_vision), rngs=rngs, pad_multiple=pad_multiple,
                            dtype=np_dtype(param_dtype))
        self.model = QwenModel(cfg, make, attn_impl)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(make, "lm_head")

    @property
    def text(self) -> QwenModel:
        return self.model

    @staticmethod
    def create_cache(cfg: QwenConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
        """An empty decode cache (`KVCache.create`)."""
        return KVCache.create(cfg, batch, max_len, dtype)

    def decode_layers(self):
        """None: the cached path runs the layers over their own weights (no stacking)."""
        return None

    def hidden_states(self, input_ids: jax.Array, attention_mask: jax.Array,
                      cache: KVCache | None = None, layers=None, rows: jax.Array | None = None):
        """Final normed hidden states [B, S, H] (compute dtype).

        input_ids [B, S] int32; attention_mask [B, S] (1 = real token, 0 = padding).
        Without a cache: a full forward; with `rows` [B, C] int32 (positions in [0, S)) only
        those positions' states, [B, C, H]: the last layer's queries, output projection and
        MLP and the final norm run on them alone (its keys/values on every position), as the
        output projection after them does (the trained tokens' log-probs:
        `grpo.algo.logprobs.model_token_logprobs`); the result equals gathering the full
        [B, S, H]. With a cache: the S tokens are appended at slot
        `cache.length` (prefill, append or decode) and the updated cache is returned as
        (hidden, cache); the layers then run as a Python loop over their own parameters and
        cache arrays (no stacking per call, no per-layer slices inside the sampler's decode
        loop), while a full forward runs them as a `lax.scan` over stacked parameters
        (training: one layer's gathered weights in the compiled step). `layers` is accepted
        for the decoders' common signature and unused (`decode_layers` is None).
        """
        cfg = self.cfg
        check_rows_without_cache(rows, cache)
        dt = np_dtype(self.compute_dtype)
        mask = attention_mask.astype(bool)
        b, s = input_ids.shape
        steps = jnp.cumsum(mask.astype(jnp.int32), axis=1)
        order = None
        if cache is None:
            positions, attn_mask = full_sequence_inputs(mask)
            if self.balance_shards > 1 and s % (2 * self.balance_shards) == 0:
                # traced, not NumPy: a NumPy order's [S, S] comparison was folded into the
                # program as a constant (134 MB of StableHLO at S = 8,192)
                order = balanced_order(s, self.balance_shards)
                inverse = jnp.argsort(order)    # reordered position of each original index
                input_ids, mask, positions = input_ids[:, order], mask[:, order], positions[:, order]
                causal = order[None, :] <= order[:, None]  # key's original index <= query's
                attn_mask = causal[None] & mask[:, None, :]
                if rows is not None:    # the reordered index of each requested position
                    rows = inverse[rows]
        else:
            positions, attn_mask, valid = cache_step_inputs(mask, cache)
        cos, sin = rope_cos_sin(cfg, positions)
        x = constrain(self.model.embed_tokens(input_ids, dt), ACTIVATION)
        x, new_k, new_v = self._layers(x, cos, sin, attn_mask, cache, rows)
        hidden = self.model.norm(x)
        if cache is None:
            return hidden if order is None or rows is not None else hidden[:, inverse]
        new_cache = KVCache(
            k=new_k, v=new_v, valid=valid,
            next_pos=cache.next_pos + steps[:, -1], length=cache.length + s,
        )
        return hidden, new_cache

    def stacked_layers(self, count: int | None = None):
        """(graphdef, state) of one decoder layer with every parameter stacked over the layers
        [L, ...] (the first `count` layers when given)."""
        splits = [nnx.split(layer) for layer in list(self.model.layers)[:count]]
        stacked = jax.tree.map(lambda *xs: constrain_stacked(jnp.stack(xs)), *[s for _, s in splits])
        return splits[0][0], stacked

    def _layers(self, x, cos, sin, attn_mask, cache, rows=None):
        """Run the decoder stack.

        Without a cache (training): a `lax.scan` over the layers' parameters stacked on the
        fly. Storage stays one module per layer (HF names); stacking sharded parameters keeps
        them sharded, and the loop body gathers one layer's weights at a time, so the compiled
        step holds one gathered layer (per direction), not the whole model. Without
        `scan_layers`: a Python loop (one device).
        With a cache (the sampler): layer by layer over their own parameters and cache arrays,
        each layer writing only its new slots in place, so a decode step copies neither
        weights nor cache. With `rows` (no cache) the last layer runs on its own after the
        others and returns those positions only (`DecoderLayer`). Returns (x, new k tuple, new
        v tuple) (None, None without a cache).
        """
        if cache is not None:
            new_k, new_v = [], []
            for layer, k, v in zip(self.model.layers, cache.k, cache.v):
                x, (k, v) = layer(x, cos, sin, attn_mask, (k, v, cache.length))
                new_k.append(k)
                new_v.append(v)
            return x, tuple(new_k), tuple(new_v)
        layers = list(self.model.layers)
        body_layers, last = (layers, None) if rows is None else (layers[:-1], layers[-1])
        if not self.scan_layers:
            for layer in body_layers:
                def run(h, layer=layer):
                    return layer(h, cos, sin, attn_mask)[0]
                x = checkpointed(run, self.remat, prevent_cse=False)(x)
        elif body_layers:
            graphdef, stacked = self.stacked_layers(len(body_layers))

            def body(h, layer_state):
                layer = nnx.merge(graphdef, layer_state)
                h, _ = layer(h, cos, sin, attn_mask)
                return h, None

            x, _ = jax.lax.scan(checkpointed(body, self.remat, prevent_cse=False), x, stacked)
        if last is not None:
            def run_last(h, rows):
                return last(h, cos, sin, attn_mask, rows=rows)[0]
            # outside any scan or loop body: CSE could merge its recomputation with the forward
            x = checkpointed(run_last, self.remat, prevent_cse=True)(x, rows)
        return x, None, None
