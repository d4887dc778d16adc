"""Scene-set records and JSONL files (scene-protocol.md section 6).

Each line: {"schema": "scenegen.sceneset/1", "scene": <scene JSON, empty objects>, "seed": int,
"requested": [{"category": str, "count": int}, ...]}; `requested` is the machine-readable form of
the prompt, read by the rule judge's prompt_following grade.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, Sequence

from jscenegen.config import SEED_MAX, is_seed
from jscenegen.paths import atomic_file, json_sha256, not_a_file
from jscenegen.text import clip_text, not_unicode

from .reach_inputs import ReachabilityError, encode_scene
from .schema import (
    MAX_JSON_FILE_BYTES,
    MAX_SCENE_OBJECTS,
    Scene,
    SceneError,
    json_text,
    parse_json,
    scene_from_json,
)

SET_SCHEMA = "scenegen.sceneset/1"


@dataclass(frozen=True)
class SceneRecord:
    """One scene of a set: the empty scene, its seed and its requested items; `line`, the
    line of the scene-set file it was read from (0: not read from one), names it in errors."""

    scene: Scene
    seed: int
    requested: tuple[dict, ...] = ()
    line: int = field(default=0, compare=False)

    def to_json(self) -> dict:
        return {"schema": SET_SCHEMA, "scene": self.scene.to_json(), "seed": self.seed,
                "requested": [dict(r) for r in self.requested]}


def scene_set_hash(records: Sequence[SceneRecord]) -> str:
    """SHA-256 of the canonical JSON of `records` (each `SceneRecord.to_json`, in order): what
    a resume compares to tell a scene edited in place (prompt, room, requested items) from
    the one the run trained on."""
    return json_sha256([r.to_json() for r in records])


def record_sha256(record: SceneRecord) -> str:
    """SHA-256 of the canonical JSON of one record (`SceneRecord.to_json`: its scene's id,
    prompt, room and budget, its seed and requested items): what an evaluation report keeps per
    scene, so that reports of scenes that differ in a room or requested items under the same
    id, seed and prompt are not compared (`eval.report.check_same_episodes`)."""
    return json_sha256(record.to_json())


def record_from_json(data: dict, source: str = "<record>") -> SceneRecord:
    """Validate one JSONL record (its scene's prompt not blank, its objects list empty: the
    episode furnishes the room). Raises SceneError naming `source` and the field."""
    if not isinstance(data, dict):
        raise SceneError(f"{source}: a record must be a JSON object")
    if data.get("schema", SET_SCHEMA) != SET_SCHEMA:
        raise SceneError(f"{source}: schema {data.get('schema')!r} is not {SET_SCHEMA!r}")
    extra = set(data) - {"schema", "scene", "seed", "requested"}
    if extra:
        raise SceneError(f"{source}: unknown keys {sorted(extra)}")
    seed = data.get("seed")
    if not is_seed(seed):
        raise SceneError(f"{source}: seed must be an integer in 0..{SEED_MAX} (32 bits), got "
                         f"{clip_text(repr(seed))}")
    items = requested_items(data.get("requested", []), f"{source}: requested")
    scene = scene_from_json(data.get("scene"), f"{source}: scene")
    if not scene.prompt.strip():   # `design --prompt ""` is refused the same way
        raise SceneError(f"{source}: scene.prompt: empty; a record's prompt is the request the "
                         "planner is given")
    if scene.objects:
        n = len(scene.objects)
        raise SceneError(f"{source}: scene.objects: {n} object{'' if n == 1 else 's'}; a record's "
                         "scene is the empty room the episode furnishes (objects: [])")
    return SceneRecord(scene, seed, items)


MIN_REQUESTED_COUNT = 1
"""The least count of a requested item (a record's `requested`, `scene check --requested`);
the most is MAX_SCENE_OBJECTS, for one item and for their sum (`requested_over_scene`)."""


def requested_over_scene(total: int, item: str) -> str | None:
    """Why requested counts summing to `total` (so far, at `item`) can be no scene's request
    (more than MAX_SCENE_OBJECTS, the objects a scene holds), or None."""
    if total > MAX_SCENE_OBJECTS:
        return (f"{item}: the requested counts reach {total}, more than a scene holds "
                f"({MAX_SCENE_OBJECTS} objects)")
    return None


def requested_items(req, source: str) -> tuple[dict, ...]:
    """A record's `requested` checked: a list of {"category": Unicode text, "count": int in
    1..MAX_SCENE_OBJECTS} (a scene holds no more objects), each category once, the counts
    summing to at most MAX_SCENE_OBJECTS too (`requested_over_scene`; so at most that many
    items). Whether the categories are known depends on the catalogue, and whether an episode
    may add that many objects on scene.max_objects: `check_records_usable`. Raises SceneError
    naming `source` and the item."""
    if not isinstance(req, list):
        raise SceneError(f"{source} must be a list")
    items, seen, total = [], set(), 0
    for i, r in enumerate(req):
        ok = isinstance(r, dict) and set(r) == {"category", "count"} and isinstance(r["category"], str)
        if (not ok or not r["category"] or isinstance(r["count"], bool) or not isinstance(r["count"], int)
                or not MIN_REQUESTED_COUNT <= r["count"] <= MAX_SCENE_OBJECTS):
            raise SceneError(f"{source}[{i}] must be {{'category': str, 'count': int in "
                             f"{MIN_REQUESTED_COUNT}..{MAX_SCENE_OBJECTS}}}, got {clip_text(repr(r))}")
        if why := not_unicode(r["category"]):
            raise SceneError(f"{source}[{i}].category: {why}")
        if r["category"] in seen:
            raise SceneError(f"{source}[{i}]: category {r['category']!r} is requested twice")
        total += r["count"]
        if why := requested_over_scene(total, f"{source}[{i}] ({clip_text(repr(r['category']))} "
                                              f"x{r['count']})"):
            raise SceneError(why)
        seen.add(r["category"])
        items.append({"category": r["category"], "count": r["count"]})
    return tuple(items)


def check_records_usable(records: list[SceneRecord], catalogue, metrics, source: str, *,
                         max_objects: int) -> None:
    """Raise SceneError naming `source`, the record's line and scene when a record cannot make
    an episode under this run's settings: it requests a name that is neither a category nor a
    group of `catalogue` (no object can satisfy it, so the prompt-following grade would drop
    for every episode of that scene), its requested counts sum to more than `max_objects`
    (scene.max_objects, the objects an episode may add: prompt_following could never reach 10),
    or its room does not fit the measuring grid of `metrics` (scene.metrics: size, doors,
    vertices; every episode of it would fail at its first measurement)."""
    for i, record in enumerate(records):
        where = f"{source}:{record.line}" if record.line else f"{source}: record {i + 1}"
        scene = f"scene {record.scene.scene_id or '(no id)'}"
        for item in record.requested:
            if not catalogue.knows(item["category"]):
                raise SceneError(f"{where}: {scene} requests {clip_text(repr(item['category']))}"
                                 ": neither a category nor a group of the catalogue")
        total = sum(item["count"] for item in record.requested)
        if total > max_objects:
            raise SceneError(f"{where}: {scene} requests {total} objects in all, more than an "
                             f"episode may add (scene.max_objects {max_objects}): prompt_following "
                             "could never reach 10; lower the counts or raise scene.max_objects")
        try:
            encode_scene(record.scene, metrics, catalogue, MAX_SCENE_OBJECTS)
        except ReachabilityError as err:
            raise SceneError(f"{where}: {scene}: {err}") from None


def require_scene_set_file(p: str | Path) -> None:
    """Raise SceneError naming `p` when it is no regular file (missing, a directory, a pipe)."""
    if why := not_a_file(p):
        raise SceneError(f"scene set {p}: {why}")


MAX_RECORD_BYTES = MAX_JSON_FILE_BYTES   # one line of a scene set: as much as a scene file
MAX_SCENE_SET_RECORDS = 100_000          # the shipped train set holds 100


def _record_lines(p: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each non-blank line of the JSONL file `p` (split at "\\n" only, a
    trailing "\\r" dropped: a JSON string may hold U+2028 or a form feed raw, where
    `str.splitlines` would also split), read one line at a time. Raises SceneError naming the
    file (and line) when it is no regular file, a line is not UTF-8 or longer than
    MAX_RECORD_BYTES, it holds more than MAX_SCENE_SET_RECORDS records, or none."""
    require_scene_set_file(p)
    records = 0
    with open(p, "rb") as f:
        for n in itertools.count(1):
            raw = f.readline(MAX_RECORD_BYTES + 3)   # the record, "\r\n" and one byte more
            if not raw:
                break
            line = raw[:-1] if raw.endswith(b"\n") else raw
            line = line[:-1] if line.endswith(b"\r") else line
            if len(line) > MAX_RECORD_BYTES:
                raise SceneError(f"{p}:{n}: a record of more than {MAX_RECORD_BYTES:,} bytes (a "
                                 "scene set holds one scene per line, each at most as large as a "
                                 "scene file)")
            text = json_text(line, f"{p}:{n}", file_start=n == 1)
            if not text.strip():
                continue
            records += 1
            if records > MAX_SCENE_SET_RECORDS:
                raise SceneError(f"{p}: more than {MAX_SCENE_SET_RECORDS:,} scenes (line {n}); "
                                 "split the set")
            yield n, text
    if not records:
        raise SceneError(f"{p}: no scenes (an empty scene set: one JSON record per line)")


