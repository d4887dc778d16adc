"""Deterministic rule judge: the seven grades from the metrics and the request (CI and offline default).

Base scores (integers, clamped to 0..10, before the caps), scene-protocol.md section 5:
realism 10 - 2 per object outside its catalogue size range - 1 per storage piece more than 0.10 m
from every wall; functionality 10 - 3 per front-used object whose front is blocked or faces a wall
- 2 per chair not facing a desk within 1.5 m; layout round(10 min(1, walkable_ratio / 0.5)) - 1
per object overlapping a window box (per object in the metrics' `window_warnings`: rising across
the sill inside the box, as spec section 4 says window boxes warn only for objects taller than
the sill); completeness 10 x share of the room type's expected groups present; prompt_following
10 x share of requested objects present (each object filling at most one item: a maximum
matching over the sum of counts, `requested_share`); reachability 10 when reachable else
round(10 x reachable_object_ratio); physical_plausibility 10 - 2 per collision pair - 3 per
out-of-bounds object. Rounding is half up (floor(x + 0.5)). Then caps.apply_caps.
"""
from __future__ import annotations

import math
from typing import Sequence

from .caps import apply_caps
from .catalogue import Catalogue
from .config import GRADE_KEYS, GRADE_MAX, GRADE_MIN, JudgeConfig, MetricsConfig
from .judge import JudgeIdentity, JudgeRequest, JudgeResult, rubric_hash
from .prompts import PromptTemplates
from .schema import Scene


def _round(x: float) -> int:
    return int(math.floor(x + 0.5))


def _clamp(x: int) -> int:
    return max(GRADE_MIN, min(GRADE_MAX, x))


def requested_share(scene: Scene, requested, catalogue: Catalogue) -> float:
    """Share of requested objects present: matched / sum count (1.0 when nothing asked).

    Each object fills at most one requested item (rules revision 6): `matched` is the size of a
    maximum matching between the scene's objects and the items' slots (an item of count c has
    c slots; an object fits a slot when its category is the item's name or one of the group's
    members, `Catalogue.members`). So a queen bed counts for `bed` x1 or `queen_bed` x1, not
    both (0.5), while a queen bed and a single bed fill both, in either order. With no object
    matching two items this equals sum over items of min(have, count) / sum of counts.
    """
    total = sum(int(r["count"]) for r in requested)
    if total == 0:
        return 1.0
    cats = [o.category for o in scene.objects]
    slots = []
    for r in requested:   # more slots than objects can never be filled
        slots += [frozenset(catalogue.members(r["category"]))] * min(int(r["count"]), len(cats))
    holder: dict[int, int] = {}   # object index -> slot index (Kuhn's augmenting paths)

    def fill(s: int, seen: set[int]) -> bool:
        for j, cat in enumerate(cats):
            if cat in slots[s] and j not in seen:
                seen.add(j)
                if j not in holder or fill(holder[j], seen):
                    holder[j] = s
                    return True
        return False

    matched = sum(fill(s, set()) for s in range(len(slots)))
    return matched / total


def rule_grades(scene: Scene, requested, metrics: dict, catalogue: Catalogue) -> dict[str, int]:
    """All seven grades (GRADE_KEYS) of a scene, caps applied."""
    m = metrics
    # blocked fronts: unreachable_objects holds only objects that count for reach, so stand on
    # the floor in effect (reach_inputs.stands_on_floor: a wardrobe on a rug too, rules revision 6)
    front_bad = {
        o.id for o in scene.objects
        if (c := catalogue.get(o.category)) and c.front_used and o.id in m["unreachable_objects"]
    } | set(m["front_to_wall_objects"])
    expected = catalogue.expected(scene.room.type)
    cats = {o.category for o in scene.objects}
    completeness = (
        sum(1 for alts in expected if cats & set(alts)) / len(expected) if expected else 1.0
    )
    grades = {
        "realism": 10 - 2 * len(m["size_out_of_range_objects"]) - len(m["storage_off_wall_objects"]),
        "functionality": 10 - 3 * len(front_bad) - 2 * len(m["chairs_not_at_desk"]),
        "layout": _round(10 * min(1.0, m["walkable_ratio"] / 0.5))
        - len({w["object"] for w in m["window_warnings"]}),
        "completeness": _round(10 * completeness),
        "prompt_following": _round(10 * requested_share(scene, requested, catalogue)),
        "reachability": 10 if m["reachable"] else _round(10 * m["reachable_object_ratio"]),
        "physical_plausibility": 10 - 2 * len(m["collision_pairs"]) - 3 * len(m["oob_objects"]),
    }
    return apply_caps({k: _clamp(v) for k, v in grades.items()}, metrics)


class RuleJudge:
    """Judge backend computing `rule_grades`; never fails on a valid request."""

    def __init__(self, cfg: JudgeConfig, catalogue: Catalogue, templates: PromptTemplates,
                 metrics_cfg: MetricsConfig):
        unknown = set(cfg.grade_keys) - set(GRADE_KEYS)
        if unknown:
            raise ValueError(f"judge.grade_keys {sorted(unknown)} have no rule; the rule judge knows {GRADE_KEYS}")
        self.cfg, self.catalogue, self.templates = cfg, catalogue, templates
        self.metrics_cfg = metrics_cfg

    def identity(self) -> JudgeIdentity:
        return JudgeIdentity(backend="rule", model=None,
                             rubric_hash=rubric_hash(self.cfg, self.templates, self.metrics_cfg))

    def check_reachable(self) -> None:
        """In-process: always reachable."""

    def grade(self, requests: Sequence[JudgeRequest]) -> list[JudgeResult]:
        out = []
        for req in requests:
            g = rule_grades(req.scene, req.requested, req.metrics, self.catalogue)
            out.append(JudgeResult({k: g[k] for k in self.cfg.grade_keys}, None, {"attempts": 1}))
        return out
