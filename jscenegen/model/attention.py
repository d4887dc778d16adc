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
    b, s, nq, d = q.shape
    nkv = k.shape[1] if cached else k.shape[2]
    g = nq // nkv
    if cached:
        # queries of one kv head side by side: [B, Nkv, G*S, D] (small: S new tokens)
        qh = q.reshape(b, s, nkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, nkv, g * s, d)
        scores = jnp.einsum("bnqd,bndt->bnqt", qh, k, preferred_element_type=jnp.float32)
        scores = scores.reshape(b, nkv, g, s, -1) * (d ** -0.5)
    else:
        qg = q.reshape(b, s, nkv, g, d)
        scores = jnp.einsum("bsngd,btnd->bngst", qg, k, preferred_element_type=jnp.float32)
        scores = scores * (d ** -0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    if cached:
        out = jnp.einsum("bnqt,bntd->bnqd", probs.reshape(b, nkv, g * s, -1), v,
                         preferred_element_type=jnp.float32)
        out = out.reshape(b, nkv, g, s, d).transpose(0, 3, 1, 2, 4)
    else:
        out = jnp.einsum("bngst,btnd->bsngd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, s, nq, d).astype(q.dtype)


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                    cached: bool = False) -> jax.Array:
    if cached:
        k, v = k.transpose(0, 3, 1, 2), v.swapaxes(1, 2)
    out = jax.nn.dot_product_attention(
        q, k, v, mask=mask[:, None, :, :], implementation="cudnn"
    )
    return out.astype(q.dtype)


IMPLEMENTATIONS = {"xla": xla_attention, "cudnn": cudnn_attention}


def attention(q, k, v, mask, impl: str = "xla", cached: bool = False) -> jax.Array:
    """Grouped-query attention; returns [B, S, Nq, D] in q's dtype. Raises KeyError for an unknown impl."""
    try:
        fn = IMPLEMENTATIONS[impl]
    except KeyError:
        raise KeyError(f"attention impl {impl!r} unknown; choose from {sorted(IMPLEMENTATIONS)}") from None
    return fn(q, k, v, mask, cached)
