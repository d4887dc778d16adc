"""Logits parity against transformers' torch Qwen model on the same random, left-padded batch.

The torch side is the real thing on CPU with eager attention: `AutoModelForCausalLM` for
Qwen2/Qwen3 and `qwen3_5_text` (Qwen3_5ForCausalLM), and `Qwen3_5ForConditionalGeneration`
(the class a `qwen3_5` directory declares) for `qwen3_5`, fed text only. It is given the same
position ids jscenegen derives from the mask (cumsum - 1), as transformers' `generate` does
for left padding (its plain forward would use `arange`; docs/qwen35.md section 2.3). Only
real (unpadded) tokens are compared.
"""
from __future__ import annotations

import numpy as np

TOLERANCE_FP32_MAX_ABS = 1e-4
TOLERANCE_BF16_MEAN_KL = 1e-3
BF16_KL_TO_FP32_VS_TORCH = 2.0   # jscenegen's bf16 error may be at most twice torch's own


def bf16_within_tolerance(mean_kl: float, kl_to_fp32: dict[str, float]) -> bool:
    """bf16 parity: KL(torch bf16 || jscenegen bf16) <= 1e-3, or, where bf16 rounding alone
    moves logits further (large weights: torch's own bf16 logits then differ from its fp32 ones
    by more than 1e-3 too), jscenegen's bf16 KL to torch's fp32 logits at most
    BF16_KL_TO_FP32_VS_TORCH times torch bf16's. `kl_to_fp32`: {"jscenegen": .., "torch": ..}."""
    return mean_kl <= TOLERANCE_BF16_MEAN_KL or (
        kl_to_fp32["jscenegen"] <= BF16_KL_TO_FP32_VS_TORCH * kl_to_fp32["torch"])


def random_padded_batch(vocab: int, batch: int, seq: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids [B, S] int32, attention_mask [B, S] int32): every odd row left-padded by S/4."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(batch, seq), dtype=np.int64).astype(np.int32)
    mask = np.ones((batch, seq), np.int32)
    for b in range(1, batch, 2):
        mask[b, : seq // 4] = 0
    ids[mask == 0] = 0
    return ids, mask


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = log_softmax(p_logits.astype(np.float64)), log_softmax(q_logits.astype(np.float64))
    return (np.exp(lp) * (lp - lq)).sum(-1)


def torch_model(model_dir: str, model_type: str, dtype: str):
    """transformers' torch model of an HF directory in `dtype`, eager attention, eval mode:
    Qwen3_5ForConditionalGeneration for qwen3_5, else AutoModelForCausalLM. Turns off
    transformers' progress bars for the process (the command's stderr is its errors)."""
    import torch
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM
    if model_type == "qwen3_5":
        from transformers import Qwen3_5ForConditionalGeneration as cls
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()   # its "Loading weights" bar on stderr
    torch_dtype = getattr(torch, dtype)  # torch spells dtypes as jscenegen.model.dtypes does
    return cls.from_pretrained(model_dir, dtype=torch_dtype, attn_implementation="eager").eval()


def logits_parity(model_dir: str, *, batch: int = 2, seq: int = 64, dtype: str = "float32",
                  seed: int = 0) -> dict:
    """Compare jscenegen and transformers logits; returns max_abs_diff, mean_kl, top1_agreement
    (None when a logit is not finite), finite_logits, constant_positions (real positions whose
    torch logits are the same for every token: nothing compared there), ok.

    `ok` applies the tolerances: fp32 max |diff| <= 1e-4; bf16 `bf16_within_tolerance`, with
    `kl_to_fp32` (each side's bf16 mean KL to torch's fp32 logits) in the result; and no
    constant position.
    Raises ImportError without torch, and the loaders' errors for a bad directory.
    """
    import jax
    import torch
    from flax import nnx

    from jscenegen.model.hf_io import load_hf

    model = load_hf(model_dir, param_dtype=dtype, compute_dtype=dtype)  # refuses a bad dir first
    ids, mask = random_padded_batch(model.cfg.vocab_size, batch, seq, seed)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)

    def torch_logits(torch_dtype: str) -> np.ndarray:
        ref = torch_model(model_dir, model.cfg.model_type, torch_dtype)
        with torch.no_grad():
            out = ref(input_ids=torch.from_numpy(ids.astype(np.int64)),
                      attention_mask=torch.from_numpy(mask.astype(np.int64)),
                      position_ids=torch.from_numpy(positions.astype(np.int64))).logits
        return out.float().numpy()

    ref_logits = torch_logits(dtype)
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda st, i, m: nnx.merge(graphdef, st)(i, m))
    ours = np.asarray(forward(state, ids, mask), np.float32)
    real = mask.astype(bool)
    ours_real, ref_real = ours[real], ref_logits[real]   # [positions, vocab]
    diff = np.abs(ours_real - ref_real)
    kl = _kl(ref_real, ours_real)
    finite = bool(np.isfinite(ours_real).all() and np.isfinite(ref_real).all())
    # a position whose torch logits are one value for every token compares nothing (a model
    # whose norm overflows gives 0 everywhere: equal to ours, a perfect score)
    constant = int((ref_real.max(-1) == ref_real.min(-1)).sum())
    result = {
        "max_abs_diff": float(diff.max()),
        "mean_kl": float(kl.mean()),
        # the argmax of a NaN row is no prediction
        "top1_agreement": float((ours.argmax(-1) == ref_logits.argmax(-1))[real].mean())
        if finite else None,
        "finite_logits": finite, "constant_positions": constant,
        "dtype": dtype, "batch": batch, "seq": seq, "model_type": model.cfg.model_type,
    }
    if dtype == "float32":
        result["ok"] = result["max_abs_diff"] <= TOLERANCE_FP32_MAX_ABS
    else:
        truth = torch_logits("float32")[real]
        result["kl_to_fp32"] = {"jscenegen": float(_kl(truth, ours_real).mean()),
                                "torch": float(_kl(truth, ref_real).mean())}
        result["ok"] = finite and bf16_within_tolerance(result["mean_kl"], result["kl_to_fp32"])
    result["ok"] = bool(result["ok"] and constant == 0)
    return result
