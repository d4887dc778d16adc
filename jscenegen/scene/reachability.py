"""Door-anchored grid reachability, NumPy reference (scene-protocol.md section 4).

free = floor eroded by the agent disk, minus blocking footprints dilated by it; a 4-connected
flood fill from each door's start cell gives the reached region; an object is reachable when the
ring between its footprint dilated by r and by r + margin touches the reached region (for
front-used objects only the ring strictly beyond the front face's line counts). Regions are the
4-connected components of free with more than `min_region_cells` cells. An object's footprint
is the cells whose centre lies inside or on its box; a box that holds no cell centre of the room's
grid (thinner than a cell between two rows of centres: a 3 cm deep standing mirror) is the one
cell holding its mm-rounded centre, cell (y // cell, x // cell), a centre on a cell boundary
going to the cell above or right of it (`footprint_mask`; without it such an object would
neither block nor ever be reachable, and a 2.5 cm move would flip it). The method follows
PhyScene's door-anchored reachability with SceneEval's front accessibility; this module is the
plain reference (connected-component labelling, literal rings) the JAX kernel in reachability_jax.py must
match exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.ndimage

from .reach_inputs import GridSpec, ReachInputs


@dataclass(frozen=True)
class ReachResult:
    """Counts and flags of one scene; masks [ny, nx] bool on the room's own grid (reference only)."""

    floor_cells: int
    free_cells: int
    reached_cells: int
    num_regions: int
    largest_region_cells: int
    door_start_free: np.ndarray  # [D] bool, False for padding doors
    object_reachable: np.ndarray  # [N] bool, False for padding and non-counted objects
    free: np.ndarray | None = None
    reached: np.ndarray | None = None


_FOUR_NEIGHBOURS = np.array([[0, 1, 0], [1, 1, 1], [0, 1, 0]], bool)


def _cell_centres(nx: int, ny: int, cell_mm: int) -> tuple[np.ndarray, np.ndarray]:
    half = cell_mm // 2
    px = (np.arange(nx, dtype=np.int64) * cell_mm + half)[None, :]
    py = (np.arange(ny, dtype=np.int64) * cell_mm + half)[:, None]
    return np.broadcast_to(px, (ny, nx)), np.broadcast_to(py, (ny, nx))


def floor_mask(poly: np.ndarray, nx: int, ny: int, cell_mm: int) -> np.ndarray:
    """[ny, nx] bool: cell centre inside the polygon (crossing number, exact integer arithmetic)."""
    px, py = _cell_centres(nx, ny, cell_mm)
    poly = poly.astype(np.int64)
    inside = np.zeros((ny, nx), bool)
    for i in range(len(poly)):
        (x0, y0), (x1, y1) = poly[i], poly[(i + 1) % len(poly)]
        if y0 == y1:
            continue
        crosses = (y0 > py) != (y1 > py)
        lhs = (px - x0) * (y1 - y0)
        rhs = (py - y0) * (x1 - x0)
        left = lhs < rhs if y1 > y0 else lhs > rhs
        inside ^= crosses & left
    return inside


