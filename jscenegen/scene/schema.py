"""Scene schema `scenegen.scene/1`: room, openings, objects and budget as validated pydantic models.

Units are metres and degrees; top view x right, y forward, z up; yaw counter-clockwise from above;
an object's front is its local +y at yaw 0 (scene-protocol.md section 1). Models are frozen: the
runtime builds new scenes instead of mutating them, so snapshots (revert) are free.
"""
from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from jscenegen.config import PlainModel, validation_message
from jscenegen.paths import loads_json, not_a_file

SCHEMA_VERSION = "scenegen.scene/1"
Mount = Literal["floor", "on", "wall", "ceiling"]

# Hard bounds on what a scene may hold, so that reading and measuring any scene ends quickly
# (docs/scenes.md, "Bounds"): counted before any validation or geometry. The config caps
# (scene.max_objects = 40, scene.metrics.max_polygon_vertices and max_doors) may not exceed them.
MAX_SCENE_OBJECTS = 128  # measuring 128 crowded objects takes ~0.3 s (bench/scene_measure.py)
MAX_FLOOR_VERTICES = 64
MAX_OPENINGS = 16  # doors, and windows, each
MAX_NAME_CHARS = 128  # an object's category; its id (`<category>_<n>`) up to 16 more
MAX_ID_CHARS = MAX_NAME_CHARS + 16  # an object's id and a scene's scene_id
MAX_DESCRIPTION_CHARS = 1000  # an object's description: every later prompt repeats it
MAX_JSON_FILE_BYTES = 4 * 2**20  # read_json_file refuses larger files unread; parsing 4 MiB takes ~0.2 s
# Every length and coordinate (metres) lies within +-MAX_COORDINATE_M: far beyond any room, and small
# enough that the geometry (rounding, grids, float32 on the device) stays exact and finite.
MAX_COORDINATE_M = 1000.0
MAX_YAW_DEG = 36000.0  # yaw is read modulo 360; a larger magnitude loses its degrees to rounding


class SceneError(ValueError):
    """A scene (file or JSON) that does not satisfy the schema; the message names the field."""


class Door(PlainModel):
    """A door on edge `wall` (vertex wall -> wall+1), centred `offset` metres along that edge."""

    wall: int = Field(ge=0)
    offset: float
    width: float = Field(gt=0)
    height: float = Field(gt=0)


class Window(Door):
    """A window like a door plus its sill height above the floor (metres)."""

    sill: float = Field(ge=0)


