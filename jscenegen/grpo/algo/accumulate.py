"""Gradient accumulation over micro-batches inside one jit, shared by the GRPO and SFT steps.

A batch of B rows is cut into k contiguous blocks of B / k rows (`split_micro`), a `lax.scan`
runs `value_and_grad` on each and sums the gradients and losses, so the compiled program holds
one micro-batch's activations. The gradients are summed in float32 whatever the parameters'
dtype (bf16 accumulators rounded away every micro-batch's contribution below 2^-8 of the sum;
MaxText and VERL's FSDP reduce in fp32), and returned in float32, which the optimizer takes.
The loss of a micro-batch must already carry its share of the batch normaliser (VERL's
global token/sequence counts, fixed before the loop): then the sum is the gradient of the
whole batch's objective, exactly.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jscenegen.sharding.rules import round_up


def num_micro_batches(rows: int, micro_rows: int | None, key: str = "micro_batch_size") -> int:
    """k = rows / micro_rows (1 when micro_rows is None or covers the batch).

    Raises ValueError naming the config `key` when micro_rows does not divide rows."""
    if micro_rows is None or micro_rows >= rows:
        return 1
    if rows % micro_rows:
        raise ValueError(f"batch of {rows} rows does not split into micro-batches of "
                         f"{key}={micro_rows} rows")
    return rows // micro_rows


def check_padded_micro_batches(rows: int, fsdp: int, micro_rows: int | None, rows_text: str,
                               key: str) -> int:
    """`num_micro_batches` of a batch of `rows` rows once padded to a multiple of `fsdp` (the
    mesh's fsdp axis pads the batch's rows before the step splits them), checked from the
    config before any work. Raises ValueError naming `rows_text` (what sets the rows), the
    padding and `key` with the sizes that would divide."""
    padded = round_up(rows, fsdp)
    if micro_rows is None or micro_rows >= padded or padded % micro_rows == 0:
        return num_micro_batches(padded, micro_rows, key)
    divisors = [d for d in range(1, padded + 1) if padded % d == 0]
    pad = f", padded to {padded} (a multiple of mesh.fsdp={fsdp})," if padded != rows else ""
    raise ValueError(f"{key}={micro_rows}: {rows_text} = {rows} rows{pad} do not split into "
                     f"micro-batches of {micro_rows} rows; choose one of "
                     f"{', '.join(map(str, divisors[:12]))}{' ...' if len(divisors) > 12 else ''}")


def split_micro(batch: Any, k: int) -> Any:
    """Every [B, ...] leaf of `batch` reshaped to [k, B / k, ...] (contiguous row blocks)."""
    return jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)


def accumulate_grads(loss_fn: Callable[[Any, Any], tuple[jax.Array, Any]], params: Any,
                     micro: Any, aux_init: Any,
                     aux_combine: Callable[[Any, Any], Any] = lambda a, b: jax.tree.map(jnp.add, a, b),
                     ) -> tuple[Any, jax.Array, Any]:
    """Sum of gradients, losses and auxiliaries of `loss_fn` over the micro-batches.

    loss_fn(params, micro_batch) -> (loss [] float32, aux pytree); micro: a `split_micro`
    batch; aux_init: the auxiliaries' starting value; aux_combine(total, new): how they
    accumulate (default: sum). Returns (grads: float32 arrays of params' shapes (and
    shardings), each the float32 sum of the micro-batches' gradients; summed loss; combined aux).
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def f32(tree):
        return jax.tree.map(lambda g: g.astype(jnp.float32), tree)

    if jax.tree.leaves(micro)[0].shape[0] == 1:
        # one micro-batch: no zero-filled accumulators, no loop (the same numbers: 0 + g = g)
        (value, new_aux), grads = grad_fn(params, jax.tree.map(lambda x: x[0], micro))
        return f32(grads), value, aux_combine(aux_init, new_aux)

    def body(carry, mb):
        grads, loss, aux = carry
        (value, new_aux), g = grad_fn(params, mb)
        return (jax.tree.map(jnp.add, grads, f32(g)), loss + value, aux_combine(aux, new_aux)), None

    zeros = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=jnp.float32), params)
    init = (zeros, jnp.zeros((), jnp.float32), aux_init)
    (grads, loss, aux), _ = jax.lax.scan(body, init, micro)
    return grads, loss, aux
