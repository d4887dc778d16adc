"""Qwen3.5 (`qwen3_5`, `qwen3_5_text`): the hybrid decoder of Gated DeltaNet and gated attention.

Mirrors transformers' `models/qwen3_5/modeling_qwen3_5.py` (5.24; "T" below) for text input:

- each layer is `x + mixer(input_layernorm(x))`, then `x + mlp(post_attention_layernorm(x))`,
  with the mixer chosen per `cfg.layer_types`: `GatedDeltaNet` ("linear_attention",
  T `Qwen3_5GatedDeltaNet`) or `GatedAttention` ("full_attention", T `Qwen3_5Attention`);
- every RMSNorm is zero-centred, `(1 + w)` in fp32 (`ZeroCentredRMSNorm`, T `Qwen3_5RMSNorm`),
  except the Gated DeltaNet's output norm (`GatedRMSNorm`, plain `w`, times silu(z));
- RoPE is partial (first `cfg.rotary_dim` dims; model/rope.py), positions 1-D from the mask.
  Image and video positions (T `Qwen3_5Model.get_rope_index`) are not built: jscenegen runs
  text only, for which the multimodal RoPE reduces exactly to this.

The vision tower (`model.visual.*`) and the MTP head (`mtp.*`) are carried as `Carried`
variables (model/weights.py): loaded, placed and saved bit-exactly, never run.

Padding (docs/qwen35.md "Decode state and padding"): a padded position leaves both Gated
DeltaNet states untouched (beta 0, decay 1 i.e. g = 0, no conv input), and the causal conv of a
real token reads the previous *real* tokens of its row, skipping padding anywhere (left-padded
bucket chunks appended after history, masked decode slots of stopped rows). Left- and
right-padded rows therefore give the unpadded row's logits, and a cache appended in padded
chunks gives the full sequence's.

Decode state (`HybridCache`): K/V for the full-attention layers only; per Gated DeltaNet layer
the last K-1 real conv inputs [B, conv_dim, K-1] (compute dtype) and the recurrent state
[B, H_v, d_k, d_v] (fp32).

Sequence parallelism: under a mesh with sp > 1 a full sequence stays split over `sp` through
the Gated DeltaNet layers too: each shard runs its positions from zero states and corrects
them with the exchanged conv tails and state maps (`GatedDeltaNet._context_parallel`,
docs/qwen35.md 8.6); the gated attention layers gather K/V over `sp` as the dense decoder does.

Layers run as a `lax.scan` over the repeating unit of `layer_types` (3 x GDN + 1 attention in
the releases), each run of same-type layers inside the unit a nested scan, so one layer's
weights are gathered at a time (`stacked_layers`). A tail that is not a whole unit (the test
fixture's 5 layers) runs as one more group.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jscenegen.model.causal_conv import causal_conv, conv_state_prefix, last_real_inputs
from jscenegen.model.config import FULL_ATTENTION, LINEAR_ATTENTION, QwenConfig
from jscenegen.model.dtypes import np_dtype
from jscenegen.model.gated_delta import (
    gated_delta_chunked,
    gated_delta_prefix,
    gated_delta_segment,
    gated_delta_step,
)
from jscenegen.model.qwen import (
    MLP,
    CausalLM,
    Embedding,
    Linear,
    cache_step_inputs,
    cached_attention,
    check_rows_without_cache,
    full_sequence_inputs,
    logical,
    query_inputs,
    rms_normalized,
    take_rows,
    with_empty_slots,
)
from jscenegen.model.remat import checkpointed, remat_policy
from jscenegen.model.rope import apply_rope, rope_cos_sin
from jscenegen.model.weights import CarriedTree, ParamFactory, split_channel_blocks, weight_table
from jscenegen.sharding.constraints import axis_size, constrain, constrain_grouped
from jscenegen.sharding.rules import (
    ACTIVATION,
    FSDP,
    LAYER_HEADS,
    LAYER_KV,
    REPLICATED,
    ROWS,
    SEQ_GATHERED,
    SP,
    TRAINING_SPECS,
)

log = logging.getLogger(__name__)

CHUNK_SIZE = 64       # the chunked delta rule's chunk (transformers' and FLA's default)
CAUSAL_BALANCE_REFUSAL = ("model.causal_balance is not supported for Qwen3.5: the Gated "
                          "DeltaNet recurrence needs the tokens in order; set it to false")
L2NORM_EPS = 1e-6     # T `l2norm`: fixed, not rms_norm_eps


def check_causal_balance(arch: str, causal_balance: bool, sp: int) -> None:
    """Refuse (ValueError, CAUSAL_BALANCE_REFUSAL) before any model is made what the loader
    would refuse when building it: model.causal_balance (a token reorder for `sp` > 1 sequence
    shards) on a model of architecture `arch` "qwen3_5"."""
    if arch == "qwen3_5" and causal_balance and sp > 1:
        raise ValueError(CAUSAL_BALANCE_REFUSAL)


# ---- norms ------------------------------------------------------------------------------------
class ZeroCentredRMSNorm(nnx.Module):
    """y = (x32 * rsqrt(mean(x32^2) + eps)) * (1 + w32), cast to x's dtype after the multiply.

    T `Qwen3_5RMSNorm.forward` (weight initialised to 0). x [..., D] any float dtype.
    """

    def __init__(self, make: ParamFactory, name: str, eps: float):
        self.eps = eps
        self.weight = make(f"{name}.weight")

    def __call__(self, x: jax.Array) -> jax.Array:
        return (rms_normalized(x, self.eps) * (1.0 + logical(self.weight, jnp.float32))).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """y = (w * rmsnorm(o)) * silu(z), per head over d_v (T `Qwen3_5RMSNormGated.forward`).

    o [..., Dv] (the delta rule's output in the compute dtype), z [..., Dv]. The norm is
    computed in fp32 and cast to o's dtype, the weight multiplies in the promotion of its own
    dtype and o's (fp32 in a release, whose gated-norm weights are stored fp32), the gate in
    fp32; the result is cast to o's dtype.
    """

    def __init__(self, make: ParamFactory, name: str, eps: float):
        self.eps = eps
        self.weight = make(f"{name}.weight")

    def __call__(self, o: jax.Array, z: jax.Array) -> jax.Array:
        n = rms_normalized(o, self.eps).astype(o.dtype)
        w = logical(self.weight, jnp.result_type(self.weight.dtype, o.dtype))
        y = (w * n).astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
        return y.astype(o.dtype)


# ---- gated attention --------------------------------------------------------------------------
class GatedAttention(nnx.Module):
    """Full attention with an output gate (T `Qwen3_5Attention`).

    q_proj [2 H hd, h] gives per head [query | gate] (rows 2 hd h .. 2 hd h + hd - 1 are head
    h's query, the next hd its gate); q/k zero-centred RMSNorm over hd, then partial RoPE;
    grouped-query attention (scale hd^-0.5); out = o_proj(attn * sigmoid(gate)).
    """

    def __init__(self, cfg: QwenConfig, make: ParamFactory, name: str, attn_impl: str):
        self.nq, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.attn_impl = attn_impl
        self.q_proj = Linear(make, f"{name}.q_proj")
        self.k_proj = Linear(make, f"{name}.k_proj")
        self.v_proj = Linear(make, f"{name}.v_proj")
        self.o_proj = Linear(make, f"{name}.o_proj")
        self.q_norm = ZeroCentredRMSNorm(make, f"{name}.q_norm", cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(make, f"{name}.k_norm", cfg.rms_norm_eps)

    def __call__(self, x, cos, sin, mask, kv=None, rows=None):
        """x [B, S, h]; cos/sin [B, S, rotary_dim] f32; mask [B, S, Sk] bool; kv as
        `qwen.cached_attention`. Returns (out [B, S, h], (k_all, v_all) or (k, v)). rows
        [B, C] int (no cache): queries and gates at those positions only, out [B, C, h] (keys
        and values of every position)."""
        b, s, _ = x.shape
        xq, cos_q, sin_q, mask = query_inputs(x, cos, sin, mask, rows)
        c = xq.shape[1]
        qg = self.q_proj(xq).reshape(b, c, self.nq, 2 * self.hd)
        q, gate = qg[..., : self.hd], qg[..., self.hd:]
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).reshape(b, s, self.nkv, self.hd))
        v = self.v_proj(x).reshape(b, s, self.nkv, self.hd)
        q, k = apply_rope(q, cos_q, sin_q), apply_rope(k, cos, sin)
        out, new_kv = cached_attention(q, k, v, mask, kv, self.attn_impl)
        out = out * jax.nn.sigmoid(gate)
        return self.o_proj(out.reshape(b, c, self.nq * self.hd)), new_kv


# ---- Gated DeltaNet ---------------------------------------------------------------------------
def l2norm(x: jax.Array) -> jax.Array:
    """x * rsqrt(sum(x^2) + 1e-6) over the last axis, in fp32 (T `l2norm`, FLA's convention)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


class Conv1dWeight(nnx.Module):
    """Holds `conv1d.weight` [C, 1, K] (depthwise, no bias) under its HF name."""

    def __init__(self, make: ParamFactory, name: str):
        self.weight = make(f"{name}.weight")


class GatedDeltaNet(nnx.Module):
    """The Gated DeltaNet token mixer (T `Qwen3_5GatedDeltaNet.forward`).

    With x [B, S, h] (after input_layernorm), C = 2 H_k d_k + H_v d_v, r = H_v / H_k:
      u = silu(causal_conv(x @ in_proj_qkv.T))           [B, S, C], channels [q | k | v]
      q, k [B, S, H_k, d_k], v [B, S, H_v, d_v]          (head-major splits)
      z = x @ in_proj_z.T -> [B, S, H_v, d_v]
      beta = sigmoid(x @ in_proj_b.T)                     [B, S, H_v]
      g = -exp(A_log) * softplus(x @ in_proj_a.T + dt_bias)  fp32 log decay
      q, k = l2norm(repeat_interleave(q|k, r, heads))    fp32; the kernel scales q by d_k^-0.5
      o, S = gated delta rule (model/gated_delta.py): chunked for S > 1, one step for S = 1
      out = out_proj(GatedRMSNorm(o, z))
    Padding: beta = 0 and g = 0 at padded positions (the state is untouched) and the conv
    skips them (`causal_conv`).
    """

    def __init__(self, cfg: QwenConfig, make: ParamFactory, name: str):
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.in_proj_qkv = Linear(make, f"{name}.in_proj_qkv")
        self.in_proj_z = Linear(make, f"{name}.in_proj_z")
        self.in_proj_b = Linear(make, f"{name}.in_proj_b")
        self.in_proj_a = Linear(make, f"{name}.in_proj_a")
        self.conv1d = Conv1dWeight(make, f"{name}.conv1d")
        self.A_log = make(f"{name}.A_log")
        self.dt_bias = make(f"{name}.dt_bias")
        self.norm = GatedRMSNorm(make, f"{name}.norm", cfg.rms_norm_eps)
        self.out_proj = Linear(make, f"{name}.out_proj")

    def __call__(self, x: jax.Array, mask: jax.Array, conv_state: jax.Array | None = None,
                 rec_state: jax.Array | None = None):
        """x [B, S, h] compute dtype; mask [B, S] bool; conv_state [B, C, K-1] and rec_state
        [B, H_v, d_k, d_v] f32 entering this call (None: zeros, a sequence start).
        Returns (out [B, S, h], conv_state, rec_state) with the states after the real tokens.

        Sequence parallelism: a full sequence (no states given) under a mesh with sp > 1
        whose rows divide over fsdp and positions over sp runs context-parallel
        (`_context_parallel`: every sp shard keeps its own positions; only per-row conv
        tails and state maps move) and returns (out, None, None). Otherwise (a cache, a
        single device, indivisible shapes) the sequence is gathered over sp
        (SEQ_GATHERED) and the recurrence runs whole on each sp shard.
        """
        b, s, _ = x.shape
        dt = x.dtype
        sp, fsdp = axis_size(SP), axis_size(FSDP)
        context_parallel = (conv_state is None and rec_state is None and sp > 1
                            and s % sp == 0 and b % fsdp == 0)
        if not context_parallel:
            if conv_state is None and rec_state is None and sp > 1:
                log.warning("Gated DeltaNet: %d rows over fsdp=%d or %d positions over sp=%d do "
                            "not divide, so the sequence is gathered and its recurrence runs "
                            "whole on each sp shard (no context parallelism); pad the batch "
                            "(sharding.layout.pad_batch) to divide", b, fsdp, s, sp)
            x = constrain(x, SEQ_GATHERED)
        u = self.in_proj_qkv(x)
        z = self.in_proj_z(x).reshape(b, s, self.hv, self.dv)
        beta = jax.nn.sigmoid(self.in_proj_b(x))
        a = self.in_proj_a(x).astype(jnp.float32)
        g = -jnp.exp(logical(self.A_log, jnp.float32)) * jax.nn.softplus(
            a + logical(self.dt_bias, jnp.float32))
        beta = jnp.where(mask[..., None], beta, 0)
        g = jnp.where(mask[..., None], g, 0.0)
        weight = logical(self.conv1d.weight, jnp.float32)[:, 0, :]
        if context_parallel:
            o = self._context_parallel(u, mask, weight, g, beta, chunk=min(CHUNK_SIZE, s // sp))
        else:
            if conv_state is None:
                conv_state = jnp.zeros((b, weight.shape[0], weight.shape[1] - 1), dt)
            u, conv_state = causal_conv(u, mask, weight, conv_state)
            q, k, v = self._heads(u.astype(dt))
            if s == 1:
                if rec_state is None:
                    rec_state = jnp.zeros((b, self.hv, self.dk, self.dv), jnp.float32)
                o, rec_state = gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0],
                                                rec_state)
                o = o[:, None]
            else:
                o, rec_state = gated_delta_chunked(q, k, v, g, beta, rec_state,
                                                   chunk_size=min(CHUNK_SIZE, s))
        o = self.norm(o.astype(dt), z)
        return self.out_proj(o.reshape(b, s, self.hv * self.dv)), conv_state, rec_state

    def _heads(self, u: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """u [B, S, C] (after the conv, compute dtype) -> q, k [B, S, H_v, d_k] f32 (key heads
        repeated to value heads, l2-normalised), v [B, S, H_v, d_v] (head-major splits).
        A tensor-parallel rollout copy stores the channels grouped by tp shard (metadata
        `channel_groups`, `weights.group_channel_blocks`): each device splits its own."""
        b, s, _ = u.shape
        kd, vd = self.hk * self.dk, self.hv * self.dv
        groups = self.in_proj_qkv.weight.get_metadata().get("channel_groups", 1)
        q, k, v = split_channel_blocks(u, (kd, kd, vd), groups)
        q = q.reshape(b, s, self.hk, self.dk)
        k = k.reshape(b, s, self.hk, self.dk)
        v = v.reshape(b, s, self.hv, self.dv)
        r = self.hv // self.hk
        return l2norm(jnp.repeat(q, r, axis=2)), l2norm(jnp.repeat(k, r, axis=2)), v

    def _context_parallel(self, u, mask, weight, g, beta, chunk: int) -> jax.Array:
        """Conv + delta rule of a full sequence split over `sp` (docs/qwen35.md 8.6), from
        zero states. u [B, S, C], mask [B, S], g/beta [B, S, H_v] sharded ACTIVATION (rows
        over fsdp, positions over sp); weight [C, K] f32. Returns o [B, S, H_v, d_v] f32,
        sharded ACTIVATION.

        Per sp shard i (its segment of every row), inside `jax.shard_map`:
          1. conv: its last K-1 real inputs and real count (`last_real_inputs`) are
             all-gathered over sp; the state entering it folds shards 0..i-1
             (`conv_state_prefix`), so each token's window holds the previous K-1 real tokens
             of the whole row, as unsharded;
          2. delta rule from a zero state plus the affine map of the entering state
             (`gated_delta_segment`: o0, final0, q_eff, transition, one chunked pass);
             (transition, final0) are all-gathered over sp and composed in order,
             S_{j+1} = transition_j S_j + final0_j (`gated_delta_prefix`);
          3. o = o0 + q_eff S_i.
        What moves between sp shards per GDN layer and row: K-1 conv inputs x C channels and
        a count, and H_v x d_k x (d_k + d_v) fp32 of maps; never the sequence.
        """
        dt = u.dtype
        heads = self._heads

        def body(u, mask, g, beta, weight):
            i = jax.lax.axis_index(SP)
            tail, count = last_real_inputs(u, mask, weight.shape[-1])
            entering = conv_state_prefix(jax.lax.all_gather(tail, SP),
                                         jax.lax.all_gather(count, SP))
            conv_in = jax.lax.dynamic_index_in_dim(entering, i, keepdims=False)
            y, _ = causal_conv(u, mask, weight, conv_in)
            q, k, v = heads(y.astype(dt))
            o0, final0, q_eff, transition = gated_delta_segment(q, k, v, g, beta, chunk)
            states = gated_delta_prefix(jax.lax.all_gather(transition, SP),
                                        jax.lax.all_gather(final0, SP))
            s_in = jax.lax.dynamic_index_in_dim(states, i, keepdims=False)
            return o0 + jnp.einsum("bthk,bhkv->bthv", q_eff, s_in,
                                   precision=jax.lax.Precision.HIGHEST)

        # check_vma off: the kernels start from constants (zero / identity states) that the
        # varying-axes checker would want cast per carry; every output is per-shard anyway.
        seq = TRAINING_SPECS.specs[ACTIVATION]  # only the training mesh has an sp axis
        return jax.shard_map(body, in_specs=(seq, seq, seq, seq, REPLICATED), out_specs=seq,
                             check_vma=False)(u, mask, g, beta, weight)


# ---- decoder layer, cache, model ---------------------------------------------------------------
class LayerInputs(NamedTuple):
    """What every layer of one forward reads: cos/sin [B, S, rotary_dim] f32, attn_mask
    [B, S, Sk] bool (full attention), mask [B, S] bool (real tokens), offset (the cache slot the
    chunk starts at, or None without a cache)."""

    cos: jax.Array
    sin: jax.Array
    attn_mask: jax.Array
    mask: jax.Array
    offset: jax.Array | None


class HybridDecoderLayer(nnx.Module):
    """T `Qwen3_5DecoderLayer`: pre-norm mixer (GatedDeltaNet as `linear_attn`, or
    GatedAttention as `self_attn`) and SwiGLU MLP, zero-centred norms."""

    def __init__(self, cfg: QwenConfig, make: ParamFactory, name: str, kind: str, attn_impl: str):
        eps = cfg.rms_norm_eps
        self.input_layernorm = ZeroCentredRMSNorm(make, f"{name}.input_layernorm", eps)
        if kind == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(cfg, make, f"{name}.linear_attn")
        else:
            self.self_attn = GatedAttention(cfg, make, f"{name}.self_attn", attn_impl)
        self.post_attention_layernorm = ZeroCentredRMSNorm(
            make, f"{name}.post_attention_layernorm", eps)
        self.mlp = MLP(make, f"{name}.mlp")

    def __call__(self, x: jax.Array, inputs: LayerInputs, caches: dict | None, index, rows=None):
        """x [B, S, h]; caches: {"k", "v": [La, B, Smax, Nkv, hd], "conv": [Ll, B, C, K-1],
        "state": [Ll, B, H_v, d_k, d_v]} or None; index: this layer's position among the layers
        of its kind (the cache row it owns). Returns (x, caches). With `rows` [B, C] int (no
        cache; the last layer of a forward whose caller needs C positions only): the residual,
        the MLP and the attention's queries at those positions only (a GatedDeltaNet mixer runs
        its recurrence over every position), so x comes back [B, C, h]."""
        y = self.input_layernorm(x)
        if hasattr(self, "linear_attn"):
            conv = rec = None
            if caches is not None:
                conv = jax.lax.dynamic_index_in_dim(caches["conv"], index, keepdims=False)
                rec = jax.lax.dynamic_index_in_dim(caches["state"], index, keepdims=False)
            y, conv, rec = self.linear_attn(y, inputs.mask, conv, rec)
            if rows is not None:
                y = take_rows(y, rows)
            if caches is not None:
                caches = dict(caches,
                              conv=jax.lax.dynamic_update_index_in_dim(caches["conv"], conv, index, 0),
                              state=jax.lax.dynamic_update_index_in_dim(caches["state"], rec, index, 0))
        else:
            kv = None if caches is None else (caches["k"], caches["v"], index, inputs.offset)
            y, new_kv = self.self_attn(y, inputs.cos, inputs.sin, inputs.attn_mask, kv, rows)
            if caches is not None:
                caches = dict(caches, k=new_kv[0], v=new_kv[1])
        if rows is not None:
            x = take_rows(x, rows)
        x = constrain(x + y.astype(x.dtype), ACTIVATION)
        x = constrain(x + self.mlp(self.post_attention_layernorm(x)), ACTIVATION)
        return x, caches


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HybridCache:
    """Decode state of a Qwen3.5 model.

    k, v: [La, B, Smax, Nkv, hd] compute dtype (full-attention layers only); conv:
    [Ll, B, conv_dim, K-1] compute dtype (each GDN layer's last K-1 real conv inputs, oldest
    first; channels in the order of the in_proj_qkv it decodes with, grouped by tp shard in a
    tensor-parallel rollout); state: [Ll, B, H_v, d_k, d_v] float32 (each GDN layer's recurrent state); valid
    [B, Smax] bool; next_pos [B] int32; length [] int32 (as `qwen.KVCache`).
    """

    k: jax.Array
    v: jax.Array
    conv: jax.Array
    state: jax.Array
    valid: jax.Array
    next_pos: jax.Array
    length: jax.Array

    @classmethod
    def create(cls, cfg: QwenConfig, batch: int, max_len: int, dtype=jnp.float32) -> "HybridCache":
        full = sum(k == FULL_ATTENTION for k in cfg.kinds)
        linear = len(cfg.kinds) - full
        kv = (full, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        return cls(
            k=jnp.zeros(kv, dtype), v=jnp.zeros(kv, dtype),
            conv=jnp.zeros((linear, batch, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1), dtype),
            state=jnp.zeros((linear, batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                             cfg.linear_value_head_dim), jnp.float32),
            valid=jnp.zeros((batch, max_len), bool),
            next_pos=jnp.zeros((batch,), jnp.int32), length=jnp.zeros((), jnp.int32),
        )

    @staticmethod
    def partition_specs() -> "HybridCache":
        """Where each array lives on the mesh (`sharding.rules`): per-layer arrays [L, B, ...]
        split rows over fsdp, and in a tensor-parallel rollout their heads over tp as the
        projections make them (the K/V LAYER_KV; the GDN states and conv inputs LAYER_HEADS,
        channels grouped by shard as in_proj_qkv's), per-row arrays ROWS, the slot counter
        REPLICATED."""
        return HybridCache(k=LAYER_KV, v=LAYER_KV, conv=LAYER_HEADS, state=LAYER_HEADS,
                           valid=ROWS, next_pos=ROWS, length=REPLICATED)

    def grown(self, extra: int) -> "HybridCache":
        """This cache with `extra` more empty K/V slots (contents, the GDN states, positions and
        length kept): the recurrent layers' states have no slot axis."""
        return HybridCache(with_empty_slots(self.k, 2, extra), with_empty_slots(self.v, 2, extra),
                           self.conv, self.state, with_empty_slots(self.valid, 1, extra),
                           self.next_pos, self.length)


@dataclasses.dataclass(frozen=True)
class Run:
    """Consecutive layers of one kind inside the repeating unit: unit offset and length."""

    kind: str
    start: int
    length: int


def layer_plan(kinds: tuple[str, ...]) -> tuple[int, tuple[Run, ...]]:
    """(period, runs): the shortest unit that `kinds` repeats (the last repetition may be cut
    short), split into runs of one kind. Releases: period 4, runs (GDN x 3, attention x 1)."""
    n = len(kinds)
    period = next(p for p in range(1, n + 1) if all(kinds[i] == kinds[i % p] for i in range(n)))
    runs: list[Run] = []
    for i, kind in enumerate(kinds[:period]):
        if runs and runs[-1].kind == kind:
            runs[-1] = Run(kind, runs[-1].start, runs[-1].length + 1)
        else:
            runs.append(Run(kind, i, 1))
    return period, tuple(runs)


class TextModel(nnx.Module):
    """T `Qwen3_5TextModel`: embed_tokens, layers, norm (names under `prefix`)."""

    def __init__(self, cfg: QwenConfig, make: ParamFactory, prefix: str, attn_impl: str):
        self.embed_tokens = Embedding(make, f"{prefix}embed_tokens", cfg.pad_token_id)
        self.layers = nnx.List([HybridDecoderLayer(cfg, make, f"{prefix}layers.{i}", kind, attn_impl)
                                for i, kind in enumerate(cfg.kinds)])
        self.norm = ZeroCentredRMSNorm(make, f"{prefix}norm", cfg.rms_norm_eps)


class VisionLanguageModel(nnx.Module):
    """T `Qwen3_5Model` as jscenegen holds it: the carried vision tower (`visual`) and the
    text model (`language_model`)."""

    def __init__(self, cfg: QwenConfig, make: ParamFactory, attn_impl: str):
        self.visual = CarriedTree(make, "model.visual.")
        self.language_model = TextModel(cfg, make, "model.language_model.", attn_impl)


class Qwen35ForCausalLM(CausalLM):
    """A Qwen3.5 causal LM on text: T `Qwen3_5ForCausalLM` (qwen3_5_text) or the text path of
    `Qwen3_5ForConditionalGeneration` (qwen3_5), with the vision tower and MTP head carried.

    Args as `qwen.QwenForCausalLM` (cfg, rngs, pad_multiple, param_dtype, compute_dtype, remat,
    attn_impl), and train_vision: hold the vision tower's tensors as trainable `nnx.Param`s
    in the param dtype (zero gradient on text, AdamW state and decay, as VERL with
    freeze_vision_tower false) instead of `Carried` ones (`weights.weight_table`).
    Raises ValueError for balance_shards > 1 (the causal load-balanced token order would feed
    the recurrence out of order: model.causal_balance must stay false) and for train_vision
    on a config without a vision tower.
    """

    def __init__(self, cfg: QwenConfig, *, rngs: nnx.Rngs, pad_multiple: int = 1,
                 param_dtype: str = "float32", compute_dtype: str = "float32",
                 remat: bool | str = False, attn_impl: str = "xla", balance_shards: int = 1,
                 train_vision: bool = False):
        if not cfg.hybrid:
            raise ValueError(f"Qwen35ForCausalLM needs a qwen3_5 config, got {cfg.model_type!r}")
        if balance_shards > 1:
            raise ValueError(CAUSAL_BALANCE_REFUSAL)
        self.cfg = cfg
        self.compute_dtype = compute_dtype
        self.remat = remat_policy(remat)
        self.balance_shards = 1
        make = ParamFactory(weight_table(cfg, train_vision=train_vision), rngs=rngs, pad_multiple=pad_multiple,
                            dtype=np_dtype(param_dtype))
        if cfg.model_type == "qwen3_5":
            self.model = VisionLanguageModel(cfg, make, attn_impl)
        else:
            self.model = TextModel(cfg, make, "model.", attn_impl)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(make, "lm_head")
        self.mtp = CarriedTree(make, "mtp.") if cfg.mtp_layers else None

    @property
    def text(self) -> TextModel:
        return self.model.language_model if self.cfg.model_type == "qwen3_5" else self.model

    def decode_params(self) -> nnx.filterlib.Filter:
        """The parameters but the vision tower (`model.visual.*`, trainable under train_vision):
        a rollout copy of it would take memory on every device and count in the rollout
        layout's weight bytes for nothing text decoding reads."""
        return nnx.All(nnx.Param, nnx.Not(nnx.PathContains("visual")))

    @staticmethod
    def create_cache(cfg: QwenConfig, batch: int, max_len: int, dtype=jnp.float32) -> HybridCache:
        """An empty decode cache (`HybridCache.create`)."""
        return HybridCache.create(cfg, batch, max_len, dtype)

    def hidden_states(self, input_ids: jax.Array, attention_mask: jax.Array,
                      cache: HybridCache | None = None, layers=None, rows: jax.Array | None = None):
        """Final normed hidden states [B, S, h] (compute dtype), as `QwenForCausalLM`'s.

        input_ids [B, S] int32; attention_mask [B, S] (1 = real token, 0 = padding). Without
        a cache: a full forward from empty states; with `rows` [B, C] int32 only those
        positions' states [B, C, h] (the last layer runs after the others' scan, its residual,
        MLP and attention queries at those positions only). With a cache: the S tokens are appended
        at slot `cache.length` and (hidden, updated cache) is returned. `layers`: the result
        of `stacked_layers()` computed once outside a loop that calls the model repeatedly.
        """
        check_rows_without_cache(rows, cache)
        dt = np_dtype(self.compute_dtype)
        mask = attention_mask.astype(bool)
        if cache is None:
            positions, attn_mask = full_sequence_inputs(mask)
            valid = None
        else:
            positions, attn_mask, valid = cache_step_inputs(mask, cache)
        cos, sin = rope_cos_sin(self.cfg, positions)
        inputs = LayerInputs(cos, sin, attn_mask, mask, None if cache is None else cache.length)
        caches = None if cache is None else dict(k=cache.k, v=cache.v, conv=cache.conv,
                                                 state=cache.state)
        x = constrain(self.text.embed_tokens(input_ids, dt), ACTIVATION)
        x, caches = self._layers(x, inputs, caches, layers, rows)
        hidden = self.text.norm(x)
        if cache is None:
            return hidden
        new_cache = HybridCache(
            k=caches["k"], v=caches["v"], conv=caches["conv"], state=caches["state"],
            valid=valid, next_pos=cache.next_pos + jnp.sum(mask, axis=1, dtype=jnp.int32),
            length=cache.length + input_ids.shape[1])
        return hidden, new_cache

    def stacked_layers(self, count: int | None = None):
        """The first `count` layers' parameters (default all) stacked for the scan: a list of
        segments (the whole units, then the cut-short last unit if any), each a list over the
        unit's runs of (graphdef, state [G, R, ...], index [G, R] int32: each layer's row in its
        kind's cache).
        """
        kinds = self.cfg.kinds
        period, runs = layer_plan(kinds)
        n = len(kinds) if count is None else count
        ordinal = [sum(k == kinds[i] for k in kinds[:i]) for i in range(n)]
        groups, tail = divmod(n, period)
        segments = []
        for base, count, limit in ((0, groups, period), (groups * period, 1, tail)):
            if count == 0 or limit == 0:
                continue
            segment = []
            for run in runs:
                length = min(run.length, limit - run.start)
                if length <= 0:
                    continue
                ids = [[base + g * period + run.start + r for r in range(length)] for g in range(count)]
                splits = [[nnx.split(self.text.layers[i]) for i in row] for row in ids]
                rows = [jax.tree.map(lambda *xs: jnp.stack(xs), *[st for _, st in row])
                        for row in splits]
                state = jax.tree.map(lambda *xs: constrain_grouped(jnp.stack(xs)), *rows)
                index = jnp.asarray(np.array([[ordinal[i] for i in row] for row in ids], np.int32))
                segment.append((splits[0][0][0], state, index))
            segments.append(segment)
        return segments

    def _layers(self, x, inputs: LayerInputs, caches, layers=None, rows=None):
        """Run the decoder stack: per segment a `lax.scan` over its groups, inside each group
        the unit's runs (a nested scan for a run of several layers). Storage stays one module
        per layer (HF names); each step gathers one layer's weights. The caches ride in the
        carry and each layer writes only its own row. With `rows` (no cache) the last layer
        runs on its own after the others and returns those positions only."""
        n = len(self.cfg.kinds)
        if rows is not None and layers is not None:
            raise ValueError("rows selects positions of a full forward; stacked layers are for "
                             "a decode loop")
        segments = layers if layers is not None else self.stacked_layers(
            n if rows is None else n - 1)

        def apply(graphdef, h, caches, layer_state, index):
            return nnx.merge(graphdef, layer_state)(h, inputs, caches, index)

        def apply_first(graphdef, h, caches, state, index):
            return apply(graphdef, h, caches, jax.tree.map(lambda a: a[0], state), index[0])

        # With remat, each checkpointed call takes the scan's own slices (never a value
        # computed outside it), so the backward pass keeps only those sharded slices and the
        # carried activations (and, under "minimal", the projections' outputs), not a
        # per-layer copy of anything gathered.
        apply = checkpointed(apply, self.remat, prevent_cse=False, static_argnums=(0,))
        apply_first = checkpointed(apply_first, self.remat, prevent_cse=False, static_argnums=(0,))

        def run_layers(graphdef, h, caches, state, index):
            if index.shape[0] == 1:
                return apply_first(graphdef, h, caches, state, index)

            def body(carry, xs):
                return apply(graphdef, *carry, *xs), None

            return jax.lax.scan(body, (h, caches), (state, index))[0]

        for segment in segments:
            graphdefs = [gd for gd, _, _ in segment]

            def group(carry, xs, graphdefs=graphdefs):
                h, caches = carry
                for gd, (state, index) in zip(graphdefs, xs):
                    h, caches = run_layers(gd, h, caches, state, index)
                return (h, caches), None

            xs = [(state, index) for _, state, index in segment]
            (x, caches), _ = jax.lax.scan(group, (x, caches), xs)
        if rows is not None:
            last = self.text.layers[n - 1]

            def run_last(h, rows):
                return last(h, inputs, None, None, rows)[0]
            # outside any scan: CSE could merge its recomputation with the forward
            x = checkpointed(run_last, self.remat, prevent_cse=True)(x, rows)
        return x, caches
