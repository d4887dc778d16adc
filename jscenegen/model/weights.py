"""The one weight table: every tensor of a model, its HF name, logical shape and initial value.

Names and orientations are exactly transformers' state-dict keys
(`model.layers.N.self_attn.q_proj.weight` is [num_heads * head_dim, hidden], out x in, as
torch.nn.Linear stores it). jscenegen keeps weights in this orientation, so every format
(HF safetensors, VERL FSDP2 shards, orbax) maps name to name with no transposes. The modules
(model/qwen.py, model/qwen35.py) take their parameters from this table through a
`ParamFactory`; loading, saving, the checkpoint store, the converters and the mesh report read
the same table.

Padding: dim 0 of every stored parameter may be zero-padded to a multiple of the device
count (FSDP2's layout, ../shared/DESIGN.md). The logical row count travels with the parameter
as nnx metadata (`rows`), so modules slice the padding off without being told sizes.

Carried tensors: a Qwen3.5 checkpoint also holds a vision tower (`model.visual.*`) and a
multi-token-prediction head (`mtp.*`) that the text path never runs. They are in the table
(`WeightSpec.carried`) so loading checks their names and shapes and saving writes them back,
but the model holds them as `Carried` variables, not `nnx.Param`s: `nnx.split(model,
nnx.Param, ...)` leaves them out of gradients and optimizer state, and they keep the dtype
the file stored them in (bit-exact round trips).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jscenegen.model.config import LINEAR_ATTENTION, QwenConfig
from jscenegen.sharding.rules import padded_shape

Init = Literal["normal", "zeros", "ones", "a_log"]
INIT_STD = 0.02  # transformers' initializer_range default for Qwen
A_INIT_RANGE = (0.01, 16.0)  # Qwen3.5: A_log = log(U(0.01, 16)) (modeling_qwen3_5.py, _init_weights)


class CheckpointFormatError(ValueError):
    """Named tensors that do not match the architecture; the message names the source and key."""


class Carried(nnx.Variable):
    """A tensor the model carries but never computes with (Qwen3.5's vision tower and MTP
    head): loaded, placed and saved like a parameter, in the dtype the file stored it, and
    outside `nnx.Param` filters (no gradient, no optimizer state)."""


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """One tensor: logical `shape` (HF orientation), how a fresh model initialises it
    (`normal`: N(0, 0.02) as transformers' `_init_weights`; `zeros`; `ones`; `a_log`:
    log(U(0.01, 16)), Qwen3.5's A_log) and whether it is `carried` (module docstring)."""

    shape: tuple[int, ...]
    init: Init = "normal"
    carried: bool = False


def weight_table(cfg: QwenConfig, *, include_tied_head: bool = False,
                 train_vision: bool = False) -> dict[str, WeightSpec]:
    """Ordered {hf_name: WeightSpec} of every tensor of the model.

    `train_vision` (the `model.train_vision` option) makes the vision tower's tensors
    trainable parameters instead of carried ones: still never run on text, so their gradient
    is zero, but AdamW keeps state for them and decays them, as VERL does when it runs the
    tower on a dummy image with `freeze_vision_tower: false` (docs/qwen35.md 7.1). The MTP
    head stays carried (transformers never builds it, so no torch run trains it).
    Raises ValueError for `train_vision` on a config without a vision tower.

    The order is `torch.nn.Module.parameters()` order of transformers' Qwen{2,3}ForCausalLM,
    Qwen3_5ForCausalLM (qwen3_5_text) or Qwen3_5ForConditionalGeneration (qwen3_5: vision
    tower, text model, lm_head), which VERL's optimizer state indices follow; the `mtp.*`
    tensors, which transformers never builds, come last. With tied embeddings there is no
    separate `lm_head.weight` parameter (`include_tied_head` lists it as the alias torch's
    state_dict() still reports).
    """
    if train_vision and cfg.vision is None:
        raise ValueError(f"model.train_vision: true needs a model with a vision tower "
                         f"(model_type qwen3_5); this one is {cfg.model_type!r}")
    if not cfg.hybrid:
        return _dense_table(cfg, include_tied_head)
    table: dict[str, WeightSpec] = {}
    if cfg.vision is not None:
        table.update(_vision_table(cfg, carried=not train_vision))
    p = cfg.text_prefix
    table[p + "embed_tokens.weight"] = WeightSpec((cfg.vocab_size, cfg.hidden_size))
    for i, kind in enumerate(cfg.kinds):
        if kind == LINEAR_ATTENTION:
            table.update(_gated_deltanet_table(cfg, f"{p}layers.{i}.linear_attn."))
        else:
            table.update(_gated_attention_table(cfg, f"{p}layers.{i}.self_attn."))
        table.update(_mlp_and_norms(cfg, f"{p}layers.{i}.", norm_init="zeros"))
    table[p + "norm.weight"] = WeightSpec((cfg.hidden_size,), "zeros")
    if not cfg.tie_word_embeddings or include_tied_head:
        table["lm_head.weight"] = WeightSpec((cfg.vocab_size, cfg.hidden_size))
    table.update(_mtp_table(cfg))
    return table


def _dense_table(cfg: QwenConfig, include_tied_head: bool) -> dict[str, WeightSpec]:
    """Qwen2/Qwen3 (transformers' modeling_qwen{2,3}.py)."""
    h, nq, nkv, hd, v = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                         cfg.head_dim, cfg.vocab_size)
    table: dict[str, WeightSpec] = {"model.embed_tokens.weight": WeightSpec((v, h))}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for proj, rows in (("q_proj", nq * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
            table[f"{p}self_attn.{proj}.weight"] = WeightSpec((rows, h))
            if cfg.qkv_bias:
                table[f"{p}self_attn.{proj}.bias"] = WeightSpec((rows,), "zeros")
        table[p + "self_attn.o_proj.weight"] = WeightSpec((h, nq * hd))
        if cfg.qk_norm:
            table[p + "self_attn.q_norm.weight"] = WeightSpec((hd,), "ones")
            table[p + "self_attn.k_norm.weight"] = WeightSpec((hd,), "ones")
        table.update(_mlp_and_norms(cfg, p, norm_init="ones"))
    table["model.norm.weight"] = WeightSpec((h,), "ones")
    if not cfg.tie_word_embeddings or include_tied_head:
        table["lm_head.weight"] = WeightSpec((v, h))
    return table


def _mlp_and_norms(cfg: QwenConfig, p: str, *, norm_init: Init,
                   carried: bool = False) -> dict[str, WeightSpec]:
    """A decoder layer's SwiGLU MLP and its two RMSNorms (zero-initialised in Qwen3.5's
    (1 + w) form, ones in Qwen2/3's)."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    return {
        p + "mlp.gate_proj.weight": WeightSpec((f, h), carried=carried),
        p + "mlp.up_proj.weight": WeightSpec((f, h), carried=carried),
        p + "mlp.down_proj.weight": WeightSpec((h, f), carried=carried),
        p + "input_layernorm.weight": WeightSpec((h,), norm_init, carried),
        p + "post_attention_layernorm.weight": WeightSpec((h,), norm_init, carried),
    }


def _gated_attention_table(cfg: QwenConfig, p: str, carried: bool = False) -> dict[str, WeightSpec]:
    """Qwen3_5Attention: q_proj [2 H hd, h] (per head [query | gate]), k/v_proj [KV hd, h],
    o_proj [h, H hd], q/k norms [hd] (zero-centred)."""
    h, nq, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return {
        p + "q_proj.weight": WeightSpec((2 * nq * hd, h), carried=carried),
        p + "k_proj.weight": WeightSpec((nkv * hd, h), carried=carried),
        p + "v_proj.weight": WeightSpec((nkv * hd, h), carried=carried),
        p + "o_proj.weight": WeightSpec((h, nq * hd), carried=carried),
        p + "q_norm.weight": WeightSpec((hd,), "zeros", carried),
        p + "k_norm.weight": WeightSpec((hd,), "zeros", carried),
    }


def _gated_deltanet_table(cfg: QwenConfig, p: str) -> dict[str, WeightSpec]:
    """Qwen3_5GatedDeltaNet in torch parameter order (its own dt_bias and A_log first, then
    the submodules conv1d, norm, out_proj, in_proj_qkv/z/b/a)."""
    h, hv, dv, c = (cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim,
                    cfg.conv_dim)
    return {
        p + "dt_bias": WeightSpec((hv,), "ones"),
        p + "A_log": WeightSpec((hv,), "a_log"),
        p + "conv1d.weight": WeightSpec((c, 1, cfg.linear_conv_kernel_dim)),
        p + "norm.weight": WeightSpec((dv,), "ones"),
        p + "out_proj.weight": WeightSpec((h, hv * dv)),
        p + "in_proj_qkv.weight": WeightSpec((c, h)),
        p + "in_proj_z.weight": WeightSpec((hv * dv, h)),
        p + "in_proj_b.weight": WeightSpec((hv, h)),
        p + "in_proj_a.weight": WeightSpec((hv, h)),
    }


def _vision_table(cfg: QwenConfig, carried: bool = True) -> dict[str, WeightSpec]:
    """Qwen3_5VisionModel's tensors (carried unless `model.train_vision`): patch embedding,
    position embedding, `depth` blocks, merger: 12 * depth + 9 tensors (docs/qwen35.md
    section 3.2)."""
    v = cfg.vision
    d, i, m2 = v.hidden_size, v.intermediate_size, v.hidden_size * v.spatial_merge_size ** 2
    p = "model.visual."

    def linear(name: str, out: int, inp: int) -> dict[str, WeightSpec]:
        return {f"{name}.weight": WeightSpec((out, inp), carried=carried),
                f"{name}.bias": WeightSpec((out,), "zeros", carried)}

    def layer_norm(name: str, n: int) -> dict[str, WeightSpec]:
        return {f"{name}.weight": WeightSpec((n,), "ones", carried),
                f"{name}.bias": WeightSpec((n,), "zeros", carried)}

    table = {
        p + "patch_embed.proj.weight": WeightSpec(
            (d, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size), carried=carried),
        p + "patch_embed.proj.bias": WeightSpec((d,), "zeros", carried),
        p + "pos_embed.weight": WeightSpec((v.num_position_embeddings, d), carried=carried),
    }
    for b in range(v.depth):
        q = f"{p}blocks.{b}."
        table.update(layer_norm(q + "norm1", d))
        table.update(layer_norm(q + "norm2", d))
        table.update(linear(q + "attn.qkv", 3 * d, d))
        table.update(linear(q + "attn.proj", d, d))
        table.update(linear(q + "mlp.linear_fc1", i, d))
        table.update(linear(q + "mlp.linear_fc2", d, i))
    table.update(layer_norm(p + "merger.norm", d))
    table.update(linear(p + "merger.linear_fc1", m2, m2))
    table.update(linear(p + "merger.linear_fc2", v.out_hidden_size, m2))
    return table


def _mtp_table(cfg: QwenConfig) -> dict[str, WeightSpec]:
    """The multi-token-prediction head (carried; shapes of vLLM's `Qwen3_5MultiTokenPredictor`,
    docs/qwen35.md section 3.3): fc [h, 2h], three zero-centred norms and, per MTP layer, one
    gated-attention decoder layer."""
    if cfg.mtp_layers == 0:
        return {}
    h = cfg.hidden_size
    table = {"mtp.fc.weight": WeightSpec((h, 2 * h), carried=True)}
    for i in range(cfg.mtp_layers):
        p = f"mtp.layers.{i}."
        table.update(_gated_attention_table(cfg, p + "self_attn.", carried=True))
        table.update(_mlp_and_norms(cfg, p, norm_init="zeros", carried=True))
    for name in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        table[f"mtp.{name}.weight"] = WeightSpec((h,), "zeros", True)
    return table


def param_shapes(cfg: QwenConfig, *, include_tied_head: bool = False,
                 carried: bool = False, train_vision: bool = False) -> dict[str, tuple[int, ...]]:
    """Ordered {hf_name: logical shape} of `weight_table`: the trainable parameters (the
    vision tower among them with `train_vision`), and with `carried` the carried tensors too
    (every tensor of the HF file)."""
    table = weight_table(cfg, include_tied_head=include_tied_head, train_vision=train_vision)
    return {n: s.shape for n, s in table.items() if carried or not s.carried}


class ParamFactory:
    """Makes a model's variables from its weight table.

    Each is created at its logical shape padded on dim 0 to `pad_multiple` (padding rows
    zero), in `dtype`, with metadata `rows` = the logical dim-0 size: an `nnx.Param`, or a
    `Carried` for a carried tensor.
    Args: table (`weight_table`), rngs (the `params` stream draws the random inits, in
    creation order), pad_multiple (the mesh's device count, 1 unsharded), dtype.
    """

    def __init__(self, table: dict[str, WeightSpec], *, rngs: nnx.Rngs | None,
                 pad_multiple: int = 1, dtype: Any = jnp.float32):
        self.table = table
        self.rngs = rngs
        self.pad_multiple = pad_multiple
        self.dtype = dtype

    def __call__(self, name: str) -> nnx.Variable:
        """The variable `name`. Raises KeyError when the table has no such weight."""
        try:
            spec = self.table[name]
        except KeyError:
            raise KeyError(f"weight {name!r} is not in the model's weight table") from None
        value = jnp.zeros(padded_shape(spec.shape, self.pad_multiple), self.dtype)
        n = spec.shape[0]
        if spec.init == "ones":
            value = value.at[:n].set(1)
        elif spec.init == "normal":
            draw = INIT_STD * jax.random.normal(self.rngs.params(), spec.shape, self.dtype)
            value = value.at[:n].set(draw)
        elif spec.init == "a_log":
            low, high = A_INIT_RANGE
            draw = jax.random.uniform(self.rngs.params(), spec.shape, jnp.float32, low, high)
            value = value.at[:n].set(jnp.log(draw).astype(self.dtype))
        return (Carried if spec.carried else nnx.Param)(value, rows=n)

    def optional(self, name: str) -> nnx.Param | None:
        """The parameter `name`, or None when the architecture has no such weight (e.g. biases)."""
        return self(name) if name in self.table else None

    def names(self, prefix: str) -> list[str]:
        """The table's names starting with `prefix`, in table order."""
        return [n for n in self.table if n.startswith(prefix)]


class CarriedTree(nnx.Module):
    """Carried tensors under one prefix as nested modules whose attribute paths are the
    tensors' HF names (`model.visual.blocks.0.attn.qkv.weight`).

    Args: make (ParamFactory), prefix ("model.visual." or "mtp."); every table name under
    the prefix becomes a `Carried` variable.
    """

    def __init__(self, make: ParamFactory, prefix: str):
        for name in make.names(prefix):
            node: nnx.Module = self
            *path, leaf = name[len(prefix):].split(".")
            for part in path:
                if not hasattr(node, part):
                    setattr(node, part, _Node())
                node = getattr(node, part)
            setattr(node, leaf, make(name))


class _Node(nnx.Module):
    """One level of a `CarriedTree`."""


def column_blocks(cfg: QwenConfig) -> tuple[int, ...]:
    """Sizes of the consecutive output-feature blocks of the `rules.COLUMN_BLOCKS` parameters:
    Qwen3.5's in_proj_qkv and conv1d channels [q | k | v] = (H_k d_k, H_k d_k, H_v d_v);
    () for a model without Gated DeltaNet layers."""
    if LINEAR_ATTENTION not in cfg.kinds:
        return ()
    return (cfg.linear_key_dim, cfg.linear_key_dim, cfg.linear_value_dim)


def group_channel_blocks(w: jax.Array, blocks: tuple[int, ...], groups: int) -> jax.Array:
    """w [sum(blocks), ...] with dim 0's consecutive blocks each cut into `groups` equal parts
    and stored part-major: [b0_0 | b1_0 | b2_0 | b0_1 | ...], so an even split of dim 0 over
    `groups` devices gives device r the r-th part of every block (a tensor-parallel rollout
    copy of in_proj_qkv / conv1d: shard r holds q_r, k_r, v_r). `split_channel_blocks` reads
    the result. Raises ValueError when `groups` does not divide a block or the blocks do not
    sum to dim 0."""
    if sum(blocks) != w.shape[0] or any(b % groups for b in blocks):
        raise ValueError(f"group_channel_blocks: blocks {blocks} must sum to dim 0 "
                         f"({w.shape[0]}) and each split into {groups} parts")
    starts = np.cumsum((0, *blocks))
    parts = [w[a:b].reshape(groups, (b - a) // groups, *w.shape[1:])
             for a, b in zip(starts[:-1], starts[1:])]
    return jnp.concatenate(parts, axis=1).reshape(w.shape)


def split_channel_blocks(u: jax.Array, blocks: tuple[int, ...], groups: int) -> list[jax.Array]:
    """The blocks of u's last axis [..., sum(blocks)], laid out by `group_channel_blocks` with
    `groups` (1: consecutive): [..., blocks[i]] each, in their original channel order. With
    the last axis split over `groups` devices each device reads its own parts: no channel
    crosses devices."""
    if groups == 1:
        starts = np.cumsum((0, *blocks))
        return [u[..., a:b] for a, b in zip(starts[:-1], starts[1:])]
    lead = u.shape[:-1]
    grouped = u.reshape(*lead, groups, u.shape[-1] // groups)
    parts = split_channel_blocks(grouped, tuple(b // groups for b in blocks), 1)
    return [x.reshape(*lead, b) for x, b in zip(parts, blocks)]


def param_name(path: tuple) -> str:
    """The HF name of a pytree path into a model's parameters (an `nnx.State`, an optimizer
    moment tree or nested dicts): the dotted keys, without the `.value` of an nnx Variable."""
    return jax.tree_util.keystr(path, simple=True, separator=".").removesuffix(".value")


def named_leaves(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> dict[str, Any]:
    """{hf_name: leaf} of a parameter-shaped pytree, in the tree's (sorted) leaf order."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return {param_name(path): leaf for path, leaf in leaves}


def named_params(model: nnx.Module) -> dict[str, nnx.Param]:
    """{hf_name: nnx.Param} of a model (its attribute paths are the HF names): the trainable
    parameters."""
    return named_leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))


def named_weights(model: nnx.Module) -> dict[str, nnx.Variable]:
    """{hf_name: variable} of every tensor a model holds, its `nnx.Param`s and its `Carried`
    tensors (what `weight_table` lists)."""
    state = nnx.state(model, nnx.Any(nnx.Param, Carried))
    return named_leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def constant_tensors(named_tensors: Iterable[tuple[str, Any]]) -> list[str]:
    """Names of the tensors of more than one element that hold a single value (norms of ones,
    zero biases: a formula error reading them does not show in a comparison).

    named_tensors: (name, tensor) pairs: arrays, or torch tensors (a module's
    `named_parameters()`). Returns the names in the given order."""
    out = []
    for name, tensor in named_tensors:
        x = np.asarray(tensor.detach().float().numpy() if hasattr(tensor, "detach") else tensor)
        if x.size > 1 and bool(np.all(x == x.reshape(-1)[0])):
            out.append(name)
    return out


def redraw_constant_tensors(model: nnx.Module, seed: int, scale: float = 0.05) -> list[str]:
    """Add N(0, scale^2) noise (NumPy generator `seed`) to every tensor of `model` that holds a
    single value (`constant_tensors`: norms, biases), in place; returns their names. For
    parity checks, where a constant tensor hides the formula that reads it."""
    rng = np.random.default_rng(seed)
    weights = named_weights(model)
    names = constant_tensors((n, v.get_value()) for n, v in weights.items())
    for name in names:
        value = weights[name].get_value()
        noise = scale * rng.standard_normal(value.shape).astype(np.float32)
        weights[name].set_value((value.astype(np.float32) + noise).astype(value.dtype))
    return names
