"""Every PartitionSpec jscenegen uses, in one table: the training layout and the rollout layouts.

Training (mesh axes ("fsdp", "sp")): parameters and both Adam moments follow torch FSDP2's
`Shard(0)` over all devices (dim 0 split over fsdp x sp, padded to a multiple of the device
count: ../shared/DESIGN.md "Parameter sharding"); activations split batch rows over `fsdp` and
sequence positions over `sp`.

Rollout (mesh axes ("data", "tp") over the same devices, `ROLLOUT_AXES`): the sampler's weights
are a second copy, made once after every train step, laid out so that decoding moves no weight
bytes: whole on every device (`tp` = 1, the `replicated` layout) or Megatron-split over the
tensor axis (`tp` > 1: `COLUMN` weights split their output features, `COLUMN_BLOCKS` each block
of them, `ROW` weights their input features, `VOCAB` the vocabulary), rows data-parallel over
`data`. Which parameter is which kind is the table `ROLLOUT_PARAM_KINDS` (HF-name suffixes), so
another decoder family gets its rollout layout by adding rows (block sizes of a `COLUMN_BLOCKS`
one: `model.weights.column_blocks`); the same table says which parameters the copy casts to
the rollout dtype (those read in the compute dtype; the rest keep their own). The `fsdp` rollout layout decodes on the training
arrays themselves (one weight all-gather per layer per token; kept for comparison).

The model constrains activations by role (`ACTIVATION`, `HEADS`, `SEQ_GATHERED`, `CACHED_KV`,
`WEIGHT`, `STACKED`, `GROUPED`, `ROWS`, `LAYER_HEADS`, `LAYER_KV`, `READ_KV`);
`TRAINING_SPECS` and `ROLLOUT_SPECS` map each role to the
spec of that layout (`sharding.constraints` picks the active one). Everything else that places
an array (the loader, the checkpoint store, the sampler, the batch layout) takes its spec from
here.
"""
from __future__ import annotations

import dataclasses
import math

from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("fsdp", "sp")              # the training mesh
FSDP, SP = AXES                    # the axis names, for collectives inside shard_map
ROLLOUT_AXES = ("data", "tp")      # the rollout mesh: rows over data, tensor parallelism over tp

PARAM = P(AXES)                    # [n, ...] parameter / Adam moment: dim 0 over every device
STACKED_PARAM = P(None, AXES)      # [L, n, ...] parameters stacked over layers (the layer scan)
GROUPED_PARAM = P(None, None, AXES)  # [G, R, n, ...] stacked over layer groups and runs (hybrid scan)
BATCH = P("fsdp", "sp")            # [B, T, ...] host batches: rows over fsdp, positions over sp
BATCH_ROWS = P("fsdp")             # [B] per-row host arrays
REPLICATED = P()                   # whole on every device (gathered weights, scalars)

# ---- activation roles: the model constrains by role, each layout maps a role to a spec --------
ACTIVATION = "activation"          # [B, S, H, ...] hidden states
HEADS = "heads"                    # [B, S, N, D] per-head projections (queries)
SEQ_GATHERED = "seq_gathered"      # [B, S, ...] every position on each device (keys/values)
CACHED_KV = "cached_kv"            # [B, Nkv, ...] one layer's KV cache (head-major)
WEIGHT = "weight"                  # a parameter as a layer reads it (None: as placed)
STACKED = "stacked"                # [L, n, ...] parameters stacked over the layers
GROUPED = "grouped"                # [G, R, n, ...] stacked over layer groups and runs (Qwen3.5)
ROWS = "rows"                      # [B, ...] per-row arrays (sampler state, logits)
LAYER_HEADS = "layer_heads"        # [L, B, N, ...] per-layer per-row per-head (or per-channel)
                                   # arrays: Qwen3.5's Gated DeltaNet states and conv inputs
LAYER_KV = "layer_kv"              # [L, B, S, Nkv, D] Qwen3.5's full-attention K/V cache
READ_KV = "read_kv"                # [B, S, Nkv, D] keys/values as attention reads them


@dataclasses.dataclass(frozen=True)
class ActivationSpecs:
    """Role -> PartitionSpec (None: leave the array as XLA places it) on a mesh with `axes`."""

    axes: tuple[str, ...]
    specs: dict[str, P | None]


