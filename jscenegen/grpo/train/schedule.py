"""The GRPO100 schedule: scene order, D-D-D-P-C roles, episode seeds, effective-update counting.

../shared/specs/grpo.md "Role schedule and update counting": effective update k trains role
`roles[k mod len(roles)]`; an attempt runs the G episodes of the current scene; it is effective
when a trained token has a non-zero advantage. For an attempt without signal the `zero_spread`
policy decides: `redraw` (same scene, next seeds, at most `max_redraws` times, then the next
scene without a step), `skip` (next scene at once) or `count` (step anyway; it counts).
When every scene has been used, the order starts again (epoch + 1, which enters the seeds).

With `rollout.groups_per_batch` = k > 1 an attempt takes the next k scenes of the order (their
groups rolled out in one batch and trained in one optimizer step); redraws and the advance
then apply to all k together. k = 1 is the recipe.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Literal, Mapping, Sequence

from pydantic import Field

from jscenegen.config import SEED_MAX, STEPS_MAX, Section
from jscenegen.grpo.algo.roles import role_from_letter
from jscenegen.grpo.rollout.config import GROUP_MAX
from jscenegen.grpo.rollout.seeds import episode_seed
from jscenegen.scene.sceneset import SceneRecord, scene_set_hash


class ScheduleConfig(Section):
    """Which scenes, in which order, and how updates are counted."""

    train_set: str = Field("data/scenes/train.jsonl", description="JSONL scene set (file order = order)")
    dev_set: str = Field("data/scenes/dev.jsonl", description="dev scenes for evaluation")
    num_scenes: int | None = Field(None, gt=0, description="use the first N scenes (null: all)")
    roles: str = Field("DDDPC", pattern=r"^[DPC]+$", description="role cycle: effective update k "
                       "trains only the sampled tokens of role roles[k mod len(roles)] (D designer, "
                       "P planner, C critic); enters the schedule hash")
    group_size: int = Field(8, ge=2, le=GROUP_MAX, description="episodes per scene (GRPO's "
                            "group; one episode has no advantage signal)")
    total_updates: int = Field(100, ge=1, le=STEPS_MAX, description="effective updates (optimizer steps with signal)")
    zero_spread: Literal["redraw", "skip", "count"] = Field(
        "redraw", description="an attempt whose trained tokens all have zero advantage: redraw "
        "(no step; the same scene with the next seeds, up to max_redraws times, then the next "
        "scene), skip (no step; the next scene), count (step anyway; it counts as effective)")
    max_redraws: int = Field(2, ge=0, le=STEPS_MAX, description="zero_spread redraw: most redraws of an "
                             "attempt's scene(s) before the schedule moves on without a step")
    max_attempts: int | None = Field(None, ge=1, le=STEPS_MAX, description="stop after this many update "
                                     "attempts even without total_updates effective ones "
                                     "(a weak policy may never produce signal); null: no cap")
    seed: int = Field(0, ge=0, le=SEED_MAX, description="run-level seed: enters every rollout's "
                      "episode seeds (0 = the seeds of earlier releases); the scene order, the SFT "
                      "warm start and the dev evaluation's seeds do not depend on it")


@dataclasses.dataclass
class SchedulePosition:
    """Where the schedule stands; JSON-able, saved in every checkpoint's train state."""

    scene_index: int = 0        # index into the scene order
    epoch: int = 0              # passes over the scene order completed
    redraw: int = 0             # redraws of the current scene so far
    effective_updates: int = 0  # optimizer steps with signal (or counted)
    attempts: int = 0           # update attempts (rollout groups) so far

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "SchedulePosition":
        """The position `to_json` wrote (every field an int; KeyError for a missing one)."""
        return cls(**{f.name: int(d[f.name]) for f in dataclasses.fields(cls)})

    @classmethod
    def after_steps(cls, steps: int, num_scenes: int, groups_per_batch: int = 1) -> "SchedulePosition":
        """The position of a run that took `steps` updates of `groups_per_batch` scenes each,
        every one stepping, without redraws: what a checkpoint without the run's own position
        (one converted from VERL, which counts global steps only) resumes at."""
        scenes = steps * groups_per_batch
        return cls(scene_index=scenes % num_scenes, epoch=scenes // num_scenes,
                   effective_updates=steps, attempts=steps)


