"""Episode reward and outcome (scene-protocol.md section 5; seed.md "outcome reward").

R = mean(grades) / 10 - unit_penalty * min(units, unit_norm) / unit_norm; a policy failure gets
`failure_reward` (-1); a judge or infrastructure failure is masked (reward 0.0, never NaN, never
-1) so GRPO leaves it out of the group statistics and the loss.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .config import GRADE_MAX, GRADE_MIN, RewardConfig

# policy failures (reward -1, trained on)
POLICY_FAILURES = (
    "no_action_block",
    "multiple_action_blocks",
    "truncated_action",
    "text_after_action",
    "bad_json",
    "unknown_action",
    "unknown_op",
    "schema_violation",
    "role_violation",
    "planner_turn_cap",
    "episode_token_cap",
    "truncated_generation",
    "invalid_terminal_scene",
)
# not the policy's fault (masked out of the loss, logged)
JUDGE_FAILURES = ("judge_timeout", "judge_unparseable", "judge_error")
RUNTIME_FAILURES = ("runtime_error", "rollout_error")   # our scene runtime or sampler failed
# the episode's prompt alone (system prompt, room, request) reaches sampling.max_episode_tokens:
# the policy never acted; a setting of the run, not a fault a streak of updates should stop on
SETUP_FAILURES = ("prompt_over_cap",)
MASKED_FAILURES = JUDGE_FAILURES + RUNTIME_FAILURES + SETUP_FAILURES


@dataclass(frozen=True)
class Outcome:
    """Result of one episode. `masked` samples carry reward 0.0 and must not enter advantages."""

    reward: float
    quality: float | None
    unit_penalty: float
    units: int
    grades: dict[str, int] | None
    failure_cause: str | None
    masked: bool
    metrics: dict | None = None
    judge_info: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def unit_penalty(units: int, cfg: RewardConfig) -> float:
    """unit_penalty * min(units, unit_norm) / unit_norm (0 .. 0.8 with defaults)."""
    return cfg.unit_penalty * min(max(units, 0), cfg.unit_norm) / cfg.unit_norm


def reward_from_grades(grades: dict[str, int], units: int, cfg: RewardConfig) -> tuple[float, float, float]:
    """(reward, quality = mean(grades) / 10, unit penalty). Raises ValueError on empty/non-finite grades."""
    if not grades:
        raise ValueError("no grades to average")
    vals = [float(v) for v in grades.values()]
    if not all(math.isfinite(v) for v in vals):
        raise ValueError(f"non-finite grade in {grades}")
    quality = (sum(vals) / len(vals) - GRADE_MIN) / (GRADE_MAX - GRADE_MIN)
    pen = unit_penalty(units, cfg)
    return quality - pen, quality, pen


def judged_outcome(grades, units: int, cfg: RewardConfig, metrics=None, judge_info=None) -> Outcome:
    """Outcome of a finished episode the judge graded."""
    r, q, pen = reward_from_grades(grades, units, cfg)
    return Outcome(r, q, pen, units, dict(grades), None, False, metrics, judge_info or {})


def failed_outcome(cause: str, units: int, cfg: RewardConfig, metrics=None, judge_info=None) -> Outcome:
    """Outcome of a failure: policy failures get cfg.failure_reward, masked failures 0.0 and masked=True.

    Raises ValueError for a cause in neither list.
    """
    if cause in POLICY_FAILURES:
        return Outcome(cfg.failure_reward, None, 0.0, units, None, cause, False, metrics, judge_info or {})
    if cause in MASKED_FAILURES:
        return Outcome(0.0, None, 0.0, units, None, cause, True, metrics, judge_info or {})
    raise ValueError(f"unknown failure cause {cause!r}; known: {POLICY_FAILURES + MASKED_FAILURES}")
