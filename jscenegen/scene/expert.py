"""Scripted expert: a designer that furnishes a room validly from its request, and a runner that
plays all three roles with it through the same Episode state machine a model-driven rollout uses.

The designer searches placements in a private simulation (free of charge) and emits only the final
`add_object` operations, each at an exact wall-flush or neighbour-flush pose (the same poses the
snap operations produce). A placement is kept when it collides with nothing, stays inside the
floor, keeps door clearances and tall objects clear of windows, and the measured scene stays
fully reachable. Requested items that do not fit are left out (the grade shows it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .actions import format_action
from .catalogue import Catalogue, load_catalogue
from .config import JudgeConfig, SceneRuntimeConfig
from .episode import Episode, judge_episodes
from .geometry import (
    box_corners,
    front_direction,
    opening_box,
    opening_centre,
    outside_fraction,
    penetration,
    wall_frame,
)
from .judge import Judge, make_judge
from .judge_rule import rule_grades
from .metrics import measure
from .ops import SceneEditor, parse_op
from .reach_inputs import is_thin
from .sceneset import SceneRecord

WALL_ITEMS = ("wardrobe", "dresser", "chest_of_drawers", "bookshelf", "tv_stand", "vanity", "desk", "standing_mirror")
CORNER_ITEMS = ("plant", "floor_lamp", "armchair")
GAP = 0.02


def _yaw(d) -> float:
    return round(math.degrees(math.atan2(-d[0], d[1])) % 360.0, 6)


@dataclass
class _Sim:
    editor: SceneEditor
    cfg: SceneRuntimeConfig
    catalogue: Catalogue
    ops: list

    def fits(self, pos, yaw: float, size, mount: str = "floor", elevation: float = 0.0) -> bool:
        """Cheap geometric screen before measuring: inside, no contact, openings clear."""
        room = self.editor.scene.room
        feet = box_corners(pos[0], pos[1], size[0], size[1], yaw)
        if outside_fraction(feet, np.asarray(room.floor_polygon)) > 1e-4:
            return False
        top = elevation + size[2]
        for o in self.editor.scene.objects:
            if o.mount == "on":
                continue
            thin = is_thin(o, self.catalogue, self.cfg.metrics)
            vertical = min(top, o.elevation + o.size[2]) - max(elevation, o.elevation)
            if thin or size[2] <= self.cfg.metrics.thin_height_m or vertical <= 0:
                continue
            other = box_corners(o.position[0], o.position[1], o.size[0], o.size[1], o.yaw)
            if penetration(feet, other) > -0.005:
                return False
        if mount == "floor" and size[2] > self.cfg.metrics.thin_height_m:
            for door in room.doors:
                if penetration(opening_box(room, door, self.cfg.metrics.door_clearance_m + 0.1), feet) > -0.02:
                    return False
        for win in room.windows:
            if top > win.sill and elevation < win.sill + win.height:
                if penetration(opening_box(room, win, self.cfg.metrics.window_clearance_m), feet) > -0.005:
                    return False
        return True

    def try_add(self, raw: dict, need_reach: bool = True) -> str | None:
        """Apply an add_object in the simulation; keep it if the scene stays valid. Returns the id."""
        before = self.editor.scene
        lines, _ = self.editor.apply_batch([parse_op(raw)])
        if "error" in lines[0]:
            self.editor.scene = before
            return None
        new_id = lines[0].split("-> ")[1].split(" ")[0]
        m = measure(self.editor.scene, self.cfg, self.catalogue)
        bad = m["collision_pairs"] or m["oob_objects"] or m["door_blocked"] or m["window_warnings"]
        if bad or (need_reach and not m["reachable"]):
            self.editor.scene = before
            self.editor.counters[raw["category"]] -= 1
            return None
        self.ops.append(raw)
        return new_id


def _wall_poses(room, size, door_pts, prefer_far: bool, step: float = 0.1):
    """Candidate (pos, yaw) with the object's back against each wall, best first."""
    out = []
    for i in range(len(room.floor_polygon)):
        p0, t, n, length = wall_frame(room, i)
        if length < size[0] + 2 * GAP:
            continue
        k = max(1, int((length - size[0] - 2 * GAP) / step))
        for j in range(k + 1):
            s = size[0] / 2 + GAP + (length - size[0] - 2 * GAP) * j / k
            pos = p0 + t * s + n * (size[1] / 2 + GAP)
            dist = min((float(np.hypot(*(pos - d))) for d in door_pts), default=0.0)
            centred = abs(s - length / 2)
            score = (centred - 0.3 * dist) if prefer_far else (0.3 * centred - 0.01 * length)
            out.append((score, i, j, (round(float(pos[0]), 2), round(float(pos[1]), 2)), _yaw(n)))
    out.sort()
    return [(pos, yaw) for _, _, _, pos, yaw in out]


