"""Pieces the benchmarks share: a synthetic GRPO batch, timers, interleaved rounds in a
carry-over balanced order, paired per-round ratios, the sitting's record (commit, host, load, time) and
the project's atomic JSON write (`jscenegen.paths.write_json`)."""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable

import numpy as np

from jscenegen.commands import int_in, positive_int_arg  # noqa: F401  (the benches' int flags)
from jscenegen.paths import write_json  # noqa: F401  (the benches' --json-out: the project's atomic writer)


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


def round_order(names, r: int) -> list:
    """The engines in the order round r runs them: a Williams design, balanced for carry-over
    (what the engine run just before leaves behind: torch's OpenMP threads that may still
    spin, a warm or a flushed cache). Row i of the square is the sequence 0, 1, n-1, 2, n-2,
    ... shifted by i (mod n). For an even number n of engines, round r runs row r mod n: over
    any n consecutive rounds each engine runs at each place once and right after each other
    engine exactly once. For an odd n a square cannot balance that, so round r runs row r//2
    (mod n), mirrored in the odd rounds: over any 2n consecutive rounds (from round 0) each
    engine runs at each place twice and right after each other engine exactly twice; over
    any even number of rounds from round 0, a runs right after b as often as b right after a.
    Fewer rounds (the benches' default 5 with 5 engines: half of 10) are balanced only
    that far (`balanced_rounds`)."""
    names = list(names)
    n = len(names)
    if n % 2 == 0:
        row, mirrored = r % n, False
    else:
        row, mirrored = (r // 2) % n, r % 2 == 1
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        if len(first) % 2:
            first.append(low)
            low += 1
        else:
            first.append(high)
            high -= 1
    order = [names[(k + row) % n] for k in first]
    return order[::-1] if mirrored else order


def balanced_rounds(n: int) -> int:
    """The rounds `round_order` needs for n engines to follow each other equally often: n for
    an even n, 2n for an odd one (1 for one engine)."""
    return n if n % 2 == 0 or n == 1 else 2 * n


def round_orders(names, n_rounds: int) -> list[list]:
    """The engine order of each of rounds 0 .. n_rounds - 1 (`round_order`), as `rounds` runs
    them: what a sitting's JSON records (`round_orders`) so that a reader can check the
    balance."""
    return [round_order(names, r) for r in range(n_rounds)]


def rounds(engines: dict[str, Callable[[int], None]], n_rounds: int, warmup: int = 1) -> dict:
    """Time every engine once per round, engines interleaved (a load spike on a shared machine
    then hits all of them alike) in a carry-over balanced order (`round_order`, a Williams
    design: over `balanced_rounds(len(engines))` rounds every engine runs right after every
    other equally often, so none always runs right after the same other one, e.g. after
    torch's OpenMP threads that may still spin; with fewer rounds the balance is partial).
    engines: {name: fn(round_index)}. Returns {name: {"wall_s": [per round],
    "cpu_s": [per round]}} (index r: round r); cpu_s is this process's CPU time (all
    threads), which other jobs on the machine barely change for JAX engines (torch's OpenMP
    threads spin while they wait for a core: its CPU time grows on a loaded machine)."""
    for fn in engines.values():
        for w in range(warmup):
            fn(-1 - w)
    out = {name: {"wall_s": [], "cpu_s": []} for name in engines}
    for r, order in enumerate(round_orders(engines, n_rounds)):
        for name in order:
            c0, t0 = time.process_time(), time.perf_counter()
            engines[name](r)
            out[name]["wall_s"].append(time.perf_counter() - t0)
            out[name]["cpu_s"].append(time.process_time() - c0)
    return out


def paired(key: str, ours: dict, other: dict | None, *, cpu: bool = True) -> dict:
    """JSON fields of the rate of `ours` over `other` (each `rounds()`' {"wall_s", "cpu_s"}
    of one engine, the same tokens per call): `key` the median of the per-round ratios
    other_wall[r] / ours_wall[r] (the two timed in the same round, a minute's drift of the
    host cancels), `key_min` and `key_max` their range, `key_rounds` all of them,
    `key_of_medians` the ratio of the two medians (the old headline), and `cpu_key` the
    median per-round ratio of CPU seconds. {key: "not installed"} when `other` is None."""
    if other is None:
        return {key: "not installed"}
    per = [o / u for u, o in zip(ours["wall_s"], other["wall_s"])]
    out = {key: median(per), f"{key}_min": min(per), f"{key}_max": max(per),
           f"{key}_rounds": [round(x, 4) for x in per],
           f"{key}_of_medians": median(other["wall_s"]) / median(ours["wall_s"])}
    if cpu:
        out[f"cpu_{key}"] = median([o / u for u, o in zip(ours["cpu_s"], other["cpu_s"])])
    return out


def median(xs) -> float:
    return float(statistics.median(xs))


def load_average() -> list[float]:
    """The machine's 1/5/15-minute load averages (how busy the shared machine was)."""
    return [round(x, 2) for x in os.getloadavg()]


def _utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def cpu_model() -> str:
    """The host CPU's model name (/proc/cpuinfo, else lscpu, else platform)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine() or "unknown"


# read by glibc, the dynamic loader and XLA when the process starts: each moves CPU timings
# (GLIBC_TUNABLES=glibc.malloc.hugetlb=1 took 28% off every JAX train step on the AMD EPYC host)
TIMING_ENVIRONMENT = ("GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_",
                      "MALLOC_TRIM_THRESHOLD_", "XLA_FLAGS", "OMP_NUM_THREADS")


def sitting_start() -> dict:
    """What a sitting's JSON records before the timing: the code's commit (short hash;
    `dirty` when tracked files differ from it, untracked ones not counted), the host's CPU
    model, its cores (`cpu_count`, and `cores_usable` to this process), the UTC start, the
    load average before, and `environment`: the variables of TIMING_ENVIRONMENT that are set
    (allocator, loader and XLA settings; {} when none)."""
    commit = _git("rev-parse", "--short", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {"commit": commit or "unknown", "dirty": None if status is None else bool(status),
            "cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "cores_usable": usable,
            "utc_start": _utc(), "load_before": load_average(),
            "environment": {k: os.environ[k] for k in TIMING_ENVIRONMENT if k in os.environ}}


def sitting_end(record: dict) -> dict:
    """`record` with the UTC end and the load average after added."""
    return {**record, "utc_end": _utc(), "load_after": load_average()}


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