def _parse_record(p: Path, n: int, line: str, first: bool) -> SceneRecord:
    try:
        data = parse_json(line, f"{p}:{n}")
    except SceneError as err:   # a pretty-printed JSON file breaks on its first line
        hint = " (a scene set holds one JSON record per line: JSONL)" if first else ""
        raise SceneError(f"{err}{hint}") from None
    return replace(record_from_json(data, f"{p}:{n}"), line=n)


def read_scene_set(path: str | Path) -> list[SceneRecord]:
    """All records of a JSONL scene set (at least one, every non-empty `scene_id` once). Raises
    SceneError naming file and line, or the file when it holds no record."""
    p = Path(path)
    out, lines = [], {}
    for n, line in _record_lines(p):
        record = _parse_record(p, n, line, first=not out)
        scene_id = record.scene.scene_id
        if scene_id and scene_id in lines:   # reports name scenes by id: they would clash
            raise SceneError(f"{p}:{n}: scene_id {clip_text(repr(scene_id))} is already the id of "
                             f"line {lines[scene_id]}")
        lines[scene_id] = n
        out.append(record)
    return out


class RecordIndexError(SceneError, IndexError):
    """A record number outside a scene set (`read_scene_record`)."""


def read_scene_record(path: str | Path, index: int) -> SceneRecord:
    """Record `index` (0-based, blank lines not counted) of a JSONL scene set, the only one
    parsed and checked (`scene furnish` of one scene of a large set: every record costs ~0.2
    ms to validate). Raises SceneError naming file and line, or RecordIndexError naming the
    number of records when `index` is outside them."""
    p = Path(path)
    if index < 0:
        raise RecordIndexError(f"{index} is outside {p} (records are numbered from 0)")
    count = 0
    for count, (n, line) in enumerate(_record_lines(p), 1):
        if count == index + 1:
            return _parse_record(p, n, line, first=index == 0)
    raise RecordIndexError(f"{index} is outside {p} ({count} scenes)")


def write_scene_set(path: str | Path, records: list[SceneRecord]) -> None:
    """Write records as JSONL atomically (temporary file in the same folder, then rename)."""
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r.to_json(), sort_keys=True, separators=(",", ":")) + "\n")
