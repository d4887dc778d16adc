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


COMPARE_ROWS = 256   # positions compared at a time: the float64 temporaries stay small


def _compare(ours: np.ndarray, ref: np.ndarray, rows: np.ndarray) -> dict:
    """Statistics of `ours` against `ref` ([positions, vocab] float32) over the positions
    `rows`, COMPARE_ROWS at a time: max |diff|, the sum of KL(ref || ours), finite (both),
    top-1 agreements, and constant positions (torch logits one value for every token: nothing
    compared there; a model whose norm overflows gives 0 everywhere, equal to ours)."""
    out = {"max_abs_diff": 0.0, "kl_sum": 0.0, "finite": True, "top1": 0, "constant": 0}
    for start in range(0, len(rows), COMPARE_ROWS):
        at = rows[start:start + COMPARE_ROWS]
        a, b = ours[at], ref[at]
        out["max_abs_diff"] = float(np.max([out["max_abs_diff"], np.abs(a - b).max()]))  # NaN stays
        out["kl_sum"] += float(_kl(b, a).sum())
        out["finite"] = out["finite"] and bool(np.isfinite(a).all() and np.isfinite(b).all())
        out["top1"] += int((a.argmax(-1) == b.argmax(-1)).sum())
        out["constant"] += int((b.max(-1) == b.min(-1)).sum())
    return out


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
    torch logits are the same for every token: nothing compared there), constant_tensors (the
    model's tensors that hold one value: `parity.coverage`), ok.

    `ok` applies the tolerances: fp32 max |diff| <= 1e-4; bf16 `bf16_within_tolerance`, with
    `kl_to_fp32` (each side's bf16 mean KL to torch's fp32 logits) in the result; and no
    constant position.
    Raises ImportError without torch, and the loaders' errors for a bad directory.
    """
    import jax
    import torch
    from flax import nnx

    from jscenegen.model.hf_io import load_hf
    from jscenegen.model.weights import constant_tensors, named_weights

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
    real = np.flatnonzero(mask.reshape(-1))   # the real positions, rows of [B * T, vocab]
    ours, ref_logits = ours.reshape(-1, ours.shape[-1]), ref_logits.reshape(-1, ours.shape[-1])
    stats = _compare(ours, ref_logits, real)
    finite = stats["finite"]
    result = {
        "max_abs_diff": stats["max_abs_diff"],
        "mean_kl": stats["kl_sum"] / len(real),
        "top1_agreement": stats["top1"] / len(real) if finite else None,  # NaN rows predict nothing
        "finite_logits": finite, "constant_positions": stats["constant"],
        "dtype": dtype, "batch": batch, "seq": seq, "model_type": model.cfg.model_type,
        "constant_tensors": constant_tensors((n, np.asarray(v.get_value(), np.float32))
                                             for n, v in named_weights(model).items()),
    }
    if dtype == "float32":
        result["ok"] = result["max_abs_diff"] <= TOLERANCE_FP32_MAX_ABS
    else:
        del stats
        truth = torch_logits("float32").reshape(-1, ours.shape[-1])
        result["kl_to_fp32"] = {"jscenegen": _compare(truth, ours, real)["kl_sum"] / len(real),
                                "torch": _compare(truth, ref_logits, real)["kl_sum"] / len(real)}
        result["ok"] = finite and bf16_within_tolerance(result["mean_kl"], result["kl_to_fp32"])
    result["ok"] = bool(result["ok"] and result["constant_positions"] == 0)
    return result
