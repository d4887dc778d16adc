"""The model as a pure function of its parameters, for jitted training code.

`hidden_fn(graphdef, *other_states)` turns a split NNX model
(`graphdef, params, *other = nnx.split(model, nnx.Param, ...)`) into
`fn(params, input_ids, attention_mask, rows=None) -> (hidden [B, T, H], output_embedding
[V, H])` (with `rows` [B, C]: hidden [B, C, H], those positions only), so parameters and
optimizer state are plain pytrees the caller shards and differentiates.
`split_params(model)` makes that split and replaces everything that is not a parameter
(Qwen3.5's carried vision tower and MTP head) by abstract shapes, so the trained function
provably never reads a carried tensor and no jit closes over one.
`shared(key, build)` keeps the jitted functions built for one model structure and
configuration, so a second trainer or sampler of the same run in one process (a resume, the
tests) neither re-traces nor re-lowers them.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable

import jax
from flax import nnx

HiddenFn = Callable[..., tuple[jax.Array, jax.Array]]   # (params, input_ids, attention_mask, rows=None)

_SHARED: dict[Hashable, Any] = {}
SHARED_KEPT = 12     # the most recently used builds kept (their executables stay alive): a
                     # trainer holds three (train step, sampler, reshard)


def shared(key: Hashable | None, build: Callable[[], Any]) -> Any:
    """`build()`, or the value an earlier call with an equal `key` built (None: never shared).
    Callers key their jitted functions by everything the traced code closes over: the model
    structure (`structure_key`), configs, static options, the sharding layout."""
    if key is None:
        return build()
    value = _SHARED.pop(key) if key in _SHARED else build()
    _SHARED[key] = value
    while len(_SHARED) > SHARED_KEPT:
        _SHARED.pop(next(iter(_SHARED)))
    return value


def structure_key(graphdef: nnx.GraphDef, *states: Any) -> Hashable | None:
    """A key equal for equally structured models: the graphdef and the states' tree and
    leaves, which compare by value when abstract (`split_params`' frozen state); None when a
    leaf is a concrete array (no value equality: such a model equals only itself)."""
    leaves, treedef = jax.tree.flatten(states)
    key = (graphdef, treedef, tuple(leaves))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def split_params(model: nnx.Module, params: nnx.filterlib.Filter = nnx.Param
                 ) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, params, frozen) of a model: `params` the state the filter `params` selects
    (by default the `nnx.Param`s: what the optimizer steps; the sampler passes the model's
    `decode_params`), `frozen` every other variable (`Carried` tensors, and parameters the
    filter leaves out) as jax.ShapeDtypeStruct leaves, for `hidden_fn(graphdef, frozen)`. The
    frozen values stay in the model (`model.weights.named_weights`); reading one inside the
    function fails at trace time, which is what they are: never computed with."""
    graphdef, params, rest = nnx.split(model, params, ...)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), rest)
    return graphdef, params, abstract


class _ModelHidden:
    """`hidden_fn`'s function. Two of them compare (and hash) equal when their models have
    the same structure (graphdef) and the same abstract frozen state, so compiled code keyed
    by the function (`GRPOStep`) is traced once per process for every trainer of one model
    and config; with concrete arrays among the other states it is equal only to itself."""

    def __init__(self, graphdef: nnx.GraphDef, other_states: tuple):
        self.graphdef, self.other_states = graphdef, other_states
        self._key = structure_key(graphdef, *other_states)

    def __call__(self, params, input_ids, attention_mask, rows=None):
        model = nnx.merge(self.graphdef, params, *self.other_states)
        return model.hidden_states(input_ids, attention_mask, rows=rows), model.output_embedding()

    def __eq__(self, other) -> bool:
        if self._key is None or not isinstance(other, _ModelHidden):
            return self is other
        return self._key == other._key

    def __hash__(self) -> int:
        return id(self) if self._key is None else hash(self._key)


def hidden_fn(graphdef: nnx.GraphDef, *other_states: Any) -> HiddenFn:
    """The model's final normed hidden states (all positions, or those of `rows` [B, C]) and
    its output embedding (logical vocabulary rows, compute dtype) as a function of its
    parameters. The model must provide `hidden_states(input_ids, attention_mask, rows=)` and
    `output_embedding()` (qwen.CausalLM does:
    QwenForCausalLM, Qwen35ForCausalLM). A model with `Carried` tensors (Qwen3.5) is split
    by `split_params` and its frozen state passed here. Functions of equally structured
    models compare equal (see `_ModelHidden`)."""
    return _ModelHidden(graphdef, other_states)
