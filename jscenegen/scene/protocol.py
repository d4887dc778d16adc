"""`protocol_hash`: the identity of the environment a run trains against (scene-protocol.md section 7).

SHA-256 of canonical JSON over: the prompt templates, the action grammar (text plus every
operation's fields and validation settings, `op_signatures`), operation costs, budget, object and turn caps, reward coefficients, metric
parameters, the catalogue, the grade keys and cap table, the judge's identity (backend, model,
rubric hash), and `RULES_REVISION`. A run refuses to resume or extend when it changes.
"""
from __future__ import annotations

import dataclasses
import typing

from pydantic import AfterValidator, BaseModel, BeforeValidator, PlainValidator, WrapValidator

from jscenegen.paths import json_sha256

from .actions import ACTION_GRAMMAR
from .caps import caps_table
from .catalogue import load_catalogue
from .config import SAMPLING_JUDGES, JudgeConfig, SceneRuntimeConfig
from .judge import make_judge, renamed_judge_text, renamed_model_judge
from .ops import OP_MODELS
from .prompts import load_templates

RULES_REVISION = 8
"""Raised whenever a measuring or grading rule changes in code rather than through a config value,
so that a run (or an evaluation report) graded under the old rule is not continued (or compared)
under the new one. 8: a wall mount is supported when its whole back face lies along one wall,
both back corners within mount_gap_m of it, collinear consecutive floor edges counting as one
wall (geometry.straight_walls; the stored polygon and its edge numbers are unchanged): a 1 m
shelf flush along a straight wall across an extra vertex of it measured 0.5 m off and was listed
unsupported. Revision 7's rule first measured the back face's nearest point to a wall and then,
still under 7, each edge's farther back corner, edge by edge without merging. 7: the footprint penetration depth (geometry.penetration: collisions, door
clearance and window boxes) is the shortest move that separates, per axis min(a1 - b0, b1 - a0),
not the projections' overlap: a 5 mm board inside a bed's footprint collides (it measured 5 mm,
below penetration_m); partial overlaps measure as before. `unsupported_objects` (measured,
read by no rule grade) also lists a wall mount whose back face does not lie along a wall (both
its corners within mount_gap_m of the same one), a ceiling mount whose top is more than that from the ceiling, and an object `on`
a parent whose category the catalogue's `top_surfaces` does not list (only `on` objects off
their parent's top were listed: a picture in mid-room, a plant on it). 6: an object mounted `on` another blocks walking when it is not thin and its
bottom is below block_height_m (scene-protocol.md section 4), and a floor object standing on a
rug blocks a door's clearance box and must be reachable, and has its front checked (front to
a wall, blocked front), as on the floor (`on` objects blocked nothing: a plant on a rug could
stand in the door's box; a wardrobe on a rug facing a wall escaped the functionality cap), all
through reach_inputs.stands_on_floor; the `blockers` hint leaves an object out with what stands
on it (a nightstand without its lamp freed nothing, so neither was listed); `prompt_following` gives each object
to one requested item only (a queen bed was counted for both `bed` and `queen_bed`). 5: `replace_object` with none of category, description or size is an error
(it was a charged no-op). 4: an object mounted `on` another keeps its centre on its parent's top
through moves, rotations, snaps, resizes and replaces (only add_object checked it: a lamp could
be moved off its nightstand to hang in the air at no cost); the prompt's operation table marks
the snaps' orientation optional, as the operations read it. 3: a footprint that holds no reachability cell centre (a 3 cm deep mirror) is
the cell holding the object's centre, so it blocks and can be reached (it did neither); a number
in an action that is infinite as a float (1e400) is bad_json (was schema_violation).
2: the door clearance box is blocked by floor objects only; a front faces a
wall within 2 x agent_radius_m (was agent_radius_m + access_margin_m); the functionality cap
counts storage fronts only (scene-protocol.md sections 4 and 5); resizes lift every level of
children; a move carrying a child off the floor is refused; a centre on any wall line is on
the floor; descriptions hold at most 1000 characters; NaN/Infinity in an action are bad_json."""


def protocol_payload(cfg: SceneRuntimeConfig, judge_cfg: JudgeConfig, judge_identity: dict | None = None) -> dict:
    """The JSON-able data that `protocol_hash` digests (useful to diff two protocols)."""
    templates = load_templates(cfg.prompts_dir)
    identity = judge_identity if judge_identity is not None else make_judge(judge_cfg, cfg).identity()
    return {
        "prompts_sha256": templates.digest(),
        "action_grammar": ACTION_GRAMMAR,
        "op_schemas": op_signatures(),
        "op_costs": cfg.op_costs.model_dump(),
        "budget_units": cfg.budget_units,
        "max_objects": cfg.max_objects,
        "max_planner_turns": cfg.max_planner_turns,
        "max_critique_rounds": cfg.max_critique_rounds,
        "reward": cfg.reward.model_dump(),
        "metrics": cfg.metrics.model_dump(),
        "catalogue": load_catalogue(cfg.catalogue_path).raw,
        "grade_keys": list(judge_cfg.grade_keys),
        "caps": caps_table(cfg.metrics),
        "judge": identity,
        "rules_revision": RULES_REVISION,
    }


