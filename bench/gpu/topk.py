"""Top-k over Qwen's vocabulary on one GPU: `jax.lax.top_k` vs `sampling.chunked_top_k` vs
`sampling.block_max_top_k` (the shipped GPU path), alone and inside the 1.7B-shaped decode of
bench_gpu.py (64 rows, 128-token prompts, 256 new, top-k 50).

    python bench/gpu/topk.py [--rows 64 256] [--chunks 1024 2048 4096] [--blocks 32 64 128]
        [--decodes lax_top_k chunked block_max]

Prints one JSON line per measurement: the top-k alone (median microseconds of 50 calls, every
result checked equal to `lax.top_k`'s, ties included), then decode tokens/s with each top-k of
--decodes (`sampling.top_k` replaced for the run; median of 3 after a warm-up; block_max's
block is the fastest alone at the first row count, its fallback chunked_top_k), and last the
ratios against the first decode. On CPU it runs too (slowly); there `sampling.top_k` is
`lax.top_k`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_gpu  # noqa: E402
from common import description, positive_int_arg  # noqa: E402

VOCAB, K = bench_gpu.QWEN3_1_7B["vocab_size"], bench_gpu.TOP_K


def kernel_us(fn, z, calls: int = 50) -> float:
    fn(z)[0].block_until_ready()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(z)[0].block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e6)


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--rows", type=positive_int_arg, nargs="+", default=[64, 256])
    ap.add_argument("--chunks", type=positive_int_arg, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--blocks", type=positive_int_arg, nargs="+", default=[32, 64, 128])
    ap.add_argument("--decodes", nargs="+", default=["lax_top_k", "chunked", "block_max"],
                    choices=["lax_top_k", "chunked", "block_max"])
    ap.add_argument("--decode-rows", type=positive_int_arg, default=64)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from jscenegen.generate import sampling

    best_block = None
    for rows in args.rows:
        z = np.random.default_rng(0).normal(size=(rows, VOCAB)).astype(np.float32)
        z[:, 5:40] = z[:, 3:4]
        z = jnp.asarray(z)
        base = jax.jit(lambda z: jax.lax.top_k(z, K))
        want = [np.asarray(x) for x in base(z)]
        line = {"rows": rows, "vocab": VOCAB, "k": K, "lax_top_k_us": kernel_us(base, z)}
        for chunk in args.chunks:
            fn = jax.jit(lambda z, chunk=chunk: sampling.chunked_top_k(z, K, chunk))
            got = [np.asarray(x) for x in fn(z)]
            assert all((a == b).all() for a, b in zip(want, got)), f"chunk {chunk} differs"
            line[f"chunked_{chunk}_us"] = kernel_us(fn, z)
        for block in args.blocks:
            fn = jax.jit(lambda z, block=block: sampling.block_max_top_k(
                z, K, block, fallback=sampling.chunked_top_k))
            got = [np.asarray(x) for x in fn(z)]
            assert all((a == b).all() for a, b in zip(want, got)), f"block_max {block} differs"
            line[f"block_max_{block}_us"] = kernel_us(fn, z)
        best_block = best_block or min(args.blocks, key=lambda c: line[f"block_max_{c}_us"])
        print(json.dumps(line), flush=True)

    decode_args = types.SimpleNamespace(decode_batch=args.decode_rows, prompt=128, new=256, repeats=3)
    attn = "cudnn" if jax.default_backend() == "gpu" else "xla"
    shipped = sampling.top_k
    results = {}
    variants = {"lax_top_k": lambda z, k: tuple(jax.lax.top_k(z, k)),
                "chunked": lambda z, k: sampling.chunked_top_k(z, k),
                "block_max": lambda z, k: sampling.block_max_top_k(
                    z, k, best_block or sampling.TOP_K_BLOCK, fallback=sampling.chunked_top_k)}
    for name in args.decodes:
        fn = variants[name]
        sampling.top_k = fn
        try:
            r = bench_gpu._jax_decode(bench_gpu.QWEN3_1_7B, decode_args, attn)
        finally:
            sampling.top_k = shipped
        results[name] = args.decode_rows * decode_args.new / r["decode_s"]
        print(json.dumps({"decode_rows": args.decode_rows, "top_k": name,
                          **({"block": best_block or sampling.TOP_K_BLOCK} if name == "block_max" else {}),
                          "decode_tokens_per_s": results[name],
                          "ms_per_step": 1000 * r["decode_s"] / decode_args.new}), flush=True)
    first = args.decodes[0]
    print(json.dumps({"bench": "gpu-topk", "device": jax.devices()[0].device_kind,
                      **{f"decode_{n}_vs_{first}": r / results[first] for n, r in results.items()}}))


if __name__ == "__main__":
    main()