def schedule_hash(scene_seeds: Sequence[tuple[str, int]], roles: str, group_size: int,
                  run_seed: int = 0) -> str:
    """SHA-256 of canonical JSON {scenes: [[scene_id, seed], ...], roles, group_size[, seed]}
    (the run seed enters only when it is not 0, so seed-0 hashes are those of earlier releases)."""
    payload = {"scenes": [[sid, int(seed)] for sid, seed in scene_seeds], "roles": roles,
               "group_size": int(group_size)}
    if run_seed:
        payload["seed"] = int(run_seed)
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


class Schedule:
    """The schedule over `scene_seeds` = [(scene_id, seed), ...] in file order."""

    def __init__(self, scene_seeds: Sequence[tuple[str, int]], cfg: ScheduleConfig):
        if not scene_seeds:
            raise ValueError(f"schedule: the scene set {cfg.train_set} is empty")
        self.scene_seeds = list(scene_seeds)
        self.cfg = cfg

    def hash(self, prefix: int | None = None) -> str:
        """Schedule hash over the first `prefix` scenes (default: all)."""
        scenes = self.scene_seeds if prefix is None else self.scene_seeds[:prefix]
        return schedule_hash(scenes, self.cfg.roles, self.cfg.group_size, self.cfg.seed)

    def role(self, pos: SchedulePosition) -> int:
        """Role code trained by the next effective update."""
        return role_from_letter(self.role_letter(pos))

    def role_letter(self, pos: SchedulePosition) -> str:
        return self.cfg.roles[pos.effective_updates % len(self.cfg.roles)]

    def seeds(self, pos: SchedulePosition, offset: int = 0) -> list[int]:
        """Episode seeds of the G members of the attempt's group `offset` (0: the current scene;
        j: the scene j places later in the order, across an epoch boundary)."""
        index, epoch = self.scene_at(pos, offset)
        seed = self.scene_seeds[index][1]
        return [episode_seed(seed, m, pos.redraw, epoch, self.cfg.seed)
                for m in range(self.cfg.group_size)]

    def scene_at(self, pos: SchedulePosition, offset: int = 0) -> tuple[int, int]:
        """(scene index, epoch) `offset` places after the current scene."""
        n = len(self.scene_seeds)
        flat = pos.scene_index + offset
        return flat % n, pos.epoch + flat // n

    def extended(self, pos: SchedulePosition, saved_scenes: int) -> SchedulePosition:
        """`pos`, saved by a run over the first `saved_scenes` scenes, on this (longer) order.

        A run that had just finished a pass over its scenes saved (0, epoch + 1) (`advance`
        wraps at its own count): with scenes appended, the pass goes on into them, (saved_scenes,
        epoch), as an uninterrupted run over the longer order would. A position inside a pass
        (or its redraws) is kept: the appended scenes come at the end of that pass; so is one
        after a batch of k > 1 scenes (`groups_per_batch`) that crossed the end of a pass (k
        not dividing `saved_scenes`): it already played scenes of the next epoch."""
        if (saved_scenes < len(self.scene_seeds) and pos.epoch > 0 and pos.scene_index == 0
                and pos.redraw == 0):
            return dataclasses.replace(pos, scene_index=saved_scenes, epoch=pos.epoch - 1)
        return pos

    def done(self, pos: SchedulePosition) -> bool:
        """total_updates effective updates reached, or max_attempts attempts made."""
        cap = self.cfg.max_attempts
        return pos.effective_updates >= self.cfg.total_updates or (cap is not None and pos.attempts >= cap)

    def advance(self, pos: SchedulePosition, has_signal: bool,
                scenes: int = 1) -> tuple[SchedulePosition, bool]:
        """Position after an attempt over `scenes` scenes and whether the optimizer steps for it.

        `has_signal`: some trained token has a non-zero advantage.
        """
        step = has_signal or self.cfg.zero_spread == "count"
        nxt = dataclasses.replace(pos, attempts=pos.attempts + 1)
        if step:
            nxt.effective_updates += 1
        elif self.cfg.zero_spread == "redraw" and pos.redraw < self.cfg.max_redraws:
            nxt.redraw += 1
            return nxt, False
        nxt.redraw = 0
        nxt.scene_index, nxt.epoch = self.scene_at(pos, scenes)
        return nxt, step


