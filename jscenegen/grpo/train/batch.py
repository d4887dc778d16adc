"""From one group of finished episodes to the padded [B, T] arrays of a GRPO update.

Every array is aligned with the token sequence (entry t concerns token t). Rows are the G
episodes, padded with all-zero rows to a multiple of the mesh's `fsdp` axis; columns are padded
to a multiple of `col_multiple` (fewer recompilations; the `sp` axis must divide it). Padding
has attention_mask 0 and loss_mask 0, so it counts in no normaliser.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jscenegen.grpo.algo.advantages import grpo_outcome_advantages
from jscenegen.grpo.algo.roles import role_loss_mask
from jscenegen.grpo.rollout.engine import Trajectory, trajectory_batch

TRAIN_KEYS = ("input_ids", "attention_mask", "loss_mask", "advantages", "rollout_logp")


@dataclasses.dataclass
class GroupBatch:
    """Host arrays of one update and what the trainer logs about them.

    arrays: input_ids int32, attention_mask int32, loss_mask float32, advantages float32
    (A_b * loss_mask), rollout_logp float32, all [rows, T]; episode_advantages [G] float32;
    has_signal: some trained token has a non-zero advantage (specs/grpo.md "effective update").
    """

    arrays: dict[str, np.ndarray]
    episode_advantages: np.ndarray
    has_signal: bool
    trained_tokens: int


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_group_batch(trajectories: Sequence[Trajectory], selected_role: int, *,
                      row_multiple: int, col_multiple: int, eps: float = 1e-6,
                      norm_by_std: bool = True) -> GroupBatch:
    """Assemble the update of one group (all `trajectories` share one scene and group id).

    Masked episodes (judge or infrastructure failures) and non-finite rewards get advantage 0
    and stay out of the group statistics; policy failures (-1) are ordinary members.
    """
    g = len(trajectories)
    t = round_up(max(tr.num_tokens for tr in trajectories), col_multiple)
    arr = trajectory_batch(trajectories, length=t, rows=round_up(g, row_multiple))
    mask = np.asarray(role_loss_mask(arr["roles"], arr["policy_mask"], selected_role), np.float32)
    scores = arr["reward"][:g]
    valid = ~arr["masked"][:g] & np.isfinite(scores)
    adv = np.asarray(grpo_outcome_advantages(np.where(valid, scores, 0.0), np.zeros(g, np.int32),
                                             valid, eps=eps, norm_by_std=norm_by_std, group_size=g),
                     np.float32)
    rows_adv = np.zeros(arr["input_ids"].shape[0], np.float32)
    rows_adv[:g] = adv
    advantages = rows_adv[:, None] * mask
    return GroupBatch(
        arrays={"input_ids": arr["input_ids"], "attention_mask": arr["attention_mask"],
                "loss_mask": mask, "advantages": advantages, "rollout_logp": arr["rollout_logp"]},
        episode_advantages=adv,
        has_signal=bool(np.any(advantages != 0)),
        trained_tokens=int(mask.sum()),
    )
