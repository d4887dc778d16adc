"""Pieces the benchmarks share: a synthetic GRPO batch, timers, interleaved rounds, machine load."""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import numpy as np

from jscenegen.commands import int_in, positive_int_arg  # noqa: F401  (the benches' int flags)


def positive_float(text: str) -> float:
    """argparse type of a finite number > 0 (argparse names the flag)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    return value


def description(doc: str) -> str:
    """A bench's --help description: its docstring's first paragraph as one line."""
    return " ".join(doc.split("\n\n")[0].split())


def grpo_batch(vocab: int, batch: int, seq: int, trained_from: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tokens [batch, seq], full attention, tokens from `trained_from` on trained with a
    +-1 advantage (alternating rows), old log-probs near a random model's (log 1/V) so the
    ratio stays inside the clip range; every row an episode (episode_mask [batch] 1)."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((batch, seq), np.float32)
    mask[:, trained_from:] = 1.0
    adv = np.where(np.arange(batch) % 2 == 0, 1.0, -1.0).astype(np.float32)[:, None] * mask
    return {"input_ids": rng.integers(0, vocab, (batch, seq)).astype(np.int32),
            "attention_mask": np.ones((batch, seq), np.int32), "loss_mask": mask,
            "advantages": adv, "episode_mask": np.ones(batch, np.float32),
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


def rounds(engines: dict[str, Callable[[int], None]], n_rounds: int, warmup: int = 1) -> dict:
    """Time every engine once per round, engines interleaved (a load spike on a shared machine
    then hits all of them alike). engines: {name: fn(round_index)}. Returns {name: {"wall_s":
    [per round], "cpu_s": [per round]}}; cpu_s is this process's CPU time (all threads), which
    other jobs on the machine barely change for JAX engines (torch's OpenMP threads spin while
    they wait for a core: its CPU time grows on a loaded machine)."""
    for fn in engines.values():
        for w in range(warmup):
            fn(-1 - w)
    out = {name: {"wall_s": [], "cpu_s": []} for name in engines}
    for r in range(n_rounds):
        for name, fn in engines.items():
            c0, t0 = time.process_time(), time.perf_counter()
            fn(r)
            out[name]["wall_s"].append(time.perf_counter() - t0)
            out[name]["cpu_s"].append(time.process_time() - c0)
    return out


def median(xs) -> float:
    return float(statistics.median(xs))


def load_average() -> list[float]:
    """The machine's 1/5/15-minute load averages (how busy the shared machine was)."""
    return [round(x, 2) for x in os.getloadavg()]


def tunix_qwen3_config(c, **extra):
    """Tunix 0.1.7's `tunix.models.qwen3.model.ModelConfig` for a Qwen3 shape `c` (anything
    with QwenConfig's attribute names; extra: e.g. dtype, param_dtype)."""
    from tunix.models.qwen3 import model as tmodel

    return tmodel.ModelConfig(
        num_layers=c.num_hidden_layers, vocab_size=c.vocab_size, embed_dim=c.hidden_size,
        hidden_dim=c.intermediate_size, num_heads=c.num_attention_heads,
        head_dim=c.head_dim, num_kv_heads=c.num_key_value_heads,
        rope_theta=int(c.rope_theta), norm_eps=c.rms_norm_eps,
        use_tied_embedding=c.tie_word_embeddings, **extra)


class IdTokenizer:
    """Token ids as space-separated text, for Tunix's string-in sampler: pad and bos 0 (no bos
    is added, padding is masked), eos beyond the vocabulary (never sampled)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, s, **kw):
        return [int(x) for x in s.split()]

    def decode(self, ids, **kw):
        return " ".join(map(str, ids))

    def bos_id(self):
        return 0

    def pad_id(self):
        return 0

    def eos_id(self):
        return self.vocab_size + 7


def versus(name: str, ours: dict, other: dict | None) -> dict:
    """JSON fields comparing `ours` with engine `name` (each {"tokens_per_s",
    "tokens_per_cpu_s"}): its tokens/s, `vs_<name>` (wall) and `cpu_vs_<name>` (CPU time);
    {name: "not installed"} when `other` is None."""
    if other is None:
        return {name: "not installed"}
    return {f"{name}_tokens_per_s": other["tokens_per_s"],
            f"vs_{name}": ours["tokens_per_s"] / other["tokens_per_s"],
            f"cpu_vs_{name}": ours["tokens_per_cpu_s"] / other["tokens_per_cpu_s"]}
