"""Top-k over Qwen's vocabulary on one GPU: `jax.lax.top_k` vs `sampling.chunked_top_k`, alone
and inside the 1.7B-shaped decode of bench_gpu.py (64 rows, 128-token prompts, 256 new, top-k 50).

    python bench/gpu/topk.py [--rows 64 256] [--chunks 1024 2048 4096] [--trace DIR]

Prints one JSON line per measurement: the top-k alone (median microseconds of 50 calls, both
results checked equal to `lax.top_k`'s, ties included), then decode tokens/s with each top-k
(`sampling.top_k` replaced for the run; median of 3 after a warm-up), and last the ratios.
--trace DIR writes a JAX profiler trace (with a Perfetto JSON) of one decode with the chunked
top-k. On CPU it runs too (slowly); there `sampling.top_k` never takes the chunked path.
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--decode-rows", type=int, default=64)
    ap.add_argument("--trace", help="write a profiler trace of one chunked-top-k decode here")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from jscenegen.generate import sampling

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
        print(json.dumps(line), flush=True)

    decode_args = types.SimpleNamespace(decode_batch=args.decode_rows, prompt=128, new=256, repeats=3)
    attn = "cudnn" if jax.default_backend() == "gpu" else "xla"
    shipped = sampling.top_k
    results = {}
    for name, fn in (("lax_top_k", lambda z, k: tuple(jax.lax.top_k(z, k))),
                     ("chunked", lambda z, k: sampling.chunked_top_k(z, k))):
        sampling.top_k = fn
        try:
            r = bench_gpu._jax_decode(bench_gpu.QWEN3_1_7B, decode_args, attn)
        finally:
            sampling.top_k = shipped
        results[name] = args.decode_rows * decode_args.new / r["decode_s"]
        print(json.dumps({"decode_rows": args.decode_rows, "top_k": name,
                          "decode_tokens_per_s": results[name],
                          "ms_per_step": 1000 * r["decode_s"] / decode_args.new}), flush=True)
    if args.trace:
        sampling.top_k = lambda z, k: sampling.chunked_top_k(z, k)
        trace_args = types.SimpleNamespace(decode_batch=args.decode_rows, prompt=128, new=64, repeats=1)
        with jax.profiler.trace(args.trace, create_perfetto_trace=True):
            bench_gpu._jax_decode(bench_gpu.QWEN3_1_7B, trace_args, attn)
        sampling.top_k = shipped
    print(json.dumps({"bench": "gpu-topk", "device": jax.devices()[0].device_kind,
                      "decode_chunked_vs_lax": results["chunked"] / results["lax_top_k"]}))


if __name__ == "__main__":
    main()
