"""Numbers against the torch baseline (logits, one GRPO step, N updates)."""

ROW_TOKENS_MAX = 1 << 16   # tokens of one parity row (--seq, one recorded trajectory)
FLOAT32_MAX = 3.4028234663852886e38   # numpy.finfo(numpy.float32).max: what both engines read


def parity_peak_bytes(cfg, rows: int, seq: int, backward: bool) -> int:
    """An estimate, in bytes, of the peak a parity run holds for `rows` x `seq` tokens (one
    micro-batch) of the model `cfg` (a `QwenConfig`), both engines in one process: the
    seq^2 terms and the logits. W = one full-attention layer's fp32 [rows, heads, seq, seq]
    weights (transformers' `eager_attention_forward`; Gated DeltaNet layers hold no seq^2
    array), M = a [rows, seq, seq] fp32 mask, L = the fp32 [rows, seq, vocab] logits.
    Forward only (`logits`): 4 L + 3 W + 2 M (each side's logits, JAX's device copy, the
    bf16 run's fp32 truth; the comparison works `logits.COMPARE_ROWS` positions at a time; a layer's
    scores, scaled and masked scores and softmax; the mask on both sides). With `backward`:
    3 L + (3 n + 2) W + 2 M over the n full-attention layers (each layer's softmax kept for
    the gradient by torch and by JAX, its backward's products). The W and M terms calibrated on
    the micro Qwen3 (2 heads, 2 layers, vocabulary 1,373) by peak RSS, 2026-12-06: forward 490
    MB a 4,096-token row (estimate 558 MB); backward 323 MB a 2,048-token row (335 MB) and
    1,095 MB a 4,096-token row (1,273 MB). Model weights are not counted."""
    from jscenegen.model.config import FULL_ATTENTION

    logits = 4 * rows * seq * cfg.vocab_size
    mask = 4 * rows * seq * seq
    weights = mask * cfg.num_attention_heads   # one layer's
    if not backward:
        return 4 * logits + 3 * weights + 2 * mask
    layers = sum(kind == FULL_ATTENTION for kind in cfg.kinds)
    return 3 * logits + (3 * layers + 2) * weights + 2 * mask
