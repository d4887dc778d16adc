"""Typed configuration of the SceneGen runtime (`scene:`) and of its judge (`judge:`).

Every number of ../shared/specs/scene-protocol.md is a default here, never a constant in code.
`RunConfig` carries both as `scene:` and `judge:`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from jscenegen.config import REDACTED, Section

from .schema import MAX_FLOOR_VERTICES, MAX_OPENINGS, MAX_SCENE_OBJECTS

GRADE_MIN, GRADE_MAX = 0, 10   # every grade, the judge's and the critic's, is an integer here


def is_grade(value) -> bool:
    """Whether `value` is a grade: a JSON integer (not a boolean) in GRADE_MIN..GRADE_MAX."""
    return type(value) is int and GRADE_MIN <= value <= GRADE_MAX


def grade_template(grade_keys) -> str:
    """The grades object as the prompts show it: `"realism": <0-10>, ...`."""
    return ", ".join(f'"{k}": <{GRADE_MIN}-{GRADE_MAX}>' for k in grade_keys)


GRADE_KEYS = (
    "realism",
    "functionality",
    "layout",
    "completeness",
    "prompt_following",
    "reachability",
    "physical_plausibility",
)


UNITS_MAX = 2**20    # budget units: a budget, a cost, the penalty's norm (the spec's budget is 512)
TURNS_MAX = 4096     # planner turns and critique rounds of one episode (its tokens end it sooner)


def _op_cost(units: int, also: str = "") -> Any:
    """A designer operation's cost field: `units` of budget by default."""
    return Field(units, ge=0, le=UNITS_MAX, description=f"units of budget the operation costs, "
                 f"charged when requested{also}")


class OpCosts(Section):
    """Unit cost of each designer operation (scene-protocol.md section 3)."""

    add_object: int = _op_cost(8, ", also when it then fails validation")
    replace_object: int = _op_cost(8)
    resize_object: int = _op_cost(3)
    move_object: int = _op_cost(2)
    remove_object: int = _op_cost(2, "; its children go with it")
    snap_to_wall: int = _op_cost(2)
    snap_to_object: int = _op_cost(2)
    rotate_object: int = _op_cost(1)
    get_scene: int = _op_cost(0)


MAX_RING_CELLS = 31   # scene/reachability_jax.py shifts rows packed in 32-bit words


