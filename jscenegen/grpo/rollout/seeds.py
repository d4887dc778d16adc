"""Episode seeds: each episode's sampling key derives from its scene and place in the group,
so a group is repeatable, independent of batch neighbours, and a resumed run replays it."""
from __future__ import annotations

import hashlib


def episode_seed(scene_seed: int, member: int, redraw: int, epoch: int = 0, run_seed: int = 0) -> int:
    """hash(scene seed, member index, redraw index[, epoch][, run seed]) -> a 31-bit seed
    (SHA-256 based; epoch and run seed enter only when not 0)."""
    key = f"{scene_seed}:{member}:{redraw}" + (f":{epoch}" if epoch else "")
    if run_seed:
        key += f":run{run_seed}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") & 0x7FFFFFFF
