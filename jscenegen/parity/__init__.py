"""Numbers against the torch baseline (logits, one GRPO step, N updates)."""

ROW_TOKENS_MAX = 1 << 16   # tokens of one parity row (--seq, one recorded trajectory)


def torch_memory_floor(cfg, rows: int, seq: int, backward: bool) -> int:
    """A lower bound, in bytes, of what the torch baseline holds at once for a batch of `rows` x
    `seq` tokens of the model `cfg` (a `QwenConfig`): its fp32 [rows, seq, vocab] logits plus
    eager attention's fp32 [rows, heads, seq, seq] weights, of one full-attention layer in a
    forward pass, of every one (kept for the gradient) with `backward`. transformers'
    `eager_attention_forward` materialises them; Gated DeltaNet layers hold no seq^2 array."""
    from jscenegen.model.config import FULL_ATTENTION

    layers = sum(kind == FULL_ATTENTION for kind in cfg.kinds) if backward else 1
    scores = rows * cfg.num_attention_heads * seq * seq * layers
    return 4 * (rows * seq * cfg.vocab_size + scores)
