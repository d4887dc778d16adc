"""Rollout throughput: jscenegen's KV-cache sampler vs transformers `generate`, same weights.

Shape (issue 6): a tiny random Qwen3 (vocab 8192, hidden 256, 4 layers), batch 8, 64-token
prompts, 128 new tokens per row, top-k 50 sampling (generate's default top-k), temperature 1,
no stop token (every row generates exactly 128 tokens). Both run on CPU in this process: torch
with its default threads, JAX on the process's default devices (no forced device count).
Each side is warmed up once (jscenegen: compilation), then timed over --repeats runs; the best
run counts. Tunix's sampler is measured only when `tunix` is importable (it is not part of
jscenegen's dependencies).

    python bench/rollout.py [--repeats 3]

Prints one line per engine and, last, a JSON line with "ratio" = jscenegen / transformers
generated tokens per second.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time

import numpy as np

VOCAB, BATCH, PROMPT, NEW, TOP_K = 8192, 8, 64, 128, 50


def build(tmp: str):
    from flax import nnx

    from jscenegen.model.config import preset_config
    from jscenegen.model.hf_io import save_hf
    from jscenegen.model.qwen import QwenForCausalLM

    cfg = preset_config("qwen3", "tiny", vocab_size=VOCAB)
    model = QwenForCausalLM(cfg, rngs=nnx.Rngs(0))
    save_hf(model, tmp)
    return model


def bench_jscenegen(model, prompts, repeats: int) -> float:
    from jscenegen.generate.sampler import Sampler
    from jscenegen.generate.sampling import SamplingParams

    sampler = Sampler(model, SamplingParams(temperature=1.0, top_k=TOP_K), buckets=(PROMPT,))
    sampler.generate(prompts, NEW, seeds=range(BATCH))                       # compile
    best = float("inf")
    for r in range(repeats):
        t = time.perf_counter()
        out = sampler.generate(prompts, NEW, seeds=[r * BATCH + i for i in range(BATCH)])
        best = min(best, time.perf_counter() - t)
        assert (out["lengths"] == NEW).all()
    return BATCH * NEW / best


def bench_transformers(path: str, prompts, repeats: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(ids)
    kw = dict(do_sample=True, top_k=TOP_K, top_p=1.0, temperature=1.0, max_new_tokens=NEW,
              min_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, **kw)               # warm-up
        best = float("inf")
        for r in range(repeats):
            torch.manual_seed(r)
            t = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, **kw)
            best = min(best, time.perf_counter() - t)
            assert out.shape == (BATCH, PROMPT + NEW)
    return BATCH * NEW / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import jax
    import torch

    print(f"devices: jax {jax.devices()} (default devices, none forced); torch threads "
          f"{torch.get_num_threads()}")
    print(f"shape: qwen3 tiny vocab {VOCAB} hidden 256 layers 4, batch {BATCH}, prompt {PROMPT}, "
          f"new {NEW}, top-k {TOP_K}")
    prompts = np.random.default_rng(0).integers(3, VOCAB, (BATCH, PROMPT)).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        model = build(tmp)
        ours = bench_jscenegen(model, prompts, args.repeats)
        print(f"jscenegen sampler: {ours:,.0f} generated tokens/s")
        theirs = bench_transformers(tmp, prompts, args.repeats)
        print(f"transformers generate: {theirs:,.0f} generated tokens/s")
    result = {"ratio": ours / theirs, "jscenegen_tokens_per_s": ours,
              "transformers_tokens_per_s": theirs, "batch": BATCH, "prompt": PROMPT, "new": NEW}
    if importlib.util.find_spec("tunix") is None:
        print("tunix: not installed (google-tunix); its sampler was not measured")
        result["tunix"] = "not installed"
    else:
        print("tunix: installed, but its sampler needs its own model classes; not measured here")
        result["tunix"] = "installed, not measured"
    print(json.dumps(result))


if __name__ == "__main__":
    main()