def expert_ops(record: SceneRecord, cfg: SceneRuntimeConfig | None = None, catalogue: Catalogue | None = None,
               max_checks: int = 25) -> list[dict]:
    """Raw designer operations (JSON dicts) that furnish `record`'s room for its request."""
    cfg = cfg or SceneRuntimeConfig()
    catalogue = catalogue or load_catalogue(cfg.catalogue_path)
    scene = record.scene.model_copy(update={"objects": ()})
    sim = _Sim(SceneEditor(scene, cfg, catalogue), cfg, catalogue, [])
    room = scene.room
    door_pts = [opening_centre(room, d)[0] for d in room.doors]
    want: dict[str, int] = {}
    for r in record.requested:
        for cat in catalogue.members(r["category"])[:1]:
            want[cat] = want.get(cat, 0) + r["count"]
    beds = [c for c in want if c in catalogue.members("bed")]

    def place_on_walls(cat: str, prefer_far: bool, then=None) -> str | None:
        """First wall pose that keeps the scene valid (and for which `then(new_id)` succeeds)."""
        size = catalogue.get(cat).default_size
        checks = 0
        for pos, yaw in _wall_poses(room, size, door_pts, prefer_far):
            if not sim.fits(pos, yaw, size):
                continue
            checks += 1
            saved = (sim.editor.scene, len(sim.ops), dict(sim.editor.counters))
            got = sim.try_add({"op": "add_object", "category": cat, "description": cat.replace("_", " "),
                               "position": list(pos), "yaw": yaw})
            if got and then is not None and not then(got):
                sim.editor.scene, sim.editor.counters = saved[0], saved[2]
                del sim.ops[saved[1]:]
                got = None
            if got or checks >= max_checks:
                return got
        return None

    def beside(target_id: str, cat: str, side: str, orient: str, along: float, need_reach=True) -> str | None:
        tgt = sim.editor.scene.object(target_id)
        size = catalogue.get(cat).default_size
        f = front_direction(tgt.yaw)
        ux = np.array([f[1], -f[0]])
        d, tangent, half_t = {"front": (f, ux, tgt.size[1] / 2), "left": (-ux, f, tgt.size[0] / 2),
                              "right": (ux, f, tgt.size[0] / 2)}[side]
        yaw = _yaw(-d) if orient == "toward" else tgt.yaw
        fo = front_direction(yaw)
        uo = np.array([fo[1], -fo[0]])
        half_o = abs(size[0] / 2 * float(uo @ d)) + abs(size[1] / 2 * float(fo @ d))
        pos = np.asarray(tgt.position) + d * (half_t + half_o + GAP) + tangent * along
        pos = (round(float(pos[0]), 2), round(float(pos[1]), 2))
        if not sim.fits(pos, yaw, size):
            return None
        return sim.try_add({"op": "add_object", "category": cat, "description": cat.replace("_", " "),
                            "position": list(pos), "yaw": yaw}, need_reach)

    bed_id = place_on_walls(beds[0], prefer_far=True) if beds else None
    stands = []
    if bed_id and want.get("nightstand"):
        bed = sim.editor.scene.object(bed_id)
        ns = catalogue.get("nightstand").default_size
        head = -(bed.size[1] / 2 - ns[1] / 2 - GAP)
        for side in ("left", "right")[: want.get("nightstand", 0)]:
            got = beside(bed_id, "nightstand", side, "same", head)
            if got:
                stands.append(got)
    for cat in WALL_ITEMS:
        for _ in range(want.get(cat, 0)):
            if cat == "desk" and want.get("chair"):
                place_on_walls(cat, False, then=lambda desk: beside(desk, "chair", "front", "toward", 0.0))
            else:
                place_on_walls(cat, prefer_far=False)
    for cat in CORNER_ITEMS:
        for _ in range(want.get(cat, 0)):
            place_on_walls(cat, prefer_far=False)
    for _ in range(want.get("wall_shelf", 0)):
        size = catalogue.get("wall_shelf").default_size
        for pos, yaw in _wall_poses(room, size, door_pts, prefer_far=False, step=0.25):
            if sim.fits(pos, yaw, size, "wall", 1.6) and sim.try_add(
                {"op": "add_object", "category": "wall_shelf", "description": "wall shelf", "position": list(pos),
                 "yaw": yaw, "mount": "wall", "elevation": 1.6}):
                break
    lamps = want.get("table_lamp", 0)
    for parent in stands[:lamps]:
        p = sim.editor.scene.object(parent)
        sim.try_add({"op": "add_object", "category": "table_lamp", "description": "bedside lamp",
                     "position": list(p.position), "yaw": p.yaw, "mount": "on", "parent": parent}, need_reach=False)
    if want.get("rug"):
        poly = np.asarray(room.floor_polygon)
        centre = poly.mean(axis=0)
        if bed_id:
            bed = sim.editor.scene.object(bed_id)
            centre = np.asarray(bed.position) + front_direction(bed.yaw) * (bed.size[1] / 2)
        for size in ((2.0, 1.4, 0.01), (1.6, 1.0, 0.01), (1.2, 0.8, 0.01)):
            feet = box_corners(centre[0], centre[1], size[0], size[1], 0.0)
            if outside_fraction(feet, poly) < 1e-4 and sim.try_add(
                {"op": "add_object", "category": "rug", "description": "rug", "size": list(size),
                 "position": [round(float(centre[0]), 2), round(float(centre[1]), 2)], "yaw": 0.0}):
                break
    return sim.ops