class MetricsConfig(Section):
    """Geometry and reachability parameters (scene-protocol.md section 4), metres.

    `grid_size` is the side of the fixed padded grid in cells (128 x 5 cm = 6.4 m; a multiple of
    32, the JAX kernel packs rows into uint32 words); a room whose bounding box does not fit is
    refused.
    """

    cell_m: float = Field(0.05, gt=0, le=1, description="side of one reachability grid cell (m); "
                          "must be a whole even number of millimetres")
    agent_radius_m: float = Field(0.15, ge=0, description="radius of the walking agent (m): free "
                                  "space is the floor eroded by it minus the blocking footprints "
                                  "dilated by it; a front-used object faces a wall when the wall is "
                                  "closer in front of it than twice this (no room for the agent); "
                                  f"with access_margin_m at most {MAX_RING_CELLS} cells of cell_m")
    access_margin_m: float = Field(0.10, ge=0, description="access ring width (m): an object is "
                                   "reachable when the ring between its footprint dilated by "
                                   "agent_radius_m and by agent_radius_m + this touches the reached "
                                   "cells")
    block_height_m: float = Field(1.5, gt=0, description="an object whose bottom (elevation) is at "
                                  "or above this height (m) never blocks walking")
    thin_height_m: float = Field(0.03, ge=0, description="an object at most this tall (m), or a "
                                 "catalogue `thin` category, is a thin covering (rug, mat): it "
                                 "neither blocks walking nor collides")
    min_region_m2: float = Field(0.1, ge=0, le=1e6, description="free-space components count as regions "
                                 "(num_regions) only when larger than this area (m^2)")
    penetration_m: float = Field(0.01, ge=0, description="footprint penetration depth (m: the "
                                 "shortest move that separates the footprints, so one lying inside "
                                 "another is in by its way out, not by its own thickness) from "
                                 "which two objects collide, and an object enters a door clearance "
                                 "or window box")
    oob_fraction: float = Field(0.01, ge=0, le=1, description="share of an object's footprint "
                                "outside the floor above which it is out of bounds, as is one above "
                                "the walls (oob_objects: -3 physical_plausibility each, rule judge)")
    oob_cap_fraction: float = Field(0.05, ge=0, le=1, description="share of a footprint outside "
                                    "the floor above which the object caps physical_plausibility "
                                    "at 4 (oob_cap_objects; so does one above the walls)")
    door_clearance_m: float = Field(0.8, ge=0, description="depth (m) into the room of each door's "
                                    "clearance box (the door's width): a blocking object in it "
                                    "blocks the door")
    window_clearance_m: float = Field(0.5, ge=0, description="depth (m) into the room of each "
                                      "window's box (the window's width): a non-thin object in it "
                                      "whose top is above the sill and bottom below the window's "
                                      "top is a window warning")
    wall_gap_m: float = Field(0.10, ge=0, description="a storage piece farther than this (m) from "
                              "every wall is off the wall (storage_off_wall_objects: -1 realism "
                              "each in the rule judge)")
    mount_gap_m: float = Field(0.05, ge=0, description="a wall-mounted object whose back face "
                               "(its local -y side) does not lie along a wall of the floor "
                               "polygon (both its corners within this, in m, of the same wall), "
                               "or a ceiling-mounted one whose top is farther "
                               "than this from wall_height, is unsupported (unsupported_objects: "
                               "measured, no grade of the rule judge reads it)")
    chair_desk_m: float = Field(1.5, ge=0, description="a chair is at a desk when a desk-like "
                                "object's centre lies within this distance (m) of its centre and "
                                "within 60 degrees of its front (else -2 functionality)")
    grid_size: int = Field(128, ge=32, le=512, multiple_of=32, description="side of the fixed "
                           "padded reachability grid in cells (times cell_m: the longest room "
                           "bounding-box side); a larger room is refused")
    max_polygon_vertices: int = Field(16, ge=3, le=MAX_FLOOR_VERTICES, description="most floor "
                                      "polygon vertices a measured room may have (the grid's "
                                      "padded size); more are refused")
    max_doors: int = Field(4, ge=1, le=MAX_OPENINGS, description="most doors a measured room may "
                           "have (the grid's padded size); more are refused")

    @field_validator("cell_m")
    @classmethod
    def _whole_even_millimetres(cls, value: float) -> float:
        """The grid's cell centres lie on whole millimetres (scene/reach_inputs.py)."""
        mm = round(value * 1000)
        if mm < 2 or mm % 2 or abs(mm - value * 1000) > 1e-6:
            raise ValueError(f"{value} m is not a whole even number of millimetres >= 2 (0.002 m)")
        return value

    @property
    def cell_mm(self) -> int:
        """cell_m in whole millimetres (an even number: `cell_m`'s check)."""
        return round(self.cell_m * 1000)

    @property
    def ring_mm(self) -> int:
        """The access ring's outer radius, agent_radius_m + access_margin_m, in millimetres."""
        return round((self.agent_radius_m + self.access_margin_m) * 1000)

    @model_validator(mode="after")
    def _ring_fits_the_kernels(self) -> "MetricsConfig":
        """The agent's disk and access ring are dilations by a disk of that many cells: the
        JAX kernel shifts rows packed in 32-bit words by at most MAX_RING_CELLS (beyond, it
        disagreed with NumPy) and NumPy's dilation grows with the disk's area (1000 m hung)."""
        cells = self.ring_mm // self.cell_mm
        if cells > MAX_RING_CELLS:
            ring = self.agent_radius_m + self.access_margin_m
            raise ValueError(f"agent_radius_m + access_margin_m = {ring:g} m is {cells:,} cells "
                             f"of cell_m {self.cell_m:g} m; at most {MAX_RING_CELLS}")
        return self


# The bounds of the reward's settings, and so of every reward (scene-protocol.md section 5:
# grades' mean / 10 minus the operation-cost penalty; -1 for a policy failure; 0 when masked).
UNIT_PENALTY_MAX = 1.0        # a spent budget costs at most the whole quality range
FAILURE_REWARD_MIN = -1.0     # the spec's failure reward; a softer one may be configured
FAILURE_REWARD_MAX = 0.0      # never above a masked episode's 0: a failure is not rewarded
REWARD_MAX = 1.0              # all grades GRADE_MAX, nothing spent
REWARD_MIN = min(FAILURE_REWARD_MIN, -UNIT_PENALTY_MAX)   # a failure, or grades 0 with the budget spent


