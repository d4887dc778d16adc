"""How fast one device streams a decode step's weights, by working-set size and dtype.

A jitted loop of 50 steps; each step multiplies an [8, 256] activation (the rollout bench's 8
rows) by every one of N weights [256, 1024] in turn, so a step reads all N weights once, as a
decode step reads the model's. Printed per working set (MB of weights) and dtype: ms per step
and the weight bytes streamed per second (best of 5 runs). On a CPU the rate falls where the
working set outgrows the last-level cache; the rollout bench's decode step reads ~21 MB of fp32
weights and ~4-6 MB of KV cache.

    python bench/weight_stream.py [--sizes 4 8 12 16 24 32 48] [--dtypes float32 bfloat16]

No baseline: this is the bound the sampler is measured against, not a target.
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from common import description, positive_float

ROWS, IN, OUT, STEPS = 8, 256, 1024, 50


def stream_loop(nbytes: float, dtype=jnp.float32, steps: int = STEPS) -> tuple[Callable[[], None], int]:
    """A compiled loop of `steps` steps, each reading about `nbytes` of [256, 1024] weights once
    (an [8, 256] activation times each in turn, as a decode step reads a model's), ready to
    run: (run(), the bytes a step reads)."""
    itemsize = jnp.dtype(dtype).itemsize
    count = max(1, round(nbytes / (IN * OUT * itemsize)))
    rng = np.random.default_rng(0)
    weights = [jnp.asarray(rng.random((IN, OUT), np.float32), dtype) for _ in range(count)]

    @jax.jit
    def loop(x, weights):
        def body(_, x):
            for w in weights:
                x = x + (x @ w)[:, :IN] * 1e-3
            return x
        return jax.lax.fori_loop(0, steps, body, x)

    x = jnp.ones((ROWS, IN), dtype)
    loop(x, weights).block_until_ready()
    return lambda: loop(x, weights).block_until_ready(), count * IN * OUT * itemsize


def step_seconds(megabytes: float, dtype) -> tuple[float, int]:
    """Best-of-5 seconds per step and the weight bytes a step reads."""
    run, nbytes = stream_loop(megabytes * 1e6, dtype)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best / STEPS, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument("--sizes", type=positive_float, nargs="+", default=[4, 8, 12, 16, 24, 32, 48],
                        help="working sets, MB of weights")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    print(f"device: {jax.devices()[0]}")
    for dtype in args.dtypes:
        for megabytes in args.sizes:
            seconds, nbytes = step_seconds(megabytes, jnp.dtype(dtype))
            print(f"  {dtype:9s} {nbytes / 1e6:6.1f} MB  {seconds * 1e3:7.3f} ms/step  "
                  f"{nbytes / seconds / 1e9:5.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
