"""Designer operations: argument schemas, unit charging, validation and application.

Semantics (scene-protocol.md section 3): units are charged when an operation is requested, also
when it then fails validation; a request that would exceed the budget is refused, not charged,
and ends the batch; validation errors (unknown id, centre outside the floor, size out of range,
too many objects, ...) change nothing and are reported back; collisions are measured, never
refused. Snapping leaves a 1 cm gap, as SceneSmith's snap tools do.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Annotated, Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from jscenegen.config import validation_message
from jscenegen.paths import is_decimal
from jscenegen.text import clip_text

from .catalogue import Catalogue
from .config import SceneRuntimeConfig
from .geometry import footprint, front_direction, point_on_polygon, wall_frame
from .schema import MAX_YAW_DEG, Mount, Scene, SceneObject, ceiling_elevation, id_sort_key

SNAP_GAP_M = 0.01
Vec2 = tuple[float, float]
Vec3 = tuple[float, float, float]


class _Op(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)


class AddObject(_Op):
    op: Literal["add_object"]
    category: str
    description: str = ""
    size: Vec3 | None = None
    position: Vec2
    yaw: float = 0.0
    mount: Mount = "floor"
    parent: str | None = None
    elevation: float | None = None


class ReplaceObject(_Op):
    op: Literal["replace_object"]
    id: str
    category: str | None = None
    description: str | None = None
    size: Vec3 | None = None


class ResizeObject(_Op):
    op: Literal["resize_object"]
    id: str
    size: Vec3 | None = None
    scale: float | Vec3 | None = None


class MoveObject(_Op):
    op: Literal["move_object"]
    id: str
    position: Vec2
    yaw: float | None = None


class RemoveObject(_Op):
    op: Literal["remove_object"]
    id: str


class SnapToWall(_Op):
    op: Literal["snap_to_wall"]
    id: str
    wall: int | None = None
    orientation: Literal["away", "along"] = "away"


class SnapToObject(_Op):
    op: Literal["snap_to_object"]
    id: str
    target: str
    side: Literal["left", "right", "front", "back"]
    orientation: Literal["toward", "same", "none"] = "none"
    offset: float = 0.0


class RotateObject(_Op):
    op: Literal["rotate_object"]
    id: str
    yaw: float


class GetScene(_Op):
    op: Literal["get_scene"]


OP_MODELS = {
    m.model_fields["op"].annotation.__args__[0]: m
    for m in (AddObject, ReplaceObject, ResizeObject, MoveObject, RemoveObject, SnapToWall, SnapToObject,
              RotateObject, GetScene)
}
Operation = Annotated[Union[tuple(OP_MODELS.values())], Field(discriminator="op")]
_OP_ADAPTER = TypeAdapter(Operation)

OP_ARGS = {
    "add_object": "category, description, size? [w,d,h] (catalogue default), position [x,y], yaw?, mount? "
    "(floor|on|wall|ceiling), parent? (for on), elevation? (for wall)",
    "replace_object": "id, category?, description?, size?",
    "resize_object": "id, size [w,d,h] or scale (number or [sw,sd,sh])",
    "move_object": "id, position [x,y], yaw?",
    "remove_object": "id (children go too)",
    "snap_to_wall": "id, wall? (nearest), orientation? (away, the default: back to the wall | "
    "along: side to the wall)",
    "snap_to_object": "id, target, side (left|right|front|back of target; right = target's local +x), "
    "orientation? (toward|same|none, the default), offset? (m along that side)",
    "rotate_object": "id, yaw",
    "get_scene": "-",
}


class OpSchemaError(ValueError):
    """An operation that is not an object with a known `op` and well-typed arguments (policy failure)."""

    def __init__(self, cause: str, message: str):
        super().__init__(message)
        self.cause = cause


def parse_op(raw) -> _Op:
    """Validate one raw JSON operation. Raises OpSchemaError(cause "unknown_op" | "schema_violation")."""
    if not isinstance(raw, dict) or not isinstance(raw.get("op"), str):
        raise OpSchemaError("schema_violation", f"operation {json.dumps(raw)[:80]} has no string field 'op'")
    if raw["op"] not in OP_MODELS:
        raise OpSchemaError("unknown_op", f"unknown operation {clip_text(repr(raw['op']))}; "
                                          f"known: {', '.join(OP_MODELS)}")
    try:
        return _OP_ADAPTER.validate_json(json.dumps(raw), strict=True)
    except ValidationError as err:
        e = err.errors()[0]
        loc = ".".join(str(p) for p in e["loc"][1:])
        raise OpSchemaError("schema_violation", f"{raw['op']}: {loc}: {e['msg']}") from None


def op_table(cfg: SceneRuntimeConfig) -> str:
    """Text table of operations, arguments and unit costs for the system prompt."""
    costs = cfg.op_costs.model_dump()
    return "\n".join(f"  {name} ({costs[name]} units): {OP_ARGS[name]}" for name in OP_MODELS)


def op_costs_text(cfg: SceneRuntimeConfig) -> str:
    """One line of operation names and unit costs (for compact prompts without the full table)."""
    costs = cfg.op_costs.model_dump()
    return ", ".join(f"{name} {costs[name]}" for name in OP_MODELS)


class OpError(ValueError):
    """A validation error of one operation: reported to the model, changes nothing."""


MAX_ERROR_CHARS = 400   # an error line echoes what it refuses, clipped: it enters the next prompt


def _valid(obj: SceneObject) -> SceneObject:
    """`obj` checked against the scene schema (model_copy skips validation): an operation
    whose result no scene file could hold (a yaw or coordinate out of range) is an OpError."""
    try:
        return SceneObject.model_validate(obj.model_dump())
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise OpError(f"{field}: {validation_message(first)}" if field else validation_message(first)) from None


def _r(x: float) -> float:
    return round(float(x), 6)


def _yaw_of_front(d: np.ndarray) -> float:
    """Yaw (deg, 0..360) whose front (local +y) points along unit vector d."""
    return _r(math.degrees(math.atan2(-d[0], d[1])) % 360.0)


@dataclass
class SceneEditor:
    """Applies designer operations to a scene, charging units. Ids are `<category>_<n>`, never reused."""

    scene: Scene
    cfg: SceneRuntimeConfig
    catalogue: Catalogue
    counters: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        self._take_ids(self.scene.objects)

    def _take_ids(self, objects) -> None:
        """Count the ids of `objects` as given: `_new_id` continues after the largest n of each category."""
        for o in objects:
            cat, _, n = o.id.rpartition("_")
            if is_decimal(n):
                self.counters[cat] = max(self.counters.get(cat, 0), int(n))

    # ---- batch -----------------------------------------------------------------------------
    def apply_batch(self, ops: list[_Op]) -> tuple[list[str], bool]:
        """Apply `ops` in order. Returns (one result line per op, budget_refused)."""
        lines = []
        costs = self.cfg.op_costs.model_dump()
        for i, op in enumerate(ops):
            cost = costs[op.op]
            b = self.scene.budget
            if b.used_units + cost > b.total_units:
                lines.append(
                    f"{i + 1}. {op.op}: refused, budget exhausted (needs {cost}, "
                    f"{b.total_units - b.used_units} left); the remaining operations were not run"
                )
                return lines, True
            self.scene = self.scene.model_copy(update={"budget": b.model_copy(update={"used_units": b.used_units + cost})})
            try:
                msg = getattr(self, "_" + op.op)(op)
                lines.append(f"{i + 1}. {op.op}: ok{(' ' + msg) if msg else ''} [{cost} units]")
            except OpError as err:
                lines.append(f"{i + 1}. {op.op}: error: {clip_text(str(err), MAX_ERROR_CHARS)} "
                             f"[{cost} units charged]")
        return lines, False

    # ---- helpers ---------------------------------------------------------------------------
    def _get(self, object_id: str) -> SceneObject:
        o = self.scene.object(object_id)
        if o is None:
            known = ", ".join(sorted((x.id for x in self.scene.objects), key=id_sort_key)) or "none"
            raise OpError(f"unknown id {object_id!r} (objects: {known})")
        return o

    def _inside(self, pos, carried: str | None = None) -> None:
        """OpError unless `pos` is on the floor (its boundary included); `carried` names the
        child a parent's move would take there."""
        if not point_on_polygon(pos[0], pos[1], self.scene.room.floor_polygon):
            what = f"it would carry {carried} to centre" if carried else "centre"
            raise OpError(f"{what} [{pos[0]:.6g}, {pos[1]:.6g}] is outside the floor")

    def _check_size(self, category: str, size) -> None:
        cat = self.catalogue.get(category)
        if cat is not None and not cat.size_ok(size):
            ranges = ", ".join(f"{lo}-{hi}" for lo, hi in cat.size_range)
            raise OpError(f"size {[round(s, 3) for s in size]} outside the {category} range [{ranges}] (w, d, h)")

    def _descendants(self, object_id: str) -> list[str]:
        out, frontier = [], [object_id]
        while frontier:
            cur = frontier.pop()
            kids = [o.id for o in self.scene.objects if o.parent == cur]
            out += kids
            frontier += kids
        return out

    def _replace_objects(self, changed: dict[str, SceneObject], removed: set[str] = frozenset()) -> None:
        """Put `changed` (keyed by their current ids) into the scene, each validated first; an
        object mounted `on` another must keep its centre on its parent's top (a move, a
        resize or a replace that would leave it hanging beside it is refused)."""
        changed = {k: _valid(o) for k, o in changed.items()}
        objs = tuple(changed.get(o.id, o) for o in self.scene.objects if o.id not in removed)
        objs += tuple(o for k, o in changed.items() if self.scene.object(k) is None)
        by_id = {o.id: o for o in objs}
        moved = {o.id for o in changed.values()}
        for o in objs:
            if o.mount == "on" and (o.id in moved or o.parent in moved):
                parent = by_id[o.parent]
                if not point_on_polygon(o.position[0], o.position[1], footprint(parent).tolist()):
                    raise OpError(f"the centre of {o.id} would not be on top of its parent "
                                  f"{parent.id}")
        self.scene = self.scene.model_copy(update={"objects": objs})
        self._take_ids(changed.values())

    def _rigid(self, obj: SceneObject, pos, yaw: float) -> None:
        """Move `obj` to pos/yaw and carry its descendants with the same rigid motion."""
        self._inside(pos)
        if not abs(yaw) <= MAX_YAW_DEG:
            raise OpError(f"yaw {yaw:.6g} is beyond +-{MAX_YAW_DEG:g} degrees")
        dyaw = yaw - obj.yaw
        c, s = math.cos(math.radians(dyaw)), math.sin(math.radians(dyaw))
        old = np.asarray(obj.position)
        changed = {obj.id: obj.model_copy(update={"position": (_r(pos[0]), _r(pos[1])), "yaw": _r(yaw)})}
        for kid_id in self._descendants(obj.id):
            kid = self.scene.object(kid_id)
            rel = np.asarray(kid.position) - old
            new = np.array([c * rel[0] - s * rel[1], c * rel[1] + s * rel[0]]) + np.asarray(pos)
            new = (_r(new[0]), _r(new[1]))   # checked as stored
            self._inside(new, carried=kid_id)
            changed[kid_id] = kid.model_copy(update={"position": new, "yaw": _r(kid.yaw + dyaw)})
        self._replace_objects(changed)

    def _mounted_elevation(self, mount: str, elevation: float, height: float) -> float:
        """Elevation of a wall-mounted object (as given, its top at most the wall height) or a
        ceiling-mounted one (its top at the ceiling); raises OpError when it leaves the wall."""
        wall_height = self.scene.room.wall_height
        if mount == "ceiling":
            elevation = ceiling_elevation(wall_height, height)
        if elevation < 0 or elevation + height > wall_height + 1e-9:
            raise OpError(f"elevation {elevation:.6g} with height {height:.6g} puts the object "
                          f"outside 0..wall_height ({wall_height:g})")
        return elevation

    def _resized(self, o: SceneObject, size) -> dict[str, SceneObject]:
        """`o` with `size` (a ceiling object stays at the ceiling, a wall object must stay on the
        wall) and the objects on it, and on those, each on its parent's new top."""
        elevation = o.elevation
        if o.mount in ("wall", "ceiling"):
            elevation = _r(self._mounted_elevation(o.mount, o.elevation, size[2]))
        changed = {o.id: o.model_copy(update={"size": tuple(size), "elevation": elevation})}
        for kid_id in self._descendants(o.id):   # each after its parent
            kid = self.scene.object(kid_id)
            parent = changed[kid.parent]
            changed[kid_id] = kid.model_copy(update={"elevation": _r(parent.elevation + parent.size[2])})
        return changed

    def _new_id(self, category: str) -> str:
        """The next id of `category`; taken (never given again) by `_replace_objects` once the
        object it names is in the scene, so a refused operation uses none."""
        return f"{category}_{self.counters.get(category, 0) + 1}"

    # ---- operations ------------------------------------------------------------------------
    def _add_object(self, op: AddObject) -> str:
        cat = self.catalogue.get(op.category)
        if cat is None:
            raise OpError(f"unknown category {op.category!r}; known: {', '.join(sorted(self.catalogue.categories))}")
        if op.mount not in cat.mounts:
            raise OpError(f"{op.category} cannot be mounted {op.mount!r} (allowed: {', '.join(cat.mounts)})")
        if len(self.scene.objects) >= self.cfg.max_objects:
            raise OpError(f"the scene already has the maximum of {self.cfg.max_objects} objects")
        size = op.size or cat.default_size
        self._check_size(op.category, size)
        self._inside(op.position)
        if op.elevation is not None and op.mount != "wall":
            raise OpError(f"elevation is derived for mount {op.mount!r}; give it only for wall mounts")
        parent = None
        if op.mount == "on":
            if not op.parent:
                raise OpError("mount 'on' needs a parent id")
            p = self._get(op.parent)   # its centre on p's top: `_replace_objects`
            elevation, parent = p.elevation + p.size[2], p.id
        elif op.parent:
            raise OpError(f"parent is only allowed with mount 'on', not {op.mount!r}")
        elif op.mount in ("wall", "ceiling"):
            default = 1.5 if cat.default_elevation is None else cat.default_elevation
            elevation = self._mounted_elevation(op.mount, op.elevation if op.elevation is not None
                                                else default, size[2])
        else:
            elevation = 0.0
        new = SceneObject.model_construct(
            id=self._new_id(op.category), category=op.category, description=op.description,
            position=(_r(op.position[0]), _r(op.position[1])), elevation=_r(elevation), size=tuple(size),
            yaw=_r(op.yaw), mount=op.mount, parent=parent,
        )
        self._replace_objects({new.id: new})
        return f"-> {new.id}"

    def _replace_object(self, op: ReplaceObject) -> str:
        old = self._get(op.id)
        if op.category is None and op.description is None and op.size is None:
            raise OpError("give category, description or size (what to replace)")
        category = op.category or old.category
        cat = self.catalogue.get(category)
        if op.category is not None and cat is None:
            raise OpError(f"unknown category {category!r}")
        if cat is not None and op.category is not None and old.mount not in cat.mounts:
            raise OpError(f"{category} cannot be mounted {old.mount!r}")
        size = op.size or (cat.default_size if (op.category and op.category != old.category) else old.size)
        self._check_size(category, size)
        changed = self._resized(old, size)
        new_id = old.id if category == old.category else self._new_id(category)
        changed[old.id] = changed[old.id].model_copy(update={
            "id": new_id, "category": category,
            "description": op.description if op.description is not None else old.description,
        })
        for kid_id in changed.keys() - {old.id}:
            if changed[kid_id].parent == old.id:
                changed[kid_id] = changed[kid_id].model_copy(update={"parent": new_id})
        self._replace_objects(changed)
        return f"-> {new_id}"

    def _resize_object(self, op: ResizeObject) -> str:
        o = self._get(op.id)
        if (op.size is None) == (op.scale is None):
            raise OpError("give exactly one of size or scale")
        if op.size is not None:
            size = op.size
        else:
            sc = (op.scale,) * 3 if isinstance(op.scale, (int, float)) else op.scale
            size = tuple(_r(a * b) for a, b in zip(o.size, sc))
        if min(size) <= 0:
            raise OpError("sizes must be positive")
        self._check_size(o.category, size)
        self._replace_objects(self._resized(o, size))
        return ""

    def _move_object(self, op: MoveObject) -> str:
        o = self._get(op.id)
        self._rigid(o, op.position, o.yaw if op.yaw is None else op.yaw)
        return ""

    def _rotate_object(self, op: RotateObject) -> str:
        o = self._get(op.id)
        self._rigid(o, o.position, op.yaw)
        return ""

    def _remove_object(self, op: RemoveObject) -> str:
        self._get(op.id)
        gone = {op.id, *self._descendants(op.id)}
        self._replace_objects({}, removed=gone)
        return f"(removed {', '.join(sorted(gone, key=id_sort_key))})"

    def _snap_to_wall(self, op: SnapToWall) -> str:
        o = self._get(op.id)
        room = self.scene.room
        n_walls = len(room.floor_polygon)
        if op.wall is not None and not 0 <= op.wall < n_walls:
            raise OpError(f"wall {op.wall} does not exist (0..{n_walls - 1})")
        c = np.asarray(o.position)
        wall = op.wall
        if wall is None:
            best = math.inf
            for i in range(n_walls):
                p0, t, _, length = wall_frame(room, i)
                s = min(max(float((c - p0) @ t), 0.0), length)
                d = float(np.hypot(*(p0 + t * s - c)))
                if d < best - 1e-9:
                    best, wall = d, i
        p0, t, n, length = wall_frame(room, wall)
        if op.orientation == "away":
            yaw, half_perp, half_along = _yaw_of_front(n), o.size[1] / 2, o.size[0] / 2
        else:
            yaw, half_perp, half_along = _yaw_of_front(t), o.size[0] / 2, o.size[1] / 2
        s = float((c - p0) @ t)
        s = length / 2 if length < 2 * half_along else min(max(s, half_along), length - half_along)
        pos = p0 + t * s + n * (half_perp + SNAP_GAP_M)
        self._rigid(o, (pos[0], pos[1]), yaw)
        return f"(wall {wall})"

    def _snap_to_object(self, op: SnapToObject) -> str:
        o, tgt = self._get(op.id), self._get(op.target)
        if o.id == tgt.id:
            raise OpError("an object cannot snap to itself")
        if tgt.id in self._descendants(o.id):
            raise OpError(f"{tgt.id} sits on {o.id}")
        f = front_direction(tgt.yaw)
        ux = np.array([f[1], -f[0]])
        d, tangent, half_t = {
            "front": (f, ux, tgt.size[1] / 2),
            "back": (-f, ux, tgt.size[1] / 2),
            "right": (ux, f, tgt.size[0] / 2),
            "left": (-ux, f, tgt.size[0] / 2),
        }[op.side]
        yaw = {"toward": _yaw_of_front(-d), "same": tgt.yaw, "none": o.yaw}[op.orientation]
        fo = front_direction(yaw)
        uo = np.array([fo[1], -fo[0]])
        half_o = abs(o.size[0] / 2 * float(uo @ d)) + abs(o.size[1] / 2 * float(fo @ d))
        pos = np.asarray(tgt.position) + d * (half_t + half_o + SNAP_GAP_M) + tangent * op.offset
        self._rigid(o, (pos[0], pos[1]), yaw)
        return ""

    def _get_scene(self, op: GetScene) -> str:
        return ""
