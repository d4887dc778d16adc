"""Float geometry of footprints: oriented boxes, separating-axis overlap, polygon clipping, openings.

Footprints are oriented rectangles given by 4 corners [4, 2] float64 (metres) in counter-clockwise
order back-left, back-right, front-right, front-left (front = local +y at yaw 0). The separating
axis theorem for two convex polygons gives both the overlap test and the penetration depth (over
the edge normals, the smallest distance one polygon must move to separate: `penetration`).
"""
from __future__ import annotations

import math

import numpy as np

from .schema import Door, Room, SceneObject


def _cos_sin(yaw_deg: float) -> tuple[float, float]:
    """cos and sin of an angle in degrees, exact at multiples of 90 so quarter turns stay exact."""
    q = yaw_deg / 90.0
    if q == int(q):
        return ((1.0, 0.0), (0.0, 1.0), (-1.0, 0.0), (0.0, -1.0))[int(q) % 4]
    a = math.radians(yaw_deg)
    return math.cos(a), math.sin(a)


def box_corners(cx: float, cy: float, width: float, depth: float, yaw_deg: float) -> np.ndarray:
    """Corners [4, 2] float64 of a width x depth rectangle centred at (cx, cy), rotated by yaw_deg."""
    c, s = _cos_sin(yaw_deg)
    local = np.array([[-width / 2, -depth / 2], [width / 2, -depth / 2], [width / 2, depth / 2], [-width / 2, depth / 2]])
    rot = np.array([[c, -s], [s, c]])
    return local @ rot.T + np.array([cx, cy])


def footprint(obj: SceneObject) -> np.ndarray:
    """Footprint corners [4, 2] float64 of an object (metres)."""
    return box_corners(obj.position[0], obj.position[1], obj.size[0], obj.size[1], obj.yaw)


def front_direction(yaw_deg: float) -> np.ndarray:
    """Unit vector [2] of the object's front (local +y) in the room frame."""
    c, s = _cos_sin(yaw_deg)
    return np.array([-s, c])


def penetration(a: np.ndarray, b: np.ndarray) -> float:
    """Separating-axis penetration depth (m) of convex polygons a [n, 2], b [m, 2] (spec section 4,
    "penetration >= 1 cm": metrics `penetration_m`).

    Along each edge normal, with a's projection [a0, a1] and b's [b0, b1], the depth is the
    distance one polygon must move along that normal to separate: min(a1 - b0, b1 - a0). The
    result is the smallest depth over all edge normals. <= 0 means separated (or touching): the
    value is then the (negated) gap along the first separating normal. For a partial overlap the
    depth equals the projections' overlap (min(a1, b1) - max(a0, b0)); for a projection that
    holds the other (a 5 mm thick shelf inside a bed's footprint) it is the larger move out,
    not the thin object's own extent. This is the one place the rule lives: collisions, door
    clearance and window boxes (metrics.py) and the expert's spacing (expert.py) all call it.
    """
    depth = math.inf
    for poly in (a, b):
        for i in range(len(poly)):
            e = poly[(i + 1) % len(poly)] - poly[i]
            n = np.array([-e[1], e[0]])
            norm = np.hypot(*n)
            if norm < 1e-12:
                continue
            n = n / norm
            pa, pb = a @ n, b @ n
            depth = min(depth, pa.max() - pb.min(), pb.max() - pa.min())
            if depth <= 0:
                return depth
    return depth


def polygon_area(poly: np.ndarray) -> float:
    """Absolute shoelace area (m^2) of polygon [n, 2]."""
    if len(poly) < 3:
        return 0.0
    x, y = poly[:, 0], poly[:, 1]
    return abs(float(np.dot(x, np.roll(y, -1)) - np.dot(np.roll(x, -1), y))) / 2


def clip_to_convex(subject: np.ndarray, clip: np.ndarray) -> np.ndarray:
    """Sutherland-Hodgman: subject polygon [n, 2] (any simple polygon) clipped by convex CCW `clip`.

    The subject may be concave: the result can carry degenerate zero-width bridges, which do not
    change its area, so `polygon_area` of the result is the intersection area.
    """
    out = [tuple(p) for p in subject]
    for i in range(len(clip)):
        a, b = clip[i], clip[(i + 1) % len(clip)]
        ex, ey = b[0] - a[0], b[1] - a[1]

        def side(p):
            return ex * (p[1] - a[1]) - ey * (p[0] - a[0])

        src, out = out, []
        for j in range(len(src)):
            p, q = src[j], src[(j + 1) % len(src)]
            sp, sq = side(p), side(q)
            if sp >= 0:
                out.append(p)
            if (sp >= 0) != (sq >= 0):
                t = sp / (sp - sq)
                out.append((p[0] + t * (q[0] - p[0]), p[1] + t * (q[1] - p[1])))
        if not out:
            return np.zeros((0, 2))
    return np.array(out)


def outside_fraction(corners: np.ndarray, floor: np.ndarray) -> float:
    """Share (0..1) of the footprint's area outside the floor polygon [n, 2] (CCW, simple)."""
    area = polygon_area(corners)
    if area <= 0:
        return 0.0
    inside = polygon_area(clip_to_convex(floor, corners))
    return float(min(1.0, max(0.0, 1.0 - inside / area)))


def point_in_polygon(x: float, y: float, poly) -> bool:
    """Crossing-number test of point (x, y) against polygon [[x, y], ...]."""
    inside = False
    n = len(poly)
    for i in range(n):
        (x0, y0), (x1, y1) = poly[i], poly[(i + 1) % n]
        if (y0 > y) != (y1 > y):
            xc = x0 + (y - y0) * (x1 - x0) / (y1 - y0)
            if x < xc:
                inside = not inside
    return inside


