"""Episode seeds: each episode's sampling key derives from its scene and place in the group,
so a group is repeatable, independent of batch neighbours, and a resumed run replays it."""
from __future__ import annotations

import hashlib


def episode_seed(scene_seed: int, member: int, redraw: int, epoch: int = 0) -> int:
    """hash(scene seed, member index, redraw index[, epoch]) -> a 31-bit seed (SHA-256 based)."""
    key = f"{scene_seed}:{member}:{redraw}" + (f":{epoch}" if epoch else "")
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") & 0x7FFFFFFF
