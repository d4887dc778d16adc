"""The judge interface: requests, results, the judge prompt, and the backend factory.

Every backend grades a *list* of requests at once (G episodes of a group finish together) and
returns one JudgeResult per request: the configured grade keys as integers 0..10, or a failure
cause ("judge_timeout", "judge_unparseable", "judge_error") that the reward masks.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Protocol, Sequence, TypedDict

from .caps import CAPS, active_caps, cap_text, caps_table
from .catalogue import load_catalogue
from .config import JudgeConfig, MetricsConfig, SceneRuntimeConfig, grade_template
from .metrics import metrics_text
from .prompts import PromptTemplates, load_templates
from .schema import Scene, canonical_text


@dataclass(frozen=True)
class JudgeRequest:
    """One terminal scene to grade, its `requested` items [{"category", "count"}] and its metrics."""

    scene: Scene
    requested: tuple[dict, ...]
    metrics: dict


@dataclass(frozen=True)
class JudgeResult:
    """Grades {key: int} or a failure cause; `info` holds latency_s, attempts and the judge's comments."""

    grades: dict[str, int] | None
    failure: str | None = None
    info: dict = field(default_factory=dict)


def judge_failure_text(cause: str, info: dict) -> str:
    """A judge failure as a message names it: `cause` (JUDGE_FAILURES), then the detail the
    judge recorded in its result's `info` ("HTTP 500", the exception's type and text),
    clipped to 300 characters, when there is one: "judge_error: HTTP 500"."""
    from jscenegen.text import clip_text

    detail = info.get("detail")
    return f"{cause}: {clip_text(str(detail), 300)}" if detail else cause


JUDGE_ERROR_CHARS = 300   # an exception's text kept in a judge_error's detail (judge_failure_text's clip)


def judge_error_detail(err: BaseException) -> str:
    """An exception a judge raised, as its `judge_error` result's info["detail"]: its type and
    text ("RuntimeError" alone sent a reader to a log that lacked the cause), escaped to one
    line and clipped to JUDGE_ERROR_CHARS characters as an error line is (`text.one_line`)."""
    from jscenegen.text import one_line

    return one_line(f"{type(err).__name__}: {err}" if str(err) else type(err).__name__,
                    JUDGE_ERROR_CHARS)


class JudgeIdentity(TypedDict):
    """Which judge grades (`Judge.identity`): enters the protocol hash, the training metadata
    and an evaluation report's `judge`, beside the judge's sampling settings there."""

    backend: str
    model: str | None
    rubric_hash: str


# its keys: what `eval --compare` reads as the judge's identity in a report's `judge`
JUDGE_IDENTITY_KEYS = tuple(JudgeIdentity.__annotations__)


def renamed_model_judge(a, b) -> tuple[str, str] | None:
    """(the name in `a`, the name in `b`) when the judge identities `a` and `b` (dicts, as a
    report or a checkpoint's metadata records them) are both the model judge's and their
    `model`s ("<directory name>@<digest>", `grpo.rollout.model_judge.judge_model_name`) have
    the same digest under other names: the same judge files in a renamed directory, which the
    identity tells apart (documented). None otherwise (other files, another backend)."""
    if not (isinstance(a, dict) and isinstance(b, dict)
            and a.get("backend") == b.get("backend") == "model"):
        return None
    (name_a, at_a, digest_a), (name_b, at_b, digest_b) = (
        str(j.get("model") or "").rpartition("@") for j in (a, b))
    if not (at_a and at_b and digest_a) or digest_a != digest_b or name_a == name_b:
        return None
    return name_a, name_b


def renamed_judge_text(names: tuple[str, str], remedy: str) -> str:
    """How a refusal says that the judge differs by its directory's name alone
    (`renamed_model_judge`): "the same judge files under another directory name (ja -> jb):
    <remedy>"."""
    from jscenegen.text import clip_text

    return (f"the same judge files under another directory name ({clip_text(names[0], 80)} -> "
            f"{clip_text(names[1], 80)}): {remedy}")


class Judge(Protocol):
    """A judge backend."""

    def identity(self) -> JudgeIdentity:
        """`JudgeIdentity`: enters the protocol hash and training metadata."""

    def grade(self, requests: Sequence[JudgeRequest]) -> list[JudgeResult]:
        """Grade every request; never raises for a bad answer, returns failures instead."""

    def check_reachable(self) -> None:
        """Before a run: raise ValueError when the judge cannot grade at all (a server that
        refuses the API key), warn when it cannot grade now; nothing for an in-process judge."""


