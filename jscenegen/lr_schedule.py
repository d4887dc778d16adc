"""VERL's LR multiplier as torch's LambdaLR computes it: Python floats (double precision).

`jscenegen.grpo.algo.optimizer.lr_multiplier` is the same formula in float32 for the jitted
train step; this one is what a torch run holds (the `lr` / `_last_lr` a checkpoint converted to
VERL resumes at, which torch's `LambdaLR.load_state_dict` does not recompute). The torch
reference of the tests and parity checks does not use it: it takes transformers' schedulers
(`parity.torch_reference.make_torch_optimizer`), and tests/test_grpo_optimizer.py holds both
formulas to them.
"""
from __future__ import annotations

import math
from typing import Any


def lr_lambda(cfg: Any, step: int) -> float:
    """VERL's LambdaLR multiplier at scheduler count `step` (`last_epoch`), a Python float.

    `cfg`: an optim config's schedule fields (`lr_schedule` "constant" | "cosine",
    `warmup_steps`, `total_steps`, `min_lr_ratio`, `num_cycles`; as attributes). Warmup:
    step / max(1, warmup_steps); then constant: 1, cosine: max(m, x (1 - m)/2 + (1 + m)/2),
    x = cos(2 pi num_cycles p), p = (step - warmup) / max(1, total - warmup)
    (verl/utils/torch_functional.py: get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup).
    """
    if step < cfg.warmup_steps:
        return float(step) / float(max(1, cfg.warmup_steps))
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = float(step - cfg.warmup_steps) / float(max(1, cfg.total_steps - cfg.warmup_steps))
    x = math.cos(math.pi * float(cfg.num_cycles) * 2.0 * progress)
    lo = cfg.min_lr_ratio
    return max(lo, x * (1 - lo) * 0.5 + (1 + lo) * 0.5)
