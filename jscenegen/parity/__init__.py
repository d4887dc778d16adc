"""Numbers against the torch baseline (logits, one GRPO step, N updates)."""

ROW_TOKENS_MAX = 1 << 16   # tokens of one parity row (--seq, one recorded trajectory)
