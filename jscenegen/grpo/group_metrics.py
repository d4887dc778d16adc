"""Per-update rollout metrics (scene-protocol.md section 8) from one group of trajectories."""
from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np

from jscenegen.grpo.rollout import Trajectory


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def group_metrics(trajectories: Sequence[Trajectory], grade_keys: Sequence[str]) -> dict:
    """Reward mean/std and its quality and unit-penalty parts, grade means, failure rate by
    cause, judge failures, units, reachable/collision/OOB rates, zero-std flag.

    Masked episodes (judge/infrastructure failures) are excluded from reward statistics and
    counted separately; policy failures (-1) are included.
    """
    n = len(trajectories)
    valid = [t for t in trajectories if not t.masked]
    rewards = np.array([t.reward for t in valid], np.float64)
    causes = Counter(t.failure_cause for t in trajectories if t.failure_cause)
    judged = [t for t in valid if t.grades]
    out: dict = {
        "episodes": n,
        "reward/mean": float(rewards.mean()) if len(rewards) else None,
        "reward/std": float(rewards.std(ddof=1)) if len(rewards) > 1 else None,
        "reward/quality": _mean(t.outcome.get("quality") for t in judged),
        "reward/unit_penalty": _mean(t.outcome.get("unit_penalty") for t in valid),
        "zero_std_group": float(len(rewards) < 2 or np.ptp(rewards) == 0),
        "failure_rate": float(sum(1 for t in valid if t.failure_cause) / max(len(valid), 1)),
        "masked_rate": float((n - len(valid)) / max(n, 1)),
        "judge_failures": float(sum(c for k, c in causes.items() if k.startswith("judge"))),
        "units/mean": _mean(t.units for t in valid),
        "tokens/mean": _mean(t.num_tokens for t in trajectories),
    }
    for key in grade_keys:
        out[f"grades/{key}"] = _mean(t.grades.get(key) for t in judged)
    for cause, count in sorted(causes.items()):
        out[f"failures/{cause}"] = count / n
    metrics = [t.metrics for t in judged if t.metrics]
    if metrics:
        out["scene/reachable_rate"] = _mean(float(bool(m.get("reachable"))) for m in metrics)
        out["scene/collision_rate"] = _mean(float(bool(m.get("collision_pairs"))) for m in metrics)
        out["scene/oob_rate"] = _mean(float(bool(m.get("oob_objects"))) for m in metrics)
    latency = [t.outcome.get("judge_info", {}).get("latency_s") for t in judged]
    out["judge/latency_s"] = _mean(latency)
    return out
