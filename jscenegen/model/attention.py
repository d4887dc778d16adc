"""The attention function boundary: one signature, several kernels.

`attention(q, k, v, mask, impl)` with q [B, S, Nq, D], k/v [B, Sk, Nkv, D] (grouped-query:
Nq a multiple of Nkv), mask [B, S, Sk] bool (True = may attend). `cached=True` takes them in
the KV cache's layout, k [B, Nkv, D, Sk] and v [B, Nkv, Sk, D]: both products then read the
cache as it lies, as plain [M, K] x [K, N] matmuls (a [B, Sk, Nkv, D] cache is transposed,
i.e. copied, for every layer and token, and XLA:CPU repacks a [N, K] right operand per call). `impl="xla"` is the plain reference used on CPU and in tests (fp32 softmax,
as transformers' eager attention); `impl="cudnn"` calls
`jax.nn.dot_product_attention(implementation="cudnn")` (GPU, bf16/fp16).
Sequence-parallel callers pass k/v already gathered over `sp`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


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


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                    cached: bool = False) -> jax.Array:
    """The same attention as `xla_attention` by cuDNN's fused kernel
    (`jax.nn.dot_product_attention(implementation="cudnn")`; GPU, bf16/fp16 inputs). Shapes
    as the module says; returns [B, S, Nq, D] in q's dtype."""
    if cached:
        k, v = k.transpose(0, 3, 1, 2), v.swapaxes(1, 2)
    out = jax.nn.dot_product_attention(
        q, k, v, mask=mask[:, None, :, :], implementation="cudnn"
    )
    return out.astype(q.dtype)


IMPLEMENTATIONS = {"xla": xla_attention, "cudnn": cudnn_attention}


def attention(q, k, v, mask, impl: str = "xla", cached: bool = False) -> jax.Array:
    """Grouped-query attention by kernel `impl`; returns [B, S, Nq, D] in q's dtype. Raises
    ValueError for an unknown impl (`model.attention` is validated before a model is built)."""
    try:
        fn = IMPLEMENTATIONS[impl]
    except KeyError:
        raise ValueError(f"attention impl {impl!r} unknown; choose from {sorted(IMPLEMENTATIONS)}") from None
    return fn(q, k, v, mask, cached)
