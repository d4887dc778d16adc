"""`jscenegen scene check|render|generate|furnish`: measure, draw and generate scenes (thin layer over jscenegen.scene)."""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from jscenegen.commands import int_in
from jscenegen.paths import data_path_arg, is_decimal


def _units_arg(text: str) -> int:
    """argparse type of `--requested-units`: an integer in [0, 2**31 - 1] (config.STEPS_MAX, an
    int32 count). pydantic is imported when a value is parsed, not when the parsers are built."""
    from jscenegen.config import STEPS_MAX

    return int_in(0, STEPS_MAX)(text)


def _requested(text: str | None, catalogue) -> list[dict]:
    """`--requested 'bed:1,nightstand:2'` as requested items, checked as a record's are, each
    name a category or group of `catalogue` (a typo would silently lower prompt_following).
    Refused at the first item whose count is below MIN_REQUESTED_COUNT (1) or whose count, or
    the counts' sum so far, passes MAX_SCENE_OBJECTS (`sceneset.requested_over_scene`): no
    more than that many items are read, whatever the text's length."""
    from jscenegen.scene.sceneset import MIN_REQUESTED_COUNT, requested_items, requested_over_scene
    from jscenegen.scene.schema import MAX_SCENE_OBJECTS
    from jscenegen.text import clip_text

    if not text:
        return []
    out, total = [], 0
    for part in text.split(","):
        cat, _, count = part.strip().partition(":")
        count = count.strip()
        if not cat or not is_decimal(count) or len(count) > 9 or int(count) < MIN_REQUESTED_COUNT:
            raise ValueError(f"--requested item {clip_text(repr(part.strip()))} is not "
                             f"category:count (a count in {MIN_REQUESTED_COUNT}..{MAX_SCENE_OBJECTS})")
        total += int(count)
        if why := requested_over_scene(total, f"--requested item {clip_text(repr(part.strip()))}"):
            raise ValueError(why)
        if not catalogue.knows(cat.strip()):
            raise ValueError(f"--requested item {clip_text(repr(part.strip()))}: "
                             f"{clip_text(repr(cat.strip()))} is neither a category nor a group of "
                             f"the catalogue (groups: {', '.join(sorted(catalogue.groups))})")
        out.append({"category": cat.strip(), "count": int(count)})
    return list(requested_items(out, "--requested"))


def _run_config(path: str | None):
    """The run config `path` (a run's own config.yaml or any config file: all its sections
    are checked, so a misspelt section is refused); None: the schema's defaults."""
    from jscenegen.config import load_config
    from jscenegen.run_config import RunConfig

    return RunConfig() if path is None else load_config(path, [], RunConfig)


def _refuse_overwriting(output: str, cfg, config: str | None, inputs: dict) -> None:
    """Refuse an `-o` that is one of `inputs` or of what the config reads or names (the
    config file, its catalogue, templates and scene sets, the installed package:
    `run_config.config_inputs`)."""
    from jscenegen.paths import refuse_overwriting_input
    from jscenegen.run_config import config_inputs

    refuse_overwriting_input(output, "-o", {**inputs, **config_inputs(cfg, config)})


def _input(path: str) -> str:
    """A scene or scene-set path as given, else under the checkout (`resolve_data_path`)."""
    from jscenegen.paths import resolve_data_path

    return str(resolve_data_path(path))


def _load(path: str):
    """(scene, requested items) from a scene JSON file or a one-record scene-set file."""
    from jscenegen.scene.sceneset import record_from_json
    from jscenegen.scene.schema import read_json_file, scene_from_json

    data = read_json_file(path)
    if isinstance(data, dict) and "scene" in data and "room" not in data:
        rec = record_from_json(data, path)
        return rec.scene, list(rec.requested)
    return scene_from_json(data, path), []


