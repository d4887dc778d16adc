"""Qwen2/2.5 and Qwen3 decoders as Flax NNX modules (one family; differences are config flags).

Mirrors transformers' `modeling_qwen2.py` / `modeling_qwen3.py`: RMSNorm, rotate-half RoPE,
grouped-query attention (Qwen2: q/k/v biases; Qwen3: q_norm/k_norm over head_dim before RoPE),
SwiGLU MLP, pre-norm decoder layers, optional tied output embedding.

Parameters are `nnx.Param`s whose dotted paths are the HF names (`model.layers.0.mlp.up_proj.weight`)
in HF orientation ([out, in]). Dim 0 of every parameter may be zero-padded to a multiple of
`pad_multiple` (FSDP2-style sharding over all devices); modules slice the padding off right
after reading a weight, so padded rows never reach the math and get zero gradients.

Positions come from the attention mask (cumulative sum), so left- and right-padded rows give
the same logits as unpadded ones. One forward handles a full sequence, a prefill into a KV
cache, a multi-token append (environment turns) and single-token decode.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jscenegen.model.attention import attention
from jscenegen.model.config import QwenConfig
from jscenegen.model.weights import padded_shape
from jscenegen.sharding.constraints import BATCH_ONLY, BATCH_SEQ, constrain, constrain_stacked, gather
from jscenegen.model.rope import apply_rope, rope_cos_sin

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _param(rngs: nnx.Rngs | None, shape, pad_multiple, dtype, init: str) -> nnx.Param:
    padded = padded_shape(tuple(shape), pad_multiple)
    if init == "ones":
        value = jnp.zeros(padded, dtype).at[: shape[0]].set(1)
    elif init == "zeros":
        value = jnp.zeros(padded, dtype)
    else:
        value = jnp.zeros(padded, dtype).at[: shape[0]].set(
            0.02 * jax.random.normal(rngs.params(), tuple(shape), dtype)
        )
    return nnx.Param(value)


def _read(p: nnx.Param, n: int, dtype) -> jax.Array:
    """The first n rows of a (possibly padded) parameter, cast to the compute dtype."""
    w = gather(p[...])  # all-gather the padded array, then slice the padding off
    if w.shape[0] != n:
        w = w[:n]
    return w.astype(dtype)


class Linear(nnx.Module):
    """y = x W^T (+ b), W [out, in] as torch.nn.Linear stores it."""

    def __init__(self, d_in, d_out, *, bias, rngs, pad_multiple, param_dtype):
        self.d_out = d_out
        self.weight = _param(rngs, (d_out, d_in), pad_multiple, param_dtype, "normal")
        self.bias = _param(rngs, (d_out,), pad_multiple, param_dtype, "zeros") if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        w = _read(self.weight, self.d_out, x.dtype)
        y = jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32).astype(x.dtype)
        if self.bias is not None:
            y = y + _read(self.bias, self.d_out, x.dtype)
        return y


class RMSNorm(nnx.Module):
    """weight * (x / sqrt(mean(x^2) + eps)), normalised in fp32 and cast back before the weight (as HF)."""

    def __init__(self, dim, eps, *, pad_multiple, param_dtype):
        self.dim, self.eps = dim, eps
        self.weight = _param(None, (dim,), pad_multiple, param_dtype, "ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return _read(self.weight, self.dim, x.dtype) * xf.astype(x.dtype)


class Embedding(nnx.Module):
    def __init__(self, vocab, dim, *, rngs, pad_multiple, param_dtype):
        self.vocab = vocab
        self.weight = _param(rngs, (vocab, dim), pad_multiple, param_dtype, "normal")

    def __call__(self, ids: jax.Array, dtype) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0).astype(dtype)

    def logical(self, dtype) -> jax.Array:
        return _read(self.weight, self.vocab, dtype)


def balanced_order(s: int, shards: int) -> np.ndarray:
    """Token order for causal load balance: the sequence cut into 2 x shards chunks, shard i
    holding chunks i and 2 x shards - 1 - i, so every shard gets equal causal attention work.
    [s] int permutation; s must be a multiple of 2 x shards."""
    chunks = 2 * shards
    c = s // chunks
    picks = [j for i in range(shards) for j in (i, chunks - 1 - i)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for j in picks])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Preallocated keys/values for all layers.

    k, v: [L, B, Smax, Nkv, D] compute dtype; valid: [B, Smax] bool (slot holds a real token);
    next_pos: [B] int32 (RoPE position of the row's next real token); length: [] int32 (slots
    written so far; all rows write in lockstep, padding slots stay invalid).
    """

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    next_pos: jax.Array
    length: jax.Array

    @classmethod
    def create(cls, cfg: QwenConfig, batch: int, max_len: int, dtype=jnp.float32) -> "KVCache":
        shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        return cls(
            k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
            valid=jnp.zeros((batch, max_len), bool),
            next_pos=jnp.zeros((batch,), jnp.int32), length=jnp.zeros((), jnp.int32),
        )


