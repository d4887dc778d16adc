"""`jscenegen eval`: a model (HF directory or checkpoint step) and the scripted expert on a scene set."""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from jscenegen.paths import data_path_arg

# what `jscenegen eval --help` says above the options: the judge is chosen by the config alone
EVAL_DESCRIPTION = (
    "Evaluate a model or checkpoint (and the scripted expert) on a scene set: a JSON report and "
    "a PNG plot. The judge that grades the scenes is the config's judge section, set with "
    "judge.* overrides or --config: the rule judge by default (judge.backend=rule); an "
    "OpenAI-compatible server with judge.backend=http judge.base_url=URL judge.model=NAME; a "
    "model loaded in the process with judge.backend=model judge.model_path=DIR. The report "
    "records the judge and its sampling settings (judge.temperature, judge.max_tokens), and "
    "--compare refuses two reports graded by another judge or at other judge sampling "
    "settings.")


def register(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a model or checkpoint on the dev scenes (JSON report + PNG plot)",
                       description=EVAL_DESCRIPTION)
    p.add_argument("--model", metavar="DIR_OR_CHECKPOINT",
                   help="HF model directory or checkpoint step directory (RUN/checkpoints/N)")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                   help="instead of evaluating: a Markdown table of two reports of the same scenes "
                        "(e.g. RUN/eval_before.json RUN/eval_after.json) with the paired reward "
                        "difference and its 95%% interval")
    p.add_argument("--scenes", default=None, help="dev, train, or a JSONL scene-set file (default: dev)")
    p.add_argument("--samples", type=int, default=None,
                   help="episodes per scene (default: trainer.eval_samples; 1 when decoding "
                        "greedily, which plays one episode whatever the seed)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (sampling.greedy=true)")
    p.add_argument("--config", default=None, type=data_path_arg, help="run config YAML (default: configs/cpu-default.yaml)")
    p.add_argument("--out", default=None, help="JSON report (default: eval-report.json)")
    p.add_argument("--plot", default=None, help="PNG bar plot (default: the report's path with .png)")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    p.set_defaults(func=run, intermixed=True)  # overrides anywhere among the options


def compare(before: str, after: str, plot: str | None) -> int:
    from jscenegen.eval.plots import discard_plot, plot_report
    from jscenegen.eval.report import check_report, check_same_episodes, comparison_markdown, read_report
    from jscenegen.paths import check_output_file, refuse_overwriting_input

    if plot:
        check_output_file(plot, "--plot", suffix=".png")
        refuse_overwriting_input(plot, "--plot", {"BEFORE": before, "AFTER": after})
    with contextlib.suppress(OSError):   # a missing file is named when it is read
        if os.path.samefile(before, after):
            raise ValueError(f"--compare {before} {after}: BEFORE and AFTER are the same file")
    reports = read_report(before), read_report(after)
    for path, report in zip((before, after), reports):
        check_report(report, f"{path} (an evaluation report made by `jscenegen eval` or `jscenegen train`)")
    check_same_episodes(*reports, (before, after))
    try:   # the checks above hold every field it reads; no episode pair may be left unmasked
        print(comparison_markdown(*reports))
    except ValueError as err:
        raise ValueError(f"{before} vs {after}: cannot compare ({err})") from None
    if plot:
        try:
            plot_report(reports[1], plot, before=reports[0])
        except Exception as err:   # matplotlib's many errors; a stop is no Exception
            raise ValueError(f"--plot {plot}: not drawn ({discard_plot(plot, err)})") from err
    return 0