def check(args) -> int:
    """Grades come from the configured judge (`judge.backend`: the rule judge by default, the
    HTTP judge or the model judge when --config says so: the model judge's weights are loaded
    here, on one device); the output's `judge` names it. A judge failure prints
    the cause with no grades or reward and exits 1. A scene no episode may end with (empty)
    is not judged: its reward is the failure reward an episode gets (-1), with
    `failure_cause`."""
    from jscenegen.grpo.rollout.judges import build_judge
    from jscenegen.scene.catalogue import load_catalogue
    from jscenegen.scene.episode import terminal_scene_failure
    from jscenegen.scene.judge import JudgeRequest, judge_failure_text
    from jscenegen.scene.metrics import measure
    from jscenegen.scene.reward import failed_outcome, reward_from_grades

    run_cfg = _run_config(args.config)
    cfg = run_cfg.scene
    catalogue = load_catalogue(cfg.catalogue_path)
    scene, req = _load(_input(args.scene))
    if args.requested is not None:
        req = _requested(args.requested, catalogue)
    metrics = measure(scene, cfg, catalogue, blockers=True)
    units = scene.budget.used_units if args.requested_units is None else args.requested_units
    judge = build_judge(run_cfg)
    identity = {k: v for k, v in judge.identity().items() if k != "rubric_hash"}
    terminal_failure = terminal_scene_failure(scene)
    result = None if terminal_failure else judge.grade([JudgeRequest(scene, tuple(req), metrics)])[0]
    warnings = [terminal_failure] if terminal_failure else []
    warnings += [f"unknown category {o.category!r} ({o.id})" for o in scene.objects if catalogue.get(o.category) is None]
    warnings += [f"requested {r['category']!r} is neither a category nor a group"
                 for r in req if not catalogue.knows(r["category"])]
    if not req:
        warnings.append("no requested items (a scene file holds none; give --requested, or check "
                        "a scene-set record): prompt_following counts nothing asked as met")
    warnings += [f"{o} size outside its catalogue range" for o in metrics["size_out_of_range_objects"]]
    warnings += [f"{w['object']} blocks window_{w['window']}" for w in metrics["window_warnings"]]
    judge_failed = None
    if result is not None and result.grades is None:
        judge_failed = (f"the {identity['backend']} judge failed: "
                        f"{judge_failure_text(result.failure, result.info)}")
        warnings.append(judge_failed)
    for warning in warnings:   # in the JSON too, for a caller that reads only stdout
        # a failing judge's own warning said it on stderr (the HTTP judge's with its URL and
        # attempts, the model judge's with the start of its answer)
        if warning is not judge_failed:
            logging.getLogger(__name__).warning("%s", warning)
    if terminal_failure:
        outcome = failed_outcome("invalid_terminal_scene", units, cfg.reward)
        print(json.dumps({"metrics": metrics, "judge": identity, "grades": None,
                          "reward": outcome.reward, "failure_cause": outcome.failure_cause,
                          "warnings": warnings}))
        return 0
    if result.grades is None:
        print(json.dumps({"metrics": metrics, "judge": identity, "grades": None, "reward": None,
                          "judge_failure": result.failure, "warnings": warnings}))
        return 1
    reward, _, _ = reward_from_grades(result.grades, units, cfg.reward)
    print(json.dumps({"metrics": metrics, "judge": identity, "grades": result.grades,
                      "reward": round(reward, 6), "warnings": warnings}))
    return 0


def render(args) -> int:
    from jscenegen.paths import check_output_file
    from jscenegen.scene.render import render_scene

    path = _input(args.scene)
    check_output_file(args.output, "-o", suffix=".png")
    run_cfg = _run_config(args.config)
    _refuse_overwriting(args.output, run_cfg, args.config, {"the scene": path})
    scene, _ = _load(path)
    metrics = render_scene(scene, args.output, run_cfg.scene)
    print(json.dumps({"output": str(args.output), "reachable": metrics["reachable"]}))
    return 0


def generate(args) -> int:
    from jscenegen.paths import check_output_file
    from jscenegen.scene.generator import make_scene_set
    from jscenegen.scene.sceneset import write_scene_set

    check_output_file(args.output, "-o")
    _refuse_overwriting(args.output, _run_config(None), None, {})
    records = make_scene_set(args.split, args.n)
    write_scene_set(args.output, records)
    print(json.dumps({"output": str(args.output), "scenes": len(records)}))
    return 0