def jitter_ops(ops: list[dict], noise_m: float, seed: int, share: float = 0.5) -> list[dict]:
    """A copy of `ops` where each floor or wall placement moves, with probability `share`, by
    uniform(-noise_m, noise_m) per axis (rounded to 1 cm): an imperfect designer, so SFT
    demonstrations also show the critic and planner scenes with collisions and unreachable
    objects (noise injection, as in DART; Laskey et al., 2017). Objects placed on a parent keep
    their pose. Deterministic for a given seed."""
    rng = np.random.default_rng(seed)
    out = []
    for op in ops:
        op = dict(op)
        if "position" in op and op.get("mount") != "on" and rng.random() < share:
            op["position"] = [round(float(v + rng.uniform(-noise_m, noise_m)), 2) for v in op["position"]]
        out.append(op)
    return out


def expert_critique(metrics: dict, grades: dict[str, int]) -> dict:
    """A critic answer built from the measured metrics (and the rule judge's grades as its
    estimate): counts of what is wrong, in a fixed order, so it is easy to imitate."""
    notes = []
    if metrics["collision_pairs"]:
        notes.append(f"{len(metrics['collision_pairs'])} collisions")
    if metrics["oob_objects"]:
        notes.append(f"{len(metrics['oob_objects'])} objects out of the room")
    if not metrics["reachable"]:
        notes.append(f"{len(metrics['unreachable_objects'])} unreachable objects")
    if metrics["window_warnings"]:
        notes.append("objects in front of windows")
    text = ("Problems: " + ", ".join(notes) + ".") if notes else "No collisions, every object reachable."
    return {"critique": text, "grades": grades}


def scripted_answers(ep: Episode, ops: list[dict]) -> str:
    """The expert's answer text for the episode's next role."""
    role = ep.next_role
    if role == "planner":
        if ep.planner_turns == 0:
            return format_action({"action": "design", "instruction": "Furnish the room as requested."})
        if ep.critique_rounds == 0:
            return format_action({"action": "critique"})
        return format_action({"action": "finish", "summary": f"Furnished with {len(ep.scene.objects)} objects."})
    if role == "designer":
        return format_action({"ops": ops})
    m = measure(ep.scene, ep.cfg, ep.catalogue)
    grades = rule_grades(ep.scene, ep.record.requested, m, ep.catalogue)
    return format_action(expert_critique(m, {k: grades[k] for k in ep.judge_cfg.grade_keys}))


def run_scripted_episode(
    record: SceneRecord,
    cfg: SceneRuntimeConfig | None = None,
    judge_cfg: JudgeConfig | None = None,
    judge: Judge | None = None,
    noise_m: float = 0.0,
    noise_seed: int = 0,
    judged: bool = True,
) -> tuple[Episode, list[dict]]:
    """Play planner, designer and critic with the expert; judge the result.

    noise_m > 0 plays an imperfect designer (`jitter_ops` with `noise_seed`); the critic and
    planner still answer as the expert does, from what the runtime measures. judged=False
    leaves the finished episode unjudged (the caller judges many at once, `judge_episodes`).

    Returns (episode with its outcome, chat transcript [{"role", "content", "actor"}]) where
    actor is planner/designer/critic for assistant messages and "environment" otherwise.
    """
    cfg = cfg or SceneRuntimeConfig()
    judge_cfg = judge_cfg or JudgeConfig()
    ep = Episode(record, cfg, judge_cfg)
    ops = expert_ops(record, cfg, ep.catalogue)
    if noise_m > 0:
        ops = jitter_ops(ops, noise_m, noise_seed)
    chat = [
        {"role": "system", "content": ep.system_prompt(), "actor": "environment"},
        {"role": "user", "content": ep.first_user_message(), "actor": "environment"},
    ]
    while not ep.done:
        actor = ep.next_role
        text = scripted_answers(ep, ops)
        chat.append({"role": "assistant", "content": text, "actor": actor})
        res = ep.step(text)
        if res.env_message is not None:
            chat.append({"role": "user", "content": res.env_message, "actor": "environment"})
    if judged:
        judge_episodes([ep], judge or make_judge(judge_cfg, cfg))
    return ep, chat