class Room(PlainModel):
    """Room shell: counter-clockwise simple floor polygon [[x, y], ...] (metres), walls, openings.

    At least one door (reachability starts at the doors); at most MAX_FLOOR_VERTICES vertices and
    MAX_OPENINGS doors and windows each.
    """

    type: str = "bedroom"
    floor_polygon: tuple[tuple[float, float], ...] = Field(min_length=3, max_length=MAX_FLOOR_VERTICES)
    wall_height: float = Field(gt=0, le=MAX_COORDINATE_M)
    doors: tuple[Door, ...] = Field((), max_length=MAX_OPENINGS, validate_default=True)
    windows: tuple[Window, ...] = Field((), max_length=MAX_OPENINGS)

    @field_validator("floor_polygon")
    @classmethod
    def _simple_ccw(cls, poly):
        for i, (x, y) in enumerate(poly):
            if abs(x) > MAX_COORDINATE_M or abs(y) > MAX_COORDINATE_M:
                raise ValueError(f"vertex {i} {[x, y]} is beyond +-{MAX_COORDINATE_M:g} m "
                                 f"(jscenegen.scene.schema.MAX_COORDINATE_M)")
        check_simple_ccw(poly)
        return poly

    @field_validator("doors")
    @classmethod
    def _a_door(cls, doors):
        if not doors:
            raise ValueError(
                "a room needs at least one door: reachability is measured from the doors "
                "(scene-protocol.md section 4), and without one nothing is reachable"
            )
        return doors

    @model_validator(mode="after")
    def _openings_on_walls(self) -> "Room":
        n = len(self.floor_polygon)
        for kind, items in (("doors", self.doors), ("windows", self.windows)):
            for i, op in enumerate(items):
                if op.wall >= n:
                    raise ValueError(f"{kind}[{i}].wall {op.wall} is not an edge index (polygon has {n} edges)")
                top = op.height + getattr(op, "sill", 0.0)
                if top > self.wall_height + 1e-9:
                    raise ValueError(f"{kind}[{i}]: its top at {top:g} m is above wall_height "
                                     f"{self.wall_height:g}")
                length = edge_length(self.floor_polygon, op.wall)
                if op.offset - op.width / 2 < -1e-9 or op.offset + op.width / 2 > length + 1e-9:
                    raise ValueError(
                        f"{kind}[{i}]: offset {op.offset} +- width/2 leaves wall {op.wall} (length {length:.3f})"
                    )
        self._openings_apart()
        return self

    def _openings_apart(self) -> None:
        """Refuse two openings on one wall that share wall area: their spans along the wall
        (offset +- width/2) and their heights (sill to sill + height; a door's sill is the
        floor) both overlap by more than 1e-9 m. Touching openings are accepted."""
        openings = [(f"doors[{i}]", d, 0.0) for i, d in enumerate(self.doors)]
        openings += [(f"windows[{i}]", w, w.sill) for i, w in enumerate(self.windows)]
        for j, (name_b, b, sill_b) in enumerate(openings):
            for name_a, a, sill_a in openings[:j]:
                if a.wall != b.wall:
                    continue
                along = (min(a.offset + a.width / 2, b.offset + b.width / 2)
                         - max(a.offset - a.width / 2, b.offset - b.width / 2))
                up = min(sill_a + a.height, sill_b + b.height) - max(sill_a, sill_b)
                if along > 1e-9 and up > 1e-9:
                    raise ValueError(f"{name_b} overlaps {name_a} on wall {b.wall} "
                                     f"({along:.3f} m along the wall)")


MOUNT_TOLERANCE_M = 1e-5   # the operations round elevations to 1e-6 m


def ceiling_elevation(wall_height: float, height: float) -> float:
    """The elevation (m) of an object `height` tall mounted on the ceiling: its top at
    `wall_height`."""
    return wall_height - height


class SceneObject(PlainModel):
    """One object: footprint centre `position` [x, y], `size` [width, depth, height], `yaw`
    degrees, `elevation` of its bottom above the floor (>= 0), `parent` only for mount 'on'."""

    id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    category: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    description: str = Field("", max_length=MAX_DESCRIPTION_CHARS)
    position: tuple[float, float]
    elevation: float = 0.0
    size: tuple[float, float, float]
    yaw: float = 0.0
    mount: Mount = "floor"
    parent: str | None = None

    @field_validator("size")
    @classmethod
    def _positive(cls, size):
        if any(s <= 0 for s in size):
            raise ValueError(f"every size component must be > 0, got {list(size)}")
        return size

    @model_validator(mode="after")
    def _parent(self) -> "SceneObject":
        if self.mount == "on" and not self.parent:
            raise ValueError(f"object {self.id}: mount 'on' needs a parent")
        if self.mount != "on" and self.parent is not None:   # as the add operation refuses it
            raise ValueError(f"object {self.id}: a parent is only for mount 'on', not {self.mount!r}")
        if self.parent == self.id:
            raise ValueError(f"object {self.id}: parent is the object itself")
        return self

    @model_validator(mode="after")
    def _bounded(self) -> "SceneObject":
        for name, values in (("position", self.position), ("elevation", (self.elevation,)),
                             ("size", self.size)):
            if any(abs(v) > MAX_COORDINATE_M for v in values):
                shown = list(values) if len(values) > 1 else values[0]
                raise ValueError(f"object {self.id}: {name} {shown} is beyond +-{MAX_COORDINATE_M:g} m "
                                 f"(jscenegen.scene.schema.MAX_COORDINATE_M)")
        if abs(self.yaw) > MAX_YAW_DEG:
            raise ValueError(f"object {self.id}: yaw {self.yaw} is beyond +-{MAX_YAW_DEG:g} degrees")
        if self.elevation < 0:
            raise ValueError(f"object {self.id}: elevation {self.elevation} puts its bottom below "
                             "the floor (metres above the floor, >= 0)")
        return self


