"""Numbers against the torch baseline (logits, one GRPO step, N updates)."""

ROW_TOKENS_MAX = 1 << 16   # tokens of one parity row (--seq, one recorded trajectory)
FLOAT32_MAX = 3.4028234663852886e38   # numpy.finfo(numpy.float32).max: what both engines read


def torch_memory_floor(cfg, rows: int, seq: int, backward: bool) -> int:
    """A lower bound, in bytes, of what the torch baseline holds at once for `rows` x `seq`
    tokens (one micro-batch) of the model `cfg` (a `QwenConfig`). transformers'
    `eager_attention_forward` materialises fp32 [rows, heads, seq, seq] weights per
    full-attention layer (Gated DeltaNet layers hold no seq^2 array) and the head fp32 [rows,
    seq, vocab] logits. Forward only (`no_grad`): one layer's scores and their softmax, or the
    logits, at a time. With `backward`: the logits and every such layer's weights, kept for the
    gradient."""
    from jscenegen.model.config import FULL_ATTENTION

    logits = 4 * rows * seq * cfg.vocab_size
    weights = 4 * rows * cfg.num_attention_heads * seq * seq   # one layer's
    if not backward:
        return max(logits, 2 * weights)
    return logits + weights * sum(kind == FULL_ATTENTION for kind in cfg.kinds)
