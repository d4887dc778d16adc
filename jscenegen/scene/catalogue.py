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

from jscenegen.scene.schema import read_json_file

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
    """Categories plus groups and per-room-type expectations."""

    categories: dict[str, Category]
    groups: dict[str, tuple[str, ...]]
    desk_like: tuple[str, ...]
    chair_like: tuple[str, ...]
    room_types: dict[str, dict]
    raw: dict

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


def _parse(doc: dict, source: str) -> Catalogue:
    if not isinstance(doc, dict) or not isinstance(doc.get("categories"), dict):
        raise ValueError(f"{source}: expected a JSON object with a 'categories' object")
    if doc.get("version") != CATALOGUE_VERSION:
        raise ValueError(f"{source}: version must be {CATALOGUE_VERSION!r}, got {doc.get('version')!r}")
    cats = {}
    for name, e in doc["categories"].items():
        try:
            cats[name] = Category(
                name=name,
                default_size=tuple(float(v) for v in e["default_size"]),
                size_range=(tuple(e["width_range"]), tuple(e["depth_range"]), tuple(e["height_range"])),
                mounts=tuple(e["mounts"]),
                front_used=bool(e.get("front_used", False)),
                storage=bool(e.get("storage", False)),
                thin=bool(e.get("thin", False)),
                default_elevation=e.get("default_elevation"),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{source}: categories.{name}: {err!r}") from None
        if not cats[name].size_ok(cats[name].default_size):
            raise ValueError(f"{source}: categories.{name}: default_size outside its ranges")
    groups = {k: tuple(v) for k, v in doc.get("groups", {}).items()}
    return Catalogue(
        categories=cats,
        groups=groups,
        desk_like=tuple(doc.get("desk_like", ())),
        chair_like=tuple(doc.get("chair_like", ())),
        room_types=doc.get("room_types", {}),
        raw=doc,
    )


@functools.lru_cache(maxsize=8)
def load_catalogue(path: str | None = None) -> Catalogue:
    """The packaged catalogue, or the JSON file at `path` (`scene.catalogue_path`). Raises
    ValueError naming the file and the bad key, or a file that cannot be read as JSON
    (`schema.read_json_file`: missing, not a regular file, too large, not UTF-8 JSON)."""
    if path is None:
        text = resources.files("jscenegen.scene").joinpath("data/catalogue.json").read_text()
        return _parse(json.loads(text), "jscenegen/scene/data/catalogue.json")
    return _parse(read_json_file(path, f"scene.catalogue_path {path}"), str(path))


def catalogue_text(catalogue: Catalogue) -> str:
    """One line per category for prompts: default size, ranges (m) and mounts, sorted by name."""
    lines = []
    for name in sorted(catalogue.categories):
        c = catalogue.categories[name]
        ranges = ", ".join(f"{lo:g}-{hi:g}" for lo, hi in c.size_range)
        size = ", ".join(f"{v:g}" for v in c.default_size)
        lines.append(f"  {name}: [{size}]; {ranges}; {'/'.join(c.mounts)}")
    return "\n".join(lines)
