"""Typed configuration of the SceneGen runtime (`scene:`) and of its judge (`judge:`).

Every number of ../shared/specs/scene-protocol.md is a default here, never a constant in code.
The lead adds both sections to `RunConfig` as `scene:` and `judge:`; this module only defines them.
"""
from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from jscenegen.config import REDACTED, Section

from .schema import MAX_FLOOR_VERTICES, MAX_OPENINGS, MAX_SCENE_OBJECTS

GRADE_KEYS = (
    "realism",
    "functionality",
    "layout",
    "completeness",
    "prompt_following",
    "reachability",
    "physical_plausibility",
)


class OpCosts(Section):
    """Unit cost of each designer operation (scene-protocol.md section 3)."""

    add_object: int = Field(8, ge=0)
    replace_object: int = Field(8, ge=0)
    resize_object: int = Field(3, ge=0)
    move_object: int = Field(2, ge=0)
    remove_object: int = Field(2, ge=0)
    snap_to_wall: int = Field(2, ge=0)
    snap_to_object: int = Field(2, ge=0)
    rotate_object: int = Field(1, ge=0)
    get_scene: int = Field(0, ge=0)


class MetricsConfig(Section):
    """Geometry and reachability parameters (scene-protocol.md section 4), metres.

    `grid_size` is the side of the fixed padded grid in cells (128 x 5 cm = 6.4 m; a multiple of
    32, the JAX kernel packs rows into uint32 words); a room whose bounding box does not fit is
    refused.
    """

    cell_m: float = Field(0.05, gt=0)
    agent_radius_m: float = Field(0.15, ge=0)
    access_margin_m: float = Field(0.10, ge=0)
    block_height_m: float = Field(1.5, gt=0)
    thin_height_m: float = Field(0.03, ge=0)
    min_region_m2: float = Field(0.1, ge=0)
    penetration_m: float = Field(0.01, ge=0)
    oob_fraction: float = Field(0.01, ge=0, le=1)
    oob_cap_fraction: float = Field(0.05, ge=0, le=1)
    door_clearance_m: float = Field(0.8, ge=0)
    window_clearance_m: float = Field(0.5, ge=0)
    wall_gap_m: float = Field(0.10, ge=0)
    chair_desk_m: float = Field(1.5, ge=0)
    grid_size: int = Field(128, ge=32, le=512, multiple_of=32)
    max_polygon_vertices: int = Field(16, ge=3, le=MAX_FLOOR_VERTICES)
    max_doors: int = Field(4, ge=1, le=MAX_OPENINGS)


class RewardConfig(Section):
    """R = mean(grades) / 10 - unit_penalty * min(units, unit_norm) / unit_norm; failure -> failure_reward."""

    unit_penalty: float = 0.8
    unit_norm: int = Field(512, gt=0)
    failure_reward: float = -1.0


class SceneRuntimeConfig(Section):
    """The SceneGen environment: operation costs, budget, caps, metrics, reward, prompts."""

    op_costs: OpCosts = OpCosts()
    budget_units: int = Field(512, gt=0)
    max_objects: int = Field(40, ge=1, le=MAX_SCENE_OBJECTS)
    max_planner_turns: int = Field(12, ge=1)
    max_critique_rounds: int = Field(3, ge=0)
    metrics: MetricsConfig = MetricsConfig()
    reward: RewardConfig = RewardConfig()
    prompts_dir: str | None = Field(
        None, description="Directory with replacement prompt templates (default: the packaged ones)."
    )
    catalogue_path: str | None = Field(
        None, description="Replacement catalogue JSON (default: jscenegen/scene/data/catalogue.json)."
    )


class JudgeConfig(Section):
    """Which judge grades terminal scenes, and how the HTTP backend talks to its server.

    The API key is never a config value: `api_key_env` names the environment variable holding it.
    """

    backend: Literal["rule", "http"] = "rule"
    grade_keys: tuple[str, ...] = GRADE_KEYS
    enforce_caps: bool = Field(True, description="Apply the metric caps to a model judge's grades too.")
    base_url: str | None = None
    model: str | None = None
    api_key_env: str | None = "JSCENEGEN_JUDGE_API_KEY"
    # bounded so that one request's worst case (1 + max_retries timeouts and back-offs of
    # backoff_s x 2^attempt) stays hours, not years
    timeout_s: float = Field(120.0, gt=0, le=3600)
    max_retries: int = Field(2, ge=0, le=10)
    backoff_s: float = Field(1.0, ge=0, le=60)
    concurrency: int = Field(8, ge=1, le=1024)
    temperature: float = Field(0.0, ge=0)
    max_tokens: int = Field(1024, ge=16)
    max_failed_updates: int = Field(
        5, ge=0, description="train stops (with a checkpoint, exit 2) after this many updates in "
        "a row in which the judge failed every episode it was asked to grade (a judge that is "
        "down masks them all); 0: never")

    @model_validator(mode="after")
    def _check(self) -> "JudgeConfig":
        if len(set(self.grade_keys)) != len(self.grade_keys) or not self.grade_keys:
            raise ValueError(f"grade_keys must be distinct and non-empty, got {self.grade_keys}")
        if self.backend == "http" and (not self.base_url or not self.model):
            raise ValueError("judge.backend 'http' needs judge.base_url and judge.model")
        if self.backend == "http" and self.base_url == REDACTED:
            raise ValueError("judge.base_url held a credential, so the run's saved config has "
                             f"{REDACTED} in its place: give it again as an override "
                             "(judge.base_url=https://...)")
        if self.backend == "http" and not _is_http_url(self.base_url):
            raise ValueError(f"judge.base_url {shown_url(self.base_url)[:200]!r} is not an http(s) URL with "
                             "a host and a port in 1-65535, if any (e.g. http://host:8000/v1)")
        return self


def shown_url(url: str) -> str:
    """`url` without user info or query (where a credential can sit), for messages."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<not a URL>"
    host = parts.hostname or ""
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:       # not a number in 0-65535: shown as given, without user info
        port = ":" + parts.netloc.rpartition(":")[2]
    return f"{parts.scheme}://{host}{port}{parts.path}" if parts.scheme else parts.path


def _is_http_url(text: str) -> bool:
    try:
        url = urlsplit(text)
        port = url.port            # ValueError when not a number in 0-65535
    except ValueError:
        return False
    return url.scheme in ("http", "https") and bool(url.hostname) and port != 0