class Attention(nnx.Module):
    def __init__(self, cfg: QwenConfig, *, rngs, pad_multiple, param_dtype, attn_impl):
        h, nq, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        kw = dict(rngs=rngs, pad_multiple=pad_multiple, param_dtype=param_dtype)
        self.nq, self.nkv, self.hd, self.attn_impl = nq, nkv, hd, attn_impl
        self.q_proj = Linear(h, nq * hd, bias=cfg.qkv_bias, **kw)
        self.k_proj = Linear(h, nkv * hd, bias=cfg.qkv_bias, **kw)
        self.v_proj = Linear(h, nkv * hd, bias=cfg.qkv_bias, **kw)
        self.o_proj = Linear(nq * hd, h, bias=False, **kw)
        if cfg.qk_norm:
            norm_kw = dict(pad_multiple=pad_multiple, param_dtype=param_dtype)
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, **norm_kw)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, **norm_kw)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x, cos, sin, mask, kv=None):
        """x [B,S,H]; mask [B,S,Sk] -> (out, kv).

        kv = (k_all [L,B,Smax,Nkv,D], v_all, layer, offset) or None: the S new keys/values are
        written into layer `layer` of the whole-model cache at slot `offset` (in place, inside
        the layer loop's carry) and attention reads that layer's slots; the updated cache is
        returned. Without a cache the keys/values of x are used and returned as (k, v).
        """
        b, s, _ = x.shape
        q = self.q_proj(x).reshape(b, s, self.nq, self.hd)
        k = self.k_proj(x).reshape(b, s, self.nkv, self.hd)
        v = self.v_proj(x).reshape(b, s, self.nkv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
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
        # sequence parallelism: queries stay sharded over sp, keys/values are gathered over sp
        q = constrain(q, BATCH_SEQ)
        k_all_seq, v_all_seq = constrain(k, BATCH_ONLY), constrain(v, BATCH_ONLY)
        out = attention(q, k_all_seq.astype(q.dtype), v_all_seq.astype(q.dtype), mask, self.attn_impl)
        return self.o_proj(out.reshape(b, s, self.nq * self.hd)), new_kv


class MLP(nnx.Module):
    def __init__(self, cfg: QwenConfig, *, rngs, pad_multiple, param_dtype):
        kw = dict(bias=False, rngs=rngs, pad_multiple=pad_multiple, param_dtype=param_dtype)
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, **kw)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: QwenConfig, *, rngs, pad_multiple, param_dtype, attn_impl):
        norm_kw = dict(pad_multiple=pad_multiple, param_dtype=param_dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm_kw)
        self.self_attn = Attention(cfg, rngs=rngs, pad_multiple=pad_multiple,
                                   param_dtype=param_dtype, attn_impl=attn_impl)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm_kw)
        self.mlp = MLP(cfg, rngs=rngs, pad_multiple=pad_multiple, param_dtype=param_dtype)

    def __call__(self, x, cos, sin, mask, kv=None):
        attn_out, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, kv)
        x = constrain(x + attn_out, BATCH_SEQ)
        x = constrain(x + self.mlp(self.post_attention_layernorm(x)), BATCH_SEQ)
        return x, new_kv


class QwenModel(nnx.Module):
    def __init__(self, cfg: QwenConfig, *, rngs, pad_multiple, param_dtype, attn_impl):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, rngs=rngs,
                                      pad_multiple=pad_multiple, param_dtype=param_dtype)
        self.layers = nnx.List([
            DecoderLayer(cfg, rngs=rngs, pad_multiple=pad_multiple, param_dtype=param_dtype,
                         attn_impl=attn_impl)
            for _ in range(cfg.num_hidden_layers)
        ])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pad_multiple=pad_multiple,
                            param_dtype=param_dtype)