class Budget(PlainModel):
    """Unit budget of an episode: total units and units charged so far (never more than the
    total: an operation that would go over it is refused, not charged)."""

    total_units: int = Field(512, ge=0)
    used_units: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _within(self) -> "Budget":
        if self.used_units > self.total_units:
            raise ValueError(f"used_units {self.used_units} exceeds total_units {self.total_units}")
        return self


class Scene(PlainModel):
    """A scene: room, prompt, objects and budget, schema `scenegen.scene/1`."""

    schema_: Literal["scenegen.scene/1"] = Field(SCHEMA_VERSION, alias="schema")
    scene_id: str = Field("", max_length=MAX_ID_CHARS)
    prompt: str = ""
    room: Room
    objects: tuple[SceneObject, ...] = Field((), max_length=MAX_SCENE_OBJECTS)
    budget: Budget = Budget()

    model_config = ConfigDict(**PlainModel.model_config, populate_by_name=True)

    @model_validator(mode="after")
    def _ids(self) -> "Scene":
        ids = [o.id for o in self.objects]
        dup = {i for i, n in Counter(ids).items() if n > 1}
        if dup:
            raise ValueError(f"duplicate object ids {sorted(dup)}")
        known = set(ids)
        for o in self.objects:
            if o.parent is not None and o.parent not in known:
                raise ValueError(f"object {o.id}: parent {o.parent!r} is not an object id")
        parents = {o.id: o.parent for o in self.objects}
        for o in self.objects:  # follow each parent chain; coming back to an object is a cycle
            chain, at = [o.id], o.parent
            while at is not None and at not in chain:
                chain.append(at)
                at = parents[at]
            if at is not None:
                cycle = chain[chain.index(at):]
                raise ValueError(f"objects {' -> '.join(cycle + [at])}: parents form a cycle")
        return self

    @model_validator(mode="after")
    def _mounted_heights(self) -> "Scene":
        """The elevations the scene operations give these mounts (ops.py): a floor object stands
        on the floor, a ceiling object's top is at the ceiling. (An object `on` another is kept
        on its parent's top by every operation since rules revision 4, a move or resize that
        would leave it beside the top being refused and charged; a scene file that holds one off
        its parent loads and is measured as unsupported. A wall object above the wall: measured
        as out of bounds.)"""
        wall = self.room.wall_height
        for o in self.objects:
            if o.mount == "floor" and o.elevation > MOUNT_TOLERANCE_M:
                raise ValueError(f"object {o.id}: mount 'floor' stands on the floor (elevation "
                                 f"0), not at elevation {o.elevation:g}")
            if (o.mount == "ceiling"
                    and abs(o.elevation - ceiling_elevation(wall, o.size[2])) > MOUNT_TOLERANCE_M):
                raise ValueError(f"object {o.id}: mount 'ceiling' has its top at the ceiling "
                                 f"(elevation + height = wall_height {wall:g}), not at "
                                 f"{o.elevation + o.size[2]:g}")
        return self

    def object(self, object_id: str) -> SceneObject | None:
        """The object with this id, or None."""
        for o in self.objects:
            if o.id == object_id:
                return o
        return None

    def to_json(self) -> dict:
        """Plain JSON-able dict with the `schema` key."""
        return self.model_dump(mode="json", by_alias=True)


def _segments_intersect(p1, p2, p3, p4) -> bool:
    def orient(a, b, c):
        v = (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0])
        return 0 if abs(v) < 1e-12 else (1 if v > 0 else -1)

    def on_seg(a, b, c):
        return min(a[0], b[0]) - 1e-12 <= c[0] <= max(a[0], b[0]) + 1e-12 and min(a[1], b[1]) - 1e-12 <= c[
            1
        ] <= max(a[1], b[1]) + 1e-12

    o1, o2, o3, o4 = orient(p1, p2, p3), orient(p1, p2, p4), orient(p3, p4, p1), orient(p3, p4, p2)
    if o1 != o2 and o3 != o4:
        return True
    return (
        (o1 == 0 and on_seg(p1, p2, p3))
        or (o2 == 0 and on_seg(p1, p2, p4))
        or (o3 == 0 and on_seg(p3, p4, p1))
        or (o4 == 0 and on_seg(p3, p4, p2))
    )


