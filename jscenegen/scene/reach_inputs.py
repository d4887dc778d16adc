"""Millimetre-quantised integer encoding of a scene for the reachability grid (NumPy and JAX).

Both reachability implementations read only these integer arrays, so they rasterise identical
geometry: positions and sizes are rounded to whole millimetres, footprint corners are computed
from the rounded values and rounded to whole millimetres again (round half to even), and every
coordinate is taken relative to the floor polygon's minimum corner. Cell (iy, ix) has its centre
at ((ix + 0.5) cell, (iy + 0.5) cell); `cell_mm` must be even so centres are whole millimetres.
Tie rules: a cell centre on a footprint edge is inside the footprint; a door start point on a
cell boundary seeds every cell whose closed square contains it (rotation-symmetric). A footprint
that covers no cell centre of the room's grid (a 3 cm deep mirror between two rows of centres)
is the one cell holding the object's mm-rounded centre, cell (y // cell, x // cell): a centre on
a cell boundary belongs to the cell above or to the right of it (none when that cell is off the
grid), so every object within the room blocks and can be reached (reachability.footprint_mask).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .catalogue import Catalogue
from .config import MetricsConfig
from .geometry import box_corners, opening_centre
from .schema import Scene, SceneObject

INT32_LIMIT = 2**31 - 1
# The integer geometry needs 4 m (grid + m) < 2**31 for a corner m mm from the grid origin: a
# grid of side g measures every room that fits it (m <= g) while 8 g**2 < 2**31.
MAX_ANY_ROOM_GRID_MM = math.isqrt(INT32_LIMIT // 8)


def _reach_mm(grid_mm: int) -> float:
    """How far from the grid origin (mm) a corner may lie with a grid of side `grid_mm`."""
    return (math.sqrt(grid_mm ** 2 + INT32_LIMIT) - grid_mm) / 2


class ReachabilityError(ValueError):
    """A scene outside the reachability grid's hard bounds (grid size, object/door/vertex count)."""


