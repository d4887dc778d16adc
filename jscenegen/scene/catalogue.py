"""Furniture catalogue: default size, size ranges, allowed mounts and roles of each category.

The data lives in `jscenegen/scene/data/catalogue.json` (sizes from scene-systems.md section 4),
replaceable through `scene.catalogue_path`. Groups ("bed", "lamp") name sets of categories used by
`requested` items and by the rule judge's completeness check.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import get_args

from jscenegen.paths import finite_number, loads_json, resolve_data_path
from jscenegen.scene.schema import MAX_COORDINATE_M, Mount, read_json_file

CATALOGUE_VERSION = "scenegen.catalogue/1"


@dataclass(frozen=True)
class Category:
    """One furniture category; sizes in metres, [width, depth, height]."""

    name: str
    default_size: tuple[float, float, float]
    size_range: tuple[tuple[float, float], tuple[float, float], tuple[float, float]]
    mounts: tuple[str, ...]
    front_used: bool = False
    storage: bool = False
    thin: bool = False
    default_elevation: float | None = None

    def size_ok(self, size) -> bool:
        """True when every component of `size` [w, d, h] lies in its range (inclusive, 1 mm slack)."""
        return all(lo - 1e-3 <= s <= hi + 1e-3 for s, (lo, hi) in zip(size, self.size_range))


@dataclass(frozen=True)
class Catalogue:
    """Categories plus groups and per-room-type expectations.

    top_surfaces: the categories whose top carries an object mounted `on` them (a lamp on a
    nightstand, a plant on a rug); the metrics list an `on` object whose parent is of another
    category as unsupported (a plant on a picture frame). None when the catalogue file has no
    `top_surfaces` key (a catalogue written before it): then no parent is refused for its
    category."""

    categories: dict[str, Category]
    groups: dict[str, tuple[str, ...]]
    desk_like: tuple[str, ...]
    chair_like: tuple[str, ...]
    room_types: dict[str, dict]
    raw: dict
    top_surfaces: tuple[str, ...] | None = None

    def get(self, name: str) -> Category | None:
        return self.categories.get(name)

    def knows(self, name: str) -> bool:
        """Whether a request may name `name`: a category or a group of categories."""
        return name in self.categories or name in self.groups

    def members(self, name: str) -> tuple[str, ...]:
        """Categories a requested name stands for: a group's members, or the category itself."""
        return self.groups.get(name, (name,))

    def known(self, name: str) -> bool:
        return name in self.categories or name in self.groups

    def expected(self, room_type: str) -> list[tuple[str, ...]]:
        """Expected category alternatives for a room type (each entry: any member present)."""
        spec = self.room_types.get(room_type, {})
        out = []
        for alts in spec.get("expected", []):
            cats: tuple[str, ...] = ()
            for a in alts:
                cats += self.members(a)
            out.append(cats)
        return out

    def required(self, room_type: str) -> tuple[str, ...]:
        """Categories of which the room type needs at least one (bedroom: a bed), or ()."""
        group = self.room_types.get(room_type, {}).get("required_group")
        return self.members(group) if group else ()


MOUNTS = get_args(Mount)


def _sizes(x, n: int, what: str, *, zero_ok: bool = False) -> tuple[float, ...]:
    """`x` as n finite lengths in (0, MAX_COORDINATE_M] ([0, ...] when `zero_ok`: a range's
    lower bound); ValueError saying what is wrong."""
    if not (isinstance(x, list) and len(x) == n and all(finite_number(v) for v in x)):
        raise ValueError(f"{what} must be a list of {n} numbers, got {json.dumps(x)[:80]}")
    if not all((0 <= v if zero_ok else 0 < v) and v <= MAX_COORDINATE_M for v in x):
        raise ValueError(f"{what} {x} must lie in {'[' if zero_ok else '('}0, "
                         f"{MAX_COORDINATE_M:g}] metres")
    return tuple(float(v) for v in x)


def _category(name: str, e) -> Category:
    if not isinstance(e, dict):
        raise ValueError(f"must be an object, got {type(e).__name__}")
    ranges = []
    for key in ("width_range", "depth_range", "height_range"):
        lo, hi = _sizes(e.get(key), 2, key, zero_ok=True)
        if lo > hi:
            raise ValueError(f"{key} [{lo:g}, {hi:g}] runs backwards")
        ranges.append((lo, hi))
    mounts = e.get("mounts")
    if not (isinstance(mounts, list) and mounts and all(m in MOUNTS for m in mounts)):
        raise ValueError(f"mounts must be a non-empty list of {', '.join(MOUNTS)}, got "
                         f"{json.dumps(mounts)[:80]}")
    elevation = e.get("default_elevation")
    if elevation is not None and not (finite_number(elevation) and 0 <= elevation <= MAX_COORDINATE_M):
        raise ValueError(f"default_elevation must be a number of metres >= 0, got {json.dumps(elevation)[:80]}")
    flags = {k: e.get(k, False) for k in ("front_used", "storage", "thin")}
    for k, v in flags.items():
        if not isinstance(v, bool):
            raise ValueError(f"{k} must be true or false, got {json.dumps(v)[:80]}")
    cat = Category(name=name, default_size=_sizes(e.get("default_size"), 3, "default_size"),
                   size_range=tuple(ranges), mounts=tuple(mounts), default_elevation=elevation,
                   **flags)
    if not cat.size_ok(cat.default_size):
        raise ValueError("default_size outside its ranges")
    return cat


