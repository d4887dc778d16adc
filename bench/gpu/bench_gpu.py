"""One-GPU benchmark: bf16 GRPO train-step MFU, decode tokens/s and HBM-bandwidth use,
jscenegen vs torch (transformers) vs Tunix 0.1.7.

Model: a random Qwen3-1.7B-shaped decoder (hidden 2048, 28 layers, 16 heads, 8 kv heads,
head_dim 128, FFN 6144, vocab 151936, tied embeddings). jscenegen: fp32 parameters and AdamW
state, bf16 compute, cuDNN attention (`attn_impl="cudnn"`), per-layer remat (`--remat full`,
the default; `minimal` keeps the projections' outputs; `none`), one `GRPOStep.step`
(forward + backward + clip + AdamW, token-mean, old log-probs given); decode: `Sampler.generate`
with bf16 weights and KV cache (top-k 50, temperature 1, no stop token). torch (when importable
with CUDA): transformers Qwen3ForCausalLM with the same config, fp32 parameters under
`torch.autocast(bfloat16)`, SDPA attention, gradient checkpointing, `torch_reference.grpo_step`
(the same spec formulas and torch.optim.AdamW); decode: `generate` in bf16 with the same
sampling. Tunix (only when `tunix` is importable there; the lent GPU machines reach no package
registry, so bring the wheel): decode with its `Sampler` on its own Qwen3 module, random bf16
weights of the same shape, the same batch, prompt length, new tokens and top-k. Each engine
runs in its own process (JAX preallocates GPU memory).

Decode HBM-bandwidth utilisation = bytes a decode step must read (the bf16 weights once, plus
the KV cache of every row up to its current length, averaged over the run) x steps/s / the
device's peak HBM bandwidth (H100 3.35 TB/s, H200 4.8 TB/s, A100 2.0 TB/s or --peak-hbm-tbs).
Decode of a 1.7B-4B model at batch 64 is bandwidth-bound, so this is its roofline share.

MFU = model FLOPs per step / step time / peak bf16 FLOP/s, model FLOPs = 6 N T (N: matmul
parameters incl. the output projection, T: tokens) + 6 L S d_q T / 2 x 2 (causal attention
scores and values, forward + backward; remat's recompute not counted), peak from the device
kind (H100/H200 989 TFLOP/s dense bf16, A100 312) or --peak-tflops. MFU times the full pass
(every token's logits); `train_step_capacity_s` times the step as the trainer calls it (the
trained positions only from the last layer on, `capacity`), and
`train_capacity_logprob_max_abs_diff` compares the log-probs both give the trained tokens
(beside `train_logprob_mean_abs`, their size; `train_capacity_logprobs_ok`: below 0.1).
`decode_step_cosines`: cosine ops in the compiled cached step (1: the RoPE table evaluated
once, not in every layer's fusions, on this device's compiler).

    bash bench/gpu/run.sh                       # on the GPU machine
    python bench/gpu/bench_gpu.py --tiny        # CPU dry run: tiny model, xla attention

Prints one JSON line per engine and, last, a JSON line with "ratio" = jscenegen / torch train
tokens/s, "decode_ratio" (jscenegen / torch) and "decode_vs_tunix"; a ratio is null when that
engine could not run. `--shape 4b` uses a Qwen3-4B shape instead of 1.7B.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[1]))
from common import (  # noqa: E402
    IdTokenizer,
    description,
    grpo_batch,
    positive_float,
    positive_int_arg,
    timed,
    tunix_qwen3_config,
)

QWEN3_1_7B = dict(model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                  tie_word_embeddings=True, max_position_embeddings=40960)
TINY = dict(QWEN3_1_7B, vocab_size=1024, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
QWEN3_4B = dict(QWEN3_1_7B, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8)
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
PEAK_HBM = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}


def param_count(c: dict) -> int:
    """Parameters of the decoder (tied embedding counted once)."""
    h, hd, f = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * f + 2 * h + 2 * hd
    head = 0 if c["tie_word_embeddings"] else c["vocab_size"] * h
    return c["num_hidden_layers"] * per_layer + c["vocab_size"] * h + head + h


def decode_bytes_per_step(c: dict, rows: int, prompt: int, new: int) -> float:
    """bf16 bytes one decode step reads: the weights once and every row's KV cache at its mean
    length over the run (prompt + new / 2)."""
    kv = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 2
    return 2 * param_count(c) + rows * (prompt + new / 2) * kv
TOP_K = 50
CAPACITY_LOGPROB_TOL = 0.1   # train_capacity_logprobs_ok (see _jax_train)


def model_flops_per_token(c: dict, seq: int) -> float:
    """Training FLOPs per token (forward + backward) of the decoder and output projection."""
    h, layers, hd = c["hidden_size"], c["num_hidden_layers"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * c["intermediate_size"]
    n = layers * per_layer + c["vocab_size"] * h
    attn = 2 * 2 * layers * seq * q / 2  # QK^T and PV, causal half, forward
    return 6 * n + 3 * attn






def run_jscenegen(c: dict, args) -> dict:
    """Train and decode timings with cuDNN attention; a phase whose cuDNN kernel fails is rerun
    with xla attention and the failure recorded (`<phase>_attention`, `<phase>_cudnn_error`)."""
    attn = "xla" if args.tiny else "cudnn"
    out = {"engine": "jscenegen"}
    for phase, fn in (("train", _jax_train), ("decode", _jax_decode)):
        try:
            out.update(fn(c, args, attn))
            out[f"{phase}_attention"] = attn
        except Exception as err:  # noqa: BLE001 - a one-shot GPU run records and falls back
            if attn == "xla":
                raise
            out[f"{phase}_cudnn_error"] = f"{type(err).__name__}: {str(err)[:500]}"
            out.update(fn(c, args, "xla"))
            out[f"{phase}_attention"] = "xla"
    return out


def _jax_train(c: dict, args, attn: str) -> dict:
    import jax
    from flax import nnx

    from jscenegen.grpo.algo.config import LossConfig, OptimConfig
    from jscenegen.grpo.algo.logprobs import selection_capacity
    from jscenegen.grpo.algo.optimizer import init_train_state
    from jscenegen.grpo.train.step import GRPOStep
    from jscenegen.model.config import QwenConfig
    from jscenegen.model.functional import hidden_fn
    from jscenegen.model.qwen import QwenForCausalLM

    cfg = QwenConfig.from_hf_dict(c, "bench config")
    out = {"device": jax.devices()[0].device_kind}
    model = QwenForCausalLM(cfg, rngs=nnx.Rngs(0), param_dtype="float32",
                            compute_dtype="bfloat16", attn_impl=attn,
                            remat=False if args.remat == "none" else args.remat)
    graphdef, params, *rest = nnx.split(model, nnx.Param, ...)
    optim = OptimConfig()
    step = GRPOStep(hidden_fn(graphdef, *rest), LossConfig(), optim, donate=True)
    arrays = {k: jax.device_put(v) for k, v in
              grpo_batch(c["vocab_size"], args.batch, args.seq, trained_from=args.seq // 4).items()}
    holder = {"state": init_train_state(params, optim)}
    del model, params

    # the trainer's own call (`capacity`: the trained positions only from the last layer on,
    # cuDNN attention of C queries over S keys) against the full pass that MFU counts: the
    # same log-probs of the trained tokens to bf16 rounding (the loss itself is near 0 with
    # +-1 advantages, so comparing it would hide an error)
    cap = selection_capacity(np.asarray(arrays["loss_mask"]))
    mask = np.asarray(arrays["loss_mask"]) > 0
    lp = [np.asarray(step.logprobs(holder["state"].params, arrays["input_ids"],
                                   arrays["attention_mask"], arrays["loss_mask"], capacity=c)[0])
          for c in (None, cap)]
    out["train_capacity_logprob_max_abs_diff"] = float(np.abs(lp[1] - lp[0])[mask].max())
    out["train_logprob_mean_abs"] = float(np.abs(lp[0])[mask].mean())
    # bf16 hidden states computed by other kernels round apart by a few 1e-3; a log-prob taken
    # at a wrong position is off by the spread of the model's log-probs (~1)
    out["train_capacity_logprobs_ok"] = out["train_capacity_logprob_max_abs_diff"] < CAPACITY_LOGPROB_TOL

    def train(capacity=None):
        holder["state"], metrics = step.step(holder["state"], arrays, capacity=capacity)
        holder["loss"] = float(metrics["loss"])

    out["train_step_s"] = timed(train, warmup=3, repeats=args.repeats)
    out["train_remat"] = args.remat
    out["train_loss_finite"] = bool(np.isfinite(holder["loss"]))
    out["train_step_capacity_s"] = timed(lambda: train(cap), warmup=2, repeats=args.repeats)
    jax.clear_caches()
    return out


def decode_setup(c: dict, rows: int, prompt: int, attn: str):
    """The jscenegen side of the decode: (Sampler over a random bf16 model of shape `c`, top-k
    TOP_K, temperature 1; `rows` random prompts of `prompt` tokens; one seed per row)."""
    from flax import nnx

    from jscenegen.generate.sampler import Sampler
    from jscenegen.generate.sampling import SamplingParams
    from jscenegen.model.config import QwenConfig
    from jscenegen.model.qwen import QwenForCausalLM

    cfg = QwenConfig.from_hf_dict(c, "bench config")
    model = QwenForCausalLM(cfg, rngs=nnx.Rngs(1), param_dtype="bfloat16",
                            compute_dtype="bfloat16", attn_impl=attn)
    sampler = Sampler(model, SamplingParams(temperature=1.0, top_k=TOP_K), buckets=(prompt,))
    prompts = np.random.default_rng(0).integers(0, c["vocab_size"], (rows, prompt)).tolist()
    return sampler, prompts, list(range(rows))


def _jax_decode(c: dict, args, attn: str) -> dict:
    import jax

    sampler, prompts, seeds = decode_setup(c, args.decode_batch, args.prompt, attn)

    def decode():
        res = sampler.generate(prompts, args.new, seeds=seeds)
        assert (res["lengths"] == args.new).all(), res["lengths"]

    decode_s = timed(decode, warmup=1, repeats=args.repeats)
    cosines = decode_step_cosines(c, attn, args.decode_batch, args.prompt + args.new)
    jax.clear_caches()
    return {"decode_s": decode_s, "decode_step_cosines": cosines}


def decode_step_cosines(c: dict, attn: str, rows: int, max_len: int) -> int:
    """`cosine` ops in the compiled HLO of one cached one-token step of the bench's bf16 model
    (compiled from shapes alone): 1 when the RoPE table is evaluated once per step, not inside
    every layer's q and k fusions (model/rope.py; checked on CPU by tests/test_model_qwen.py,
    here on the device that runs the bench)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jscenegen.model.config import QwenConfig
    from jscenegen.model.qwen import KVCache, QwenForCausalLM

    cfg = QwenConfig.from_hf_dict(c, "bench config")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: QwenForCausalLM(
        cfg, rngs=nnx.Rngs(1), param_dtype="bfloat16", compute_dtype="bfloat16", attn_impl=attn)))
    cache = jax.eval_shape(lambda: KVCache.create(cfg, rows, max_len, jnp.bfloat16))
    ids = jax.ShapeDtypeStruct((rows, 1), jnp.int32)
    step = jax.jit(lambda st, ids, kv: nnx.merge(graphdef, st)(ids, jnp.ones_like(ids), cache=kv))
    return step.lower(state, ids, cache).compile().as_text().count(" cosine(")