def requested_text(requested) -> str:
    """A scene's requested objects as the prompts list them: "bed x1, nightstand x2" ("none")."""
    return ", ".join(f"{r['category']} x{r['count']}" for r in requested) or "none"


def judge_messages(req: JudgeRequest | None, cfg: JudgeConfig, templates: PromptTemplates,
                   metrics_cfg: MetricsConfig) -> list[dict]:
    """Chat messages (system + user) for an LLM judge: rubric, caps (their thresholds from
    `metrics_cfg`, the run's `scene.metrics`), scene text and metrics. `req` None: the rubric
    alone (no prompt, scene or metrics), the shortest messages the judge is sent (the model
    judge budgets its memory by it)."""
    caps = "\n".join(f"- {cap_text(c, metrics_cfg)}" for c in CAPS if c.grade in cfg.grade_keys)
    active = "; ".join(cap_text(c, metrics_cfg) for c in (active_caps(req.metrics) if req else ())
                       if c.grade in cfg.grade_keys) or "none"
    return [
        {"role": "system", "content": templates.render(
            "judge_system", grade_template=grade_template(cfg.grade_keys), caps=caps)},
        {
            "role": "user",
            "content": templates.render(
                "judge_user",
                prompt=req.scene.prompt if req else "",
                requested=requested_text(req.requested if req else ()),
                scene=canonical_text(req.scene) if req else "",
                metrics=metrics_text(req.metrics) if req else "",
                active_caps=active,
            ),
        },
    ]


def judge_check_hint(cfg: JudgeConfig) -> str:
    """What to check when the configured judge failed (graded nothing, or masked an episode),
    for an error line: the one rule for every backend."""
    if cfg.backend == "model":
        return ("check judge.model_path and judge.max_tokens, and the model judge's lines in "
                "the log")
    if cfg.backend == "http":
        return "check judge.base_url and the judge's log"
    return "the rule judge's error is in the log above"


def http_judge_sampling(cfg: JudgeConfig) -> dict:
    """{"temperature", "max_tokens"}: what the HTTP judge sends with every request beside the
    model and messages (`judge_http.HttpJudge`), and what the model judge decodes with
    (`grpo.rollout.model_judge.ModelJudge`): the backends of `config.SAMPLING_JUDGES`. They change its
    grades (and an answer cut at max_tokens is a masked failure) but are not part of its
    identity (which enters the protocol hash a run resumes under), so an evaluation report
    records them beside it (`eval.evaluate.evaluate`) and `eval --compare` compares them."""
    return {"temperature": cfg.temperature, "max_tokens": cfg.max_tokens}


def rubric_hash(cfg: JudgeConfig, templates: PromptTemplates, metrics_cfg: MetricsConfig,
                caps_enforced: bool = True) -> str:
    """SHA-256 of the judge templates, grade keys, cap table (texts filled in) and whether the
    caps clamp the judge's grades (a model judge's `enforce_caps`; the rule judge's always do)."""
    h = hashlib.sha256()
    for name in ("judge_system", "judge_user"):
        h.update(templates.texts[name].encode())
    h.update(json.dumps([list(cfg.grade_keys), caps_table(metrics_cfg), caps_enforced],
                        sort_keys=True).encode())
    return h.hexdigest()


class ModelJudgeUnavailable(ValueError):
    """`make_judge` was asked for the model judge, which this package (no JAX) cannot build."""


def make_judge(cfg: JudgeConfig, runtime: SceneRuntimeConfig | None = None) -> Judge:
    """The configured backend: RuleJudge ("rule") or HttpJudge ("http"). The model judge
    ("model") runs a JAX model, which the scene runtime knows nothing of: it is built by
    `jscenegen.grpo.rollout.judges.build_judge` (which calls this for the others); asked
    for it, this raises ModelJudgeUnavailable."""
    if cfg.backend == "model":
        raise ModelJudgeUnavailable(
            "judge.backend 'model' runs a JAX model, which the scene runtime cannot load: build "
            "the judge with jscenegen.grpo.rollout.judges.build_judge")
    runtime = runtime or SceneRuntimeConfig()
    templates = load_templates(runtime.prompts_dir)
    if cfg.backend == "rule":
        from .judge_rule import RuleJudge

        return RuleJudge(cfg, load_catalogue(runtime.catalogue_path), templates, runtime.metrics)
    from .judge_http import HttpJudge

    return HttpJudge(cfg, templates, runtime.metrics)