def furnish(args) -> int:
    """Play the record's episode with the scripted expert, judge it with the configured judge
    and write its scene to `-o`. A masked episode (the judge failed: every backend's failure
    is masked, never scored) prints "reward": null and one error line, and exits 1; the
    scene is written all the same."""
    from jscenegen.eval.report import masked_scene_error
    from jscenegen.grpo.rollout.judges import build_judge
    from jscenegen.paths import check_output_file, write_json
    from jscenegen.scene.catalogue import load_catalogue
    from jscenegen.scene.expert import run_scripted_episode
    from jscenegen.scene.sceneset import RecordIndexError, check_records_usable, read_scene_record
    from jscenegen.text import terminal_text

    scene_set = _input(args.scene_set)
    check_output_file(args.output, "-o")
    run_cfg = _run_config(args.config)
    _refuse_overwriting(args.output, run_cfg, args.config, {"the scene set": scene_set})
    cfg, judge_cfg = run_cfg.scene, run_cfg.judge
    try:
        record = read_scene_record(scene_set, args.index)
    except RecordIndexError as err:
        raise ValueError(f"--index {err}") from None
    check_records_usable([record], load_catalogue(cfg.catalogue_path), cfg.metrics,
                         str(scene_set), max_objects=cfg.max_objects)
    ep, _ = run_scripted_episode(record, cfg, judge_cfg, judge=build_judge(run_cfg))
    out = Path(args.output)
    write_json(out, ep.scene.to_json())
    o = ep.outcome
    # a masked episode (the judge failed) has no reward: null, as scene check prints it
    print(json.dumps({"output": str(out), "reward": None if o.masked else o.reward,
                      "grades": o.grades, "units": o.units, "failure_cause": o.failure_cause}))
    if why := masked_scene_error(o.failure_cause, o.masked, ep.failure_message, o.judge_info,
                                 out, judge_cfg):
        print(terminal_text(f"error: {why}"), file=sys.stderr)
        return 1
    return 0


def run(args) -> int:
    from jscenegen.scene.reach_inputs import ReachabilityError

    action = {"check": check, "render": render, "generate": generate, "furnish": furnish}[args.scene_command]
    try:
        return action(args)
    except ReachabilityError as err:   # the runtime cannot measure the scene: say which file
        if getattr(args, "scene", None) is None:
            raise
        raise ReachabilityError(f"{args.scene}: {err}") from None


def register(subparsers) -> None:
    p = subparsers.add_parser("scene", help="check (measure and grade), render, generate and "
                              "furnish scenes")
    sub = p.add_subparsers(dest="scene_command", metavar="ACTION", required=True)
    c = sub.add_parser("check", help="print metrics, the configured judge's grades (the rule judge "
                       "unless --config sets judge.backend: http or model) and reward of a scene JSON")
    c.add_argument("scene", help="scene JSON (or one scene-set record)")
    c.add_argument("--requested-units", type=_units_arg, default=None,
                   help="units for the reward (default: budget used)")
    c.add_argument("--requested", default=None, help="requested items, e.g. 'bed:1,nightstand:2'")
    c.add_argument("--config", default=None, type=data_path_arg, help="YAML with optional scene: and judge: sections "
                   "(judge.backend: http grades with that server, model with the model at "
                   "judge.model_path)")
    r = sub.add_parser("render", help="draw the top view (room, openings, objects, reachable region)")
    r.add_argument("scene")
    r.add_argument("-o", "--output", required=True, help="output PNG (the name ends in .png)")
    r.add_argument("--config", default=None, type=data_path_arg)
    g = sub.add_parser("generate", help="write a deterministic scene set (JSONL)")
    g.add_argument("--split", choices=("train", "dev"), required=True)
    g.add_argument("--n", type=int, required=True)
    g.add_argument("-o", "--output", required=True)
    f = sub.add_parser("furnish", help="furnish one scene of a set with the scripted expert; write the scene JSON")
    f.add_argument("scene_set", help="JSONL scene set")
    f.add_argument("--index", type=int, default=0)
    f.add_argument("-o", "--output", required=True)
    f.add_argument("--config", default=None, type=data_path_arg)
    p.set_defaults(func=run)
