"""GRPO train-step throughput: jscenegen's `GRPOStep.step` vs the torch reference (VERL's eager
formulas, and the same tuned for speed) vs a Tunix 0.1.7 jit step, same weights and batch,
ratios from one run.

Shape (issue 9): a tiny random Qwen3 (`jscenegen init-model --preset tiny`: vocab 8192, hidden
256, 4 layers, 4 heads, 2 kv heads, FFN 768, tied), batch 8 x 256 tokens, fp32, one GRPO update
= forward + backward + grad-norm clip + AdamW (old log-probs given, the last --trained-tokens
of each row trained (default 128, half: `trained_fraction`), token-mean, one micro-batch), no
remat.
  - jscenegen: `GRPOStep(...).step` as the trainer calls it (jit, donated state, logits of the
    trained tokens only: `capacity` from the loss mask), the model as `load_hf` builds it on one
    device (layers as a Python loop).
  - jscenegen, all logits: the same step with `capacity=None`, logits at every position as
    the untuned torch and Tunix compute them (`*_equal_work` ratios): what the trained-token
    logits save is the gap between the two jscenegen lines.
  - torch, untuned: `torch_reference.grpo_step` with its defaults, VERL's actor as written
    (transformers' model with its default SDPA attention, logits at every position, division
    by the temperature even at 1, torch.optim.AdamW's default per-tensor loop on CPU,
    per-tensor grad-norm clip), with --torch-threads (default: torch's own choice).
  - torch, tuned: the same with `torch_reference.TUNED_STEP`: logits only at the positions
    whose next token is trained (transformers' `logits_to_keep`, as our `capacity` step; the
    trained tokens here are a suffix of each row, so that is --trained-tokens positions ending
    one before the last: 127..254 of 256 with the default 128),
    no division at temperature 1, `AdamW(fused=True)`, foreach grad-norm clip. It still runs
    the last layer at every position and computes no entropy (ours does both trims: the last
    layer's queries and MLP at the trained rows only, and an entropy it reports).
  - Tunix (when the optional `bench` extra is installed): its Qwen3 module loaded from the same
    safetensors, `algo_core.grpo_loss_fn` (prompt = the untrained head of each row, completion
    = the trained tail, the same advantages and old log-probs, token-mean, beta 0) under
    `nnx.value_and_grad`, and an `nnx.Optimizer` (optax clip 1.0 + adamw, same
    hyper-parameters), in one `nnx.jit` with the optimizer donated and the nnx graph cached
    (`nnx.cached_partial`), as Tunix's own trainer sets it up (sft/peft_trainer.py). Tunix
    makes logits at every position and slices the completion (it has no way not to).
All on CPU in this process. Each engine is warmed up (compiled), then timed once per round,
the engines interleaved (a load spike on the shared machine hits all of them) in a carry-over
balanced order (`common.round_order`, a Williams design: over 2n rounds for n engines, n for
an even n, each engine runs right after each other one equally often; the default 5 rounds
with 5 engines are half of that). Every ratio is taken per round (the
two engines timed in the same round) and reported as the median of the --rounds per-round
ratios with their min and max; `*_of_medians` is the ratio of the two engines' medians. CPU
seconds (all threads) are printed beside wall seconds: other jobs barely change the JAX
engines' but inflate torch's (its OpenMP threads spin while they wait for a core), so the CPU
ratios flatter jscenegen on a loaded machine. Also timed, to show what dominates: the forward
pass alone (the log-prob recompute of the trained tokens) for jscenegen and both torch lines.

    python bench/train_step.py [--rounds 7] [--torch-threads N] [--trained-tokens 128]
                               [--json-out FILE]

Prints one line per engine and, last, a JSON line (also written to --json-out, atomically):
  vs_torch                jscenegen over the faster torch line (`torch_baseline` names it:
                          "tuned" or "untuned"), tokens/s of the full step
  vs_torch_untuned        jscenegen over the untuned (VERL-formula eager) torch
  vs_torch_untuned_equal_work   all-logits jscenegen over untuned torch (both all logits)
  vs_tunix                jscenegen over Tunix at this trained fraction
  vs_tunix_equal_work     all-logits jscenegen over Tunix (both make logits everywhere)
each with `_min`, `_max`, `_rounds`, `_of_medians` and `cpu_` counterparts; every engine's
median tokens/s; the forward times; each round's engine order (`round_orders`, the steps'
rounds, and `forward_round_orders`: lists of engine names, first run first) to check the
balance by; and the sitting: commit, dirty, cpu_model, cpu_count, cores_usable,
torch_threads, load_before/after, utc_start/end, environment (the allocator, loader and XLA
variables set).
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
    int_in,
    median,
    paired,
    positive_int_arg,
    round_orders,
    rounds,
    sitting_end,
    sitting_start,
    tunix_qwen3_config,
    write_json,
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


def torch_engine(model_dir: str, batch: dict, tuned: bool):
    """torch_reference.grpo_step on a model of its own: VERL's defaults, or (tuned) with
    TUNED_STEP's options."""
    import torch
    from transformers import AutoModelForCausalLM

    from jscenegen.grpo.algo.config import LossConfig, OptimConfig
    from jscenegen.parity import torch_reference as ref

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tb = {k: torch.from_numpy(v.astype(np.int64) if v.dtype == np.int32 else v)
          for k, v in batch.items()}
    loss_cfg, optim = LossConfig(), OptimConfig()
    opt = {"optimizer": None, "scheduler": None}
    options = ref.TUNED_STEP if tuned else {}

    def run(_):
        _, _, opt["optimizer"], opt["scheduler"] = ref.grpo_step(
            model, tb, loss_cfg, optim, optimizer=opt["optimizer"], scheduler=opt["scheduler"],
            **options)

    keep = ref.trained_positions(tb["loss_mask"]) if tuned else None

    def forward(_):
        with torch.no_grad():
            ref.shifted_logprobs(model, tb["input_ids"], tb["attention_mask"], with_entropy=False,
                                 keep=keep, divide_at_unit_temperature=not tuned)
    return run, forward