TRAINING_SPECS = ActivationSpecs(AXES, {
    ACTIVATION: P("fsdp", "sp"), HEADS: P("fsdp", "sp"), SEQ_GATHERED: P("fsdp"),
    CACHED_KV: P("fsdp"),
    WEIGHT: REPLICATED,            # FSDP: all-gathered just before use, one layer at a time
    STACKED: STACKED_PARAM, GROUPED: GROUPED_PARAM, ROWS: P("fsdp"), LAYER_HEADS: P(None, "fsdp"),
    LAYER_KV: P(None, "fsdp"), READ_KV: P("fsdp"),   # every position on each sp device
})
ROLLOUT_SPECS = ActivationSpecs(ROLLOUT_AXES, {
    ACTIVATION: P("data"), HEADS: P("data", None, "tp"), SEQ_GATHERED: P("data"),
    CACHED_KV: P("data", "tp"),
    WEIGHT: None,                  # already in its decoding layout: never gathered
    STACKED: None, GROUPED: None, ROWS: P("data"),
    # the heads (channels) over tp, as the Gated DeltaNet's column-split projections make them
    LAYER_HEADS: P(None, "data", "tp"),
    # the kv heads over tp, as k_proj/v_proj make them: no step gathers the cache
    LAYER_KV: P(None, "data", None, "tp"), READ_KV: P("data", None, "tp"),
})

# ---- rollout parameter kinds (Megatron tensor parallelism over `tp`) --------------------------
COLUMN = "column"   # [out, ...]: output features split (q/k/v, gate/up; their biases)
ROW = "row"         # [out, in]: input features split; the layer's output is all-reduced
COLUMN_BLOCKS = "column_blocks"  # [out, ...] whose out features are consecutive blocks, each
                    # split over tp: stored grouped by shard (`model.weights.group_channel_blocks`)
VOCAB = "vocab"     # [V, H]: vocabulary rows split (embedding lookup and output head)
WHOLE = "whole"     # replicated (norms, q/k norms, anything not listed)

# (HF-name suffix, kind, transposable, cast): the first matching suffix wins; no match is WHOLE,
# not transposable, not cast.
# `transposable`: the module reads it through `model.qwen.logical` (or handles `transposed`
# itself), so the rollout may store it [in, out] where the platform's matmul reads that faster.
# `cast`: the module reads it in the compute dtype (`logical(w, x.dtype)`: matmul weights, their
# biases, the embedding and output head), so the rollout copy may hold it in the rollout dtype
# (the compute dtype by default) and still read the number the trainer's forward reads. Every
# other parameter keeps its own dtype in the copy: Qwen3.5's (1 + w) norms, gated norm, A_log,
# dt_bias and conv1d are read in fp32 (model/qwen35.py), and a bf16 copy of them is another
# policy than the one the trainer recomputes. (Qwen2/Qwen3's norms read the weight in the
# compute dtype: keeping their dtype reads the same number.)
ROLLOUT_PARAM_KINDS: tuple[tuple[str, str, bool, bool], ...] = (
    ("self_attn.q_proj.weight", COLUMN, True, True), ("self_attn.q_proj.bias", COLUMN, False, True),
    ("self_attn.k_proj.weight", COLUMN, True, True), ("self_attn.k_proj.bias", COLUMN, False, True),
    ("self_attn.v_proj.weight", COLUMN, True, True), ("self_attn.v_proj.bias", COLUMN, False, True),
    ("self_attn.o_proj.weight", ROW, True, True),
    ("mlp.gate_proj.weight", COLUMN, True, True), ("mlp.up_proj.weight", COLUMN, True, True),
    ("mlp.down_proj.weight", ROW, True, True),
    # Qwen3.5 Gated DeltaNet layers: split like the attention projections (heads over tp); the
    # [q | k | v] channels of in_proj_qkv and conv1d each split over tp (shard r: q_r, k_r, v_r)
    ("linear_attn.in_proj_qkv.weight", COLUMN_BLOCKS, False, True),
    ("linear_attn.in_proj_z.weight", COLUMN, False, True),
    ("linear_attn.in_proj_b.weight", COLUMN, False, True), ("linear_attn.in_proj_a.weight", COLUMN, False, True),
    ("linear_attn.conv1d.weight", COLUMN_BLOCKS, False, False), ("linear_attn.dt_bias", COLUMN, False, False),
    ("linear_attn.A_log", COLUMN, False, False), ("linear_attn.out_proj.weight", ROW, False, True),
    ("embed_tokens.weight", VOCAB, True, True), ("lm_head.weight", VOCAB, True, True),
)


