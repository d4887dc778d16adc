"""Hard caps that tie the seven grades to the measured metrics (scene-protocol.md section 5).

The caps are data: the rule judge applies them exactly, the judge prompt lists the active ones,
an HTTP judge's grades are clamped by them when `judge.enforce_caps` is on, and the table enters
the protocol hash.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import MetricsConfig


@dataclass(frozen=True)
class Cap:
    """`grade` is bounded above (kind "max") or below ("min") by `value` when `condition` holds;
    `text` may name `scene.metrics` values as format fields, and `oob_cap_percent` (the
    fraction in per cent, as many digits as it has)."""

    grade: str
    kind: str
    value: int
    condition: str
    text: str


CAPS: tuple[Cap, ...] = (
    Cap("realism", "max", 4, "collision", "any collision caps realism at 4"),
    Cap("reachability", "max", 2, "door_blocked", "a blocked door caps reachability at 2"),
    Cap("reachability", "max", 6, "multiple_regions", "more than one walkable region caps reachability at 6"),
    Cap("reachability", "min", 7, "fully_reachable", "a fully reachable scene gets reachability at least 7"),
    Cap(
        "physical_plausibility", "max", 4, "oob_or_door_clearance",
        "an object more than {oob_cap_percent}% outside the floor or above the wall height, or a blocked door "
        "clearance box, caps physical_plausibility at 4",
    ),
    Cap("completeness", "max", 2, "missing_required", "a bedroom without a bed caps completeness at 2"),
    Cap("functionality", "max", 3, "storage_front_to_wall", "a storage front facing a wall caps functionality at 3"),
)


def conditions(metrics: dict) -> dict[str, bool]:
    """Truth of each cap condition for a metrics dict from metrics.measure."""
    return {
        "collision": bool(metrics["collision_pairs"]),
        "door_blocked": bool(metrics["door_blocked"]),
        "multiple_regions": metrics["num_regions"] > 1,
        "fully_reachable": bool(metrics["reachable"]),
        "oob_or_door_clearance": bool(metrics["oob_cap_objects"] or metrics["door_clearance_blocked"]),
        "missing_required": bool(metrics["missing_required"]),
        "storage_front_to_wall": bool(metrics["storage_front_to_wall_objects"]),
    }


def active_caps(metrics: dict) -> list[Cap]:
    """The caps whose condition holds for `metrics`."""
    cond = conditions(metrics)
    return [c for c in CAPS if cond[c.condition]]


def apply_caps(grades: dict[str, int], metrics: dict) -> dict[str, int]:
    """Grades clamped by every active cap (caps on keys not graded are ignored)."""
    out = dict(grades)
    for c in active_caps(metrics):
        if c.grade in out:
            out[c.grade] = min(out[c.grade], c.value) if c.kind == "max" else max(out[c.grade], c.value)
    return out


def cap_text(cap: Cap, metrics: MetricsConfig) -> str:
    """The cap's text with the run's metric thresholds filled in (what the judge reads)."""
    return cap.text.format(**metrics.model_dump(),
                           oob_cap_percent=f"{metrics.oob_cap_fraction * 100:g}")


def caps_table(metrics: MetricsConfig) -> list[dict]:
    """The cap table as JSON-able data, texts filled in (for the protocol hash and the docs)."""
    return [dict(c.__dict__, text=cap_text(c, metrics)) for c in CAPS]