def signed_area(poly) -> float:
    """Shoelace signed area (m^2), positive for counter-clockwise."""
    s = 0.0
    for i in range(len(poly)):
        x0, y0 = poly[i]
        x1, y1 = poly[(i + 1) % len(poly)]
        s += x0 * y1 - x1 * y0
    return s / 2


def edge_length(poly, i: int) -> float:
    """Length (m) of polygon edge i (vertex i -> i+1)."""
    (x0, y0), (x1, y1) = poly[i], poly[(i + 1) % len(poly)]
    return math.hypot(x1 - x0, y1 - y0)


def check_simple_ccw(poly) -> None:
    """Raise ValueError unless `poly` is a simple counter-clockwise polygon with non-zero edges."""
    n = len(poly)
    for i in range(n):
        if edge_length(poly, i) < 1e-6:
            raise ValueError(f"floor_polygon edge {i} has zero length")
    for i in range(n):
        for j in range(i + 1, n):
            if j == i + 1 or (i == 0 and j == n - 1):
                continue
            if _segments_intersect(poly[i], poly[(i + 1) % n], poly[j], poly[(j + 1) % n]):
                raise ValueError(f"floor_polygon is not simple: edges {i} and {j} intersect")
    if signed_area(poly) <= 0:
        raise ValueError("floor_polygon must be counter-clockwise (positive area)")


def first_error_line(err: ValidationError, source: str, root: str = "<scene>") -> str:
    """`source: dotted.key: message (+N more)` for the first error of a scene-file validation
    (`root` names a whole-document error)."""
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"]) or root
    more = f" (+{len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    return f"{source}: {loc}: {validation_message(e)}{more}"


def check_counts(data: dict, source: str = "<scene>") -> None:
    """Refuse a scene JSON dict holding more objects, floor vertices, doors or windows than the
    hard bounds (MAX_SCENE_OBJECTS, MAX_FLOOR_VERTICES, MAX_OPENINGS) by counting its lists, before
    any validation: validating or measuring an oversized scene is what would take long.
    Raises SceneError naming `source`, the key, the count and the bound."""
    room = data.get("room")
    room = room if isinstance(room, dict) else {}
    for key, items, bound, name in (
        ("objects", data.get("objects"), MAX_SCENE_OBJECTS, "MAX_SCENE_OBJECTS"),
        ("room.floor_polygon", room.get("floor_polygon"), MAX_FLOOR_VERTICES, "MAX_FLOOR_VERTICES"),
        ("room.doors", room.get("doors"), MAX_OPENINGS, "MAX_OPENINGS"),
        ("room.windows", room.get("windows"), MAX_OPENINGS, "MAX_OPENINGS"),
    ):
        if isinstance(items, (list, tuple)) and len(items) > bound:
            raise SceneError(
                f"{source}: {key} has {len(items)} entries; a scene holds at most {bound} "
                f"(jscenegen.scene.schema.{name})"
            )


