"""Rollout statistics (scene-protocol.md section 8): one function over episode outcomes, used by
the trainer's per-update log (`group_metrics`) and the dev-scene evaluation (`summarize`).

Masked episodes (judge or infrastructure failures) are excluded from reward statistics and
counted separately; policy failures (-1) are included.
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

if TYPE_CHECKING:
    from jscenegen.grpo.rollout.engine import Trajectory


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def _zero_spread(rewards: Sequence[float]) -> bool:
    """Fewer than two rewards, or all equal: GRPO's advantages are all 0."""
    return len(rewards) < 2 or float(np.ptp(rewards)) == 0.0


def zero_spread_share(groups: Iterable[Sequence[float]]) -> float | None:
    """The share of groups (each its unmasked rewards) whose rewards have no spread (fewer
    than two, or all equal: GRPO's advantages all 0); None without groups."""
    return _mean(float(_zero_spread(g)) for g in groups)


def summarize(outcomes: Sequence[dict], grade_keys: Sequence[str]) -> dict:
    """Statistics of episode outcomes (`scene.reward.Outcome.to_json()` dicts).

    Returns {"episodes", "masked", "reward" (mean over unmasked episodes, -1 failures
    included), "reward_std", "zero_spread" (fewer than two unmasked rewards, or all equal),
    "quality" and "unit_penalty" (means over judged episodes, the two parts of their reward:
    reward = quality - unit_penalty for each), "grades" {key: mean over judged episodes},
    "units" (mean over unmasked episodes, failures included), "failure_rate" (unmasked episodes
    with a failure cause / all unmasked), "failure_causes" {cause: count, masked causes
    included}, "reachable", "collision", "out_of_bounds" (shares of the episodes with measured
    terminal metrics whose scene is fully reachable / has a colliding pair / an object out of
    the room; None without any), "judge_latency_s" (mean over every episode whose judge call
    reports one, failed calls included: a judge that times out is slow; None for the rule
    judge, which reports none)}.
    """
    valid = [o for o in outcomes if not o["masked"]]
    judged = [o for o in valid if o.get("grades")]
    rewards = [o["reward"] for o in valid]
    measured = [o["metrics"] for o in outcomes if o.get("metrics")]
    return {
        "episodes": len(outcomes),
        "masked": len(outcomes) - len(valid),
        "reward": _mean(rewards),
        "reward_std": float(np.std(rewards, ddof=1)) if len(rewards) > 1 else None,
        "zero_spread": _zero_spread(rewards),
        "quality": _mean(o.get("quality") for o in judged),
        "unit_penalty": _mean(o.get("unit_penalty") for o in judged),
        "grades": {k: _mean(o["grades"].get(k) for o in judged) for k in grade_keys},
        "units": _mean(o["units"] for o in valid),
        "failure_rate": (sum(1 for o in valid if o["failure_cause"]) / len(valid)) if valid else None,
        "failure_causes": dict(sorted(Counter(o["failure_cause"] for o in outcomes
                                              if o["failure_cause"]).items())),
        "reachable": _mean(float(bool(m.get("reachable"))) for m in measured),
        "collision": _mean(float(bool(m.get("collision_pairs"))) for m in measured),
        "out_of_bounds": _mean(float(bool(m.get("oob_objects"))) for m in measured),
        "judge_latency_s": _mean((o.get("judge_info") or {}).get("latency_s") for o in outcomes),
    }


def group_metrics(trajectories: Sequence["Trajectory"], grade_keys: Sequence[str]) -> dict:
    """`summarize` of an update's outcomes (one or more groups) as the training log's flat
    keys: reward/mean, /std (over the whole batch), /quality, /unit_penalty, zero_std_group
    (the share of its groups whose rewards have no spread), failure_rate (None, as reward/mean,
    when every episode was masked: nothing was graded, which is not "no failures"), masked_rate,
    judge_failures, units/mean, tokens/mean, grades/<key>, failures/<cause> (share of all
    episodes), scene/reachable_rate, /collision_rate, /oob_rate (when any scene was measured)
    and judge/latency_s."""
    s = summarize([t.outcome for t in trajectories], grade_keys)
    groups: dict[int, list[float]] = {}
    for t in trajectories:   # a group's unmasked rewards, as summarize reads them
        rewards = groups.setdefault(t.group_id, [])
        if not t.outcome["masked"]:
            rewards.append(t.outcome["reward"])
    n = s["episodes"]
    causes = s["failure_causes"]
    out: dict = {
        "episodes": n,
        "reward/mean": s["reward"],
        "reward/std": s["reward_std"],
        "reward/quality": s["quality"],
        "reward/unit_penalty": s["unit_penalty"],
        "zero_std_group": zero_spread_share(groups.values()),
        "failure_rate": s["failure_rate"],   # None (null) when every episode was masked, as reward/mean
        "masked_rate": s["masked"] / max(n, 1),
        "judge_failures": float(sum(c for k, c in causes.items() if k.startswith("judge"))),
        "units/mean": s["units"],
        "tokens/mean": _mean(t.num_tokens for t in trajectories),
    }
    out.update({f"grades/{k}": v for k, v in s["grades"].items()})
    out.update({f"failures/{cause}": count / n for cause, count in causes.items()})
    if s["reachable"] is not None:
        out["scene/reachable_rate"] = s["reachable"]
        out["scene/collision_rate"] = s["collision"]
        out["scene/oob_rate"] = s["out_of_bounds"]
    out["judge/latency_s"] = s["judge_latency_s"]
    return out
