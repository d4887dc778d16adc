"""The one weight table: every tensor of a model, its HF name, logical shape and initial value.

Names and orientations are exactly transformers' state-dict keys
(`model.layers.N.self_attn.q_proj.weight` is [num_heads * head_dim, hidden], out x in, as
torch.nn.Linear stores it). jscenegen keeps weights in this orientation, so every format
(HF safetensors, VERL FSDP2 shards, orbax) maps name to name with no transposes. The modules
(model/qwen.py) take their parameters from this table through a `ParamFactory`; loading,
saving, the checkpoint store, the converters and the mesh report read the same table.

Padding: dim 0 of every stored parameter may be zero-padded to a multiple of the device
count (FSDP2's layout, ../shared/DESIGN.md). The logical row count travels with the parameter
as nnx metadata (`rows`), so modules slice the padding off without being told sizes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from jscenegen.model.config import QwenConfig
from jscenegen.sharding.rules import padded_shape

Init = Literal["normal", "zeros", "ones"]
INIT_STD = 0.02  # transformers' initializer_range default for Qwen


class CheckpointFormatError(ValueError):
    """Named tensors that do not match the architecture; the message names the source and key."""


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """One tensor: logical `shape` (HF orientation) and how a fresh model initialises it
    (`normal`: N(0, 0.02) as transformers' `_init_weights`; `zeros`; `ones`)."""

    shape: tuple[int, ...]
    init: Init = "normal"


def weight_table(cfg: QwenConfig, *, include_tied_head: bool = False) -> dict[str, WeightSpec]:
    """Ordered {hf_name: WeightSpec} of every trainable parameter.

    The order is `torch.nn.Module.parameters()` order of transformers' Qwen{2,3}ForCausalLM,
    which VERL's optimizer state indices follow. With tied embeddings there is no separate
    `lm_head.weight` parameter (`include_tied_head` lists it as the alias torch's state_dict()
    still reports).
    """
    h, nq, nkv, hd, f, v = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                            cfg.head_dim, cfg.intermediate_size, cfg.vocab_size)
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
        table[p + "mlp.gate_proj.weight"] = WeightSpec((f, h))
        table[p + "mlp.up_proj.weight"] = WeightSpec((f, h))
        table[p + "mlp.down_proj.weight"] = WeightSpec((h, f))
        table[p + "input_layernorm.weight"] = WeightSpec((h,), "ones")
        table[p + "post_attention_layernorm.weight"] = WeightSpec((h,), "ones")
    table["model.norm.weight"] = WeightSpec((h,), "ones")
    if not cfg.tie_word_embeddings or include_tied_head:
        table["lm_head.weight"] = WeightSpec((v, h))
    return table


def param_shapes(cfg: QwenConfig, *, include_tied_head: bool = False) -> dict[str, tuple[int, ...]]:
    """Ordered {hf_name: logical shape} of `weight_table`."""
    return {n: s.shape for n, s in weight_table(cfg, include_tied_head=include_tied_head).items()}


class ParamFactory:
    """Makes a model's `nnx.Param`s from its weight table.

    Each parameter is created at its logical shape padded on dim 0 to `pad_multiple` (padding
    rows zero), in `dtype`, with metadata `rows` = the logical dim-0 size.
    Args: table (`weight_table`), rngs (the `params` stream draws the normal inits, in
    creation order), pad_multiple (the mesh's device count, 1 unsharded), dtype.
    """

    def __init__(self, table: dict[str, WeightSpec], *, rngs: nnx.Rngs | None,
                 pad_multiple: int = 1, dtype: Any = jnp.float32):
        self.table = table
        self.rngs = rngs
        self.pad_multiple = pad_multiple
        self.dtype = dtype

    def __call__(self, name: str) -> nnx.Param:
        """The parameter `name`. Raises KeyError when the table has no such weight."""
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
        return nnx.Param(value, rows=n)

    def optional(self, name: str) -> nnx.Param | None:
        """The parameter `name`, or None when the architecture has no such weight (e.g. biases)."""
        return self(name) if name in self.table else None


def param_name(path: tuple) -> str:
    """The HF name of a pytree path into a model's parameters (an `nnx.State`, an optimizer
    moment tree or nested dicts): the dotted keys, without the `.value` of an nnx Variable."""
    return jax.tree_util.keystr(path, simple=True, separator=".").removesuffix(".value")


def named_leaves(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> dict[str, Any]:
    """{hf_name: leaf} of a parameter-shaped pytree, in the tree's (sorted) leaf order."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return {param_name(path): leaf for path, leaf in leaves}


def named_params(model: nnx.Module) -> dict[str, nnx.Param]:
    """{hf_name: nnx.Param} of a model (its attribute paths are the HF names)."""
    return named_leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))
