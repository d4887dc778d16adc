"""The sampler's weights: the training parameters resharded into the rollout layout, once after
every train step (a skipped one too), by one jitted function.

From each FSDP2-padded training array (dim 0 split over every device) the function slices the
padding off, casts the parameters the model reads in the compute dtype (matmul and embedding
weights: `rules.rollout_casts`) to the rollout dtype and keeps every other parameter's own
dtype (norm weights, Qwen3.5's A_log, dt_bias and conv1d, which the model reads in fp32: cast,
the rollout would sample from another policy than the trainer recomputes), stores matmul
weights [in, out] where the layout says so (`RolloutLayout.transposed`, XLA:CPU), groups the
[q | k | v] channels of Qwen3.5's in_proj_qkv and conv1d by tp shard under `tp` (each device
then holds its heads' q, k and v: `rules.COLUMN_BLOCKS`) and writes the
result in the parameter's rollout sharding (`rules.rollout_param_spec`: whole, column-, row- or
vocabulary-split), so XLA emits one all-gather (or a slice of one) per parameter. The training
arrays are inputs only: nothing of them is kept or donated. Under the `fsdp` layout the training
arrays themselves are used (cast where a cast parameter's dtype differs from the rollout dtype):
no copy, no reshard; with no cast at all (`Reshard.identity`) the sampler then holds the training
arrays, so a caller that donates them (the GRPO train step, a skipped one too) gives the sampler
the new ones before it decodes again (`Sampler.set_weights`). Variables that are not `nnx.Param`
(Qwen3.5's carried vision tower and MTP head, never computed with) pass through as they are.

Memory during a reshard: the training arrays (unchanged), the new rollout weights (their
layout's bytes per device) and XLA's temporaries (`memory` below, from the compiled program);
the previous rollout weights are dropped by the caller before it reshards.
"""
from __future__ import annotations

import functools
import math
import time
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx

from jscenegen.model.functional import shared
from jscenegen.model.weights import group_channel_blocks, param_name
from jscenegen.sharding.rollout import RolloutLayout
from jscenegen.sharding.rules import (
    COLUMN_BLOCKS,
    named,
    rollout_casts,
    rollout_kind,
    rollout_param_spec,
)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def device_bytes(arrays) -> int:
    """Bytes of `arrays` summed over every device shard of every process (replicas counted
    on each device; rollout weights shard evenly, so one shard's shape gives them all)."""
    total = 0
    for a in jax.tree.leaves(arrays):
        if isinstance(a, jax.Array):
            shard = math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
            total += shard * len(a.sharding.device_set)
        else:
            total += np.asarray(a).nbytes
    return int(total)


def rollout_dtype(name: str, own: Any, dtype: Any) -> np.dtype:
    """The dtype of parameter `name` (an HF name, stored in dtype `own`) in a rollout copy whose
    rollout dtype is `dtype`: `dtype` where the model reads it in the compute dtype
    (`rules.rollout_casts`), else `own`, so the rollout reads the numbers the trainer reads."""
    return np.dtype(dtype) if rollout_casts(name) else np.dtype(own)


class _Plan(NamedTuple):
    """What the reshard does to one parameter: keep its first `rows` (the FSDP padding off),
    group its channel blocks (`grouped`: (blocks, tp), `weights.group_channel_blocks`), cast
    to `dtype`, store it [in, out] when `transposed`."""

    rows: int
    transposed: bool
    dtype: np.dtype
    grouped: tuple[tuple[int, ...], int] | None


def _reshard_arrays(plan: tuple[_Plan, ...], unpad: bool, arrays: list) -> list:
    out = []
    for a, p in zip(arrays, plan):
        if unpad and a.shape[0] != p.rows:
            a = a[:p.rows]
        if p.grouped:
            a = group_channel_blocks(a, *p.grouped)
        a = a.astype(p.dtype)
        out.append(a.T if p.transposed else a)
    return out


def _compiled(fn, inputs: list) -> tuple:
    """(fn, XLA's memory figures of fn on `inputs`: argument/output/temp bytes, or None)."""
    try:
        m = fn.lower(inputs).compile().memory_analysis()
    except Exception:  # memory analysis is best effort; the reshard itself still runs
        return fn, None
    if m is None:
        return fn, None
    return fn, {"argument_bytes": int(m.argument_size_in_bytes),
                "output_bytes": int(m.output_size_in_bytes),
                "temp_bytes": int(m.temp_size_in_bytes)}


