"""Hand-built scenes with known answers for the scene tests (4 m x 3 m room, door on wall 0)."""
from __future__ import annotations

import math

from jscenegen.scene.schema import Scene, scene_from_json


def room(door_offset: float = 2.0, windows=(), w: float = 4.0, d: float = 3.0) -> dict:
    return {
        "type": "bedroom",
        "floor_polygon": [[0, 0], [w, 0], [w, d], [0, d]],
        "wall_height": 2.6,
        "doors": [{"wall": 0, "offset": door_offset, "width": 0.9, "height": 2.1}],
        "windows": list(windows),
    }


def obj(oid, category, x, y, w, d, h, yaw=0.0, mount="floor", elevation=0.0, parent=None) -> dict:
    return {"id": oid, "category": category, "position": [x, y], "size": [w, d, h], "yaw": yaw,
            "mount": mount, "elevation": elevation, "parent": parent}


def scene(objects=(), **room_kw) -> Scene:
    return scene_from_json({"room": room(**room_kw), "objects": list(objects)})


def empty_room() -> Scene:
    return scene()


def wardrobe_across_door() -> Scene:
    return scene([obj("wardrobe_1", "wardrobe", 2.0, 0.31, 1.2, 0.6, 2.0)])


def split_room() -> Scene:
    """Queen bed from the bottom wall up, then a wardrobe (front to the right half) to 5 cm from the top wall."""
    return scene(
        [
            obj("queen_bed_1", "queen_bed", 2.0, 1.015, 1.52, 2.03, 1.0),
            obj("wardrobe_1", "wardrobe", 2.0, 2.54, 0.82, 0.6, 2.0, yaw=270),
            obj("nightstand_1", "nightstand", 3.5, 1.5, 0.45, 0.4, 0.55),
        ],
        door_offset=1.0,
    )


def gap_scene(gap: float) -> Scene:
    """A barrier of two benches across the room at y 1.4..2.0 with a `gap` between them at x = 1.8."""
    right_w = 4.0 - 1.8 - gap
    return scene(
        [
            obj("bench_1", "bench", 0.9, 1.7, 1.8, 0.6, 0.45),
            obj("bench_2", "bench", 1.8 + gap + right_w / 2, 1.7, right_w, 0.6, 0.45),
        ],
        door_offset=1.0,
    )


def rug_under_bed() -> Scene:
    return scene([obj("rug_1", "rug", 2.0, 1.5, 2.0, 1.4, 0.01)])


def high_shelf() -> Scene:
    return scene([obj("wall_shelf_1", "wall_shelf", 2.0, 1.5, 1.2, 0.3, 0.3, mount="wall", elevation=1.6)])


def wardrobe_against_top_wall(facing_wall: bool) -> Scene:
    return scene([obj("wardrobe_1", "wardrobe", 2.0, 2.69, 1.2, 0.6, 2.0, yaw=0.0 if facing_wall else 180.0)])


def transform(s: Scene, angle_deg: float = 0.0, shift=(0.0, 0.0)) -> Scene:
    """The whole scene rotated by angle_deg about the origin, then shifted."""
    c, sn = math.cos(math.radians(angle_deg)), math.sin(math.radians(angle_deg))
    if angle_deg % 90 == 0:
        c, sn = [(1, 0), (0, 1), (-1, 0), (0, -1)][int(angle_deg // 90) % 4]

    def tf(p):
        return [round(c * p[0] - sn * p[1] + shift[0], 9), round(sn * p[0] + c * p[1] + shift[1], 9)]

    data = s.to_json()
    data["room"]["floor_polygon"] = [tf(p) for p in data["room"]["floor_polygon"]]
    for o in data["objects"]:
        o["position"] = tf(o["position"])
        o["yaw"] = o["yaw"] + angle_deg
    return scene_from_json(data)


KNOWN = {
    "empty": empty_room,
    "wardrobe_door": wardrobe_across_door,
    "split": split_room,
    "gap_040": lambda: gap_scene(0.40),
    "gap_025": lambda: gap_scene(0.25),
    "rug": rug_under_bed,
    "shelf": high_shelf,
    "wardrobe_wall": lambda: wardrobe_against_top_wall(True),
    "wardrobe_room": lambda: wardrobe_against_top_wall(False),
}
