"""Pieces the benchmarks share: a synthetic GRPO batch and a median timer."""
from __future__ import annotations

import statistics
import time

import numpy as np


def grpo_batch(vocab: int, batch: int, seq: int, trained_from: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tokens [batch, seq], full attention, tokens from `trained_from` on trained with a
    +-1 advantage (alternating rows), old log-probs near a random model's (log 1/V) so the
    ratio stays inside the clip range."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((batch, seq), np.float32)
    mask[:, trained_from:] = 1.0
    adv = np.where(np.arange(batch) % 2 == 0, 1.0, -1.0).astype(np.float32)[:, None] * mask
    return {"input_ids": rng.integers(0, vocab, (batch, seq)).astype(np.int32),
            "attention_mask": np.ones((batch, seq), np.int32), "loss_mask": mask,
            "advantages": adv,
            "old_logp": (mask * (-np.log(vocab) + rng.normal(0, 0.05, (batch, seq)))).astype(np.float32)}


def timed(fn, warmup: int, repeats: int) -> float:
    """Median wall seconds of `fn()` over `repeats` runs after `warmup` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
