"""Deterministic generator of bedroom scene sets (data/scenes/train.jsonl and dev.jsonl).

Every record is a pure function of its seed: `make_record(seed, scene_id)` draws the room
(rectangular or L-shaped, sides on 5 cm steps so the grid aligns), doors, windows and the request
from numpy's PCG64 seeded with that integer. A set is `make_scene_set(split, n)`: seeds are
SPLIT_BASE[split] * 1000 + index. The shipped sets are made again (outputs inside data/ are
refused) with `jscenegen scene generate --split train --n 100 -o /tmp/train.jsonl && cmp
/tmp/train.jsonl data/scenes/train.jsonl` (and `--split dev --n 9`).
"""
from __future__ import annotations

import numpy as np

from .geometry import polygon_area
from .sceneset import SceneRecord
from .schema import Door, Room, Scene, Window, edge_length

SPLIT_BASE = {"train": 20260, "dev": 90210}
MAX_SCENES = 1_000_000  # per set: train seeds then end far below dev's
STYLES = ("Scandinavian", "mid-century", "industrial", "cosy rustic", "minimalist", "coastal", "Japandi", "classic")
WORDS = {
    "single_bed": "a single bed", "double_bed": "a double bed", "queen_bed": "a queen bed", "king_bed": "a king bed",
    "nightstand": "nightstand", "wardrobe": "wardrobe", "dresser": "dresser", "table_lamp": "bedside lamp",
    "floor_lamp": "floor lamp", "desk": "desk", "chair": "desk chair", "rug": "rug", "plant": "plant",
    "armchair": "reading armchair", "bookshelf": "bookshelf", "standing_mirror": "standing mirror",
    "chest_of_drawers": "chest of drawers", "wall_shelf": "wall shelf",
}


def _q(x: float, step: float = 0.05) -> float:
    return round(round(x / step) * step, 2)


def _room(rng: np.random.Generator) -> Room:
    w, d = _q(rng.uniform(3.0, 5.0)), _q(rng.uniform(3.0, 4.8))
    if rng.random() < 0.25 and min(w, d) >= 3.6:  # L shape: notch out the top-right corner
        nw, nd = _q(rng.uniform(0.8, min(1.4, w - 2.4))), _q(rng.uniform(0.8, min(1.4, d - 2.4)))
        poly = ((0.0, 0.0), (w, 0.0), (w, d - nd), (w - nw, d - nd), (w - nw, d), (0.0, d))
    else:
        poly = ((0.0, 0.0), (w, 0.0), (w, d), (0.0, d))
    height = _q(rng.uniform(2.5, 2.8))
    n = len(poly)
    lengths = [edge_length(poly, i) for i in range(n)]
    used: dict[int, list[tuple[float, float]]] = {}

    def place(width: float, margin: float) -> tuple[int, float] | None:
        walls = [i for i in range(n) if lengths[i] >= width + 2 * margin]
        for _ in range(20):
            i = int(rng.choice(walls))
            low = margin + width / 2   # a wall exactly width + 2 margins long: high rounds below it
            off = _q(rng.uniform(low, max(low, lengths[i] - margin - width / 2)))
            if all(abs(off - o) >= (width + ow) / 2 + 0.3 for o, ow in used.get(i, [])):
                used.setdefault(i, []).append((off, width))
                return i, off
        return None

    doors = []
    for k in range(2 if rng.random() < 0.15 else 1):
        width = float(rng.choice([0.8, 0.85, 0.9]))
        spot = place(width, 0.15)
        if spot:
            doors.append(Door(wall=spot[0], offset=spot[1], width=width, height=2.1))
    windows = []
    for _ in range(int(rng.integers(0, 3))):
        width = _q(rng.uniform(0.8, 1.6))
        spot = place(width, 0.3)
        if spot:
            windows.append(Window(wall=spot[0], offset=spot[1], width=width, height=1.2, sill=0.9))
    return Room(type="bedroom", floor_polygon=poly, wall_height=height, doors=tuple(doors), windows=tuple(windows))


def _request(rng: np.random.Generator, area: float) -> list[dict]:
    if area < 11:
        bed = str(rng.choice(["single_bed", "double_bed"]))
    elif area < 15:
        bed = str(rng.choice(["double_bed", "queen_bed"]))
    else:
        bed = str(rng.choice(["queen_bed", "king_bed"]))
    items = [{"category": bed, "count": 1}]
    items.append({"category": "nightstand", "count": 1 if bed == "single_bed" else int(rng.choice([1, 2]))})
    items.append({"category": str(rng.choice(["wardrobe", "dresser", "wardrobe"])), "count": 1})
    items.append({"category": "table_lamp", "count": 1})
    extras = ["rug", "plant", "floor_lamp", "wall_shelf", "standing_mirror"]
    if area >= 12:
        extras += ["desk", "armchair", "bookshelf", "chest_of_drawers"]
    for cat in rng.choice(extras, size=int(rng.integers(0, 3 if area < 12 else 4)), replace=False):
        items.append({"category": str(cat), "count": 1})
        if cat == "desk":
            items.append({"category": "chair", "count": 1})
    return items


def _prompt(rng: np.random.Generator, items: list[dict], area: float) -> str:
    size = "small" if area < 10 else ("medium-sized" if area < 20 else "large")
    parts = []
    for it in items:
        word = WORDS.get(it["category"], it["category"].replace("_", " "))
        if it["category"].endswith("_bed"):
            parts.append(word)
        elif it["count"] == 1:
            parts.append(("an " if word[0] in "aeiou" else "a ") + word)
        else:
            parts.append(f"{it['count']} {word}s")
    listing = ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"A {size} {rng.choice(STYLES)} bedroom with {listing}."


def make_record(seed: int, scene_id: str) -> SceneRecord:
    """One empty bedroom scene with its request, fully determined by `seed`."""
    rng = np.random.default_rng(seed)
    room = _room(rng)
    area = polygon_area(np.asarray(room.floor_polygon))
    items = _request(rng, area)
    scene = Scene(scene_id=scene_id, prompt=_prompt(rng, items, area), room=room)
    return SceneRecord(scene, seed, tuple(items))


def make_scene_set(split: str, n: int) -> list[SceneRecord]:
    """`n` records of a split ("train" or "dev"); record i has seed SPLIT_BASE[split] * 1000 + i.
    Raises ValueError for an unknown split or n outside [1, MAX_SCENES]."""
    if split not in SPLIT_BASE:
        raise ValueError(f"split must be one of {sorted(SPLIT_BASE)}, got {split!r}")
    if not 1 <= n <= MAX_SCENES:
        raise ValueError(f"n (the number of scenes, --n) must lie in [1, {MAX_SCENES:,}] (a split's "
                         f"seeds stay apart from the other's), got {n:,}")
    base = SPLIT_BASE[split] * 1000
    return [make_record(base + i, f"{split}_{i:04d}") for i in range(n)]
