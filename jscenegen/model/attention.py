"""The attention function boundary: one signature, several kernels.

`attention(q, k, v, mask, impl)` with q [B, S, Nq, D], k/v [B, Sk, Nkv, D] (grouped-query:
Nq a multiple of Nkv), mask [B, S, Sk] bool (True = may attend). `cached=True` takes them in
the KV cache's layout, k [B, Nkv, D, Sk] and v [B, Nkv, Sk, D]: both products then read the
cache as it lies, as plain [M, K] x [K, N] matmuls (a [B, Sk, Nkv, D] cache is transposed,
i.e. copied, for every layer and token, and XLA:CPU repacks a [N, K] right operand per call). `impl="xla"` is the plain reference used on CPU and in tests (fp32 softmax,
as transformers' eager attention); `impl="cudnn"` calls
`jax.nn.dot_product_attention(implementation="cudnn")` (GPU, bf16/fp16) on each device's
shard (`per_shard`). Sequence-parallel callers pass k/v already gathered over `sp`.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jscenegen.sharding.constraints import active_spec, dividing_axes
from jscenegen.sharding.rules import HEADS


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                  cached: bool = False) -> jax.Array:
    """softmax(q k^T / sqrt(D) + mask) v per head, grouped-query (transformers'
    `eager_attention_forward`): scores and softmax in float32, masked scores at float32's
    minimum (a row with no allowed key averages v uniformly, as there). Shapes as the module
    says; returns [B, S, Nq, D] in q's dtype."""
    if not cached:
        # the same products as over a cache: with k [B, S, Nkv, D] as given, XLA:CPU makes the
        # scores transposed (keys x queries) and copies q into a [D, queries] layout inside
        # the fusion that normalises and rotates it, a strided write (~5% of a train step)
        k, v = k.transpose(0, 2, 3, 1), v.swapaxes(1, 2)
    b, s, nq, d = q.shape
    nkv = k.shape[1]
    # queries grouped by kv head, [B, Nkv, G, S, D]: (G, S) are the rows of each head's
    # matmul as they lie (not merged by a reshape, which would gather S when it is sharded)
    qh = q.reshape(b, s, nkv, nq // nkv, d).transpose(0, 2, 3, 1, 4)
    scores = jnp.einsum("bngsd,bndt->bngst", qh, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None, :, :], scores * (d ** -0.5), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bngst,bntd->bngsd", probs, v, preferred_element_type=jnp.float32)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, s, nq, d).astype(q.dtype)


Kernel = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, bool], jax.Array]


def per_shard(kernel: Kernel, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
              cached: bool = False) -> jax.Array:
    """`kernel(q, k, v, mask, cached)` run by every device on its own shard, inside
    `jax.shard_map` over the active mesh (the identity wrapper without one); shapes as the
    module says, returns [B, S, Nq, D] split as q.

    The split is the active layout's `HEADS` spec of q (`sharding.rules`: training rows over
    fsdp and positions over sp; rollout rows over data and heads over tp): q and the output
    are split by it; mask [B, S, Sk] by its rows and positions (each device's own query rows,
    built globally, so causality across shards holds); k and v by its rows and heads, every
    key position on each device (sequence parallelism gathers them, as `qwen.cached_attention`
    constrains them). A dimension that axis does not divide evenly (S = 1 in decode, under the
    fsdp rollout layout's sp) is kept whole instead (`dividing_axes`); heads are split only
    where the axis divides the kv heads, so each shard keeps its query heads' kv heads.

    Why: cuDNN's fused attention (jax `_src/cudnn/fused_attention_stablehlo.py`) partitions
    itself only when q, k and v share one sharding with the sequence unsplit, and raises
    "Query, key and value should have same sharding" for sequence parallelism's split
    queries over gathered keys (jax-anchors.md 8.2: run the kernel per shard). The backward
    pass sums each shard's key/value gradients over the axes k and v are not split by
    (`shard_map`'s transpose with check_vma off), as GSPMD's partitioning of the unsharded
    kernel does.
    """
    spec = active_spec(HEADS)
    if spec is None:
        return kernel(q, k, v, mask, cached)
    rows, positions, heads = (*spec, None, None, None)[:3]
    rows = dividing_axes(rows, q.shape[0])
    positions = dividing_axes(positions, q.shape[1])
    heads = dividing_axes(heads, k.shape[1] if cached else k.shape[2])
    q_spec = P(rows, positions, heads)
    kv_spec = P(rows, heads) if cached else P(rows, None, heads)

    def body(q, k, v, mask):
        return kernel(q, k, v, mask, cached)

    # check_vma off: cuDNN's primitives carry no varying-axes rules; every output is per-shard
    return jax.shard_map(body, in_specs=(q_spec, kv_spec, kv_spec, P(rows, positions)),
                         out_specs=q_spec, check_vma=False)(q, k, v, mask)


def cudnn_kernel(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                 cached: bool = False) -> jax.Array:
    """The same attention as `xla_attention` by cuDNN's fused kernel
    (`jax.nn.dot_product_attention(implementation="cudnn")`; GPU, bf16/fp16 inputs, else
    jax raises) on whole arrays: one device, or one shard inside `per_shard`. Shapes as the
    module says; returns [B, S, Nq, D] in q's dtype."""
    if cached:
        k, v = k.transpose(0, 3, 1, 2), v.swapaxes(1, 2)
    out = jax.nn.dot_product_attention(
        q, k, v, mask=mask[:, None, :, :], implementation="cudnn"
    )
    return out.astype(q.dtype)


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                    cached: bool = False) -> jax.Array:
    """`cudnn_kernel` on each device's shard (`per_shard`): cuDNN's own partitioning refuses
    sequence-split queries. Shapes as the module says; returns [B, S, Nq, D] in q's dtype."""
    return per_shard(cudnn_kernel, q, k, v, mask, cached)


IMPLEMENTATIONS = {"xla": xla_attention, "cudnn": cudnn_attention}


def attention(q, k, v, mask, impl: str = "xla", cached: bool = False) -> jax.Array:
    """Grouped-query attention by kernel `impl`; returns [B, S, Nq, D] in q's dtype. Raises
    ValueError for an unknown impl (`model.attention` is validated before a model is built)."""
    try:
        fn = IMPLEMENTATIONS[impl]
    except KeyError:
        raise ValueError(f"attention impl {impl!r} unknown; choose from {sorted(IMPLEMENTATIONS)}") from None
    return fn(q, k, v, mask, cached)
