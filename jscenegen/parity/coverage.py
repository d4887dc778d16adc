"""What a parity run can see: the inputs under which an error would pass unnoticed.

A tensor whose elements are all one value (transformers' and `init-model`'s norms of ones,
zero biases) hides an error in the formula that reads it: a missing bias or norm weight
changes nothing. torch.optim.AdamW's decoupled decay multiplies each weight by 1 - lr x
weight_decay, a factor rounded to fp32 that is exactly 1 when lr x weight_decay <= 2^-25 (VERL's
lr 1e-6 with weight_decay 0.01): such a step cannot show an error in the decay. Parity results
name both, and the command warns.
"""
from __future__ import annotations

import numpy as np

__all__ = ["coverage_warnings", "weight_decay_visible"]

def weight_decay_visible(lr: float, weight_decay: float) -> bool:
    """Whether one AdamW step's decay can change an fp32 weight: whether the factor
    1 - lr x weight_decay (torch.optim.AdamW's decoupled form, `param.mul_(1 - lr * wd)`, the
    factor computed in double and applied in fp32) differs from 1 in fp32, that is
    lr x weight_decay > 2^-25."""
    return bool(np.float32(1.0 - lr * weight_decay) != np.float32(1.0))


def coverage_warnings(result: dict) -> list[str]:
    """The warnings a parity result's `constant_tensors` and `weight_decay_visible` call for
    (one line each; none when both are fine)."""
    out = []
    constant = result.get("constant_tensors") or []
    if constant:
        out.append(f"{len(constant)} tensor(s) hold one value each ({', '.join(constant[:3])}"
                   f"{', ...' if len(constant) > 3 else ''}): an error in a formula that reads "
                   "them would not show; compare weights that vary (jscenegen init-model "
                   "--randomise-constant)")
    if result.get("weight_decay_visible") is False:
        out.append("lr x weight_decay <= 2^-25: the decay changes no fp32 weight in one step, so "
                   "this run cannot see an error in it (--optim lr=1e-4 weight_decay=0.1 eps=1e-3 "
                   "makes it visible within the tolerances)")
    return out
