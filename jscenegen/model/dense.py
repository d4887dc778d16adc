"""y = x W^T, the projection of every linear layer and of the output head, with a backward
pass that transposes the narrower operand.

The weight gradient dW = dy^T x contracts over the tokens. A matmul library that reads its
left operand row-major only (XLA:CPU's YNNPACK dots) gets the token-contracted operand as a
transposed copy: autodiff's dW [out, in] = dot(dy, x) copies dy [T, out]. For a layer whose
output is wider than its input (q/k/v, gate/up, the output head) the copy of x [T, in] is
smaller, and x is shared by the projections that read the same input, so the copy is made
once for q, k and v (and once for gate and up): this computes dW^T = x^T dy there and
transposes the weight-sized result. The numbers are the same sums as autodiff's (fp32
accumulation), in another order. Measured on the CPU train step (bench/train_step.py):
docs/results-bench.md. Only fp32 operands take that form: with bf16 ones XLA:CPU folds the
transpose into a dot that its fallback kernel cannot run (bf16 x bf16 -> f32, "Unsupported
element type for DotThunk"), and accelerators gain nothing from it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

PROJECTION = "projection"   # the name of every dense output, for remat policies (model/remat.py)


def dense(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """x [..., in] times w [out, in] (torch.nn.functional.linear without bias) -> [..., out],
    accumulated in float32, returned in `out_dtype` (default x's dtype; the output head asks
    for float32 logits). The output is named PROJECTION (`checkpoint_name`): the backward pass
    is a custom_vjp, opaque to policies that look for dots."""
    return checkpoint_name(_dense(x, w, out_dtype), PROJECTION)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dense(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    y = jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x.dtype)


def _dense_fwd(x, w, out_dtype):
    return _dense(x, w, out_dtype), (x, w)


def _dense_bwd(out_dtype, residuals, dy):
    x, w = residuals
    dx = jnp.einsum("...o,oi->...i", dy, w, preferred_element_type=jnp.float32).astype(x.dtype)
    if x.shape[-1] < dy.shape[-1] and x.dtype == jnp.float32:
        dw = jnp.einsum("...i,...o->io", x, dy, preferred_element_type=jnp.float32).T
    else:
        dw = jnp.einsum("...o,...i->oi", dy, x, preferred_element_type=jnp.float32)
    return dx, dw.astype(w.dtype)


_dense.defvjp(_dense_fwd, _dense_bwd)
