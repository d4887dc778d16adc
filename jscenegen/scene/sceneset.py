"""Scene-set records and JSONL files (scene-protocol.md section 6).

Each line: {"schema": "scenegen.sceneset/1", "scene": <scene JSON, empty objects>, "seed": int,
"requested": [{"category": str, "count": int}, ...]}; `requested` is the machine-readable form of
the prompt, read by the rule judge's prompt_following grade.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from jscenegen.paths import atomic_file

from .schema import Scene, SceneError, parse_json, scene_from_json

SET_SCHEMA = "scenegen.sceneset/1"


@dataclass(frozen=True)
class SceneRecord:
    """One scene of a set: the empty scene, its seed and its requested items."""

    scene: Scene
    seed: int
    requested: tuple[dict, ...] = ()

    def to_json(self) -> dict:
        return {"schema": SET_SCHEMA, "scene": self.scene.to_json(), "seed": self.seed,
                "requested": [dict(r) for r in self.requested]}


def record_from_json(data: dict, source: str = "<record>") -> SceneRecord:
    """Validate one JSONL record. Raises SceneError naming `source` and the field."""
    if not isinstance(data, dict):
        raise SceneError(f"{source}: a record must be a JSON object")
    if data.get("schema", SET_SCHEMA) != SET_SCHEMA:
        raise SceneError(f"{source}: schema {data.get('schema')!r} is not {SET_SCHEMA!r}")
    extra = set(data) - {"schema", "scene", "seed", "requested"}
    if extra:
        raise SceneError(f"{source}: unknown keys {sorted(extra)}")
    seed = data.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise SceneError(f"{source}: seed must be an integer, got {seed!r}")
    req = data.get("requested", [])
    if not isinstance(req, list):
        raise SceneError(f"{source}: requested must be a list")
    items = []
    for i, r in enumerate(req):
        ok = isinstance(r, dict) and set(r) == {"category", "count"} and isinstance(r["category"], str)
        if not ok or isinstance(r["count"], bool) or not isinstance(r["count"], int) or r["count"] < 1:
            raise SceneError(f"{source}: requested[{i}] must be {{'category': str, 'count': int >= 1}}, got {r!r}")
        items.append({"category": r["category"], "count": r["count"]})
    return SceneRecord(scene_from_json(data.get("scene"), f"{source}: scene"), seed, tuple(items))


def read_scene_set(path: str | Path) -> list[SceneRecord]:
    """All records of a JSONL scene set (at least one). Raises SceneError naming file and line,
    or the file when it holds no record."""
    p = Path(path)
    if not p.is_file():
        raise SceneError(f"{p}: not a regular file" if p.exists() else f"{p}: no such scene set")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise SceneError(f"{p}: not UTF-8 text: {err}") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        data = parse_json(line, f"{p}:{n}")
        out.append(record_from_json(data, f"{p}:{n}"))
    if not out:
        raise SceneError(f"{p}: no scenes (an empty scene set: one JSON record per line)")
    return out


def write_scene_set(path: str | Path, records: list[SceneRecord]) -> None:
    """Write records as JSONL atomically (temporary file in the same folder, then rename)."""
    with atomic_file(path) as tmp, open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps(r.to_json(), sort_keys=True, separators=(",", ":")) + "\n")
