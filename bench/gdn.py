"""Chunked gated delta rule, forward + backward: jscenegen's `gated_delta_chunked` vs transformers'
`torch_chunk_gated_delta_rule`, same inputs, same process.

Shape (Qwen3.5's linear-attention layers): B = 1, T = 4096, 16 value heads, Dk = Dv = 128, fp32,
chunk 64; q/k L2-normalised, beta = sigmoid(N(0, 1)), g = -exp(A_log) * softplus(a + dt_bias)
(A_log = log U(0.01, 16), dt_bias = 1 + 0.1 N(0, 1)), initial state zero. One step = the outputs
o [B, T, H, Dv], the scalar sum(o) and its gradient w.r.t. q, k, v, g and beta: ours a jitted
`jax.value_and_grad`, torch's forward then autograd `backward()` (torch's default threads). The
median of --repeats timed runs after warm-up counts, the two engines taking turns in each repeat
(the machine may be shared; the load average is printed); forward alone is timed too. Also printed:
max|ours - torch| / max|torch| of o and of the gradients, and ours' peak memory at T = 2048, 4096,
8192 from XLA's `memory_analysis()` of the compiled step (argument + output + temp bytes, i.e.
what the executable needs on the device), to show it is linear in T.

    XLA_FLAGS=--xla_force_host_platform_device_count=1 python bench/gdn.py [--repeats 3] [--quick]

--quick: T = 512 and memory at 256 / 512 / 1024, one repeat (a smoke run). The last line is a
JSON object with the tokens/s of both and their ratio (`ratio`, ours over torch).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import numpy as np
from common import description, positive_int_arg, timed

HEADS, DK, DV, CHUNK = 16, 128, 128, 64


def inputs(seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def unit(shape):
        x = rng.normal(size=shape)
        return (x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)).astype(np.float32)

    a_log = np.log(rng.uniform(0.01, 16.0, HEADS))
    dt_bias = 1.0 + 0.1 * rng.normal(size=HEADS)
    g = -np.exp(a_log) * np.logaddexp(0.0, rng.normal(size=(1, seq, HEADS)) + dt_bias)
    return {"q": unit((1, seq, HEADS, DK)), "k": unit((1, seq, HEADS, DK)),
            "v": rng.normal(size=(1, seq, HEADS, DV)).astype(np.float32),
            "g": g.astype(np.float32),
            "beta": (1.0 / (1.0 + np.exp(-rng.normal(size=(1, seq, HEADS))))).astype(np.float32)}


NAMES = ("q", "k", "v", "g", "beta")


def jax_step():
    import jax
    import jax.numpy as jnp

    from jscenegen.model.gated_delta import gated_delta_chunked

    def loss(q, k, v, g, beta):
        o, _ = gated_delta_chunked(q, k, v, g, beta, chunk_size=CHUNK)
        return jnp.sum(o)

    fwd = jax.jit(lambda *a: gated_delta_chunked(*a, chunk_size=CHUNK)[0])
    return fwd, jax.jit(jax.value_and_grad(loss, argnums=tuple(range(5))))


def jax_runner(x: dict) -> dict:
    import jax

    fwd, step = jax_step()
    arrays = [jax.device_put(x[n]) for n in NAMES]
    _, grads = step(*arrays)
    return {"forward": lambda: jax.block_until_ready(fwd(*arrays)),
            "step": lambda: jax.block_until_ready(step(*arrays)),
            "o": np.asarray(fwd(*arrays)), "grads": [np.asarray(g) for g in grads],
            "devices": len(jax.devices())}


def peak_bytes(seq: int) -> int:
    """argument + output + temp bytes of the compiled forward + backward step at length seq."""
    import jax

    _, step = jax_step()
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in
              (np.zeros((1, seq, HEADS, d), np.float32) for d in (DK, DK, DV))]
    shapes += [jax.ShapeDtypeStruct((1, seq, HEADS), np.float32)] * 2
    m = step.lower(*shapes).compile().memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes)


def torch_runner(x: dict) -> dict:
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
    )

    tx = [torch.from_numpy(x[n]).requires_grad_() for n in NAMES]

    def step():
        for t in tx:
            t.grad = None
        o, _ = torch_chunk_gated_delta_rule(*tx, chunk_size=CHUNK)
        o.sum().backward()

    def forward():
        with torch.no_grad():
            return torch_chunk_gated_delta_rule(*tx, chunk_size=CHUNK)[0]

    step()
    return {"forward": forward, "step": step, "o": forward().numpy(),
            "grads": [t.grad.numpy() for t in tx], "threads": torch.get_num_threads()}


def time_alternating(runners: dict, repeats: int) -> None:
    """Median seconds of each runner's forward and step, the engines taking turns in every
    repeat so that both see the same load on a shared machine (warm-up: the runs above)."""
    times = {(name, part): [] for name in runners for part in ("forward", "step")}
    for _ in range(repeats):
        for name, r in runners.items():
            for part in ("forward", "step"):
                times[name, part].append(timed(r[part], 0, 1))
    for (name, part), ts in times.items():
        runners[name][f"{part}_s"] = statistics.median(ts)
        runners[name][f"{part}_min_s"] = min(ts)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--repeats", type=positive_int_arg, default=3)
    ap.add_argument("--quick", action="store_true", help="T = 512, one repeat (smoke run)")
    args = ap.parse_args()
    seq = 512 if args.quick else 4096
    repeats = 1 if args.quick else args.repeats
    mem_seqs = (256, 512, 1024) if args.quick else (2048, 4096, 8192)

    load_before = os.getloadavg()[0]
    x = inputs(seq)
    jx, th = jax_runner(x), torch_runner(x)
    time_alternating({"jscenegen": jx, "torch": th}, repeats)
    load_after = os.getloadavg()[0]
    print(f"machine: {os.cpu_count()} CPUs, 1-minute load average {load_before:.2f} before, "
          f"{load_after:.2f} after the timed runs")
    for name, r in (("jscenegen", jx), ("torch", th)):
        r["tokens_per_s"] = seq / r["step_s"]
        extra = {k: v for k, v in r.items() if k in ("devices", "threads")}
        print(f"{name:10s} fwd+bwd {r['step_s'] * 1e3:8.1f} ms (min {r['step_min_s'] * 1e3:8.1f})"
              f"  {r['tokens_per_s']:8.0f} tok/s  forward {r['forward_s'] * 1e3:7.1f} ms "
              f"(min {r['forward_min_s'] * 1e3:7.1f}, {seq / r['forward_s']:8.0f} tok/s)  {extra}")
    diffs = {"o": rel(jx["o"], th["o"])}
    diffs.update({f"d_{n}": rel(a, b) for n, a, b in zip(NAMES, jx["grads"], th["grads"])})
    print("max|ours - torch| / max|torch|: " + "  ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    peak = {str(t): peak_bytes(t) for t in mem_seqs}
    for t, b in peak.items():
        print(f"jscenegen peak (XLA memory_analysis: args + outputs + temps) T={t:>5s}: "
              f"{b / 2**20:8.1f} MiB  {b / int(t) / 1024:6.1f} KiB/token")
    print(json.dumps({"bench": "gdn", "seq": seq, "heads": HEADS, "dk": DK, "dv": DV,
                      "chunk": CHUNK, "repeats": repeats,
                      "fwd_bwd_tokens_per_s": jx["tokens_per_s"],
                      "torch_fwd_bwd_tokens_per_s": th["tokens_per_s"],
                      "ratio": jx["tokens_per_s"] / th["tokens_per_s"],
                      "ratio_vs_torch_of_fastest_runs": th["step_min_s"] / jx["step_min_s"],
                      "fwd_ratio_vs_torch": th["forward_s"] / jx["forward_s"],
                      "max_rel_diff_vs_torch": max(diffs.values()),
                      "peak_bytes": peak, "peak_bytes_source": "xla memory_analysis",
                      "jax_devices": jx["devices"], "torch_threads": th["threads"],
                      "load_avg_1min": [load_before, load_after]}))


if __name__ == "__main__":
    main()
