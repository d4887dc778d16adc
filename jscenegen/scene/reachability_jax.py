"""Batched door-anchored reachability in JAX: fixed padded grid, `lax.while_loop` fill, `vmap`.

Same integer geometry and tie rules as the NumPy reference (reachability.py), the footprint rule
included (a box holding no cell centre of the room's grid is the cell holding its centre),
reorganised for accelerators:
- Morphology is shifted ORs on the whole padded [G, G] grid (the disk split into rows: a
  horizontal dilation per row half-width, then a vertical shift).
- Regions come from label propagation: each free cell takes the largest label of its row run,
  then of its column run (a segment max), until nothing changes. That is the 4-connected flood
  fill of every component at once; the reached region is the union of the components holding a
  free door start cell.
- For a blocking object F the ring D(F, r + m) minus D(F, r) meets `reached` exactly when F
  meets D(reached, r + m), because reached never enters D(F, r); front-used objects dilate only
  the part of `reached` strictly beyond their front line. These per-object dilations run on rows
  packed 32 cells to a uint32 word (the grid side is a multiple of 32).
All integer arithmetic is int32 (bounds checked in reach_inputs.encode_scene), so results equal
the reference exactly.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .reach_inputs import GridSpec, ReachInputs


def _shift(x: jax.Array, dy: int, dx: int, fill) -> jax.Array:
    """out[..., y, x] = x[..., y - dy, x - dx]; cells shifted in from beyond the grid read `fill`."""
    pad = [(0, 0, 0)] * (x.ndim - 2) + [(dy, -dy, 0), (dx, -dx, 0)]
    return lax.pad(x, jnp.asarray(fill, x.dtype), pad)


def _dilate(mask: jax.Array, rows, outside: bool = False) -> jax.Array:
    """Disk dilation of bool [..., G, G] by `rows` ((dy, half_width), ...) from GridSpec.disk_rows."""
    widths = sorted({w for _, w in rows})
    horiz = {}
    acc = mask
    done = 0
    for w in widths:
        for dx in range(done + 1, w + 1):
            acc = acc | _shift(mask, 0, dx, outside) | _shift(mask, 0, -dx, outside)
        done = w
        horiz[w] = acc
    out = jnp.zeros_like(mask)
    for dy, w in rows:
        out = out | _shift(horiz[w], dy, 0, outside)
    return out


def _pack(mask: jax.Array) -> jax.Array:
    """bool [..., G, G] -> uint32 [..., G, G // 32]; bit b of word w is column 32 w + b."""
    g = mask.shape[-1]
    bits = mask.reshape(mask.shape[:-1] + (g // 32, 32)).astype(jnp.uint32)
    return jnp.sum(bits << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)


def _shift_x_packed(p: jax.Array, dx: int) -> jax.Array:
    """Packed rows shifted so column x takes column x - dx (|dx| < 32); zeros come in."""
    if dx == 0:
        return p
    if dx > 0:
        return (p << dx) | (_shift(p, 0, 1, 0) >> (32 - dx))
    return (p >> -dx) | (_shift(p, 0, -1, 0) << (32 + dx))


def _dilate_packed(p: jax.Array, rows) -> jax.Array:
    """`_dilate` on packed rows (uint32 [..., G, G // 32]), outside reads as empty."""
    horiz, acc, done = {}, p, 0
    for w in sorted({w for _, w in rows}):
        for dx in range(done + 1, w + 1):
            acc = acc | _shift_x_packed(p, dx) | _shift_x_packed(p, -dx)
        done = w
        horiz[w] = acc
    out = jnp.zeros_like(p)
    for dy, w in rows:
        out = out | _shift(horiz[w], dy, 0, 0)
    return out


def _centres(g: int, cell_mm: int) -> tuple[jax.Array, jax.Array]:
    c = jnp.arange(g, dtype=jnp.int32) * cell_mm + cell_mm // 2
    return c[None, :], c[:, None]  # px [1, G], py [G, 1]


def _floor(poly: jax.Array, px, py) -> jax.Array:
    x0, y0 = poly[:, 0][:, None, None], poly[:, 1][:, None, None]
    nxt = jnp.roll(poly, -1, axis=0)
    x1, y1 = nxt[:, 0][:, None, None], nxt[:, 1][:, None, None]
    crosses = (y0 > py) != (y1 > py)
    lhs = (px - x0) * (y1 - y0)
    rhs = (py - y0) * (x1 - x0)
    left = jnp.where(y1 > y0, lhs < rhs, lhs > rhs)
    odd = jnp.sum(crosses & left, axis=0) % 2
    return odd == 1


def _cross(a, b, px, py):
    """[N, G, G] int32 cross products (b - a) x (p - a) for per-object points a, b [N, 2]."""
    ax, ay = a[:, 0][:, None, None], a[:, 1][:, None, None]
    bx, by = b[:, 0][:, None, None], b[:, 1][:, None, None]
    return (bx - ax) * (py - ay) - (by - ay) * (px - ax)


def _labels(free: jax.Array) -> jax.Array:
    """[G, G] int32 component labels of `free` (the largest 1-based cell index of the component).

    Each pass gives every free cell the largest label of its run of free cells along its row,
    then along its column. A run is a segment: (line index, count of blocked cells so far along
    the line), fixed for the whole loop, so one segment max plus a gather is a pass (XLA's CPU
    cumulative max costs O(G) per cell; the segment max is linear).
    """
    g = free.shape[-1]
    init = jnp.where(free, jnp.arange(1, g * g + 1, dtype=jnp.int32).reshape(g, g), 0)
    blocked = (~free).astype(jnp.int32)
    line = jnp.arange(g, dtype=jnp.int32)
    seg_rows = (line[:, None] * (g + 1) + lax.cumsum(blocked, axis=1)).reshape(-1)
    seg_cols = (line[None, :] * (g + 1) + lax.cumsum(blocked, axis=0)).reshape(-1)

    def run_max(lab, seg):
        top = jax.ops.segment_max(lab.reshape(-1), seg, num_segments=g * (g + 1))
        return jnp.where(free, top[seg].reshape(g, g), 0)

    def body(state):
        lab, _, it = state
        new = run_max(run_max(lab, seg_rows), seg_cols)
        return new, jnp.any(new != lab), it + 1

    # every pass merges whole row and column runs; G*G passes bound any path, so it never binds
    lab, _, _ = lax.while_loop(lambda s: s[1] & (s[2] < g * g), body, (init, jnp.bool_(True), jnp.int32(0)))
    return lab


def _reach_one(poly, corners, centres, blocking, counted, front_only, starts, start_valid, extent, *,
               spec: GridSpec):
    g, cell = spec.grid_size, spec.cell_mm
    px, py = _centres(g, cell)
    r_rows, ring_rows = spec.disk_rows(spec.radius_mm), spec.disk_rows(spec.ring_mm)
    floor = _floor(poly, px, py)
    c = [corners[:, k] for k in range(4)]
    cells = jnp.arange(g, dtype=jnp.int32)
    in_room = (cells[None, :] < extent[0]) & (cells[:, None] < extent[1])  # the reference's nx x ny grid
    quad = jnp.broadcast_to(in_room, (corners.shape[0], g, g))
    for k in range(4):
        quad = quad & (_cross(c[k], c[(k + 1) % 4], px, py) >= 0)
    # a box holding no cell centre is the cell holding its centre (reachability.footprint_mask)
    cx, cy = (centres[:, i] // cell for i in range(2))   # floor division, as NumPy's
    own = in_room & (cells[None, None, :] == cx[:, None, None]) & (cells[None, :, None] == cy[:, None, None])
    feet = jnp.where(jnp.any(quad, axis=(1, 2))[:, None, None], quad, own)
    obst = jnp.any(feet & blocking[:, None, None], axis=0)
    free = ~_dilate(~floor, r_rows, outside=True) & ~_dilate(obst, r_rows)
    labels = _labels(free)
    ix, iy = starts[..., 0], starts[..., 1]
    ok = start_valid & free[jnp.clip(iy, 0, g - 1), jnp.clip(ix, 0, g - 1)]
    door_free = jnp.any(ok, axis=-1)
    seed_labels = jnp.where(ok, labels[jnp.clip(iy, 0, g - 1), jnp.clip(ix, 0, g - 1)], 0).reshape(-1)
    reached = free & jnp.any(labels[..., None] == jnp.where(seed_labels > 0, seed_labels, -1), axis=-1)
    sizes = jnp.zeros(g * g + 1, jnp.int32).at[labels.reshape(-1)].add(1)[1:]
    beyond = _cross(c[2], c[3], px, py) < 0
    region = _pack(reached[None] & (beyond | ~front_only[:, None, None]))
    near = _dilate_packed(region, ring_rows)
    reachable = counted & jnp.any((near & _pack(feet)) != 0, axis=(1, 2))
    return {
        "floor_cells": jnp.sum(floor, dtype=jnp.int32),
        "free_cells": jnp.sum(free, dtype=jnp.int32),
        "reached_cells": jnp.sum(reached, dtype=jnp.int32),
        "num_regions": jnp.sum(sizes > spec.min_region_cells, dtype=jnp.int32),
        "largest_region_cells": jnp.max(sizes),
        "door_start_free": door_free,
        "object_reachable": reachable,
    }


@functools.lru_cache(maxsize=8)
def batched_reach_fn(spec: GridSpec):
    """jit(vmap(kernel)) for one GridSpec: takes stacked ReachInputs arrays [B, ...], returns dict.

    Inputs: poly [B, V, 2] int32, corners [B, N, 4, 2] int32, centres [B, N, 2] int32,
    blocking/counted/front_only [B, N]
    bool, starts [B, D, 4, 2] int32, start_valid [B, D, 4] bool, extent [B, 2] int32 (the room's
    own grid, nx and ny cells: footprints are cut to it as in the reference). Outputs: int32 counts [B] and
    door_start_free [B, D], object_reachable [B, N] bool. Compiles once per input shape.
    """
    return jax.jit(jax.vmap(functools.partial(_reach_one, spec=spec)))


def stack_inputs(items: list[ReachInputs]) -> dict[str, np.ndarray]:
    """Stack encoded scenes (same padding) into the batched kernel's argument dict."""
    keys = ("poly", "corners", "centres", "blocking", "counted", "front_only", "starts", "start_valid")
    out = {k: np.stack([getattr(it, k) for it in items]) for k in keys}
    out["extent"] = np.array([[it.nx, it.ny] for it in items], dtype=np.int32)
    return out


def reach_jax(items: list[ReachInputs], spec: GridSpec) -> dict[str, np.ndarray]:
    """Run the batched kernel on encoded scenes; returns host NumPy arrays with a leading [B] axis."""
    out = batched_reach_fn(spec)(**stack_inputs(items))
    return {k: np.asarray(v) for k, v in out.items()}
