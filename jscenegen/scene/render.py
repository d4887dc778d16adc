"""Top-view drawing of a scene with matplotlib: room, doors, windows, objects with fronts, reachable region."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from jscenegen.paths import atomic_file

from .catalogue import Catalogue, load_catalogue
from .config import SceneRuntimeConfig
from .geometry import footprint, front_direction, opening_box
from .metrics import measure
from .reach_inputs import GridSpec, is_thin
from .schema import Scene


def render_scene(scene: Scene, out: str | Path, cfg: SceneRuntimeConfig | None = None,
                 catalogue: Catalogue | None = None, dpi: int = 120) -> dict:
    """Write a PNG top view to `out` (atomically) and return the scene's metrics.

    Draws the floor polygon, door clearance boxes (red) and window boxes (blue), each object's
    footprint with an arrow for its front (thin coverings pale, objects in a collision or
    unreachable red), and the reached grid cells (green) of the NumPy
    reachability reference.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Polygon

    cfg = cfg or SceneRuntimeConfig()
    catalogue = catalogue or load_catalogue(cfg.catalogue_path)
    metrics, res = measure(scene, cfg, catalogue, with_result=True)
    room = scene.room
    poly = np.asarray(room.floor_polygon)
    fig, ax = plt.subplots(figsize=(6, 6))
    spec = GridSpec.from_config(cfg.metrics)
    cell = spec.cell_mm / 1000
    origin = np.round(poly * 1000).min(axis=0) / 1000
    ext = [origin[0], origin[0] + res.reached.shape[1] * cell, origin[1], origin[1] + res.reached.shape[0] * cell]
    ax.imshow(np.where(res.reached, 1.0, np.nan), origin="lower", extent=ext, cmap="Greens", vmin=0, vmax=1.6,
              alpha=0.6, interpolation="nearest")
    ax.add_patch(Polygon(poly, closed=True, fill=False, lw=2.5, color="black"))
    for d in room.doors:
        ax.add_patch(Polygon(opening_box(room, d, cfg.metrics.door_clearance_m), closed=True, color="red", alpha=0.25))
    for w in room.windows:
        ax.add_patch(Polygon(opening_box(room, w, cfg.metrics.window_clearance_m), closed=True, color="blue",
                             alpha=0.2))
    bad = {i for p in metrics["collision_pairs"] for i in p} | set(metrics["unreachable_objects"])
    thin = {o.id for o in scene.objects if is_thin(o, catalogue, cfg.metrics)}
    for o in sorted(scene.objects, key=lambda o: (o.id not in thin, o.mount == "on")):  # rugs below, lamps on top
        corners = footprint(o)
        colour = "tab:red" if o.id in bad else (
            "wheat" if o.id in thin else ("tab:gray" if o.mount == "on" else "tab:orange"))
        ax.add_patch(Polygon(corners, closed=True, fill=True, alpha=0.5, ec="black", fc=colour, lw=1))
        f = front_direction(o.yaw) * min(0.3, o.size[1] / 2)
        ax.arrow(o.position[0], o.position[1], f[0], f[1], head_width=0.06, color="black", length_includes_head=True)
        ax.text(o.position[0], o.position[1], _label(o.id), fontsize=6, ha="center", va="top",
                parse_math=False)
    ax.set_xlim(poly[:, 0].min() - 0.2, poly[:, 0].max() + 0.2)
    ax.set_ylim(poly[:, 1].min() - 0.2, poly[:, 1].max() + 0.2)
    ax.set_aspect("equal")
    ax.set_title(f"{_label(scene.scene_id) or 'scene'}: reachable={metrics['reachable']}, "
                 f"regions={metrics['num_regions']}", fontsize=9, parse_math=False)
    out = Path(out)
    try:
        with atomic_file(out, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=dpi, bbox_inches="tight")
    finally:
        plt.close(fig)
    return metrics


def _label(text: str) -> str:
    """`text` as drawn: characters a font cannot show (control characters) as `?`; `$` stays
    literal (the labels are drawn with matplotlib's math parsing off)."""
    return "".join(c if c.isprintable() else "?" for c in text)