def op_signatures(models: dict[str, type[BaseModel]] = OP_MODELS) -> dict[str, dict]:
    """What each operation accepts, {op: {"fields": {name: [annotation, default or
    "required", constraints]}, "config": {strict, extra, allow_inf_nan}}}, written from the
    models' own fields: pydantic's JSON schema of the same models is rendered differently by
    other pydantic releases (a run resumed on a machine with another one would be refused).

    Raises TypeError for what this record would not describe whole (a field's alias, default
    factory or nested model, whose own fields and constraints it would not read; a validator;
    a model setting beyond `_RECORDED_CONFIG`): extend it before using one."""
    for op, m in models.items():
        decorators = m.__pydantic_decorators__
        found = [f.name for f in dataclasses.fields(decorators) if getattr(decorators, f.name)]
        unread = sorted(set(m.model_config) - _RECORDED_CONFIG)
        if found or unread:
            raise TypeError(f"operation {op!r}: {', '.join(found + unread)} is not recorded by "
                            "op_signatures; extend it")

    def field(op: str, name: str, info) -> list:
        nested = [t for t in _annotation_types(info.annotation)
                  if isinstance(t, type) and issubclass(t, BaseModel)]
        validators = [m for m in info.metadata if isinstance(m, _FIELD_VALIDATORS)] + [
            m for t in _annotation_types(info.annotation) for m in getattr(t, "__metadata__", ())
            if isinstance(m, _FIELD_VALIDATORS)]
        if info.alias or info.validation_alias or info.default_factory is not None or nested \
                or validators:
            raise TypeError(f"operation {op!r} field {name!r}: an alias, default factory, nested "
                            "model or validator is not recorded by op_signatures; extend it")
        return [repr(info.annotation), "required" if info.is_required() else repr(info.default),
                [repr(m) for m in info.metadata]]

    return {name: {"fields": {f: field(name, f, info) for f, info in m.model_fields.items()},
                   "config": {k: repr(m.model_config.get(k))
                              for k in ("strict", "extra", "allow_inf_nan")}}
            for name, m in models.items()}


_FIELD_VALIDATORS = (AfterValidator, BeforeValidator, PlainValidator, WrapValidator)
_RECORDED_CONFIG = frozenset({"strict", "extra", "allow_inf_nan", "frozen", "title"})
"""Model settings an operation may use: recorded (the first three) or not changing what it accepts."""


def _annotation_types(annotation) -> list:
    """Every type named inside an annotation (unions, containers, Annotated), itself included."""
    return [annotation, *(t for arg in typing.get_args(annotation) for t in _annotation_types(arg))]


def protocol_settings(config: dict) -> dict | None:
    """The settings of a resolved run config (`model_dump(mode="json")`, or as a checkpoint's
    metadata records it) that `protocol_payload` reads: the whole `scene` section and the
    judge's identity keys (backend and grade keys; for the language-model judges,
    SAMPLING_JUDGES, enforce_caps and what names their model: `model` for the http judge,
    model_path and chat_template_path for the model judge, whose identity digests the model at
    that path and the template it uses; the rule judge ignores them). None when the config has
    no scene or judge section. For naming what changed when the hash did (its files and
    RULES_REVISION are not settings)."""
    scene, judge = config.get("scene"), config.get("judge")
    if not isinstance(scene, dict) or not isinstance(judge, dict):
        return None
    keys = ("backend", "grade_keys")
    if (backend := judge.get("backend")) in SAMPLING_JUDGES:
        keys += _JUDGE_MODEL_SETTINGS.get(backend, ()) + ("enforce_caps",)
    return {"scene": scene, "judge": {k: judge.get(k) for k in keys}}


# the settings that name a language-model judge's model, by backend (`protocol_settings`)
_JUDGE_MODEL_SETTINGS = {"http": ("model",), "model": ("model_path", "chat_template_path")}


def judge_model_change(recorded, identity: dict) -> list[str]:
    """["judge model 'a@1f..' -> 'a@9c..' (the model judge's files at judge.model_path)"] when
    `recorded` (a checkpoint's record of its judge's identity) and `identity` are both the model
    judge's and name other models (its weights, tokenizer or config replaced, at the same
    judge.model_path or another: the identity digests the files, `model_judge.judge_model_name`;
    or the same files in a renamed directory, which the identity names too: said so,
    `renamed_model_judge`), else []: what a refused resume names when no setting tells the
    change."""
    if not isinstance(recorded, dict) or not (recorded.get("backend") == identity.get("backend") == "model"):
        return []
    if recorded.get("model") == identity.get("model"):
        return []
    why = "the model judge's files at judge.model_path"
    if renamed := renamed_model_judge(recorded, identity):   # its name alone: say so
        why = renamed_judge_text(renamed, "rename it back, or start a new run")
    return [f"judge model {recorded.get('model')!r} -> {identity.get('model')!r} ({why})"]


def protocol_hash(cfg: SceneRuntimeConfig, judge_cfg: JudgeConfig, judge_identity: dict | None = None) -> str:
    """Hex SHA-256 of `protocol_payload` serialised with sorted keys and no whitespace."""
    return json_sha256(protocol_payload(cfg, judge_cfg, judge_identity))


def protocol_digests(cfg: SceneRuntimeConfig, judge_cfg: JudgeConfig) -> dict[str, str]:
    """{part of `protocol_payload`: the first 16 hex digits of its SHA-256}, the judge left
    out (a report records it whole): what an evaluation report keeps, so that two reports
    played under other prompts, costs, budgets, rewards, metrics or catalogue are told apart
    part by part (`eval.report.check_same_episodes`)."""
    payload = protocol_payload(cfg, judge_cfg, judge_identity={})
    return {part: json_sha256(value)[:16] for part, value in payload.items() if part != "judge"}