def tunix_engine(model_dir: str, cfg, batch: dict, trained_from: int):
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
    split = trained_from   # prompt: the untrained head of each row; completion: the trained tail
    example = common.TrainExample(
        prompt_ids=jnp.asarray(batch["input_ids"][:, :split]),
        prompt_mask=jnp.ones((BATCH, split), bool),
        completion_ids=jnp.asarray(batch["input_ids"][:, split:]),
        completion_mask=jnp.asarray(batch["loss_mask"][:, split:]),
        advantages=jnp.asarray(batch["advantages"][:, split]), ref_per_token_logps=None,
        old_per_token_logps=jnp.asarray(batch["old_logp"][:, split:]))
    algo = GRPOConfig(num_generations=2, beta=0.0, epsilon=0.2, loss_agg_mode="token-mean")
    algo.temperature = 1.0          # the learner copies it from the rollout config
    o = OptimConfig()
    tx = optax.chain(optax.clip_by_global_norm(o.grad_clip),
                     optax.adamw(o.lr, o.betas[0], o.betas[1], o.eps, weight_decay=o.weight_decay))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    def train_step(model, optimizer, example):
        def loss_fn(m):   # pad/eos ids no batch token equals: every token is real
            return algo_core.grpo_loss_fn(m, example, algo, pad_id=-1, eos_id=-2)[0]
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    # as Tunix's trainer jits its step (sft/peft_trainer.py jit_train_and_eval_step): the
    # optimizer donated, the model and optimizer graph traversal cached (cache_nnx_graph,
    # its train() default)
    step = nnx.cached_partial(nnx.jit(train_step, donate_argnames=("optimizer",)), model, optimizer)

    def run(_):
        jax.block_until_ready(step(example))
    return run