def scene_from_json(data: dict, source: str = "<scene>") -> Scene:
    """Validate a JSON dict into a Scene. Raises SceneError naming `source` and the field, and
    refuses a scene beyond the hard bounds (`check_counts`) before validating it."""
    if not isinstance(data, dict):
        raise SceneError(f"{source}: a scene must be a JSON object, got {type(data).__name__}")
    if data.get("schema", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise SceneError(f"{source}: schema {data.get('schema')!r} is not {SCHEMA_VERSION!r}")
    check_counts(data, source)
    try:
        return Scene.model_validate(data)
    except ValidationError as err:
        raise SceneError(first_error_line(err, source)) from None


def parse_json(text: str, label: str):
    """json.loads(text), with every way JSON text can be bad (syntax, nesting deeper than the
    parser's recursion limit, integers beyond Python's digit limit, a key repeated within one
    object) as one SceneError naming `label`."""
    try:
        return loads_json(text)
    except ValueError as err:
        hint = ""
        if isinstance(err, json.JSONDecodeError) and err.msg == "Extra data" and err.colno == 1:
            hint = (f" (a second JSON document starts on line {err.lineno}: a JSONL file such as "
                    "a scene set? this input is one JSON document, e.g. one line of a set)")
        raise SceneError(f"{label}: not valid JSON: {err}{hint}") from None


def read_json_file(path: str | Path, label: str | None = None, max_bytes: int = MAX_JSON_FILE_BYTES):
    """Parsed JSON of `path`. Raises SceneError naming `label` (default: the path) when the file
    is missing, larger than `max_bytes` (checked before reading), or not valid JSON (including
    nesting too deep to parse)."""
    label = label or str(path)
    if why := not_a_file(path):
        raise SceneError(f"{label}: {why}")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise SceneError(f"{label}: {size} bytes; a scene or report file may hold at most {max_bytes} bytes")
            raw = f.read(max_bytes + 1)
    except OSError as err:     # removed or replaced since the check
        raise SceneError(f"{label}: {err.strerror or err}") from None
    if len(raw) > max_bytes:  # grew while we read it, or not a regular file
        raise SceneError(f"{label}: more than {max_bytes} bytes; a scene or report file may hold at most that")
    return parse_json(json_text(raw, label), label)


def json_text(raw: bytes, label: str, file_start: bool = True) -> str:
    """The text of a JSON or JSONL file's bytes, a leading UTF-8 byte-order mark dropped when
    they start the file (it is not JSON; RFC 8259 8.1 lets a reader ignore it). Raises
    SceneError naming `label` for bytes that are not UTF-8."""
    try:
        return raw.decode("utf-8-sig" if file_start else "utf-8")
    except UnicodeDecodeError as err:
        raise SceneError(f"{label}: not UTF-8 text: {err}") from None


def load_scene(path: str | Path) -> Scene:
    """Read a scene JSON file (a bare scene, or a scene-set line `{"scene": ...}`)."""
    p = Path(path)
    data = read_json_file(p)
    if isinstance(data, dict) and "scene" in data and "room" not in data:
        data = data["scene"]
    return scene_from_json(data, str(p))


_ID = re.compile(r"^(.*)_(\d+)$")


def id_sort_key(object_id: str):
    """Natural order of ids `<category>_<n>`: bed_2 before bed_10."""
    m = _ID.match(object_id)
    return (m.group(1), int(m.group(2)), object_id) if m else (object_id, -1, object_id)


def _f(x: float) -> str:
    s = f"{x:.2f}"
    return "0.00" if s == "-0.00" else s


def _deg(yaw: float) -> str:
    return str(int(round(yaw)) % 360)


def canonical_text(scene: Scene) -> str:
    """Deterministic text of a scene for prompts: 0.01 m / 1 degree rounding, objects sorted by id."""
    room = scene.room
    poly = ", ".join(f"[{_f(x)}, {_f(y)}]" for x, y in room.floor_polygon)
    lines = [
        f"room {scene.scene_id or '-'}: type {room.type}, wall_height {_f(room.wall_height)}",
        f"floor_polygon [{poly}]",
    ]
    for i, d in enumerate(room.doors):
        lines.append(f"door_{i}: wall {d.wall} offset {_f(d.offset)} width {_f(d.width)} height {_f(d.height)}")
    for i, w in enumerate(room.windows):
        lines.append(
            f"window_{i}: wall {w.wall} offset {_f(w.offset)} width {_f(w.width)} height {_f(w.height)} sill {_f(w.sill)}"
        )
    lines.append(f"budget: {scene.budget.used_units}/{scene.budget.total_units} units used")
    lines.append(f"objects ({len(scene.objects)}):")
    for o in sorted(scene.objects, key=lambda o: id_sort_key(o.id)):
        parent = f" parent {o.parent}" if o.parent else ""
        desc = json.dumps(o.description, ensure_ascii=False)
        lines.append(
            f"{o.id} {o.category} {desc} pos [{_f(o.position[0])}, {_f(o.position[1])}] elev {_f(o.elevation)} "
            f"size [{_f(o.size[0])}, {_f(o.size[1])}, {_f(o.size[2])}] yaw {_deg(o.yaw)} mount {o.mount}{parent}"
        )
    return "\n".join(lines)