class RewardConfig(Section):
    """R = mean(grades) / 10 - unit_penalty * min(units, unit_norm) / unit_norm; failure -> failure_reward.

    The bounds on `unit_penalty` and `failure_reward` keep every reward in [REWARD_MIN,
    REWARD_MAX] = [-1, 1] (what an evaluation report's check reads)."""

    unit_penalty: float = Field(0.8, ge=0, le=UNIT_PENALTY_MAX, description="weight of the budget "
                                "term: the reward loses unit_penalty x min(units used, unit_norm) "
                                "/ unit_norm (at most 1, the whole quality range)")
    unit_norm: int = Field(512, gt=0, le=UNITS_MAX, description="units of budget at which the unit penalty "
                           "reaches its full weight (used units beyond it cost nothing more)")
    failure_reward: float = Field(-1.0, ge=FAILURE_REWARD_MIN, le=FAILURE_REWARD_MAX, description=(
        "reward of an episode that ends in a policy failure, -1 to 0 (judge and runtime "
        "failures are masked instead, reward 0)"))


class SceneRuntimeConfig(Section):
    """The SceneGen environment: operation costs, budget, caps, metrics, reward, prompts."""

    op_costs: OpCosts = OpCosts()
    budget_units: int = Field(512, gt=0, le=UNITS_MAX, description="units of budget per episode; an operation "
                              "that would pass it is refused, uncharged, and ends its batch")
    max_objects: int = Field(40, ge=1, le=MAX_SCENE_OBJECTS, description="most objects a scene "
                             "may hold: add_object on a scene that has this many fails validation "
                             "(still charged)")
    max_planner_turns: int = Field(12, ge=1, le=TURNS_MAX, description="planner turns per episode; the last must "
                                   "be finish, else the episode fails (planner_turn_cap)")
    max_critique_rounds: int = Field(3, ge=0, le=TURNS_MAX, description="critic turns per episode; a further "
                                     "critique request is refused with a message, not failed")
    metrics: MetricsConfig = MetricsConfig()
    reward: RewardConfig = RewardConfig()
    prompts_dir: str | None = Field(
        None, description="Directory with replacement prompt templates (default: the packaged ones)."
    )
    catalogue_path: str | None = Field(
        None, description="Replacement catalogue JSON (default: jscenegen/scene/data/catalogue.json)."
    )


SAMPLING_JUDGES = ("http", "model")
"""The judge backends whose answer a language model samples: they read judge.enforce_caps,
temperature, max_tokens and concurrency, and an evaluation report records their temperature
and max_tokens (the rule judge computes its grades)."""


MIN_JUDGE_MAX_TOKENS = 16   # judge.max_tokens' least value (a model judge's refusal never suggests less)


