"""The model as a pure function of its parameters, for jitted training code.

`hidden_fn(graphdef, *other_states)` turns a split NNX model
(`graphdef, params, *other = nnx.split(model, nnx.Param, ...)`) into
`fn(params, input_ids, attention_mask) -> (hidden [B, T, H], output_embedding [V, H])`, so
parameters and optimizer state are plain pytrees the caller shards and differentiates.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
from flax import nnx

HiddenFn = Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def hidden_fn(graphdef: nnx.GraphDef, *other_states: Any) -> HiddenFn:
    """The model's final normed hidden states and its output embedding (logical vocabulary
    rows, compute dtype) as a function of its parameters. The model must provide
    `hidden_states(input_ids, attention_mask)` and `output_embedding()` (qwen.CausalLM does:
    QwenForCausalLM, Qwen35ForCausalLM). A model with `Carried` tensors (Qwen3.5) is split
    `nnx.split(model, nnx.Param, ...)` and its other state passed here."""

    def fn(params, input_ids, attention_mask):
        model = nnx.merge(graphdef, params, *other_states)
        return model.hidden_states(input_ids, attention_mask), model.output_embedding()

    return fn