def rollout_kind(name: str) -> tuple[str, bool]:
    """(kind, transposable) of the parameter `name` (an HF name) from `ROLLOUT_PARAM_KINDS`."""
    for suffix, kind, transposable, _ in ROLLOUT_PARAM_KINDS:
        if name.endswith(suffix):
            return kind, transposable
    return WHOLE, False


def rollout_casts(name: str) -> bool:
    """Whether the rollout copy of parameter `name` (an HF name) is cast to the rollout dtype
    (`ROLLOUT_PARAM_KINDS`' `cast`: read in the compute dtype); False: it keeps its own dtype."""
    for suffix, _, _, cast in ROLLOUT_PARAM_KINDS:
        if name.endswith(suffix):
            return cast
    return False


def rollout_param_spec(name: str, shape: tuple[int, ...], tp: int, transposed: bool = False) -> P:
    """Spec of parameter `name` at its logical `shape` (HF orientation [out, in, ...]) in a
    rollout layout with tensor-parallel size `tp`; `transposed`: stored [in, out].

    A `VOCAB` parameter whose vocabulary `tp` does not divide stays whole (memory only); a
    `COLUMN`, `COLUMN_BLOCKS` or `ROW` one raises ValueError (choose a tp dividing the head
    counts and FFN size). `COLUMN_BLOCKS` splits dim 0 as `COLUMN` does (its rows grouped by
    shard first).
    """
    kind, _ = rollout_kind(name)
    if tp == 1 or kind == WHOLE:
        return REPLICATED
    dim = 1 if kind == ROW else 0
    if dim >= len(shape) or (kind == VOCAB and shape[dim] % tp):
        return REPLICATED
    if shape[dim] % tp:
        raise ValueError(f"rollout layout tp={tp}: {name} {shape} cannot split dim {dim} "
                         f"({shape[dim]}) over {tp} devices; choose rollout.tp dividing it")
    if transposed and len(shape) == 2:
        dim = 1 - dim
    return P(*([None] * dim), "tp")


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` (> 0) that is >= n: the padded length of n rows or
    tokens on an axis split `multiple` ways."""
    return -(-n // multiple) * multiple


def padded_shape(shape: tuple[int, ...], multiple: int) -> tuple[int, ...]:
    """`shape` with dim 0 rounded up to a multiple of `multiple`: FSDP2's padding for `PARAM`
    (device r of W holds rows [r*c, (r+1)*c), c = ceil(n / W))."""
    n = shape[0]
    return (round_up(n, multiple), *shape[1:])


def named(mesh: Mesh, spec: P) -> NamedSharding:
    """`spec` on `mesh` as a NamedSharding."""
    return NamedSharding(mesh, spec)


def batch_spec(ndim: int) -> P:
    """Spec of a host batch array of rank `ndim`: [B, T, ...] -> BATCH, [B] -> BATCH_ROWS."""
    return BATCH if ndim >= 2 else BATCH_ROWS


def storage_spec(shape: tuple[int, ...], mesh: Mesh, padded: tuple[int, ...] | None = None) -> P:
    """A spec for a LOGICAL-shape (unpadded) array that JAX accepts on `mesh` (every split even).

    Each mesh axis, in mesh order, joins the lowest dimension whose size (and the size in
    `padded`, when given) it still divides; an axis that divides no dimension replicates. For
    Qwen sizes on 3 x 2 this keeps dim 0 split wherever it divides. Used to write checkpoints,
    which store arrays without FSDP padding.
    """
    dims: list[list[str]] = [[] for _ in shape]
    for axis in mesh.axis_names:
        size = mesh.shape[axis]
        for d, n in enumerate(shape):
            split = math.prod(mesh.shape[a] for a in dims[d]) * size
            if n % split == 0 and (padded is None or padded[d] % split == 0):
                dims[d].append(axis)
                break
    return P(*[None if not a else a[0] if len(a) == 1 else tuple(a) for a in dims])
