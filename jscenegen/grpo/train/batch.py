"""From the finished episodes of an update (one group, or `rollout.groups_per_batch` groups)
to the padded [B, T] arrays of a GRPO update.

Every array is aligned with the token sequence (entry t concerns token t). Rows are the
episodes (group by group), padded with all-zero rows to a multiple of the mesh's `fsdp` axis;
advantages are normalised within each group (its `group_id`); columns are padded
to a multiple of `col_multiple` (fewer recompilations; the `sp` axis must divide it). Padding
has attention_mask 0, loss_mask 0 and episode_mask 0, so it counts in no normaliser; an
episode masked for a judge or runtime failure has attention_mask and loss_mask 0 too but
episode_mask 1 (it is one of the mini-batch's episodes: the sequence modes' G counts it). Columns after every row's
last trained token are dropped (to that multiple): a causal model's loss never reads them, so
an update of a role that speaks early in its episodes computes the prefix only.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jscenegen.grpo.algo.advantages import grpo_outcome_advantages
from jscenegen.grpo.algo.roles import role_loss_mask
from jscenegen.grpo.rollout.engine import Trajectory, trajectory_batch
from jscenegen.sharding.rules import round_up

TRAIN_KEYS = ("input_ids", "attention_mask", "loss_mask", "advantages", "rollout_logp",
              "episode_mask")


@dataclasses.dataclass
class GroupBatch:
    """Host arrays of one update and what the trainer logs about them.

    arrays: input_ids int32, attention_mask int32, loss_mask float32, advantages float32
    (A_b * loss_mask), rollout_logp float32, all [rows, T], and episode_mask [rows] float32
    (1 on the N episodes' rows, masked ones included; 0 on padding rows);
    episode_advantages [N] float32;
    has_signal: some trained token has a non-zero advantage (../shared/specs/grpo.md "effective update").
    """

    arrays: dict[str, np.ndarray]
    episode_advantages: np.ndarray
    has_signal: bool
    trained_tokens: int


def build_group_batch(trajectories: Sequence[Trajectory], selected_role: int, *,
                      row_multiple: int, col_multiple: int, eps: float = 1e-6,
                      norm_by_std: bool = True, group_size: int | None = None,
                      trim: bool = True) -> GroupBatch:
    """Assemble the update of one or more groups (trajectories in group order; a group is the
    trajectories sharing a `group_id`, all of one size G).

    Masked episodes (judge or infrastructure failures) and non-finite rewards get advantage 0,
    stay out of their group's statistics and are masked out of the loss: their rows are
    zeroed like padding rows (no token attended or trained, in no token count, no KL or entropy
    term, no metric), as scene-protocol.md section 5 asks, but `episode_mask` keeps 1 on them:
    they stay episodes of the mini-batch, counted in the global sequence modes' G (VERL divides
    by ppo_mini_batch_size x n). Policy failures (-1) are ordinary members.

    row_multiple / col_multiple: the rows and columns are padded to multiples of these (the
    mesh's fsdp size; the sequence bucket and sp size). eps, norm_by_std: the advantage's
    (`grpo_outcome_advantages`). group_size: the configured G (default: the trajectories per
    group). trim: drop the columns after the last trained token of every row (rounded up to
    `col_multiple`; the same loss, gradient and metrics wherever the loss does not divide by T:
    the trainer fixes seq-mean-token-sum-norm's horizon, `constant_horizon`); False keeps the
    longest episode's length (one shape for every role: `parity train`). Raises ValueError when a group's size
    differs from it.
    """
    g = len(trajectories)
    order = {gid: i for i, gid in enumerate(dict.fromkeys(tr.group_id for tr in trajectories))}
    group_ids = np.asarray([order[tr.group_id] for tr in trajectories], np.int32)
    # at least one column: episodes that all failed before their first token still make a batch
    t = round_up(max(1, *(tr.num_tokens for tr in trajectories)), col_multiple)
    arr = trajectory_batch(trajectories, length=t, rows=round_up(g, row_multiple))
    scores = arr["reward"][:g]
    valid = ~arr["masked"][:g] & np.isfinite(scores)
    for key in ("input_ids", "attention_mask", "roles", "policy_mask", "rollout_logp"):
        arr[key][:g][~valid] = 0
    mask = np.asarray(role_loss_mask(arr["roles"], arr["policy_mask"], selected_role), np.float32)
    adv = np.asarray(grpo_outcome_advantages(np.where(valid, scores, 0.0), group_ids, valid,
                                             eps=eps, norm_by_std=norm_by_std,
                                             group_size=group_size or g // len(order)), np.float32)
    rows_adv = np.zeros(arr["input_ids"].shape[0], np.float32)
    rows_adv[:g] = adv
    advantages = rows_adv[:, None] * mask
    episode_mask = np.zeros(arr["input_ids"].shape[0], np.float32)
    episode_mask[:g] = 1.0
    arrays = {"input_ids": arr["input_ids"], "attention_mask": arr["attention_mask"],
              "loss_mask": mask, "advantages": advantages, "rollout_logp": arr["rollout_logp"]}
    if trim:
        trained_cols = np.flatnonzero(mask.any(axis=0))
        needed = round_up(int(trained_cols[-1]) + 1 if trained_cols.size else 1, col_multiple)
        arrays = {key: a[:, :needed] for key, a in arrays.items()}
    arrays["episode_mask"] = episode_mask
    return GroupBatch(
        arrays=arrays,
        episode_advantages=adv,
        has_signal=bool(np.any(advantages != 0)),
        trained_tokens=int(mask.sum()),
    )