def footprint_mask(corners: np.ndarray, centre: np.ndarray, nx: int, ny: int, cell_mm: int) -> np.ndarray:
    """[ny, nx] bool: an object's footprint cells (the module docstring's rule).

    corners [4, 2] (mm, convex CCW quad), centre [2] (mm). The cells whose centre lies inside or
    on the quad; when there is none, the one cell (centre_y // cell_mm, centre_x // cell_mm),
    or no cell when that one is off the nx x ny grid.
    """
    px, py = _cell_centres(nx, ny, cell_mm)
    c = corners.astype(np.int64)
    inside = np.ones((ny, nx), bool)
    for k in range(4):
        (ax, ay), (bx, by) = c[k], c[(k + 1) % 4]
        inside &= (bx - ax) * (py - ay) - (by - ay) * (px - ax) >= 0
    if not inside.any():
        ix, iy = (int(v) // cell_mm for v in centre)
        if 0 <= ix < nx and 0 <= iy < ny:
            inside[iy, ix] = True
    return inside


def beyond_front(corners: np.ndarray, nx: int, ny: int, cell_mm: int) -> np.ndarray:
    """[ny, nx] bool: cell centre strictly beyond the front face line (corner 2 -> corner 3)."""
    px, py = _cell_centres(nx, ny, cell_mm)
    c = corners.astype(np.int64)
    (ax, ay), (bx, by) = c[2], c[3]
    return (bx - ax) * (py - ay) - (by - ay) * (px - ax) < 0


def dilate(mask: np.ndarray, rows, outside: bool = False) -> np.ndarray:
    """Union of `mask` shifted by every disk offset; cells beyond the array read as `outside`."""
    if not rows:
        return np.zeros_like(mask)
    reach = max(max(abs(dy), w) for dy, w in rows)
    disk = np.zeros((2 * reach + 1, 2 * reach + 1), bool)
    for dy, w in rows:
        disk[reach + dy, reach - w : reach + w + 1] = True
    return scipy.ndimage.binary_dilation(mask, structure=disk, border_value=outside)


def _components(free: np.ndarray) -> np.ndarray:
    """[ny, nx] int32 labels 1..k of the 4-connected components of `free` (0 elsewhere)."""
    return scipy.ndimage.label(free, structure=_FOUR_NEIGHBOURS)[0].astype(np.int32)


def crop_window(mask: np.ndarray, margin: int) -> tuple[slice, slice] | None:
    """(rows, cols) slices of the bounding box of `mask`'s cells widened by `margin` cells (clipped
    to the grid), or None when `mask` is empty."""
    ys, xs = np.nonzero(mask)
    if len(ys) == 0:
        return None
    ny, nx = mask.shape
    return (
        slice(max(0, ys.min() - margin), min(ny, ys.max() + margin + 1)),
        slice(max(0, xs.min() - margin), min(nx, xs.max() + margin + 1)),
    )


def access_ring(inp: ReachInputs, k: int, foot: np.ndarray, nx: int, ny: int, cell: int,
                r_rows, ring_rows, margin: int) -> tuple[tuple[slice, slice], np.ndarray] | None:
    """Object k's access ring, cropped: (window, ring [window] bool), None when its footprint
    `foot` [ny, nx] (footprint_mask) is empty (the object is off the grid). The ring is the
    footprint dilated by the ring distance minus the footprint dilated by the agent radius, in
    front of the object only when it is front-only (`beyond_front`)."""
    win = crop_window(foot, margin)
    if win is None:
        return None
    f = foot[win]
    ring = dilate(f, ring_rows) & ~dilate(f, r_rows)
    if inp.front_only[k]:
        ring &= beyond_front(inp.corners[k], nx, ny, cell)[win]
    return win, ring


def reach_numpy(inp: ReachInputs, spec: GridSpec) -> ReachResult:
    """Reference reachability of one encoded scene. Returns ReachResult with masks.

    Cost: O(cells x disk) per object plus one connected-component labelling of the grid. The
    leave-one-out pass (each object removed in turn) is blockers.leave_one_out, not N calls here.
    """
    nx, ny, cell = inp.nx, inp.ny, spec.cell_mm
    r_rows, ring_rows = spec.disk_rows(spec.radius_mm), spec.disk_rows(spec.ring_mm)
    floor = floor_mask(inp.poly, nx, ny, cell)
    n_real = len(inp.object_ids)
    feet = [footprint_mask(inp.corners[k], inp.centres[k], nx, ny, cell) for k in range(n_real)]
    obst = np.zeros((ny, nx), bool)
    for k in range(n_real):
        if inp.blocking[k]:
            obst |= feet[k]
    free = ~dilate(~floor, r_rows, outside=True) & ~dilate(obst, r_rows)
    door_free = np.zeros(len(inp.door_valid), bool)
    seeds = []
    for d in range(len(inp.door_valid)):
        for s in range(4):
            if inp.start_valid[d, s]:
                ix, iy = (int(v) for v in inp.starts[d, s])
                if free[iy, ix]:
                    door_free[d] = True
                    seeds.append((iy, ix))
    labels = _components(free)
    # the flood fill from the doors' free start cells reaches exactly their components
    reached = np.isin(labels, [labels[y, x] for y, x in seeds])
    sizes = np.bincount(labels.ravel())[1:] if labels.max() > 0 else np.zeros(0, int)
    reachable = np.zeros(len(inp.counted), bool)
    margin = spec.ring_mm // cell + 1
    for k in range(n_real):
        found = access_ring(inp, k, feet[k], nx, ny, cell, r_rows, ring_rows, margin) if inp.counted[k] else None
        if found is not None:
            win, ring = found
            reachable[k] = bool((ring & reached[win]).any())
    return ReachResult(
        floor_cells=int(floor.sum()),
        free_cells=int(free.sum()),
        reached_cells=int(reached.sum()),
        num_regions=int((sizes > spec.min_region_cells).sum()),
        largest_region_cells=int(sizes.max()) if len(sizes) else 0,
        door_start_free=door_free,
        object_reachable=reachable,
        free=free,
        reached=reached,
    )
