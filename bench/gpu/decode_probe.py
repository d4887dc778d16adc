"""Where a decode step's time goes on one GPU (#16): the 1.7B-shaped decode of bench_gpu.py
(128-token prompts, 256 new, top-k 50, cuDNN attention) timed whole and its prefill alone, at
each row count asked for; optionally one decode under a JAX profiler trace, summarised by
kernel from the trace's XSpace (no Perfetto export).

    python bench/gpu/decode_probe.py [--rows 64 8] [--attn cudnn xla]
        [--label NAME] [--trace DIR]
    python bench/gpu/decode_probe.py --tiny --rows 2     # CPU dry run

--attn runs the decode once per attention implementation. Run it once per XLA_FLAGS setting to compare flags (the label names the setting). Prints one
JSON line per row count: decode_s (prefill + decode, median of --repeats after a warm-up),
prefill_s (the cache made and the prompts appended, same median), and ms_per_step =
(decode_s - prefill_s) / new tokens. With --trace, then one JSON line per profiler line of the
device planes: events, busy time (their summed durations), span, and the kernels with the most
time (name, count, total us).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_gpu  # noqa: E402
from common import description, positive_int_arg, timed  # noqa: E402


def trace_lines(trace_dir: str, top: int = 25) -> list[dict]:
    """Per line of every device plane (CPU planes when there is none) of the newest XSpace under
    `trace_dir`: events, busy_us (summed durations), span_us (first start to last end), and
    the `top` event names by total time."""
    from jax.profiler import ProfileData

    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"{trace_dir}: no *.xplane.pb written by the profiler")
    planes = list(ProfileData.from_file(files[-1]).planes)
    device = [p for p in planes if p.name.startswith("/device:")] or \
        [p for p in planes if p.name.startswith("/host:CPU")]
    out = []
    for plane in device:
        for line in plane.lines:
            totals, counts = defaultdict(float), defaultdict(int)
            start, end, n = float("inf"), 0.0, 0
            for e in line.events:
                totals[e.name] += e.duration_ns
                counts[e.name] += 1
                start, end, n = min(start, e.start_ns), max(end, e.end_ns), n + 1
            if not n:
                continue
            best = sorted(totals, key=totals.get, reverse=True)[:top]
            out.append({"plane": plane.name, "line": line.name, "events": n,
                        "busy_us": sum(totals.values()) / 1e3, "span_us": (end - start) / 1e3,
                        "top": [[k[:160], counts[k], round(totals[k] / 1e3, 1)] for k in best]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--rows", type=positive_int_arg, nargs="+", default=[64])
    ap.add_argument("--prompt", type=positive_int_arg, default=128)
    ap.add_argument("--new", type=positive_int_arg, default=256)
    ap.add_argument("--repeats", type=positive_int_arg, default=3)
    ap.add_argument("--label", default=os.environ.get("XLA_FLAGS", "default"))
    ap.add_argument("--trace", help="profile one decode at the first row count into this folder")
    ap.add_argument("--attn", nargs="+", default=["cudnn"], choices=["cudnn", "xla"])
    ap.add_argument("--tiny", action="store_true", help="tiny model, xla attention (CPU dry run)")
    args = ap.parse_args()

    import jax

    c = bench_gpu.TINY if args.tiny else bench_gpu.QWEN3_1_7B
    on_gpu = jax.default_backend() == "gpu" and not args.tiny
    runs = [(rows, attn) for attn in args.attn for rows in args.rows]
    for i, (rows, attn) in enumerate(runs):
        impl = "xla" if attn == "xla" or not on_gpu else "cudnn"
        sampler, prompts, seeds = bench_gpu.decode_setup(c, rows, args.prompt, impl)

        def decode():
            res = sampler.generate(prompts, args.new, seeds=seeds)
            assert (res["lengths"] == args.new).all(), res["lengths"]

        def prefill():
            cache, last = sampler.new_cache(rows, args.prompt + sampler.segment)
            jax.block_until_ready(sampler.append(cache, last, prompts))

        decode_s = timed(decode, warmup=1, repeats=args.repeats)
        prefill_s = timed(prefill, warmup=1, repeats=args.repeats)
        print(json.dumps({"label": args.label, "device": jax.devices()[0].device_kind,
                          "rows": rows, "attn": attn if on_gpu else "xla", "decode_s": decode_s, "prefill_s": prefill_s,
                          "tokens_per_s": rows * args.new / decode_s,
                          "ms_per_step": 1e3 * (decode_s - prefill_s) / args.new}), flush=True)
        if args.trace and i == 0:
            with jax.profiler.trace(args.trace, create_perfetto_trace=False):
                decode()
            for line in trace_lines(args.trace):
                print(json.dumps({"label": args.label, "rows": rows, **line}), flush=True)
        jax.clear_caches()


if __name__ == "__main__":
    main()