@dataclass(frozen=True)
class GridSpec:
    """Integer grid parameters derived from MetricsConfig (millimetres and cells)."""

    cell_mm: int
    grid_size: int
    radius_mm: int
    ring_mm: int
    min_region_cells: int

    @staticmethod
    def from_config(cfg: MetricsConfig) -> "GridSpec":
        # regions "larger than" min_region_m2: strictly more cells than this many
        min_cells = math.floor(cfg.min_region_m2 * 1e6 / cfg.cell_mm**2 + 1e-9)
        return GridSpec(
            cell_mm=cfg.cell_mm,
            grid_size=cfg.grid_size,
            radius_mm=round(cfg.agent_radius_m * 1000),
            ring_mm=cfg.ring_mm,
            min_region_cells=min_cells,
        )

    def disk_rows(self, r_mm: int) -> tuple[tuple[int, int], ...]:
        """((dy, half_width), ...): the disk {(dy, dx): (dx^2 + dy^2) cell^2 <= r^2} row by row."""
        rc = r_mm // self.cell_mm   # each row's w: the largest with (w^2 + dy^2) cell^2 <= r^2
        return tuple((dy, math.isqrt(r_mm**2 // self.cell_mm**2 - dy * dy)) for dy in range(-rc, rc + 1))


@dataclass(frozen=True)
class ReachInputs:
    """One scene as padded integer arrays (N objects, D doors, V vertices; coordinates in mm).

    poly [V, 2] int32 (padded by repeating the last vertex), corners [N, 4, 2] int32 (CCW:
    back-left, back-right, front-right, front-left), centres [N, 2] int32 (the rounded position,
    the corners' centre), blocking/counted/front_only [N] bool,
    starts [D, 4, 2] int32 (ix, iy) with start_valid [D, 4] bool, door_valid [D] bool.
    nx, ny: the room's own grid extent in cells; object_ids: ids of the first len(ids) slots.
    parent [N] int32: the slot of the object an `on` object stands on, -1 for none (padding, other
    mounts, an unknown id); the blocker search leaves an object out with what stands on it.
    """

    poly: np.ndarray
    corners: np.ndarray
    centres: np.ndarray
    blocking: np.ndarray
    counted: np.ndarray
    front_only: np.ndarray
    starts: np.ndarray
    start_valid: np.ndarray
    door_valid: np.ndarray
    nx: int
    ny: int
    object_ids: tuple[str, ...]
    parent: np.ndarray


def is_thin(obj: SceneObject, catalogue: Catalogue, cfg: MetricsConfig) -> bool:
    """Thin covering (rug, mat): catalogue flag or height <= thin_height_m."""
    cat = catalogue.get(obj.category)
    return bool(cat and cat.thin) or obj.size[2] <= cfg.thin_height_m


def blocks_walking(obj: SceneObject, catalogue: Catalogue, cfg: MetricsConfig) -> bool:
    """Obstacle for the agent (scene-protocol.md section 4: "objects whose bottom is >= 1.5 m and
    thin coverings never block"): not thin and bottom below `block_height_m`, whatever its mount.
    An object `on` another blocks too (rules revision 6): a plant on a rug stands on the floor in
    effect; a lamp on a nightstand adds only what overhangs the nightstand's footprint."""
    return not is_thin(obj, catalogue, cfg) and obj.elevation < cfg.block_height_m


def support_chain(obj: SceneObject, scene: Scene) -> list[SceneObject]:
    """The objects `obj` stands on, nearest first (its parent, the parent's parent, ...); empty
    unless mounted `on`. Stops at an unknown id or a repeated one (a scene built without
    validation), so it always ends."""
    chain: list[SceneObject] = []
    seen = {obj.id}
    at = obj.parent if obj.mount == "on" else None
    while at is not None and at not in seen:
        parent = next((o for o in scene.objects if o.id == at), None)
        if parent is None:
            break
        chain.append(parent)
        seen.add(at)
        at = parent.parent if parent.mount == "on" else None
    return chain


def is_floor_object(obj: SceneObject, scene: Scene) -> bool:
    """Stands on the floor, directly (mount `floor`) or through its supports (`on` a chain that
    ends at a floor object): a lamp on a nightstand or a plant on a rug is one, a lamp on a
    wall shelf is not."""
    chain = support_chain(obj, scene)
    return (chain[-1] if chain else obj).mount == "floor"


def stands_on_floor(obj: SceneObject, scene: Scene, catalogue: Catalogue, cfg: MetricsConfig) -> bool:
    """Stands on the floor in effect (rules revision 6): mount `floor`, or `on` a chain of thin
    coverings that ends on the floor (a wardrobe or a plant on a rug). A lamp on a nightstand
    does not (it stands on the nightstand), nor does anything on a wall or ceiling mount. The one
    rule for "floor object" in what must be reached (`counts_for_reach`) and in the front checks
    (metrics' front_to_wall_objects, judge_rule's blocked fronts)."""
    chain = support_chain(obj, scene)
    return (chain[-1] if chain else obj).mount == "floor" and all(
        is_thin(p, catalogue, cfg) for p in chain)


def blocks_door(obj: SceneObject, scene: Scene, catalogue: Catalogue, cfg: MetricsConfig) -> bool:
    """Counts against a door's clearance box ("must be free of floor objects", scene-protocol.md
    section 4): a floor object (`is_floor_object`) that blocks walking. A shelf hung on the wall
    beside the door, and what stands on it, does not."""
    return is_floor_object(obj, scene) and blocks_walking(obj, catalogue, cfg)


def counts_for_reach(obj: SceneObject, scene: Scene, catalogue: Catalogue, cfg: MetricsConfig) -> bool:
    """Must be reachable ("only blocking floor objects count"): an object that blocks walking and
    stands on the floor in effect (`stands_on_floor`: on the floor, or on thin coverings only).
    A lamp on a nightstand is reached through the nightstand; a plant on a rug counts as on the
    floor. (A parent that is not thin and stands on the floor through thin coverings has its
    bottom below block_height_m, so it blocks: this is "stands on nothing that blocks".)"""
    return blocks_walking(obj, catalogue, cfg) and stands_on_floor(obj, scene, catalogue, cfg)


def quantised_centre(obj: SceneObject) -> np.ndarray:
    """Footprint centre [2] int64 in absolute millimetres: the position rounded to whole mm."""
    return np.array([round(v * 1000) for v in obj.position], np.int64)


def quantised_corners(obj: SceneObject) -> np.ndarray:
    """Footprint corners [4, 2] int64 in absolute millimetres, from mm-rounded position and size."""
    x, y = (int(v) for v in quantised_centre(obj))
    w, d = (round(v * 1000) for v in obj.size[:2])
    return np.rint(box_corners(x, y, w, d, obj.yaw)).astype(np.int64)


def _start_cells(v_mm: int, cell_mm: int) -> list[int]:
    base = v_mm // cell_mm
    return [base - 1, base] if v_mm % cell_mm == 0 else [base]


def check_room_bounds(scene: Scene, cfg: MetricsConfig) -> None:
    """Raise ReachabilityError unless the room has 1..max_doors doors and at most
    max_polygon_vertices floor vertices. Counts only, so callers run it before any geometry."""
    room = scene.room
    if len(room.floor_polygon) > cfg.max_polygon_vertices:
        raise ReachabilityError(
            f"floor_polygon has {len(room.floor_polygon)} vertices, the grid allows {cfg.max_polygon_vertices}"
        )
    if not room.doors:
        raise ReachabilityError("the room has no door: reachability is measured from the doors, so nothing "
                                "would be reachable; add one to room.doors")
    if len(room.doors) > cfg.max_doors:
        raise ReachabilityError(f"{len(room.doors)} doors, the grid allows {cfg.max_doors}")


def encode_scene(
    scene: Scene,
    cfg: MetricsConfig,
    catalogue: Catalogue,
    max_objects: int,
) -> ReachInputs:
    """Encode `scene` for the reachability kernels. Raises ReachabilityError beyond the hard bounds.

    Bounds: the room's bounding box must fit grid_size cells per side, at most max_objects objects,
    1..metrics.max_doors doors, metrics.max_polygon_vertices vertices, and every corner close enough to the
    room that int32 cross products cannot overflow (4 M (E + M) < 2^31, M the largest |coordinate|,
    E the padded grid extent, all in mm).
    """
    spec = GridSpec.from_config(cfg)
    room = scene.room
    check_room_bounds(scene, cfg)
    if len(scene.objects) > max_objects:
        raise ReachabilityError(f"{len(scene.objects)} objects, the grid allows {max_objects}")
    max_doors = cfg.max_doors
    poly_abs = np.array([[round(x * 1000), round(y * 1000)] for x, y in room.floor_polygon], dtype=np.int64)
    origin = poly_abs.min(axis=0)
    poly = poly_abs - origin
    extent = poly.max(axis=0)
    nx, ny = (int(-(-int(e) // spec.cell_mm)) for e in extent)
    if max(nx, ny) > spec.grid_size:
        raise ReachabilityError(
            f"room bounding box {extent[0] / 1000:.2f} x {extent[1] / 1000:.2f} m exceeds the "
            f"{spec.grid_size} x {spec.grid_size} cell grid ({spec.grid_size * spec.cell_mm / 1000:.2f} m); "
            "raise scene.metrics.grid_size (at most 512) or cell_m"
        )
    grid_mm = spec.grid_size * spec.cell_mm
    room_mm = int(extent.max())
    if 4 * room_mm * (grid_mm + room_mm) >= INT32_LIMIT:   # the per-object bound below, at the walls
        raise ReachabilityError(
            f"room bounding box {extent[0] / 1000:.2f} x {extent[1] / 1000:.2f} m: with the "
            f"{spec.grid_size} x {spec.grid_size} cell grid ({grid_mm / 1000:.2f} m, "
            "scene.metrics.grid_size x cell_m) its far corners lie beyond what the measuring "
            f"grid's 32-bit arithmetic reaches ({_reach_mm(grid_mm) / 1000:,.1f} m from the "
            "origin); lower grid_size or cell_m to the room (a grid of at most "
            f"{MAX_ANY_ROOM_GRID_MM / 1000:.3f} m measures any room that fits it)")
    n = max_objects
    corners = np.zeros((n, 4, 2), np.int64)
    centres = np.zeros((n, 2), np.int64)
    blocking = np.zeros(n, bool)
    counted = np.zeros(n, bool)
    front_only = np.zeros(n, bool)
    for k, obj in enumerate(scene.objects):
        corners[k] = quantised_corners(obj) - origin
        centres[k] = quantised_centre(obj) - origin   # only divided, never multiplied: no int32 bound
        m = int(np.abs(corners[k]).max())
        if 4 * m * (grid_mm + m) >= INT32_LIMIT:
            raise ReachabilityError(
                f"object {obj.id}: a corner lies {m / 1000:,.1f} m from the room's grid origin; "
                f"the measuring grid's 32-bit arithmetic reaches {_reach_mm(grid_mm) / 1000:,.1f} m "
                "(move the object into or near the room)")
        blocking[k] = blocks_walking(obj, catalogue, cfg)
        counted[k] = counts_for_reach(obj, scene, catalogue, cfg)
        cat = catalogue.get(obj.category)
        front_only[k] = bool(cat and cat.front_used)
    slot = {o.id: k for k, o in enumerate(scene.objects)}
    parent = np.full(n, -1, np.int32)
    for k, obj in enumerate(scene.objects):
        if obj.mount == "on" and obj.parent in slot and obj.parent != obj.id:
            parent[k] = slot[obj.parent]
    v = cfg.max_polygon_vertices
    poly_p = np.concatenate([poly, np.repeat(poly[-1:], v - len(poly), axis=0)])
    starts = np.zeros((max_doors, 4, 2), np.int64)
    start_valid = np.zeros((max_doors, 4), bool)
    door_valid = np.zeros(max_doors, bool)
    step = (spec.radius_mm + spec.cell_mm) / 1000
    for d, door in enumerate(room.doors):
        door_valid[d] = True
        c, normal = opening_centre(room, door)
        p = np.rint((c + normal * step) * 1000).astype(np.int64) - origin
        k = 0
        for iy in _start_cells(int(p[1]), spec.cell_mm):
            for ix in _start_cells(int(p[0]), spec.cell_mm):
                starts[d, k] = (ix, iy)
                start_valid[d, k] = 0 <= ix < nx and 0 <= iy < ny
                k += 1
    return ReachInputs(
        poly=poly_p.astype(np.int32),
        corners=corners.astype(np.int32),
        centres=centres.astype(np.int32),
        blocking=blocking,
        counted=counted,
        front_only=front_only,
        starts=starts.astype(np.int32),
        start_valid=start_valid,
        door_valid=door_valid,
        nx=nx,
        ny=ny,
        object_ids=tuple(o.id for o in scene.objects),
        parent=parent,
    )