TORCH_LINES = {"torch (untuned)": "untuned", "torch (tuned)": "tuned"}


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--rounds", type=positive_int_arg, default=5)
    ap.add_argument("--torch-threads", type=positive_int_arg,
                    help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--trained-tokens", type=int_in(1, SEQ - 1), default=SEQ // 2,
                    help=f"trained tokens at the end of each {SEQ}-token row (default "
                    f"{SEQ // 2}: the trained fraction 0.5)")
    ap.add_argument("--json-out", metavar="FILE",
                    help="also write the final JSON to FILE (atomically: a temporary file renamed)")
    args = ap.parse_args()
    import jax
    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    record = sitting_start()
    print(f"load average before: {record['load_before']}; jax {jax.devices()}; torch threads "
          f"{torch.get_num_threads()}; {record['cpu_model']}, {record['cores_usable']} cores; "
          f"commit {record['commit']}{' (dirty)' if record['dirty'] else ''}")
    tokens = BATCH * SEQ
    trained_from = SEQ - args.trained_tokens
    batch = grpo_batch(VOCAB, BATCH, SEQ, trained_from=trained_from)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = build(tmp)
        jx_step, jx_all, jx_fwd = jax_engine(tmp, batch)
        engines = {"jscenegen": jx_step, "jscenegen (all logits)": jx_all}
        forwards = {"jscenegen": jx_fwd}
        for name, variant in TORCH_LINES.items():
            engines[name], forwards[name] = torch_engine(tmp, batch, tuned=variant == "tuned")
        if importlib.util.find_spec("tunix") is not None:
            engines["tunix"] = tunix_engine(tmp, cfg, batch, trained_from)
        else:
            print("tunix      not installed (pip install -e '.[bench]'); its step is not measured")
        times = rounds(engines, args.rounds, warmup=2)
        fwd = rounds(forwards, args.rounds, warmup=1)
    record = sitting_end(record)
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
    print(f"load average after: {record['load_after']}")
    faster = min(TORCH_LINES, key=lambda name: res[name]["step_s"])
    out = {"bench": "train_step", "batch": BATCH, "seq": SEQ, "vocab": VOCAB,
           "trained_tokens": args.trained_tokens, "trained_fraction": args.trained_tokens / SEQ,
           "rounds": args.rounds, **record, "torch_threads": torch.get_num_threads(),
           "torch_baseline": TORCH_LINES[faster],
           "round_orders": round_orders(engines, args.rounds),
           "forward_round_orders": round_orders(forwards, args.rounds)}
    for name, r in res.items():
        key = name.replace(" (", "_").replace(")", "").replace(" ", "_")
        out[f"{key}_tokens_per_s"] = r["tokens_per_s"]
        if "forward_s" in r:
            out[f"{key}_forward_s"] = r["forward_s"]
    ours, same = times["jscenegen"], times["jscenegen (all logits)"]
    out.update(paired("vs_torch", ours, times[faster]))
    out.update(paired("vs_torch_untuned", ours, times["torch (untuned)"]))
    out.update(paired("vs_torch_untuned_equal_work", same, times["torch (untuned)"]))
    out.update(paired("vs_tunix", ours, times.get("tunix")))
    out.update(paired("vs_tunix_equal_work", same, times.get("tunix")))
    print(f"vs torch ({out['torch_baseline']}) {out['vs_torch']:.2f}x "
          f"[{out['vs_torch_min']:.2f}-{out['vs_torch_max']:.2f}], untuned "
          f"{out['vs_torch_untuned']:.2f}x"
          + (f"; vs tunix {out['vs_tunix']:.2f}x [{out['vs_tunix_min']:.2f}-"
             f"{out['vs_tunix_max']:.2f}], equal work {out['vs_tunix_equal_work']:.2f}x"
             if "tunix" in times else "") + "  (median of per-round ratios [min-max])")
    if args.json_out:
        write_json(args.json_out, out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