SCHEDULE_HASH_SETTINGS = ("roles", "group_size", "seed")   # besides the scenes and their seeds


def check_extension(saved: dict, schedule: Schedule,
                    changed_settings: Sequence[str] | None = None,
                    recorded: Mapping[str, Any] | None = None) -> None:
    """Refuse a resume whose scene prefix, roles, group size or run seed changed.

    `saved` holds `schedule_hash` and `num_scenes` of the run being resumed. Extending the scene
    list keeps the prefix's hash; anything else raises ValueError showing both hashes and
    naming what changed: `changed_settings` ("schedule.group_size 8 -> 4", as
    `metadata.config_changes` lists the SCHEDULE_HASH_SETTINGS that differ from the
    checkpoint's recorded config `recorded`, its `schedule` section), when the hash over the
    configured scenes with the recorded settings is the checkpoint's (so they explain it);
    the first scenes or their seeds (schedule.train_set) otherwise, or when the checkpoint
    records no config (`recorded` None).
    """
    n = int(saved["num_scenes"])
    if n > len(schedule.scene_seeds):
        raise ValueError(f"resume: the run used {n} scenes but only {len(schedule.scene_seeds)} are configured")
    ours = schedule.hash(n)
    if ours == saved["schedule_hash"]:
        return
    scenes = (f"the schedule's first {n} scenes or their seeds (schedule.train_set "
              f"{schedule.cfg.train_set})")
    what = (f"{scenes}, schedule.roles, schedule.group_size or schedule.seed changed")
    if changed_settings and recorded is not None:
        try:
            theirs = schedule_hash(schedule.scene_seeds[:n], recorded["roles"],
                                   int(recorded["group_size"]), int(recorded.get("seed", 0)))
        except (KeyError, TypeError, ValueError):   # a hand-edited record: say no more than the hash
            theirs = None
        if theirs == saved["schedule_hash"]:
            what = f"the schedule changed: {'; '.join(changed_settings)}"
        elif theirs is not None:
            what = f"{scenes} changed, and {'; '.join(changed_settings)}"
    raise ValueError(f"resume refused: {what} (checkpoint schedule_hash {saved['schedule_hash']}, "
                     f"now {ours})")


def check_scene_content(saved: dict, records: Sequence[SceneRecord], train_set: str) -> None:
    """Refuse a resume whose first `saved["num_scenes"]` scene records changed in content.

    The schedule hash covers each scene's place and seed; `saved["scenes_hash"]`
    (`scene_set_hash` of the records the run trained on) covers the rest: a prompt, room or
    requested items edited in place. A checkpoint written before the key existed is not
    checked. Raises ValueError naming `train_set` and both hashes.
    """
    if saved.get("scenes_hash") is None:
        return
    n = int(saved["num_scenes"])
    ours = scene_set_hash(records[:n])
    if ours != saved["scenes_hash"]:
        raise ValueError(
            f"resume refused: the content of the first {n} scenes of {train_set} changed (a "
            "prompt, room or requested items edited; their places and seeds did not): "
            f"checkpoint scenes_hash {saved['scenes_hash']}, now {ours}")