class JudgeConfig(Section):
    """Which judge grades terminal scenes, how the HTTP backend talks to its server, and which
    model the model backend runs.

    The API key is never a config value: `api_key_env` names the environment variable holding it.
    """

    backend: Literal["rule", "http", "model"] = Field(
        "rule", description="rule: grades computed from the measured metrics, deterministic and "
        "offline; http: an OpenAI-compatible chat-completions server (base_url, model); model: "
        "a model of our own (model_path) run frozen in the process, on the run's devices, "
        "beside the policy")
    grade_keys: tuple[str, ...] = Field(GRADE_KEYS, description="grades the judge and the critic "
                                        "give (integers 0-10); the reward's quality is their "
                                        "mean / 10; the rule judge knows only the default seven")
    enforce_caps: bool = Field(True, description="Apply the metric caps to the grades of a "
                               "language-model judge (backends http and model) too.")
    base_url: str | None = Field(None, description="http judge: the server's API root (requests "
                                 "go to {base_url}/chat/completions; train first probes "
                                 "{base_url}/models; the path goes before any query string; "
                                 "user info is sent as HTTP Basic auth, so not together with an "
                                 "API key); required with backend http")
    model: str | None = Field(None, description="http judge: the model name sent in each request "
                              "(whatever the server serves); required with backend http")
    model_path: str | None = Field(None, description="model judge: the judge's HF model directory "
                                   "(config.json, safetensors, tokenizer and chat template) or a "
                                   "training checkpoint step (RUN/checkpoints/N), as --model "
                                   "of eval and design takes; required with backend model and "
                                   "refused with the others")
    chat_template_path: str | None = Field(
        None, description="model judge: a replacement chat template (jinja) for the judge "
        "model's own, which must be prefix-preserving as the policy's (Qwen3's is not: e.g. "
        "jscenegen/model/tokenizer/templates/chatml.jinja); null: the directory's own (a "
        "Qwen3.5 judge's refused one: the bundled protocol template); the template used enters "
        "the judge's identity; refused with the other backends")
    api_key_env: str | None = Field("JSCENEGEN_JUDGE_API_KEY", min_length=1, pattern=r"^[^=\x00]+$",
                                    description="name of the environment variable holding the "
                                    "http judge's API key (sent as a Bearer token); null or unset: "
                                    "no Authorization header")
    # bounded so that one request's worst case (1 + max_retries timeouts and back-offs of
    # backoff_s x 2^attempt) stays hours, not years
    timeout_s: float = Field(120.0, gt=0, le=3600, description="seconds each try of an http judge "
                             "request may take before it counts as judge_timeout")
    max_retries: int = Field(2, ge=0, le=10, description="further tries of a failed http judge "
                             "request (none after an HTTP 4xx other than 408 and 429); then the "
                             "episode is masked as a judge failure")
    backoff_s: float = Field(1.0, ge=0, le=60, description="seconds before the first retry, "
                             "doubled for each further one (a longer Retry-After in seconds, up "
                             "to 60, wins)")
    concurrency: int = Field(8, ge=1, le=1024, description="most http judge requests in flight at "
                             "once within one grading call; the model judge's most rows per "
                             "batch it decodes (a grading call of more is several batches)")
    temperature: float = Field(0.0, ge=0, description="sampling temperature of the judge's "
                               "answer: sent to the http judge's server; the model judge "
                               "decodes greedily (argmax) below 1e-5, else samples with a "
                               "fixed key per prompt (recorded in evaluation reports: `eval "
                               "--compare` refuses reports graded at another)")
    max_tokens: int = Field(1024, ge=MIN_JUDGE_MAX_TOKENS, le=1 << 20, description="the most tokens the judge's "
                            "answer may have (sent to the http judge's server as max_tokens; "
                            "the model judge's decode budget, refused beside a prompt past "
                            "its max_position_embeddings); an answer cut there is "
                            "judge_unparseable (recorded in evaluation reports as temperature is)")
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
        if self.backend == "model" and not self.model_path:
            raise ValueError("judge.backend 'model' needs judge.model_path (the judge's HF model "
                             "directory or checkpoint step)")
        for key in ("model_path", "chat_template_path"):
            if self.backend != "model" and getattr(self, key) is not None:
                raise ValueError(f"judge.{key} is read by judge.backend 'model' only, not "
                                 f"{self.backend!r}: set judge.backend=model, or leave "
                                 f"judge.{key} out")
        if self.backend == "model" and (why := not_a_model_dir(self.model_path)):
            raise ValueError(f"judge.model_path {self.model_path}: {why}")
        if self.backend == "http" and self.base_url == REDACTED:
            raise ValueError("judge.base_url held a credential, so the run's saved config has "
                             f"{REDACTED} in its place: give it again as an override "
                             "(judge.base_url=https://...)")
        if self.backend == "http" and not _is_http_url(self.base_url):
            raise ValueError(f"judge.base_url {shown_url(self.base_url)[:200]!r} is not an http(s) URL with "
                             "a host and a port in 1-65535, if any, in printable ASCII without "
                             "spaces (e.g. http://host:8000/v1)")
        return self


def not_a_model_dir(path: str) -> str | None:
    """Why `path` cannot be the model judge's model (`judge.model_path`) as far as the config
    can tell, or None: it must be an existing directory. Whether it is a model (an HF
    directory's config.json or a checkpoint step's params/ and hf/: `checkpoint.store.
    not_a_model`, the one rule, which this package cannot import), and what else it needs
    (weights, a tokenizer), is checked when the judge is built (`grpo.rollout.judges.
    build_judge`, before any command's work)."""
    p = Path(path)
    if not p.exists():
        return "no such directory"
    if not p.is_dir():
        return "not a directory (give the judge's HF model directory or checkpoint step)"
    return None


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
    """An http(s) URL with a host and a port in 1-65535, if any, in printable ASCII without
    spaces (httpx refuses control characters only when it sends, and would send a space in the
    host as %20)."""
    if any(not 0x20 < ord(c) < 0x7F for c in text):
        return False
    try:
        url = urlsplit(text)
        port = url.port            # ValueError when not a number in 0-65535
    except ValueError:
        return False
    return url.scheme in ("http", "https") and bool(url.hostname) and port != 0
