"""GRPO train-step throughput: jscenegen's `GRPOStep.step` vs the torch reference, same weights.

Shape (issue 9): a tiny random Qwen3 (`jscenegen init-model --preset tiny`: vocab 8192, hidden
256, 4 layers, 4 heads, 2 kv heads, FFN 768, tied), batch 8 x 256 tokens, fp32, one GRPO update
= forward + backward + grad-norm clip + AdamW (old log-probs given, half of each row trained,
token-mean, one micro-batch). jscenegen: `GRPOStep(...).step` (jit, donated state); torch:
`torch_reference.grpo_step` (transformers eager model, spec formulas, torch.optim.AdamW), both on
CPU in this process: torch with its default threads, JAX on the process's default devices (no
forced device count). Warm-up runs are excluded (jscenegen's first two calls compile: the state
from init and the state from a step can differ in layout); the median of --repeats timed runs
counts. Also timed, to show what dominates: the forward pass alone (log-prob recompute) on both
sides. Tunix is measured only when `tunix` is importable (it is not part of jscenegen's
dependencies).

    python bench/train_step.py [--repeats 5]

Prints one line per engine and, last, a JSON line with "ratio" = jscenegen / torch tokens per
second of the full step.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile

import numpy as np
from common import grpo_batch, timed

VOCAB, BATCH, SEQ = 8192, 8, 256


def build(tmp: str) -> None:
    from flax import nnx

    from jscenegen.model.config import preset_config
    from jscenegen.model.hf_io import save_hf
    from jscenegen.model.qwen import QwenForCausalLM

    save_hf(QwenForCausalLM(preset_config("qwen3", "tiny", vocab_size=VOCAB), rngs=nnx.Rngs(0)), tmp)






def bench_jax(model_dir: str, batch: dict, repeats: int) -> dict:
    import jax
    from flax import nnx

    from jscenegen.grpo.algo.config import LossConfig, OptimConfig
    from jscenegen.grpo.algo.optimizer import init_train_state
    from jscenegen.grpo.train.step import GRPOStep
    from jscenegen.model.functional import hidden_fn
    from jscenegen.model.hf_io import load_hf

    model = load_hf(model_dir, param_dtype="float32", compute_dtype="float32")
    graphdef, params, *rest = nnx.split(model, nnx.Param, ...)
    optim = OptimConfig()
    step = GRPOStep(hidden_fn(graphdef, *rest), LossConfig(), optim, donate=True)
    arrays = {k: jax.device_put(v) for k, v in batch.items()}
    holder = {"state": init_train_state(params, optim)}

    def run_step():
        holder["state"], metrics = step.step(holder["state"], arrays)
        jax.block_until_ready(metrics["loss"])

    step_s = timed(run_step, warmup=3, repeats=repeats)
    fwd_s = timed(lambda: jax.block_until_ready(
        step.logprobs(holder["state"].params, arrays["input_ids"], arrays["attention_mask"])),
        warmup=2, repeats=repeats)
    return {"step_s": step_s, "forward_s": fwd_s, "devices": len(jax.devices()),
            "platform": jax.devices()[0].platform}


def bench_torch(model_dir: str, batch: dict, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from jscenegen.grpo.algo.config import LossConfig, OptimConfig
    from jscenegen.parity import torch_reference as ref

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    tb = {k: torch.from_numpy(v.astype(np.int64) if v.dtype == np.int32 else v)
          for k, v in batch.items()}
    loss_cfg, optim = LossConfig(), OptimConfig()
    opt = {"optimizer": None, "scheduler": None}

    def run_step():
        _, _, opt["optimizer"], opt["scheduler"] = ref.grpo_step(
            model, tb, loss_cfg, optim, optimizer=opt["optimizer"], scheduler=opt["scheduler"])

    def forward():
        with torch.no_grad():
            ref.shifted_logprobs(model, tb["input_ids"], tb["attention_mask"])

    step_s = timed(run_step, warmup=2, repeats=repeats)
    return {"step_s": step_s, "forward_s": timed(forward, warmup=1, repeats=repeats),
            "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tokens = BATCH * SEQ
    batch = grpo_batch(VOCAB, BATCH, SEQ, trained_from=SEQ // 2)
    with tempfile.TemporaryDirectory() as tmp:
        build(tmp)
        jx = bench_jax(tmp, batch, args.repeats)
        th = bench_torch(tmp, batch, args.repeats)
    for name, r in (("jscenegen", jx), ("torch", th)):
        r["tokens_per_s"] = tokens / r["step_s"]
        extra = {k: v for k, v in r.items() if k not in ("step_s", "forward_s", "tokens_per_s")}
        print(f"{name:10s} step {r['step_s'] * 1e3:8.1f} ms  {r['tokens_per_s']:8.0f} tok/s  "
              f"forward {r['forward_s'] * 1e3:7.1f} ms  backward+AdamW "
              f"{(r['step_s'] - r['forward_s']) * 1e3:7.1f} ms  {extra}")
    if importlib.util.find_spec("tunix") is None:
        print("tunix      not installed (pip install tunix to include it)")
    print(json.dumps({"bench": "train_step", "batch": BATCH, "seq": SEQ, "vocab": VOCAB,
                      "repeats": args.repeats,
                      "jscenegen_tokens_per_s": jx["tokens_per_s"],
                      "torch_tokens_per_s": th["tokens_per_s"],
                      "jscenegen_forward_s": jx["forward_s"], "torch_forward_s": th["forward_s"],
                      "jax_devices": jx["devices"], "torch_threads": th["threads"],
                      "ratio": jx["tokens_per_s"] / th["tokens_per_s"]}))


if __name__ == "__main__":
    main()