class QwenForCausalLM(nnx.Module):
    """A Qwen2/Qwen3 causal LM.

    Args:
      cfg: the architecture (from `QwenConfig.from_dir` / `from_hf_dict`).
      rngs: initialisation PRNGs (random weights; `load_hf` replaces them).
      pad_multiple: pad dim 0 of every parameter to a multiple of this (the mesh's device count).
      param_dtype / compute_dtype: "float32" or "bfloat16".
      remat: rematerialise each decoder layer in the backward pass (jax.checkpoint).
      attn_impl: "xla" (reference, CPU) or "cudnn" (GPU, bf16).
      balance_shards: > 1 reorders a full sequence for causal load balance over that many
        sequence shards (`balanced_order`); results are returned in the original order.
    """

    def __init__(self, cfg: QwenConfig, *, rngs: nnx.Rngs, pad_multiple: int = 1,
                 param_dtype: str = "float32", compute_dtype: str = "float32",
                 remat: bool = False, attn_impl: str = "xla", balance_shards: int = 1):
        self.cfg = cfg
        self.balance_shards = balance_shards
        self.pad_multiple = pad_multiple
        self.compute_dtype = compute_dtype
        self.remat = remat
        pdt = DTYPES[param_dtype]
        self.model = QwenModel(cfg, rngs=rngs, pad_multiple=pad_multiple, param_dtype=pdt,
                               attn_impl=attn_impl)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, rngs=rngs,
                                  pad_multiple=pad_multiple, param_dtype=pdt)
        else:
            self.lm_head = None

    def output_embedding(self) -> jax.Array:
        """The output projection [V, H] at logical size (padding rows sliced off), compute dtype."""
        dt = DTYPES[self.compute_dtype]
        if self.lm_head is None:
            return self.model.embed_tokens.logical(dt)
        return _read(self.lm_head.weight, self.cfg.vocab_size, dt)

    def hidden_states(self, input_ids: jax.Array, attention_mask: jax.Array,
                      cache: KVCache | None = None, layers=None):
        """Final normed hidden states [B, S, H] (compute dtype).

        input_ids [B, S] int32; attention_mask [B, S] (1 = real token, 0 = padding).
        Without a cache: a full forward. With a cache: the S tokens are appended at slot
        `cache.length` (prefill, append or decode) and the updated cache is returned as
        (hidden, cache). `layers`: the result of `stacked_layers()` computed once outside a
        loop that calls the model repeatedly (the sampler's decode loop), so the weights are
        not re-stacked on every call.
        """
        cfg = self.cfg
        dt = DTYPES[self.compute_dtype]
        mask = attention_mask.astype(bool)
        b, s = input_ids.shape
        steps = jnp.cumsum(mask.astype(jnp.int32), axis=1)
        order = None
        if cache is None:
            positions = jnp.maximum(steps - 1, 0)
            if self.balance_shards > 1 and s % (2 * self.balance_shards) == 0:
                order = balanced_order(s, self.balance_shards)
                input_ids, mask, positions = input_ids[:, order], mask[:, order], positions[:, order]
                causal = order[None, :] <= order[:, None]  # key's original index <= query's
            else:
                causal = jnp.tril(jnp.ones((s, s), bool))
            attn_mask = causal[None] & mask[:, None, :]
        else:
            positions = jnp.maximum(cache.next_pos[:, None] + steps - 1, 0)
            valid = jax.lax.dynamic_update_slice_in_dim(cache.valid, mask, cache.length, axis=1)
            smax = cache.valid.shape[1]
            q_slot = cache.length + jnp.arange(s)
            causal = jnp.arange(smax)[None, :] <= q_slot[:, None]
            attn_mask = causal[None] & valid[:, None, :]
        cos, sin = rope_cos_sin(cfg, positions)
        x = constrain(self.model.embed_tokens(input_ids, dt), BATCH_SEQ)
        x, new_k, new_v = self._layers(x, cos, sin, attn_mask, cache, layers)
        hidden = self.model.norm(x)
        if cache is None:
            return hidden if order is None else hidden[:, np.argsort(order)]
        new_cache = KVCache(
            k=new_k, v=new_v, valid=valid,
            next_pos=cache.next_pos + steps[:, -1], length=cache.length + s,
        )
        return hidden, new_cache

    def stacked_layers(self):
        """(graphdef, state) of one decoder layer with every parameter stacked over the layers [L, ...]."""
        splits = [nnx.split(layer) for layer in self.model.layers]
        stacked = jax.tree.map(lambda *xs: constrain_stacked(jnp.stack(xs)), *[s for _, s in splits])
        return splits[0][0], stacked

    def _layers(self, x, cos, sin, attn_mask, cache, layers=None):
        """Run the decoder stack as a `lax.scan` over the layers' parameters stacked on the fly.

        Storage stays one module per layer (HF names); stacking sharded parameters keeps them
        sharded, and the loop body gathers one layer's weights at a time, so the compiled step
        holds one gathered layer (per direction), not the whole model. The KV cache [L, ...]
        rides in the loop's carry and each layer writes only its new slots, so a decode step
        never copies the cache.
        """
        graphdef, stacked = layers if layers is not None else self.stacked_layers()

        def body(carry, xs):
            h, k_all, v_all = carry
            layer_state, index = xs
            layer = nnx.merge(graphdef, layer_state)
            kv = None if cache is None else (k_all, v_all, index, cache.length)
            h, new_kv = layer(h, cos, sin, attn_mask, kv)
            if cache is not None:
                k_all, v_all = new_kv
            return (h, k_all, v_all), None

        if self.remat:
            body = jax.checkpoint(body, prevent_cse=False)
        n = len(self.model.layers)
        init = (x, None, None) if cache is None else (x, cache.k, cache.v)
        (x, new_k, new_v), _ = jax.lax.scan(body, init, (stacked, jnp.arange(n)))
        return x, new_k, new_v

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [B, S, H] -> logits [B, S, V] float32 (logical vocabulary)."""
        w = self.output_embedding()
        return jnp.einsum("bsh,vh->bsv", hidden, w, preferred_element_type=jnp.float32)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array,
                 cache: KVCache | None = None):
        """Logits [B, S, V] float32 (and the updated cache when one is given)."""
        if cache is None:
            return self.logits(self.hidden_states(input_ids, attention_mask))
        hidden, cache = self.hidden_states(input_ids, attention_mask, cache)
        return self.logits(hidden), cache