class Reshard:
    """The jitted training -> rollout weight function for one model structure and layout.

    Args:
      state: the model's `nnx.State` (from `nnx.split(model)`; arrays or ShapeDtypeStructs)
        with the training layout; its Variables' `rows` metadata give the logical dim 0.
      layout: the RolloutLayout.
      dtype: the rollout dtype (numpy dtype), e.g. the compute dtype: the dtype of the
        parameters the model reads in the compute dtype; the others keep theirs (`rollout_dtype`).
      blocks: the output-feature blocks of the `COLUMN_BLOCKS` parameters
        (`weights.column_blocks`); under `tp` > 1 those are stored grouped by shard
        (`weights.group_channel_blocks`, metadata `channel_groups` = tp).
    `__call__(state) -> (rollout_state, stats)`: stats {"reshard_s": wall seconds including
    the transfer, "reshard_bytes": bytes of the rollout weights summed over devices}.
    `memory`: the compiled program's {"argument_bytes", "output_bytes", "temp_bytes"} per
    device (None under `fsdp` without a cast, or where XLA does not report it).
    Raises ValueError when the layout's tensor size does not divide a split dimension, and
    (`__call__`, `check`) when a state's structure differs from `state`'s.
    """

    def __init__(self, state: nnx.State, layout: RolloutLayout, dtype: Any,
                 blocks: tuple[int, ...] = ()):
        self.layout = layout
        self.dtype = np.dtype(dtype)
        flat, self._treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_var)
        self._params = [i for i, (_, v) in enumerate(flat) if isinstance(v, nnx.Param)]
        flat = [flat[i] for i in self._params]
        # abstract inputs only: holding the arrays would keep the first weights alive
        self._inputs = [jax.ShapeDtypeStruct(v.shape, v.dtype,
                                             sharding=getattr(v[...], "sharding", None))
                        for _, v in flat]
        self._plan: list[_Plan] = []
        shardings = []
        for path, v in flat:
            name = param_name(path)
            rows = v.get_metadata().get("rows", v.shape[0])
            logical = (rows, *v.shape[1:])
            kind, transposable = rollout_kind(name)
            transposed = bool(layout.transposed and transposable and len(logical) == 2
                              and layout.name != "fsdp")
            grouped = (blocks, layout.tp) if kind == COLUMN_BLOCKS and layout.tp > 1 else None
            self._plan.append(_Plan(rows, transposed, rollout_dtype(name, v.dtype, self.dtype), grouped))
            if layout.mesh is None:
                shardings.append(None)
            elif layout.name == "fsdp":
                shardings.append(getattr(v[...], "sharding", None))
            else:
                shardings.append(named(layout.mesh, rollout_param_spec(name, logical, layout.tp,
                                                                       transposed)))
        self.identity = layout.name == "fsdp" and all(
            a.dtype == p.dtype for a, p in zip(self._inputs, self._plan))
        self._fn, self.memory = None, None
        if not self.identity:
            # reshards of one structure, layout and dtype (every trainer's sampler) share it
            plan, unpad = tuple(self._plan), layout.name != "fsdp"
            out_shardings = None if layout.mesh is None else tuple(shardings)
            key = ("reshard", plan, unpad, out_shardings, tuple(self._inputs))
            self._fn, self.memory = shared(key, lambda: _compiled(
                jax.jit(functools.partial(_reshard_arrays, plan, unpad),
                        out_shardings=out_shardings and list(out_shardings)), self._inputs))

    def check(self, state: nnx.State) -> list:
        """The (path, Variable) leaves of `state`; ValueError when its structure (names,
        nesting, Variable types) differs from the one this reshard was built for."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_var)
        if treedef != self._treedef:
            raise ValueError("reshard: the parameters' structure differs from the sampler's "
                             "(build a new Sampler for another architecture or padding)")
        return flat

    def __call__(self, state: nnx.State) -> tuple[nnx.State, dict]:
        flat = self.check(state)
        t0 = time.perf_counter()
        if self.identity:
            return state, {"reshard_s": 0.0, "reshard_bytes": 0}
        arrays = self._fn([flat[i][1][...] for i in self._params])
        jax.block_until_ready(arrays)
        wall = time.perf_counter() - t0
        leaves = [v for _, v in flat]
        for i, a, p in zip(self._params, arrays, self._plan):
            metadata = {"transposed": True} if p.transposed else {}
            if p.grouped:
                metadata["channel_groups"] = p.grouped[1]
            leaves[i] = leaves[i].replace(a, **metadata)
        return (jax.tree_util.tree_unflatten(self._treedef, leaves),
                {"reshard_s": wall, "reshard_bytes": device_bytes(arrays)})