def _parse(doc: dict, source: str) -> Catalogue:
    """The catalogue in `doc`; raises ValueError naming `source` and the key: sizes must be
    finite and positive, ranges ordered, mounts known, and every name a group, `desk_like`,
    `chair_like`, `top_surfaces` or a room type lists must be a category (or, for a room type,
    a group)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("categories"), dict):
        raise ValueError(f"{source}: expected a JSON object with a 'categories' object")
    if doc.get("version") != CATALOGUE_VERSION:
        raise ValueError(f"{source}: version must be {CATALOGUE_VERSION!r}, got {doc.get('version')!r}")
    cats = {}
    for name, e in doc["categories"].items():
        try:
            cats[name] = _category(name, e)
        except ValueError as err:
            raise ValueError(f"{source}: categories.{name}: {err}") from None

    def names(key: str, value, allowed) -> tuple[str, ...]:
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise ValueError(f"{source}: {key} must be a list of names, got {json.dumps(value)[:80]}")
        unknown = [v for v in value if v not in allowed]
        if unknown:
            raise ValueError(f"{source}: {key} names {unknown[0]!r}, which is not a category of "
                             "the catalogue")
        return tuple(value)

    raw_groups = doc.get("groups", {})
    if not isinstance(raw_groups, dict):
        raise ValueError(f"{source}: groups must be an object of name -> [categories]")
    groups = {k: names(f"groups.{k}", v, cats) for k, v in raw_groups.items()}
    room_types = doc.get("room_types", {})
    if not isinstance(room_types, dict) or not all(isinstance(v, dict) for v in room_types.values()):
        raise ValueError(f"{source}: room_types must be an object of room type -> object")
    for rt, spec in room_types.items():
        expected = spec.get("expected", [])
        if not isinstance(expected, list):
            raise ValueError(f"{source}: room_types.{rt}.expected must be a list of lists of "
                             f"names, got {json.dumps(expected)[:80]}")
        for i, alts in enumerate(expected):
            names(f"room_types.{rt}.expected[{i}]", alts, cats.keys() | groups.keys())
        required = spec.get("required_group")
        if required is not None and not isinstance(required, str):
            raise ValueError(f"{source}: room_types.{rt}.required_group must be a group name, "
                             f"got {json.dumps(required)[:80]}")
        if required is not None and required not in groups:
            raise ValueError(f"{source}: room_types.{rt}.required_group {required!r} is not a group")
    return Catalogue(
        categories=cats,
        groups=groups,
        desk_like=names("desk_like", doc.get("desk_like", []), cats),
        chair_like=names("chair_like", doc.get("chair_like", []), cats),
        room_types=room_types,
        raw=doc,
        top_surfaces=(names("top_surfaces", doc["top_surfaces"], cats) if "top_surfaces" in doc
                      else None),
    )


PACKAGED_CATALOGUE = "data/catalogue.json"   # in the jscenegen.scene package


def _catalogue_file(path: str) -> Path:
    """The file `scene.catalogue_path` `path` names: found as `resolve_data_path` finds it (in
    the working directory, else the checkout, as scene.prompts_dir), else `path` as given (its
    reader says it is missing)."""
    try:
        return resolve_data_path(path)
    except FileNotFoundError:
        return Path(path)


def load_catalogue(path: str | None = None) -> Catalogue:
    """The packaged catalogue, or the JSON file at `path` (`scene.catalogue_path`, relative
    paths as `_catalogue_file` finds them: cached by the file found and its modification time
    and size, so a relative path read from another working directory, or a file edited since,
    is read again). Raises ValueError naming the file and the bad key, or a file that cannot
    be read as JSON (`schema.read_json_file`: missing, not a regular file, too large, not
    UTF-8 JSON)."""
    if path is None:
        return _read_catalogue(None, None, None)
    found = _catalogue_file(path).absolute()
    try:
        st = found.stat()
        version = (st.st_mtime_ns, st.st_size)
    except OSError:
        version = None   # read_json_file names the problem
    return _read_catalogue(str(found), str(path), version)


@functools.lru_cache(maxsize=8)
def _read_catalogue(found: str | None, given: str | None, version: tuple | None) -> Catalogue:
    if found is None:
        text = resources.files("jscenegen.scene").joinpath(PACKAGED_CATALOGUE).read_text(encoding="utf-8")
        return _parse(loads_json(text), "jscenegen/scene/data/catalogue.json")
    return _parse(read_json_file(Path(found), f"scene.catalogue_path {given}"), given)


def catalogue_text(catalogue: Catalogue) -> str:
    """One line per category for prompts: default size, ranges (m) and mounts, sorted by name."""
    lines = []
    for name in sorted(catalogue.categories):
        c = catalogue.categories[name]
        ranges = ", ".join(f"{lo:g}-{hi:g}" for lo, hi in c.size_range)
        size = ", ".join(f"{v:g}" for v in c.default_size)
        lines.append(f"  {name}: [{size}]; {ranges}; {'/'.join(c.mounts)}")
    return "\n".join(lines)