def run_torch(c: dict, args) -> dict:
    import contextlib

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from jscenegen.grpo.algo.config import LossConfig, OptimConfig
    from jscenegen.parity import torch_reference as ref

    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        return {"engine": "torch", "skipped": "torch has no CUDA device here"}
    dev = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    hf = {k: v for k, v in c.items() if k != "model_type"}
    out = {"engine": "torch", "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if cuda else "cpu", "attention": "sdpa"}
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**hf, attn_implementation="sdpa")).to(dev)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    tb = {k: torch.from_numpy(v.astype(np.int64) if v.dtype == np.int32 else v).to(dev)
          for k, v in grpo_batch(c["vocab_size"], args.batch, args.seq, trained_from=args.seq // 4).items()}
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if cuda
                else contextlib.nullcontext())
    opt = {"optimizer": None, "scheduler": None}
    loss_cfg, optim = LossConfig(), OptimConfig()

    def train():
        with autocast:
            metrics, _, opt["optimizer"], opt["scheduler"] = ref.grpo_step(
                model, tb, loss_cfg, optim, optimizer=opt["optimizer"], scheduler=opt["scheduler"])
        sync()
        out["train_loss_finite"] = bool(np.isfinite(metrics["loss"]))

    out["train_step_s"] = timed(train, warmup=2, repeats=args.repeats)
    model = opt = tb = None  # free the GPU memory before the decode model
    if cuda:
        torch.cuda.empty_cache()

    torch.manual_seed(1)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = Qwen3ForCausalLM(Qwen3Config(**hf, attn_implementation="sdpa")).to(dev, dtype).eval()
    ids = torch.from_numpy(np.random.default_rng(0).integers(
        0, c["vocab_size"], (args.decode_batch, args.prompt))).to(dev)
    kw = dict(do_sample=True, top_k=TOP_K, top_p=1.0, temperature=1.0, max_new_tokens=args.new,
              min_new_tokens=args.new, eos_token_id=None, pad_token_id=0)

    def decode():
        with torch.no_grad():
            res = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
        sync()
        assert res.shape == (args.decode_batch, args.prompt + args.new), res.shape

    out["decode_s"] = timed(decode, warmup=1, repeats=args.repeats)
    return out


def run_tunix(c: dict, args) -> dict:
    """Tunix 0.1.7's Sampler decode on its own Qwen3 module (random bf16 weights)."""
    import importlib.util

    if importlib.util.find_spec("tunix") is None:
        return {"engine": "tunix", "skipped": "tunix is not installed here"}
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tunix.generate.sampler import CacheConfig, Sampler
    from tunix.models.qwen3 import model as tmodel

    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    tcfg = tunix_qwen3_config(SimpleNamespace(**c), dtype=dtype, param_dtype=dtype)
    model = tmodel.Qwen3(tcfg, rngs=nnx.Rngs(1))

    sampler = Sampler(model, IdTokenizer(c["vocab_size"]), CacheConfig(
        cache_size=args.prompt + args.new, num_layers=c["num_hidden_layers"],
        num_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"]))
    prompts = np.random.default_rng(0).integers(1, c["vocab_size"], (args.decode_batch, args.prompt))
    text = [" ".join(map(str, p)) for p in prompts]

    def decode():
        out = sampler(text, max_generation_steps=args.new, max_prompt_length=args.prompt,
                      temperature=1.0, top_p=1.0, top_k=TOP_K, seed=0, return_logprobs=True)
        assert all(len(t) == args.new for t in out.tokens)

    return {"engine": "tunix", "device": jax.devices()[0].device_kind,
            "decode_s": timed(decode, warmup=1, repeats=args.repeats)}


def finish(r: dict, c: dict, args) -> dict:
    """Add tokens/s, MFU and decode HBM-bandwidth utilisation to one engine's raw timings."""
    kind = r.get("device", "")
    if "decode_s" in r:
        r["decode_tokens_per_s"] = args.decode_batch * args.new / r["decode_s"]
        hbm = args.peak_hbm_tbs * 1e12 if args.peak_hbm_tbs else next(
            (v for k, v in PEAK_HBM.items() if k in kind), None)
        step_bytes = decode_bytes_per_step(c, args.decode_batch, args.prompt, args.new)
        r["decode_bytes_per_step"] = step_bytes
        r["decode_hbm_tb_per_s"] = step_bytes * args.new / r["decode_s"] / 1e12
        r["decode_hbm_util"] = None if hbm is None else r["decode_hbm_tb_per_s"] * 1e12 / hbm
    if "train_step_s" not in r:
        return r
    tokens = args.batch * args.seq
    r["train_tokens_per_s"] = tokens / r["train_step_s"]
    peak = args.peak_tflops * 1e12 if args.peak_tflops else next(
        (v for k, v in PEAK_BF16.items() if k in kind), None)
    r["model_tflops_per_s"] = model_flops_per_token(c, args.seq) * r["train_tokens_per_s"] / 1e12
    r["mfu"] = None if peak is None else r["model_tflops_per_s"] * 1e12 / peak
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--tiny", action="store_true", help="tiny model, xla attention (CPU dry run)")
    ap.add_argument("--engine", choices=["jscenegen", "torch", "tunix"],
                    help="run one engine in this process (default: both, each in a subprocess)")
    for name, full, tiny, what in (("batch", 8, 2, "train rows"),
                                   ("seq", 2048, 64, "train tokens per row"),
                                   ("decode-batch", 64, 2, "decoded rows"),
                                   ("prompt", 128, 16, "prompt tokens per decoded row"),
                                   ("new", 256, 8, "decoded tokens per row")):
        ap.add_argument(f"--{name}", type=positive_int_arg, help=f"{what} (default {full}; --tiny: {tiny})")
        ap.set_defaults(**{f"_{name}": (full, tiny)})
    ap.add_argument("--repeats", type=positive_int_arg, default=3)
    ap.add_argument("--remat", choices=["full", "minimal", "none"], default="full",
                    help="jscenegen's train-step rematerialisation (model.remat_policy)")
    ap.add_argument("--peak-tflops", type=positive_float, help="peak dense bf16 TFLOP/s of the device")
    ap.add_argument("--peak-hbm-tbs", type=positive_float, help="peak HBM bandwidth of the device, TB/s")
    ap.add_argument("--shape", choices=["1.7b", "4b"], default="1.7b", help="model shape")
    ap.add_argument("--engine-timeout", type=positive_float, default=None,
                    help="seconds one engine's process may run before it is recorded as timed out")
    args = ap.parse_args()
    for name in ("batch", "seq", "decode_batch", "prompt", "new"):
        if getattr(args, name) is None:
            full, tiny = getattr(args, "_" + name.replace("_", "-"))
            setattr(args, name, tiny if args.tiny else full)
    c = TINY if args.tiny else (QWEN3_4B if args.shape == "4b" else QWEN3_1_7B)
    if args.engine:
        run = {"jscenegen": run_jscenegen, "torch": run_torch, "tunix": run_tunix}[args.engine]
        print(json.dumps(finish(run(c, args), c, args)), flush=True)
        return
    results = {}
    for engine in ("jscenegen", "torch", "tunix"):
        try:
            proc = subprocess.run([sys.executable, __file__, "--engine", engine, *sys.argv[1:]],
                                  capture_output=True, text=True, timeout=args.engine_timeout)
        except subprocess.TimeoutExpired:
            results[engine] = {"engine": engine,
                               "error": f"timed out after {args.engine_timeout} s"}
            print(json.dumps(results[engine]), flush=True)
            continue
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        if proc.returncode or not lines:
            results[engine] = {"engine": engine, "error": proc.stderr.strip()[-2000:]}
        else:
            results[engine] = json.loads(lines[-1])
        print(json.dumps(results[engine]), flush=True)
    jx, th, tx = results["jscenegen"], results["torch"], results["tunix"]

    def ratio(a, b, key):
        return a[key] / b[key] if key in a and key in b else None

    print(json.dumps({
        "bench": "gpu", "tiny": args.tiny, "shape": "tiny" if args.tiny else args.shape,
        "params": param_count(c), "batch": args.batch, "seq": args.seq,
        "decode_batch": args.decode_batch, "prompt": args.prompt, "new": args.new,
        "jscenegen_mfu": jx.get("mfu"), "torch_mfu": th.get("mfu"),
        "jscenegen_decode_tokens_per_s": jx.get("decode_tokens_per_s"),
        "torch_decode_tokens_per_s": th.get("decode_tokens_per_s"),
        "tunix_decode_tokens_per_s": tx.get("decode_tokens_per_s"),
        "jscenegen_decode_hbm_util": jx.get("decode_hbm_util"),
        "torch_decode_hbm_util": th.get("decode_hbm_util"),
        "tunix_decode_hbm_util": tx.get("decode_hbm_util"),
        "decode_ratio": ratio(jx, th, "decode_tokens_per_s"),
        "decode_vs_tunix": ratio(jx, tx, "decode_tokens_per_s"),
        "ratio": ratio(jx, th, "train_tokens_per_s"),
    }))


if __name__ == "__main__":
    main()