def run(args) -> int:
    from jscenegen.eval.evaluate import (
        check_samples,
        check_scenes_fit,
        evaluate,
        evaluation_samples,
        policy_chat,
        policy_engine,
        policy_mesh,
        report_scene_ids,
    )
    from jscenegen.paths import check_output_file, refuse_overwriting_input
    from jscenegen.run_config import config_inputs, load_run_config, scene_set_path, warn_inert_settings
    from jscenegen.scene.sceneset import require_scene_set_file
    from jscenegen.sharding.mesh import refuse_multi_host

    if args.compare:
        _refuse_evaluation_flags(args)
        return compare(*args.compare, args.plot)
    if not args.model:
        raise ValueError("--model is required (or --compare BEFORE AFTER)")
    args.out = args.out or "eval-report.json"
    args.scenes = args.scenes or "dev"
    cfg = load_run_config(args.config, args.overrides, args.greedy, model_flag=True)
    refuse_multi_host("eval", cfg.mesh)
    warn_inert_settings(cfg, sections=("judge",))   # the only conditional keys it reads
    try:
        scenes = scene_set_path(args.scenes, cfg)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"--scenes {err}") from None
    require_scene_set_file(scenes)   # before the outputs are checked against it
    samples = evaluation_samples(cfg, args.samples)
    try:
        check_samples(samples)
    except ValueError as err:
        raise ValueError(f"--samples: {err}" if args.samples is not None else str(err)) from None
    # the outputs are written after the whole evaluation: refuse what cannot be written now
    check_output_file(args.out, "--out")   # before its name makes the plot's (`.` has none)
    plot_path = args.plot or Path(args.out).with_suffix(".png")
    check_output_file(plot_path, "--plot", suffix=".png")
    inputs = {"--model": args.model, "--scenes": scenes, **config_inputs(cfg, args.config)}
    refuse_overwriting_input(args.out, "--out", inputs)
    refuse_overwriting_input(plot_path, "--plot", {**inputs, "--out": args.out})

    from jscenegen.eval.report import check_report_episodes, ungraded_judge_failures, unmeasured_model
    from jscenegen.grpo.rollout.judges import build_judge, load_judge
    from jscenegen.scene.catalogue import load_catalogue
    from jscenegen.scene.judge import judge_check_hint
    from jscenegen.scene.sceneset import check_records_usable, read_scene_set
    from jscenegen.text import terminal_text

    records = read_scene_set(scenes)
    check_report_episodes(len(records), samples, f"--scenes {scenes}")
    report_scene_ids(records, f"--scenes {scenes}")   # each scene named once, before the model loads
    check_records_usable(records, load_catalogue(cfg.scene.catalogue_path), cfg.scene.metrics,
                         str(scenes), max_objects=cfg.scene.max_objects)
    mesh = policy_mesh(cfg)
    judge = build_judge(cfg, mesh=mesh)   # a model judge: its files read, no weights yet
    judge.check_reachable()
    chat = policy_chat(cfg, args.model)
    check_scenes_fit(chat, records, cfg, str(scenes))   # before the model loads
    engine = policy_engine(cfg, args.model, chat=chat, mesh=mesh)
    load_judge(judge)   # a model judge's weights, beside the policy's

    def progress(row: dict) -> None:
        m, e = row["model"], row["expert"]
        print(json.dumps({"scene": row["scene_id"], "reward": m["reward"], "failure_causes":
                          m["failure_causes"], "units": m["units"], "expert_reward": e["reward"]}),
              flush=True)

    report = evaluate(engine, records, judge=judge, scene_cfg=cfg.scene, judge_cfg=cfg.judge,
                      samples=samples, progress=progress)
    report.update(model=str(args.model), scene_set=str(scenes))
    out, plot = Path(args.out), Path(plot_path)
    _write_report_and_plot(report, out, plot)
    print(json.dumps({"event": "done", "report": str(out), "plot": str(plot),
                      "overall": report["overall"]}))
    ungraded = ungraded_judge_failures(report)
    if ungraded:
        print(terminal_text(f"error: the judge graded none of the episodes it was sent "
                            f"({ungraded}); the report {out} records them "
                            f"({judge_check_hint(cfg.judge)})"), file=sys.stderr)
        return 1
    unmeasured = unmeasured_model(report, cfg.judge)
    if unmeasured:   # the report says so with reward null; a script reads the exit code
        print(terminal_text(f"error: {unmeasured}; the report {out} records them, with no "
                            "reward of the model"), file=sys.stderr)
        return 1
    return 0


def _refuse_evaluation_flags(args) -> None:
    """--compare reads two reports: refuse (ValueError) the flags of an evaluation beside it."""
    given = [flag for flag, value in (("--model", args.model), ("--samples", args.samples),
                                      ("--config", args.config), ("--out", args.out),
                                      ("--scenes", args.scenes)) if value is not None]
    given += ["--greedy"] if args.greedy else []
    if given or args.overrides:
        raise ValueError(f"--compare reads two reports only (it prints the table, --plot draws "
                         f"it); {', '.join(given) or 'overrides'} would be ignored (run the "
                         "evaluation first, then compare)")


def _write_report_and_plot(report: dict, out: Path, plot: Path) -> None:
    """The report at `out` and its plot at `plot`, both or neither when stopped: the plot waits
    beside its place until the report is written; parents this made are removed on an error.
    A plot that cannot be drawn does not cost the evaluation: the report is written (an
    earlier plot at `plot` removed), then a ValueError names the plot."""
    from jscenegen.eval.plots import discard_plot, plot_report
    from jscenegen.paths import hidden_name, new_parents_removed_on_error, refuse_non_regular, write_json

    pending = plot.with_name(hidden_name(plot.name, "pending.png"))
    with new_parents_removed_on_error(out), new_parents_removed_on_error(plot):
        try:
            try:
                plot_report(report, pending)
            except Exception as err:   # matplotlib's many errors; a stop is no Exception
                write_json(out, report)
                raise ValueError(f"--plot {plot}: not drawn ({discard_plot(plot, err)}); the "
                                 f"report is written to {out}") from err
            refuse_non_regular(plot, f"--plot {plot}")   # made a directory while eval ran
            write_json(out, report)
            os.replace(pending, plot)
        finally:
            pending.unlink(missing_ok=True)
