"""GRPO train-step throughput: jscenegen's `GRPOStep.step` vs the torch reference vs a Tunix
0.1.7 jit step, same weights and batch, ratios from one run.

Shape (issue 9): a tiny random Qwen3 (`jscenegen init-model --preset tiny`: vocab 8192, hidden
256, 4 layers, 4 heads, 2 kv heads, FFN 768, tied), batch 8 x 256 tokens, fp32, one GRPO update
= forward + backward + grad-norm clip + AdamW (old log-probs given, the second half of each row
trained, token-mean, one micro-batch), no remat.
  - jscenegen: `GRPOStep(...).step` as the trainer calls it (jit, donated state, logits of the
    trained tokens only: `capacity` from the loss mask), the model as `load_hf` builds it on one
    device (layers as a Python loop).
  - jscenegen, all logits: the same step with `capacity=None`, logits at every position as
    torch and Tunix compute them (the same work; `same_work_*` ratios): what the trained-token
    logits save is the gap between the two jscenegen lines.
  - torch: `torch_reference.grpo_step` (transformers' model with its default SDPA attention,
    spec formulas, torch.optim.AdamW) with --torch-threads (default: torch's own choice).
  - Tunix (when the optional `bench` extra is installed): its Qwen3 module loaded from the same
    safetensors, `algo_core.grpo_loss_fn` (prompt = first half, completion = second half, the
    same advantages and old log-probs, token-mean, beta 0) under `nnx.value_and_grad`, and an
    `nnx.Optimizer` (optax clip 1.0 + adamw, same hyper-parameters), all in one `nnx.jit`.
All on CPU in this process. Each engine is warmed up (compiled), then timed once per round
with the engines interleaved (a load spike on the shared machine hits all of them); medians
over --rounds count. CPU seconds (all threads) are printed beside wall seconds: other jobs
barely change the JAX engines' but inflate torch's (its OpenMP threads spin while they wait
for a core), so `cpu_ratio` flatters jscenegen on a loaded machine. Also timed, to show what
dominates: the forward pass alone (the log-prob recompute of the trained tokens) for
jscenegen and torch.

    python bench/train_step.py [--rounds 5] [--torch-threads N]

Prints one line per engine and, last, a JSON line with `ratio` (jscenegen / torch tokens per
second of the full step), `vs_tunix`, `same_work_ratio` and `same_work_vs_tunix` (all logits
over torch / Tunix), their CPU-time counterparts and the load average.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile

import numpy as np
from common import (
    description,
    grpo_batch,
    load_average,
    median,
    positive_int_arg,
    rounds,
    tunix_qwen3_config,
    versus,
)

VOCAB, BATCH, SEQ = 8192, 8, 256


def build(tmp: str):
    from flax import nnx

    from jscenegen.model.config import preset_config
    from jscenegen.model.hf_io import save_hf
    from jscenegen.model.qwen import QwenForCausalLM

    model = QwenForCausalLM(preset_config("qwen3", "tiny", vocab_size=VOCAB), rngs=nnx.Rngs(0))
    save_hf(model, tmp)
    return model.cfg


def jax_engine(model_dir: str, batch: dict):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jscenegen.grpo.algo.config import LossConfig, OptimConfig
    from jscenegen.grpo.algo.logprobs import selection_capacity
    from jscenegen.grpo.algo.optimizer import init_train_state
    from jscenegen.grpo.train.step import GRPOStep
    from jscenegen.model.functional import hidden_fn
    from jscenegen.model.hf_io import load_hf

    model = load_hf(model_dir, param_dtype="float32", compute_dtype="float32")
    graphdef, params, *rest = nnx.split(model, nnx.Param, ...)
    optim = OptimConfig()
    step = GRPOStep(hidden_fn(graphdef, *rest), LossConfig(), optim, donate=True)
    cap = selection_capacity(batch["loss_mask"])
    arrays = {k: jax.device_put(v) for k, v in batch.items()}

    def stepper(capacity):
        # a state of its own (copied weights): each step donates the state it is given
        holder = {"state": init_train_state(jax.tree.map(jnp.copy, params), optim)}

        def run(_):
            holder["state"], metrics = step.step(holder["state"], arrays, capacity=capacity)
            jax.block_until_ready(metrics["loss"])
        return run, holder

    run, holder = stepper(cap)
    run_all, _ = stepper(None)

    def forward(_):
        jax.block_until_ready(step.logprobs(holder["state"].params, arrays["input_ids"],
                                            arrays["attention_mask"], arrays["loss_mask"],
                                            capacity=cap))
    run(0)   # the first two calls compile (the state from init and from a step differ in layout)
    return run, run_all, forward


def torch_engine(model_dir: str, batch: dict):
    import torch
    from transformers import AutoModelForCausalLM

    from jscenegen.grpo.algo.config import LossConfig, OptimConfig
    from jscenegen.parity import torch_reference as ref

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tb = {k: torch.from_numpy(v.astype(np.int64) if v.dtype == np.int32 else v)
          for k, v in batch.items()}
    loss_cfg, optim = LossConfig(), OptimConfig()
    opt = {"optimizer": None, "scheduler": None}

    def run(_):
        _, _, opt["optimizer"], opt["scheduler"] = ref.grpo_step(
            model, tb, loss_cfg, optim, optimizer=opt["optimizer"], scheduler=opt["scheduler"])

    def forward(_):
        with torch.no_grad():
            ref.shifted_logprobs(model, tb["input_ids"], tb["attention_mask"], with_entropy=False)
    return run, forward


def tunix_engine(model_dir: str, cfg, batch: dict):
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from tunix.models.qwen3 import params as tparams
    from tunix.rl import algo_core, common
    from tunix.rl.grpo.grpo_learner import GRPOConfig

    from jscenegen.grpo.algo.config import OptimConfig

    tcfg = tunix_qwen3_config(cfg)
    model = tparams.create_model_from_safe_tensors(model_dir, tcfg)
    half = SEQ // 2
    example = common.TrainExample(
        prompt_ids=jnp.asarray(batch["input_ids"][:, :half]),
        prompt_mask=jnp.ones((BATCH, half), bool),
        completion_ids=jnp.asarray(batch["input_ids"][:, half:]),
        completion_mask=jnp.asarray(batch["loss_mask"][:, half:]),
        advantages=jnp.asarray(batch["advantages"][:, half]), ref_per_token_logps=None,
        old_per_token_logps=jnp.asarray(batch["old_logp"][:, half:]))
    algo = GRPOConfig(num_generations=2, beta=0.0, epsilon=0.2, loss_agg_mode="token-mean")
    algo.temperature = 1.0          # the learner copies it from the rollout config
    o = OptimConfig()
    tx = optax.chain(optax.clip_by_global_norm(o.grad_clip),
                     optax.adamw(o.lr, o.betas[0], o.betas[1], o.eps, weight_decay=o.weight_decay))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, example):
        def loss_fn(m):   # pad/eos ids no batch token equals: every token is real
            return algo_core.grpo_loss_fn(m, example, algo, pad_id=-1, eos_id=-2)[0]
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    def run(_):
        jax.block_until_ready(step(model, optimizer, example))
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--rounds", type=positive_int_arg, default=5)
    ap.add_argument("--torch-threads", type=positive_int_arg,
                    help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args()
    import jax
    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    load_before = load_average()
    print(f"load average before: {load_before}; jax {jax.devices()}; torch threads "
          f"{torch.get_num_threads()}")
    tokens = BATCH * SEQ
    batch = grpo_batch(VOCAB, BATCH, SEQ, trained_from=SEQ // 2)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = build(tmp)
        jx_step, jx_all, jx_fwd = jax_engine(tmp, batch)
        th_step, th_fwd = torch_engine(tmp, batch)
        engines = {"jscenegen": jx_step, "jscenegen (all logits)": jx_all, "torch": th_step}
        if importlib.util.find_spec("tunix") is not None:
            engines["tunix"] = tunix_engine(tmp, cfg, batch)
        else:
            print("tunix      not installed (pip install -e '.[bench]'); its step is not measured")
        times = rounds(engines, args.rounds, warmup=2)
        fwd = rounds({"jscenegen": jx_fwd, "torch": th_fwd}, args.rounds, warmup=1)
    load_after = load_average()
    res = {}
    for name, t in times.items():
        wall, cpu = median(t["wall_s"]), median(t["cpu_s"])
        res[name] = {"tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu,
                     "step_s": wall, "cpu_s": cpu}
        extra = ""
        if name in fwd:
            f = median(fwd[name]["wall_s"])
            res[name]["forward_s"] = f
            extra = f"  forward {f * 1e3:7.1f} ms  backward+AdamW {(wall - f) * 1e3:7.1f} ms"
        print(f"{name:22s} step {wall * 1e3:8.1f} ms  {tokens / wall:8.0f} tok/s  "
              f"{tokens / cpu:8.0f} tok per CPU-s{extra}  rounds "
              f"{[round(tokens / w) for w in t['wall_s']]}")
    print(f"load average after: {load_after}")
    jx, th = res["jscenegen"], res["torch"]
    out = {"bench": "train_step", "batch": BATCH, "seq": SEQ, "vocab": VOCAB,
           "rounds": args.rounds, "load_before": load_before, "load_after": load_after,
           "torch_threads": torch.get_num_threads(),
           "jscenegen_tokens_per_s": jx["tokens_per_s"], "torch_tokens_per_s": th["tokens_per_s"],
           "jscenegen_forward_s": jx["forward_s"], "torch_forward_s": th["forward_s"],
           "ratio": jx["tokens_per_s"] / th["tokens_per_s"],
           "cpu_ratio": jx["tokens_per_cpu_s"] / th["tokens_per_cpu_s"]}
    out.update(versus("tunix", jx, res.get("tunix")))
    same = res["jscenegen (all logits)"]
    out.update({"same_work_ratio": same["tokens_per_s"] / th["tokens_per_s"],
                "cpu_same_work_ratio": same["tokens_per_cpu_s"] / th["tokens_per_cpu_s"]})
    out.update({f"same_work_{k}": v for k, v in versus("tunix", same, res.get("tunix")).items()
                if k.endswith("vs_tunix") and not k.startswith("tunix")})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