def point_on_polygon(x: float, y: float, poly, tol: float = 1e-6) -> bool:
    """Point (x, y) inside polygon [[x, y], ...] or within `tol` (m; operations store positions
    rounded to 1e-6 m) of its boundary: one rule for a centre on any wall line
    (`point_in_polygon`'s crossing test counts only some edges)."""
    xs, ys = [v[0] for v in poly], [v[1] for v in poly]
    if not (min(xs) - tol <= x <= max(xs) + tol and min(ys) - tol <= y <= max(ys) + tol):
        return False
    p = np.array([x, y], dtype=float)
    n = len(poly)
    for i in range(n):
        if point_segment_distance(p, poly[i], poly[(i + 1) % n]) <= tol:
            return True
    return point_in_polygon(x, y, poly)


def wall_frame(room: Room, wall: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """(start [2], unit tangent [2], inward unit normal [2], length m) of polygon edge `wall`.

    For a counter-clockwise polygon the interior lies to the left of each edge, so the inward
    normal is the tangent rotated by +90 degrees.
    """
    poly = room.floor_polygon
    p0 = np.array(poly[wall], dtype=float)
    p1 = np.array(poly[(wall + 1) % len(poly)], dtype=float)
    d = p1 - p0
    length = float(np.hypot(*d))
    t = d / length
    return p0, t, np.array([-t[1], t[0]]), length


def opening_centre(room: Room, opening: Door) -> tuple[np.ndarray, np.ndarray]:
    """(centre point on the wall [2], inward normal [2]) of a door or window."""
    p0, t, n, _ = wall_frame(room, opening.wall)
    return p0 + t * opening.offset, n


def opening_box(room: Room, opening: Door, depth: float) -> np.ndarray:
    """Clearance box corners [4, 2] (CCW): the opening's width along the wall x `depth` into the room."""
    p0, t, n, _ = wall_frame(room, opening.wall)
    c = p0 + t * opening.offset
    a, b = c - t * opening.width / 2, c + t * opening.width / 2
    return np.array([a, b, b + n * depth, a + n * depth])


def segment_distance(p: np.ndarray, q: np.ndarray, a: np.ndarray, b: np.ndarray) -> float:
    """Shortest distance (m) between segments pq and ab (0 when they cross)."""

    def cross(o, u, v):
        return (u[0] - o[0]) * (v[1] - o[1]) - (u[1] - o[1]) * (v[0] - o[0])

    d1, d2, d3, d4 = cross(a, b, p), cross(a, b, q), cross(p, q, a), cross(p, q, b)
    if ((d1 > 0) != (d2 > 0)) and ((d3 > 0) != (d4 > 0)) and d1 * d2 < 0 and d3 * d4 < 0:
        return 0.0
    return min(point_segment_distance(p, a, b), point_segment_distance(q, a, b),
               point_segment_distance(a, p, q), point_segment_distance(b, p, q))


def segment_to_walls(p: np.ndarray, q: np.ndarray, floor) -> float:
    """Smallest distance (m) from segment pq to any edge (wall) of the floor polygon [[x, y], ...]."""
    poly = np.asarray(floor, dtype=float)
    return min(segment_distance(p, q, poly[i], poly[(i + 1) % len(poly)]) for i in range(len(poly)))


def point_segment_distance(x: np.ndarray, a: np.ndarray, b: np.ndarray) -> float:
    """Distance (m) from point x to segment ab (each [2] float, metres; lists are taken too):
    to the nearest point of the segment, an end when x projects beyond it; to `a` when a == b.
    The one point-to-segment distance of this module (`segment_distance`,
    `point_on_polygon` and `segment_off_walls` call it)."""
    x, a, b = (np.asarray(v, dtype=float) for v in (x, a, b))
    d = b - a
    ll = float(d @ d)
    t = 0.0 if ll == 0 else min(1.0, max(0.0, float((x - a) @ d) / ll))
    return float(np.hypot(*(a + t * d - x)))


def straight_walls(floor, tol: float = 1e-6) -> list[tuple[np.ndarray, np.ndarray]]:
    """The floor polygon [N, 2] (CCW, simple; metres) as walls: (start [2], end [2]) per wall,
    consecutive collinear edges merged into one wall (a vertex within `tol` m of the segment
    joining its neighbours lies along a straight wall). Only for measuring: the stored polygon
    and its edge numbers (doors and windows name an edge) stay as they are."""
    poly = np.asarray(floor, dtype=float)
    n = len(poly)
    corners = [i for i in range(n)
               if point_segment_distance(poly[i], poly[i - 1], poly[(i + 1) % n]) > tol]
    return [(poly[c], poly[corners[(k + 1) % len(corners)]]) for k, c in enumerate(corners)]


def segment_off_walls(p: np.ndarray, q: np.ndarray, floor) -> float:
    """How far (m) segment pq (ends p, q: [2] float, metres) lies from lying along one wall of
    the floor polygon [N, 2]: for each wall the larger of p's and q's distances to it, the
    smallest over the walls. Collinear consecutive edges count as one wall (`straight_walls`),
    so a back face across a vertex in the middle of a straight wall lies along it. Small only
    when both ends are near the same wall (a segment sticking out of a wall measures its
    length, though one end touches it)."""
    return min(max(point_segment_distance(p, a, b), point_segment_distance(q, a, b))
               for a, b in straight_walls(floor))


def distance_to_walls(corners: np.ndarray, floor) -> float:
    """Smallest distance (m) from a footprint [4, 2] to any edge of the floor polygon."""
    return min(segment_to_walls(corners[k], corners[(k + 1) % 4], floor) for k in range(4))
