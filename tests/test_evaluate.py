"""`jscenegen eval` / `jscenegen design`: evaluation report and plot, the expert reference row,
checkpoint loading, and one designed room, with the tiny chat model on the 3 x 2 CPU mesh."""
import json
import re

import numpy as np
import pytest

from jscenegen.checkpoint.store import CheckpointError
from jscenegen.cli import main
from jscenegen.eval.evaluate import evaluate, load_policy, policy_chat, policy_engine
from jscenegen.eval.plots import main_failure_cause, plot_report
from jscenegen.grpo.rollout.seeds import episode_seed
from jscenegen.grpo.rollout.stats import summarize
from jscenegen.model.tokenizer.chat import ChatTokenizer
from jscenegen.run_config import load_run_config
from jscenegen.scene.expert import run_scripted_episode
from jscenegen.scene.judge import make_judge
from jscenegen.scene.schema import scene_from_json

from chat_fixtures import chat_model_dir, dev_records, nfc_chat_model_dir
from cli_errors import one_error_line
from scene_fixtures import JudgeServer

# Tiny caps: the ~2,100-token prompt fits, every 8-token turn of a random model is truncated.
TINY = ["sampling.max_new_tokens=8", "sampling.max_episode_tokens=2560", "sampling.buckets=[128,1024]"]
SCENES = 2


@pytest.fixture(scope="module")
def cfg():
    return load_run_config(None, TINY, greedy=True)


@pytest.fixture(scope="module")
def engine(cfg):
    return policy_engine(cfg, chat_model_dir())


@pytest.fixture(scope="module")
def report(engine, cfg):
    judge = make_judge(cfg.judge, cfg.scene)
    return evaluate(engine, dev_records()[:SCENES], judge=judge, scene_cfg=cfg.scene,
                    judge_cfg=cfg.judge, samples=1)


def test_report_structure_and_seeds(report, cfg):
    assert report["schema"] == "jscenegen.eval/1" and report["samples"] == 1
    assert [r["scene_id"] for r in report["scenes"]] == [r.scene.scene_id for r in dev_records()[:SCENES]]
    for row, record in zip(report["scenes"], dev_records()):
        assert row["seed"] == record.seed
        (ep,) = row["model"]["episodes"]
        assert ep["seed"] == episode_seed(record.seed, 0, 0) and ep["member"] == 0
        assert set(row["model"]["grades"]) == set(cfg.judge.grade_keys)
    json.dumps(report)  # the report is plain JSON


def test_random_model_fails_with_its_cause(report):
    for row in report["scenes"]:
        m = row["model"]
        assert m["reward"] == -1.0 and m["failure_rate"] == 1.0 and m["masked"] == 0
        (ep,) = m["episodes"]
        assert ep["failure_cause"] in ("truncated_generation", "truncated_action")
        assert m["failure_causes"] == {ep["failure_cause"]: 1}
        assert m["quality"] is None and ep["grades"] is None
    overall = report["overall"]["model"]
    assert overall["episodes"] == SCENES and overall["reward"] == -1.0
    assert overall["failure_rate"] == 1.0 and overall["units"] == 0.0
    # one episode per scene: no scene's group has a spread
    assert overall["zero_spread_scenes"] == 1.0


def test_expert_row_is_the_scripted_episode(report, cfg):
    rewards = []
    for row, record in zip(report["scenes"], dev_records()):
        ep, _ = run_scripted_episode(record, cfg.scene, cfg.judge)
        o = ep.outcome
        e = row["expert"]
        assert e["reward"] == pytest.approx(o.reward, abs=1e-12) and o.failure_cause is None
        assert e["units"] == o.units > 0
        assert e["grades"] == {k: float(v) for k, v in o.grades.items()}
        assert e["quality"] == pytest.approx(o.quality) and e["unit_penalty"] == pytest.approx(o.unit_penalty)
        assert e["reachable"] == float(bool(o.metrics["reachable"]))
        rewards.append(o.reward)
    assert report["overall"]["expert"]["reward"] == pytest.approx(np.mean(rewards))
    assert report["overall"]["expert"]["failure_rate"] == 0.0


def test_a_scene_the_model_could_not_start_is_left_out_of_both_overall_rows(engine, cfg):
    """The model's row masks a scene whose prompt alone reaches the episode cap
    (prompt_over_cap); the expert's overall row averaged it in, over other scenes than the
    model's."""
    from dataclasses import replace

    short, other = dev_records()[:2]
    long = replace(short, scene=short.scene.model_copy(update={"prompt": "a wide room " * 900}))
    rep = evaluate(engine, [long, other], judge=make_judge(cfg.judge, cfg.scene),
                   scene_cfg=cfg.scene, judge_cfg=cfg.judge, samples=1)
    (ep,) = rep["scenes"][0]["model"]["episodes"]
    assert ep["failure_cause"] == "prompt_over_cap" and ep["masked"]
    assert rep["scenes"][0]["expert"]["episodes"][0]["failure_cause"] is None   # still shown
    expert_other = rep["scenes"][1]["expert"]
    assert rep["overall"]["expert"]["episodes"] == rep["overall"]["model"]["episodes"] - 1 == 1
    assert rep["overall"]["expert"]["reward"] == expert_other["reward"]


def _engine_fails_for(monkeypatch, failing) -> None:
    """The rollout engine raises (a device out of memory) whenever it samples for a group whose
    id is in `failing` (None: every group): `run_group` masks those episodes `rollout_error`."""
    from jscenegen.grpo.rollout.engine import RolloutEngine

    sampled = RolloutEngine._sampled_turns

    def out_of_memory(self, rows, pad, keys):
        if failing is None or any(r.group_id in failing for r in rows):
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory allocating 8.00GiB")
        return sampled(self, rows, pad, keys)

    monkeypatch.setattr(RolloutEngine, "_sampled_turns", out_of_memory)


def test_a_scene_the_engine_failed_is_left_out_of_both_overall_rows(engine, cfg, monkeypatch):
    """Only prompt_over_cap scenes were left out of `overall.expert`: a scene whose model
    episodes the engine failed (rollout_error) was in the expert's mean and not the model's."""
    _engine_fails_for(monkeypatch, {0})
    rep = evaluate(engine, dev_records()[:2], judge=make_judge(cfg.judge, cfg.scene),
                   scene_cfg=cfg.scene, judge_cfg=cfg.judge, samples=1)
    (ep,) = rep["scenes"][0]["model"]["episodes"]
    assert ep["failure_cause"] == "rollout_error" and ep["masked"]
    assert rep["scenes"][0]["expert"]["episodes"][0]["failure_cause"] is None   # still shown
    assert rep["overall"]["expert"]["episodes"] == 1
    assert rep["overall"]["expert"]["reward"] == rep["scenes"][1]["expert"]["reward"]
    assert rep["overall"]["model"]["episodes"] == 2 and rep["overall"]["model"]["reward"] == -1.0


@pytest.mark.parametrize("judge, check", [
    ({"backend": "http", "base_url": "http://127.0.0.1:8000/v1", "model": "m"},
     "check judge.base_url and the judge's log"),
    ({"backend": "model", "model_path": "{model}"},
     "check judge.model_path and judge.max_tokens, and the model judge's lines in the log"),
    ({}, "the rule judge's error is in the log above"),
])
def test_unmeasured_model_names_what_masked_every_episode(judge, check):
    """The judge failure's clause says what to check for the configured backend (the one
    rule, `scene.judge.judge_check_hint`; a model judge was told to check judge.base_url)."""
    from jscenegen.eval.report import masked_why, unmeasured_model
    from jscenegen.scene.config import JudgeConfig

    from chat_fixtures import chat_model_dir

    cfg = JudgeConfig(**{k: v.format(model=chat_model_dir()) for k, v in judge.items()})

    def summary(reward, causes, episodes):
        return {"reward": reward, "failure_causes": causes, "episodes": episodes}

    rep = {"overall": {"model": summary(None, {"rollout_error": 3, "judge_timeout": 1}, 4),
                       "expert": summary(0.9, {}, 1)}}
    assert unmeasured_model(rep, cfg) == (
        "every one of the 4 model episodes was masked (judge_timeout x1, rollout_error x3): "
        "jscenegen's sampler or scene runtime failed, not the policy (the log line above names "
        f"the error; JSCENEGEN_DEBUG=1 adds its traceback); the judge failed ({check})")
    assert masked_why(["judge_error"], cfg) == f"the judge failed ({check})"
    rep["overall"]["model"] = summary(None, {"prompt_over_cap": 1}, 1)
    assert unmeasured_model(rep, cfg) == ("the one model episode was masked (prompt_over_cap x1): "
                                          "the prompt alone reaches sampling.max_episode_tokens")
    rep["overall"]["model"] = summary(-1.0, {"rollout_error": 3, "bad_json": 1}, 4)
    assert unmeasured_model(rep, cfg) == ""   # one episode measured the model
    assert unmeasured_model({"overall": {"expert": summary(0.9, {}, 1)}}, cfg) == ""


def test_summarize_excludes_masked_and_counts_causes():
    base = {"quality": None, "unit_penalty": 0.0, "grades": None, "metrics": None}
    outs = [dict(base, reward=0.5, units=10, failure_cause=None, masked=False, quality=0.6,
                 unit_penalty=0.1, grades={"a": 4}, metrics={"reachable": True}),
            dict(base, reward=-1.0, units=4, failure_cause="truncated_action", masked=False),
            dict(base, reward=0.0, units=7, failure_cause="judge_timeout", masked=True)]
    s = summarize(outs, ["a"])
    assert s["reward"] == pytest.approx(-0.25) and s["masked"] == 1 and s["units"] == 7.0
    assert s["failure_rate"] == 0.5 and s["reachable"] == 1.0 and s["grades"] == {"a": 4.0}
    assert s["failure_causes"] == {"judge_timeout": 1, "truncated_action": 1}
    assert s["zero_spread"] is False and s["collision"] == 0.0

    from types import SimpleNamespace

    from jscenegen.grpo.rollout.stats import group_metrics

    g = group_metrics([SimpleNamespace(outcome=o, num_tokens=100 + i, group_id=0) for i, o in enumerate(outs)], ["a"])
    assert g["reward/mean"] == s["reward"] and g["masked_rate"] == pytest.approx(1 / 3)
    assert g["failures/truncated_action"] == pytest.approx(1 / 3) and g["judge_failures"] == 1.0
    assert g["zero_std_group"] == 0.0 and g["tokens/mean"] == 101.0 and g["grades/a"] == 4.0
    assert g["scene/reachable_rate"] == 1.0 and g["failure_rate"] == 0.5


def test_an_update_whose_every_episode_was_masked_logs_no_failure_rate():
    """Nothing graded (a judge outage) is not "no failures": failure_rate is None (null in
    metrics.jsonl, left out of swanlab), as reward/mean; it was logged as 0.0."""
    from types import SimpleNamespace

    from jscenegen.grpo.rollout.stats import group_metrics

    out = dict(reward=0.0, units=5, failure_cause="judge_timeout", masked=True, quality=None,
               unit_penalty=None, grades=None, metrics=None)
    g = group_metrics([SimpleNamespace(outcome=dict(out), num_tokens=50, group_id=i // 2) for i in range(4)], ["a"])
    assert g["failure_rate"] is None and g["reward/mean"] is None
    assert g["masked_rate"] == 1.0 and g["failures/judge_timeout"] == 1.0


def test_reward_parts_latency_and_zero_spread_share_of_several_groups():
    """quality and unit_penalty are the judged episodes' parts (their difference is those
    episodes' mean reward); a timed-out judge call's latency counts; zero_std_group is the
    share of groups without spread, not one flag for the pooled batch."""
    from types import SimpleNamespace

    from jscenegen.grpo.rollout.stats import group_metrics

    def judged(reward, units, latency):
        return {"reward": reward, "units": units, "failure_cause": None, "masked": False,
                "quality": 0.8, "unit_penalty": 0.8 - reward, "grades": {"a": 8}, "metrics": None,
                "judge_info": {"latency_s": latency}}

    failed = {"reward": -1.0, "units": 128, "failure_cause": "bad_json", "masked": False,
              "quality": None, "unit_penalty": 0.0, "grades": None, "metrics": None}
    timeout = {"reward": 0.0, "units": 64, "failure_cause": "judge_timeout", "masked": True,
               "quality": None, "unit_penalty": 0.0, "grades": None, "metrics": None,
               "judge_info": {"latency_s": 60.0}}
    groups = [[failed, failed], [judged(0.7, 64, 2.0), judged(0.6, 128, 4.0), timeout]]
    g = group_metrics([SimpleNamespace(outcome=o, num_tokens=10, group_id=k)
                       for k, group in enumerate(groups) for o in group], ["a"])
    assert g["zero_std_group"] == 0.5
    assert g["reward/quality"] - g["reward/unit_penalty"] == pytest.approx((0.7 + 0.6) / 2)
    assert g["judge/latency_s"] == pytest.approx(22.0)
    assert g["units/mean"] == pytest.approx((128 + 128 + 64 + 128) / 4)


def test_a_bar_is_labelled_with_the_policy_failure_it_shows():
    """`failure_rate` counts unmasked episodes, `failure_causes` every episode: one bad_json
    (the bar's -1) beside 15 masked judge timeouts was labelled judge_timeout."""
    summary = {"failure_rate": 1.0, "failure_causes": {"bad_json": 1, "judge_timeout": 15}}
    assert main_failure_cause(summary) == "bad_json"
    summary = {"failure_rate": 1.0, "failure_causes": {"bad_json": 2, "schema_violation": 3}}
    assert main_failure_cause(summary) == "schema_violation"
    assert main_failure_cause({"failure_rate": 0.5, "failure_causes": {"bad_json": 1}}) is None
    assert main_failure_cause({"failure_rate": None, "failure_causes": {"judge_error": 4}}) is None


def _plotted(report, out, **kw):
    """(the axes `plot_report` drew, the PNG's pixels [H, W, C])."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt

    captured = {}
    real_savefig = plt.Figure.savefig

    def spy(fig, *args, **kwargs):
        captured["fig"] = fig
        return real_savefig(fig, *args, **kwargs)

    plt.Figure.savefig = spy
    try:
        out = plot_report(report, out, **kw)
    finally:
        plt.Figure.savefig = real_savefig
    (ax,) = captured["fig"].axes
    return ax, mpimg.imread(out)


def test_plot_draws_the_reports_rewards(report, tmp_path):
    """The PNG decodes, and its bars are the report's rewards: one axes, a bar per scene and
    series (model, expert) whose heights are the per-scene mean rewards."""
    out = tmp_path / "sub" / "report.png"
    ax, image = _plotted(report, out)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    heights = [b.get_height() for b in ax.patches]
    want = [row[s]["reward"] if row[s]["reward"] is not None else np.nan
            for s in ("model", "expert") for row in report["scenes"]]
    np.testing.assert_allclose(heights, want, rtol=1e-6)
    assert not [p for p in out.parent.iterdir() if p.name != "report.png"]  # no temp files left


def test_plot_shows_odd_scene_ids_as_text_masked_scenes_and_a_bounded_number_of_bars(tmp_path):
    """A scene id matplotlib reads as math (`$\\bad$`) made the plot raise after the whole
    evaluation, and `eval` wrote no report (helper-170); a scene whose episodes were all masked
    drew a bar at 0; 8,000 scenes drew an 880,000-pixel-wide figure (2.8 GB)."""
    from jscenegen.eval.plots import MAX_BARS

    ids = ["$\\bad$", "x_{1}$^$", *(f"s{i}" for i in range(MAX_BARS + 8))]
    rep = _synthetic_report(scenes=tuple(ids))
    rep["scenes"][1]["model"].update(reward=None, failure_rate=None, failure_causes={"judge_error": 2})
    ax, image = _plotted(rep, tmp_path / "r.png")
    assert [t.get_text() for t in ax.get_xticklabels()] == ids[:MAX_BARS]
    heights = [b.get_height() for b in ax.patches]
    assert len(heights) == MAX_BARS and np.isnan(heights[1]) and heights[0] == 0.5
    assert [t.get_text() for t in ax.texts] == ["masked"]
    assert ax.get_title().endswith(f"the first {MAX_BARS} of {MAX_BARS + 10} scenes)")
    assert image.shape[1] < 7000


def test_plot_cuts_long_scene_ids(tmp_path):
    """A report's scene id has no bound: one of 2,000,000 characters took 3 minutes to draw
    (plots.MAX_LABEL_CHARS, 40, are drawn)."""
    rep = _synthetic_report(scenes=("x" * 20_000, "b"))
    ax, _ = _plotted(rep, tmp_path / "r.png", before=_synthetic_report(scenes=("x" * 20_000, "b")))
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        "x" * 40 + "... (20,000 characters)", "b"]


def test_checkpoint_step_loads_its_params(tmp_path, engine, cfg):
    """A checkpoint step (params x 2) loads into the model built from its hf/config.json."""
    from jscenegen.checkpoint.metadata import training_metadata
    from jscenegen.checkpoint.store import CheckpointStore
    from jscenegen.model.config import QwenConfig
    from jscenegen.model.hf_io import iter_hf_tensors
    from jscenegen.model.weights import named_params, param_shapes

    hf = chat_model_dir()
    params = {n: 2.0 * a.astype(np.float32) for n, a in iter_hf_tensors(hf)}
    zeros = {n: np.zeros_like(a) for n, a in params.items()}
    meta = training_metadata(config={}, protocol_hash="p", schedule_hash="s", optimizer_step=0,
                             effective_updates=0, judge=None)
    with CheckpointStore(tmp_path / "checkpoints") as store:
        step = store.save(3, params=params, adam={"count": np.int32(0), "mu": zeros, "nu": zeros},
                          train_state={}, metadata=meta, hf_assets_dir=hf,
                          shapes=param_shapes(QwenConfig.from_dir(hf)))
    mesh = engine.sampler.mesh
    with pytest.raises(FileNotFoundError, match=rf"a checkpoint step's assets .*: give the step, {step}$"):
        load_policy(step / "hf", mesh)   # said "no model.safetensors", naming no way out
    model = load_policy(step, mesh)
    got = named_params(model)
    assert set(got) == set(params)
    for name, want in params.items():
        arr = np.asarray(got[name][...])
        np.testing.assert_array_equal(arr[: want.shape[0]], want)
        assert not arr[want.shape[0]:].any()  # FSDP padding rows are zero
        assert arr.shape[0] % mesh.size == 0
    ck_engine = policy_engine(cfg, step)  # tokenizer and chat template from the step's hf/
    assert ck_engine.chat.encode("<action>") == engine.chat.encode("<action>")
    assert ck_engine.chat.eot_id == engine.chat.eot_id
    (step / "params" / "extra").write_text("x")  # an unlisted file: checksums refuse the step
    with pytest.raises(CheckpointError, match=f"^--model {re.escape(str(step))}: checkpoint step is not usable"):
        load_policy(step, mesh)
    (step / "params" / "extra").unlink()
    (step / "hf" / "tokenizer.json").write_text("{}")  # transformers alone: a KeyError
    with pytest.raises(CheckpointError, match="not usable"):  # verified before it is read
        policy_chat(cfg, step)


def test_eval_command_writes_report_and_plot(tmp_path, capsys, caplog):
    scenes = tmp_path / "two.jsonl"
    scenes.write_text("".join(json.dumps(r.to_json()) + "\n" for r in dev_records()[:1]))
    out = tmp_path / "r.json"
    plot = tmp_path / ("p" * 251 + ".png")   # a legal name: its `.NAME.pending.png` was not
    assert main(["eval", "--model", str(chat_model_dir()), "--scenes", str(scenes), "--greedy",
                 "--out", str(out), "--plot", str(plot), *TINY]) == 0
    rep = json.loads(out.read_text())
    assert rep["model"] == str(chat_model_dir()) and rep["sampling"]["greedy"] is True
    assert rep["samples"] == 1   # greedy: one episode per scene, not trainer.eval_samples alike
    import hashlib

    from jscenegen.model.tokenizer.build import chatml_template

    assert rep["sampling"]["chat_template_sha256"] == hashlib.sha256(
        chatml_template().encode()).hexdigest()   # the fixture tokenizer's own template
    assert rep["sampling"]["end_ids"] == list(ChatTokenizer.from_dir(chat_model_dir()).end_ids)
    # the dtypes the logits came from (model.param_dtype, rollout.dtype, model.compute_dtype)
    assert {k: rep["sampling"][k] for k in ("param_dtype", "rollout_dtype", "compute_dtype")} == {
        "param_dtype": "float32", "rollout_dtype": "float32", "compute_dtype": "float32"}
    from jscenegen.paths import json_sha256
    from jscenegen.run_config import load_run_config
    from jscenegen.scene.protocol import protocol_digests

    cfg = load_run_config(None, TINY)
    assert rep["protocol"] == protocol_digests(cfg.scene, cfg.judge)   # what --compare checks
    assert rep["scenes"][0]["scene_sha256"] == json_sha256(dev_records()[0].to_json())
    assert rep["overall"]["model"]["reward"] == -1.0 and len(rep["scenes"]) == 1
    assert plot.read_bytes()[:4] == b"\x89PNG" and sorted(p.name for p in tmp_path.iterdir()) == [
        plot.name, "r.json", "two.jsonl"]
    assert main(["eval", "--model", str(tmp_path), "--scenes", str(scenes), *TINY]) == 2
    assert "neither an HF model directory" in capsys.readouterr().err
    # asked for: played, with one warning line that the episodes will be identical
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert main(["eval", "--model", str(tmp_path), "--scenes", str(scenes), "--greedy",
                     "--samples", "3", *TINY]) == 2
    assert [m for m in caplog.messages if "identical" in m] == [
        "--greedy with --samples 3: argmax decoding ignores the seed, so the 3 episodes of a "
        "scene are identical (and `eval --compare` would count them as 3 pairs)"]


def test_an_eval_stopped_while_writing_leaves_both_outputs_or_neither(tmp_path, monkeypatch):
    """A stop between the report and its plot left the report alone (and the plot of an
    earlier run beside it); the directories it had made for them stayed too."""
    import jscenegen.paths
    from jscenegen.signals import Terminated

    scenes = tmp_path / "one.jsonl"
    scenes.write_text(json.dumps(dev_records()[0].to_json()) + "\n")
    model = chat_model_dir()   # built (its config.json written) before write_json is stopped

    def stopped(path, obj):
        raise Terminated

    monkeypatch.setattr(jscenegen.paths, "write_json", stopped)
    fresh = tmp_path / "new" / "sub" / "r.json"
    earlier = tmp_path / "r.json"
    earlier.write_text("earlier report")
    earlier.with_suffix(".png").write_bytes(b"earlier plot")
    for out in (fresh, earlier):
        assert main(["eval", "--model", str(model), "--scenes", str(scenes),
                     "--greedy", "--out", str(out), *TINY]) == 143
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.jsonl", "r.json", "r.png"]
    assert earlier.read_text() == "earlier report"
    assert earlier.with_suffix(".png").read_bytes() == b"earlier plot"


def test_an_eval_whose_plot_path_became_a_directory_keeps_the_earlier_report(tmp_path, capsys,
                                                                           monkeypatch):
    """The report was replaced, then the plot's rename failed naming the hidden pending file."""
    import jscenegen.eval.plots

    scenes = tmp_path / "one.jsonl"
    scenes.write_text(json.dumps(dev_records()[0].to_json()) + "\n")
    out, plot = tmp_path / "r.json", tmp_path / "r.png"
    out.write_text("earlier report")
    drawn = jscenegen.eval.plots.plot_report

    def drawn_while_someone_makes_a_directory(report, path):
        plot.mkdir()
        return drawn(report, path)

    monkeypatch.setattr(jscenegen.eval.plots, "plot_report", drawn_while_someone_makes_a_directory)
    assert main(["eval", "--model", str(chat_model_dir()), "--scenes", str(scenes), "--greedy",
                 "--out", str(out), *TINY]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: --plot {plot}: is a directory, not a regular file; jscenegen writes a new file "
        "and renames it over the target, so give a file path")
    assert out.read_text() == "earlier report" and plot.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.jsonl", "r.json", "r.png"]


def test_an_eval_whose_plot_cannot_be_drawn_still_writes_its_report(tmp_path, capsys, monkeypatch):
    """The plot is drawn before the report is written (so a stop leaves both or neither): a
    plot that raised lost the whole evaluation (helper-170)."""
    import jscenegen.eval.plots

    scenes = tmp_path / "one.jsonl"
    scenes.write_text(json.dumps(dev_records()[0].to_json()) + "\n")
    out = tmp_path / "new" / "r.json"
    out.parent.mkdir()
    out.with_suffix(".png").write_bytes(b"an earlier evaluation's plot")

    def broken(report, path):
        raise RuntimeError("Unknown symbol: \\bad\nfound '\\'")

    monkeypatch.setattr(jscenegen.eval.plots, "plot_report", broken)
    assert main(["eval", "--model", str(chat_model_dir()), "--scenes", str(scenes), "--greedy",
                 "--out", str(out), *TINY]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"error: --plot {out.with_suffix('.png')}: not drawn (RuntimeError: "
                          "Unknown symbol: ") and err.endswith(f"); the report is written to {out}")
    report = json.loads(out.read_text())
    assert [r["scene_id"] for r in report["scenes"]] == [dev_records()[0].scene.scene_id]
    assert sorted(p.name for p in out.parent.iterdir()) == ["r.json"]


def test_eval_with_a_judge_that_grades_nothing_fails_after_writing_the_report(tmp_path, capsys):
    """A judge that refuses the key stops eval before the model loads; one that answers every
    grading request with HTTP 500 leaves a report (every episode a judge failure) and exit 1."""
    scenes = tmp_path / "one.jsonl"
    scenes.write_text(json.dumps(dev_records()[0].to_json()) + "\n")
    out = tmp_path / "r.json"
    for plan, code in ((["401"], 2), (["500"], 1)):
        server = JudgeServer(plan)
        try:
            got = main(["eval", "--model", str(chat_model_dir()), "--scenes", str(scenes),
                        "--greedy", "--out", str(out), *TINY, "judge.backend=http",
                        f"judge.base_url={server.url}", "judge.model=judge-27b",
                        "judge.max_retries=0", "judge.timeout_s=5"])
        finally:
            server.close()
        err = capsys.readouterr().err
        assert got == code, err
        if code == 2:
            assert "refuses requests without an API key" in err and "(HTTP 401 to GET /models)" in err
            assert server.calls == 0 and not out.exists()
    assert "the judge graded none of the episodes it was sent (judge_error x1)" in err
    rep = json.loads(out.read_text())
    assert rep["overall"]["expert"]["failure_causes"] == {"judge_error": 1}
    assert rep["overall"]["expert"]["quality"] is None


def test_eval_and_design_fail_when_the_engine_failed_every_episode(tmp_path, capsys, monkeypatch):
    """A sampler that crashed (a device out of memory) masks every episode rollout_error: eval
    wrote a report with no model reward and design the empty room, both with exit 0, so a
    script took a failed evaluation for a result. Both now write their output and exit 1."""
    _engine_fails_for(monkeypatch, None)
    scenes = tmp_path / "one.jsonl"
    scenes.write_text(json.dumps(dev_records()[0].to_json()) + "\n")
    out = tmp_path / "r.json"
    assert main(["eval", "--model", str(chat_model_dir()), "--scenes", str(scenes), "--greedy",
                 "--out", str(out), *TINY]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: the one model episode was masked (rollout_error x1): jscenegen's sampler or scene "
        "runtime failed, not the policy (the log line above names the error; JSCENEGEN_DEBUG=1 "
        f"adds its traceback); the report {out} records them, with no reward of the model")
    rep = json.loads(out.read_text())
    assert rep["overall"]["model"]["reward"] is None
    assert rep["overall"]["model"]["failure_causes"] == {"rollout_error": 1}
    assert rep["overall"]["expert"]["episodes"] == 0   # the same scenes as the model's row
    scene = tmp_path / "scene.json"
    assert main(["design", "--model", str(chat_model_dir()), "--prompt", "A small bedroom.",
                 "-o", str(scene), "--greedy", *TINY]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: the episode was masked (rollout_error: RuntimeError: RESOURCE_EXHAUSTED: out of "
        "memory allocating 8.00GiB): jscenegen's sampler or scene runtime failed, not the policy "
        "(the log line above names the error; JSCENEGEN_DEBUG=1 adds its traceback); "
        f"{scene} holds the scene as it stood")
    assert scene_from_json(json.loads(scene.read_text()), str(scene)).objects == ()


def test_design_checks_the_judge_before_loading_the_model(tmp_path, capsys):
    """design loaded the model and played the episode before it met a judge refusing its key."""
    out = tmp_path / "scene.json"
    server = JudgeServer(["401"])
    try:
        got = main(["design", "--model", str(chat_model_dir()), "--prompt", "A small bedroom.",
                    "-o", str(out), "--greedy", *TINY, "judge.backend=http",
                    f"judge.base_url={server.url}", "judge.model=judge-27b", "judge.max_retries=0",
                    "judge.timeout_s=5"])
    finally:
        server.close()
    err = capsys.readouterr().err
    assert got == 2 and "refuses requests without an API key" in err, err
    assert server.calls == 0 and not out.exists()


def _design_plays_a_finished_episode(monkeypatch) -> None:
    """`jscenegen design`'s engine plays a short finished episode (the planner asks for a bed,
    the designer adds one, the planner finishes) instead of the tiny model's truncated turns,
    so the episode reaches the judge."""
    from jscenegen.grpo.rollout.engine import RolloutEngine
    from jscenegen.scene.actions import format_action

    bed = {"op": "add_object", "category": "double_bed", "description": "bed",
           "position": [1.8, 1.6], "yaw": 0}

    def policy(ep):
        if ep.next_role == "designer":
            return format_action({"ops": [bed]})
        return format_action({"action": "design", "instruction": "a bed"} if ep.planner_turns == 0
                             else {"action": "finish", "summary": "done"})

    run_group = RolloutEngine.run_group
    monkeypatch.setattr(RolloutEngine, "run_group",
                        lambda self, *a, **kw: run_group(self, *a, **{**kw, "forced": policy}))


class _RaisingJudge:
    """The configured judge, except that grading raises (a bug or a lost connection in a
    local judge)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def grade(self, requests):
        raise ConnectionError("judge server down")


@pytest.mark.parametrize("judge,cause,check", [
    ("http_500", "judge_error: HTTP 500", "check judge.base_url and the judge's log"),
    ("raising", "judge_error: ConnectionError: judge server down",
     "the rule judge's error is in the log above")])
def test_design_fails_when_the_judge_did_not_grade_the_scene(tmp_path, capsys, monkeypatch, judge,
                                                             cause, check):
    """A judge failure during design (an HTTP judge answering 500, a judge that raises) masks
    the episode: the scene is written, and design exits 1 with one error line naming the
    cause (the line said only `judge_error`; what failed was in a log line above it)."""
    import jscenegen.scene.judge as judge_module

    _design_plays_a_finished_episode(monkeypatch)
    out = tmp_path / "scene.json"
    args = ["design", "--model", str(chat_model_dir()), "--prompt", "A small bedroom.", "-o",
            str(out), "--greedy", "sampling.max_new_tokens=512", "sampling.max_episode_tokens=6144",
            "sampling.buckets=[128,1024]"]
    server = None
    if judge == "http_500":
        server = JudgeServer(["500"])
        args += ["judge.backend=http", f"judge.base_url={server.url}", "judge.model=judge-27b",
                 "judge.max_retries=0", "judge.timeout_s=5"]
    else:
        make = judge_module.make_judge
        monkeypatch.setattr(judge_module, "make_judge", lambda *a, **kw: _RaisingJudge(make(*a, **kw)))
    try:
        got = main(args)
    finally:
        if server is not None:
            server.close()
    captured = capsys.readouterr()
    assert got == 1, captured.err
    result = json.loads(captured.out.split("--- result ---\n", 1)[1])
    assert result["failure_cause"] == "judge_error" and result["masked"], result
    assert result["reward"] is None   # not a score: printed 0.0 (scene check/furnish: null)
    errors = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    assert errors == [captured.err.splitlines()[-1]]
    assert errors[0] == (f"error: the judge did not grade the scene ({cause}); {out} holds it "
                         f"({check})")   # what to check for the backend that failed
    assert server is None or server.calls >= 1
    assert len(scene_from_json(json.loads(out.read_text()), str(out)).objects) == 1


def test_ungraded_judge_failures_counts_only_when_nothing_was_graded():
    from jscenegen.eval.report import ungraded_judge_failures

    def summary(quality, causes):
        return {"quality": quality, "failure_causes": causes}

    both_failed = {"overall": {"model": summary(None, {"judge_timeout": 2, "truncated_action": 1}),
                               "expert": summary(None, {"judge_error": 1})}}
    assert ungraded_judge_failures(both_failed) == "judge_error x1, judge_timeout x2"
    one_graded = {"overall": {"model": summary(None, {"judge_timeout": 2}),
                              "expert": summary(7.5, {})}}
    assert ungraded_judge_failures(one_graded) == ""
    never_judged = {"overall": {"model": summary(None, {"truncated_action": 3})}}
    assert ungraded_judge_failures(never_judged) == ""


def test_design_writes_the_terminal_scene(tmp_path, capsys):
    """The transcript escapes control characters (an ANSI sequence in the prompt coloured the
    terminal); the scene keeps the prompt as given."""
    out = tmp_path / "scene.json"
    png = tmp_path / "scene.png"
    prompt = "A small \x1b[31mbedroom\x07 with a single bed and a desk."
    assert main(["design", "--model", str(chat_model_dir()), "--prompt", prompt, "-o", str(out),
                 "--render", str(png), "--greedy", *TINY]) == 0
    scene = scene_from_json(json.loads(out.read_text()), str(out))
    assert scene.prompt == prompt and scene.objects == ()
    printed = capsys.readouterr().out
    assert "--- planner ---" in printed and "--- environment ---" in printed
    assert "A small \\x1b[31mbedroom\\x07 with" in printed and "\x1b" not in printed
    result = json.loads(printed.split("--- result ---\n", 1)[1])
    assert result["reward"] == -1.0 and result["failure_cause"] in ("truncated_generation",
                                                                   "truncated_action")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_design_record_rooms(tmp_path):
    from jscenegen.commands.design import DEFAULT_ROOM_SEED, design_record
    from jscenegen.scene.generator import make_record
    from jscenegen.scene.schema import SceneError

    rec = design_record("A calm bedroom.", None, 5)
    assert rec.seed == 5 and rec.requested == () and rec.scene.prompt == "A calm bedroom."
    assert rec.scene.room == make_record(DEFAULT_ROOM_SEED, "x").scene.room
    dev = dev_records()[1].scene
    (tmp_path / "scene.json").write_text(json.dumps(dev.to_json()))
    (tmp_path / "room.json").write_text(json.dumps(dev.room.model_dump(mode="json")))
    (tmp_path / "record.json").write_text(json.dumps(dev_records()[1].to_json()))  # a scene-set line
    for name in ("scene.json", "room.json", "record.json"):
        rec = design_record("Two beds.", str(tmp_path / name), 0)
        assert rec.scene.room == dev.room and rec.scene.prompt == "Two beds."
    (tmp_path / "bad.json").write_text(json.dumps({"floor_polygon": [[0, 0], [1, 0]], "wall_height": 2.5}))
    with pytest.raises(SceneError, match="bad.json.*floor_polygon"):
        design_record("x", str(tmp_path / "bad.json"), 0)
    broken = dev.to_json()
    broken["room"]["wall_height"] = -1.0       # a scene file's error names --room as the others do
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    with pytest.raises(SceneError, match=rf"^--room {re.escape(str(tmp_path / 'broken.json'))}: "):
        design_record("x", str(tmp_path / "broken.json"), 0)
    with pytest.raises(SceneError, match="--prompt is empty"):
        design_record("  ", None, 0)


def _paired_reports(rewards, masked=()):
    return {"scenes": [{"scene_id": sid, "model": {"episodes": [
        {"seed": seed, "reward": r, "masked": (sid, seed) in masked,
         "failure_cause": "bad_json" if r == -1 else None} for seed, r in eps]}}
        for sid, eps in rewards.items()]}


def test_compare_reports_pairs_episodes_by_scene_and_seed():
    from scipy import stats

    from jscenegen.eval.report import compare_reports

    report = _paired_reports
    before = report({"a": [(1, -1.0), (2, 0.5)], "b": [(3, -1.0), (4, -1.0)]})
    after = report({"a": [(2, 0.7), (1, 0.6)], "b": [(3, -1.0), (4, 0.2)]}, masked={("b", 3)})
    c = compare_reports(before, after)
    diffs = np.array([1.6, 0.2, 1.2])  # (a,1), (a,2), (b,4); (b,3) is masked after
    assert c["pairs"] == 3 and c["scenes"] == 2 and c["diff"] == pytest.approx(diffs.mean())
    # by hand: scene means 0.9 (2 pairs) and 1.2 (1 pair) around 1.0; terms n_s/N (d_s - d) are
    # -1/15 and +1/15, so se = sqrt(2/1 * 2/225) = 2/15, with t(0.975, 1 degree of freedom)
    half = 12.706204736 * 2 / 15
    assert c["diff_ci95"] == pytest.approx([1.0 - half, 1.0 + half])
    assert c["per_scene"] == pytest.approx({"a": 0.9, "b": 1.2})
    assert c["failure_rate_before"] == pytest.approx(2 / 3) and c["failure_rate_after"] == 0.0
    with pytest.raises(ValueError, match="share no"):
        compare_reports(before, report({"c": [(1, 0.0)]}))
    one = compare_reports(before, report({"a": [(2, 0.7)]}))   # one pair has no spread: no interval
    assert one["pairs"] == 1 and one["diff"] == pytest.approx(0.2) and one["diff_ci95"] is None
    # one scene of several pairs: no spread between scenes, no interval
    one = compare_reports(before, report({"a": [(1, 0.6), (2, 0.7)]}))
    assert one["pairs"] == 2 and one["scenes"] == 1 and one["diff_ci95"] is None
    # the same number of pairs per scene: the t interval over the scene means
    rng = np.random.default_rng(0)
    d = {f"s{i}": rng.normal(0.3 * i, 0.5, 4) for i in range(5)}
    c = compare_reports(report({s: [(k, 0.0) for k in range(4)] for s in d}),
                        report({s: [(k, float(x)) for k, x in enumerate(v)] for s, v in d.items()}))
    means = [v.mean() for v in d.values()]
    want = stats.ttest_1samp(means, 0.0).confidence_interval(0.95)
    assert c["scenes"] == 5 and c["pairs"] == 20 and c["diff"] == pytest.approx(np.mean(means))
    assert c["diff_ci95"] == pytest.approx([want.low, want.high])


def test_the_interval_covers_a_shared_scene_effect_95_percent_of_the_time():
    """9 scenes x 16 episodes whose scenes each draw an effect around a true difference of 0:
    the episodes of a scene are not independent, and an interval over the 144 pairs as if they
    were (z = 1.96) covered 0 about half the time; the scene-clustered t interval covers it
    ~95% of the time."""
    from jscenegen.eval.report import compare_reports

    rng = np.random.default_rng(1)
    scenes, samples, trials, covered, covered_z = 9, 16, 400, 0, 0
    before = _paired_reports({f"s{i}": [(k, 0.0) for k in range(samples)] for i in range(scenes)})
    for _ in range(trials):
        effect = rng.normal(0.0, 0.3, scenes)
        diffs = [[float(effect[i] + x) for x in rng.normal(0.0, 0.5, samples)] for i in range(scenes)]
        after = _paired_reports({f"s{i}": list(enumerate(d)) for i, d in enumerate(diffs)})
        lo, hi = compare_reports(before, after)["diff_ci95"]
        covered += lo <= 0.0 <= hi
        pairs = np.ravel(diffs)   # the former interval: mean +- 1.96 sd / sqrt(pairs)
        half = 1.96 * pairs.std(ddof=1) / np.sqrt(pairs.size)
        covered_z += abs(pairs.mean()) <= half
    assert 0.92 <= covered / trials <= 0.98, covered / trials
    assert covered_z / trials < 0.65, covered_z / trials   # 58.75% (docs/eval.md "The interval")


def test_comparison_markdown_has_a_row_per_scene_and_the_interval(report):
    import copy

    from scipy import stats

    from jscenegen.eval.report import check_report, check_same_episodes, compare_reports, comparison_markdown

    check_report(report, "report.json")  # what `eval --compare` checks first holds for a real report
    after = copy.deepcopy(report)        # the same episodes, rewarded otherwise
    for row, value in zip(after["scenes"], (0.25, 0.75)):
        row["model"]["episodes"][0].update(reward=value, masked=False, failure_cause=None)
        row["model"].update(reward=value, failure_rate=0.0)
    after["overall"]["model"].update(reward=0.5, failure_rate=0.0)
    check_report(after, "after.json")
    check_same_episodes(report, after, ("before.json", "after.json"))
    text = comparison_markdown(report, after)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + len(report["scenes"]) + 1
    diffs = [v - row["model"]["episodes"][0]["reward"] for row, v in zip(report["scenes"], (0.25, 0.75))]
    want = stats.ttest_1samp(diffs, 0.0).confidence_interval(0.95)   # 2 scenes of 1 pair
    change = compare_reports(report, after)
    assert change["diff"] == pytest.approx(np.mean(diffs)) and change["scenes"] == 2
    assert change["diff_ci95"] == pytest.approx([want.low, want.high])
    assert (f"diff {np.mean(diffs):+.3f}, 95% CI [{want.low:+.3f}, {want.high:+.3f}] over 2 "
            "scenes, 2 pairs)") in rows[-1], rows[-1]
    assert rows[1].split(" | ")[1] == f"{report['scenes'][0]['model']['reward']:.2f} -> 0.25"


def test_one_scene_compares_without_an_interval(tmp_path, capsys):
    """One scene has no spread between scenes: the table says so, eval_change.json has null."""
    from jscenegen.eval.report import comparison_markdown

    rep = _synthetic_report(scenes=("a",))
    assert comparison_markdown(rep, rep).splitlines()[-1].split(" | ")[1].endswith(
        "(diff +0.000, 95% CI n/a (one scene), 2 pairs)")
    assert _compare(tmp_path, capsys, rep, rep) == (0, "")


def test_a_multi_process_evaluation_takes_process_0s_grades(cfg, monkeypatch):
    """A run's dev evaluations (`eval_before`, `eval_every`, `eval_after`) run on every process
    of a multi-process run: each called its own judge (N times the judge's cost, different
    grades per process with a sampling judge, requests without the key that only process 0
    checked). They now grade as the training rollouts do (`judge_on_primary`): on a process
    other than 0 the report holds process 0's grades and the local judge is never asked."""
    import jscenegen.grpo.rollout.primary_judge as primary_judge

    class LocalJudge:
        def identity(self):
            return {"backend": "local", "model": "never-asked", "rubric_hash": "0"}

        def grade(self, requests):
            raise AssertionError("a process other than 0 asked its own judge")

    keys = cfg.judge.grade_keys
    sent = {}

    def from_process_0(payload):
        assert payload is None                       # this process sends nothing
        sent["rows"] = [[{k: 3 + i for i, k in enumerate(keys)}, None, {}]]
        return json.dumps(sent["rows"]).encode()

    monkeypatch.setattr(primary_judge, "for_processes", primary_judge.PrimaryJudge)
    monkeypatch.setattr(primary_judge, "is_primary", lambda: False)
    monkeypatch.setattr(primary_judge, "bytes_from_primary", from_process_0)
    report = evaluate(None, dev_records()[:1], judge=LocalJudge(), scene_cfg=cfg.scene,
                      judge_cfg=cfg.judge)
    (ep,) = report["scenes"][0]["expert"]["episodes"]
    assert ep["failure_cause"] is None and ep["grades"] == sent["rows"][0][0]


@pytest.mark.parametrize("error", [ValueError, RuntimeError])
def test_a_scene_that_cannot_start_neither_ends_nor_counts_in_the_fit_check(cfg, error):
    """`check_scenes_fit` counted any ValueError of a scene's start (a template or scene error)
    as a prompt over the cap, and any other error ended the check there (the later scenes
    unchecked). Now only EpisodeTooLong counts; a scene that cannot start is left to the
    rollout. Here scene 0 cannot start and scenes 1 and 2 start over the cap: refused, naming
    scene 1 and the cap."""
    from jscenegen.eval.evaluate import check_scenes_fit

    records = dev_records()[:3]
    cap = cfg.sampling.max_episode_tokens

    class Chat:
        def start(self, system, user):
            if records[0].scene.prompt in user:
                raise error("the template cannot render this scene")
            return None, list(range(cap))

        def encode_content(self, text):
            return text, list(range(len(text.split())))

    with pytest.raises(ValueError) as err:
        check_scenes_fit(Chat(), records, cfg, "dev.jsonl")
    message = str(err.value)
    assert message.startswith(f"dev.jsonl: {records[1].scene.scene_id}: the prompt")
    assert f"sampling.max_episode_tokens={cap}" in message and "(all 2 of the first 3 scene(s) that start do" in message


def test_a_hanging_judge_is_waited_for_once_for_all_scenes(cfg):
    """Every scene's finished episodes go to the judge together: with a judge that never
    answers, 4 scenes cost one timeout (4 requests in flight at once), not four in a row."""
    from jscenegen.scene.config import JudgeConfig

    from scene_fixtures import JudgeServer

    server = JudgeServer(["stall"])
    try:
        judge_cfg = JudgeConfig(backend="http", base_url=server.url, model="judge", api_key_env=None,
                                timeout_s=0.5, max_retries=0, concurrency=8)
        report = evaluate(None, dev_records()[:4], judge=make_judge(judge_cfg, cfg.scene),
                          scene_cfg=cfg.scene, judge_cfg=judge_cfg)
    finally:
        server.close()
    assert server.calls == 4 and server.max_inflight == 4  # one scene after another: 1
    # what it samples with is recorded beside who it is (`eval --compare` compares them)
    assert {k: v for k, v in report["judge"].items() if k != "rubric_hash"} == {
        "backend": "http", "model": "judge", "temperature": 0.0, "max_tokens": 1024}
    assert [r["expert"]["episodes"][0]["failure_cause"] for r in report["scenes"]] == ["judge_timeout"] * 4
    assert report["overall"]["expert"]["masked"] == 4


def test_eval_refuses_scenes_whose_episodes_cannot_start_before_loading_the_model(tmp_path, capsys):
    """eval played such a set to rewards of -1 (episode_token_cap) and exited 0; design and
    train refused the same case up front. The weights (garbage here) are never read."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(chat_model_dir(), model)
    (model / "model.safetensors").write_bytes(b"not weights")
    record = dev_records()[0].to_json()
    record["scene"]["prompt"] = "A bedroom with a bed, a desk and a wardrobe by the window. " * 300
    (tmp_path / "long.jsonl").write_text(json.dumps(record) + "\n")
    assert main(["eval", "--model", str(model), "--scenes", str(tmp_path / "long.jsonl"),
                 "--out", str(tmp_path / "r.json"), *TINY]) == 2
    err = one_error_line(capsys)
    assert err.startswith(f"error: {tmp_path / 'long.jsonl'}: {record['scene']['scene_id']}: the "
                          "prompt (") and "(all 1 of the first 1 scene(s) that start do: no episode could take a turn)" in err
    assert not (tmp_path / "r.json").exists()


def test_design_refuses_what_cannot_work_before_loading_the_model(tmp_path, capsys):
    """A prompt that leaves no room for a turn, or a room the runtime cannot measure, is
    refused up front, naming the limit: the model's weights (garbage here) are never read."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(chat_model_dir(), model)
    (model / "model.safetensors").write_bytes(b"not weights")
    long_prompt = "A bedroom with a bed, a desk and a wardrobe by the window. " * 300
    assert main(["design", "--model", str(model), "--prompt", long_prompt, "-o",
                 str(tmp_path / "s.json"), *TINY]) == 2
    err = capsys.readouterr().err
    assert "at or over sampling.max_episode_tokens=2560" in err and err.count("\n") == 1
    assert "shorten the prompt by at least" in err
    # a short prompt: the system prompt and the room are what does not fit
    assert main(["design", "--model", str(model), "--prompt", "A bedroom.", "-o",
                 str(tmp_path / "s.json"), *TINY[:1], TINY[2], "sampling.max_episode_tokens=64"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"at or over sampling.max_episode_tokens=64; the rest alone takes \d+: raise "
                     r"sampling.max_episode_tokens$", err.strip()) and "shorten" not in err, err
    room = dev_records()[0].scene.room.model_dump(mode="json")
    (tmp_path / "room.json").write_text(json.dumps(dict(room, doors=[])))
    assert main(["design", "--model", str(model), "--prompt", "A bedroom.", "--room",
                 str(tmp_path / "room.json"), "-o", str(tmp_path / "s.json"), *TINY]) == 2
    err = capsys.readouterr().err
    assert f"--room {tmp_path / 'room.json'}: not a scene or room: doors: a room needs at least " \
        "one door" in err and "weights" not in err and "safetensors" not in err, err
    far = dev_records()[0].scene.to_json()
    far["objects"] = [{"id": "bed_1", "category": "bed", "position": [100.0, 100.0], "size": [1.0, 1.0, 0.5]}]
    (tmp_path / "far.json").write_text(json.dumps(far))
    assert main(["design", "--model", str(model), "--prompt", "A bedroom.", "--room",
                 str(tmp_path / "far.json"), "-o", str(tmp_path / "s.json"), *TINY]) == 2
    assert f"error: --room {tmp_path / 'far.json'}: object bed_1: a corner lies 10" in \
        capsys.readouterr().err
    assert not (tmp_path / "s.json").exists()


def test_no_pytorch_advice_when_a_command_imports_transformers_without_torch(tmp_path):
    """On a machine without torch (the lent GPU machines), transformers' import-time advice
    "PyTorch was not found" is not printed by any command (cli sets TRANSFORMERS_VERBOSITY)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; sys.modules['torch'] = None; from jscenegen.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run(
        [sys.executable, "-c", code, "design", "--model", str(chat_model_dir()), "--prompt",
         "A bedroom. " * 2000, "-o", str(tmp_path / "s.json"), *TINY],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    assert proc.returncode == 2 and "max_episode_tokens" in proc.stderr  # transformers was used
    assert "PyTorch was not found" not in proc.stderr + proc.stdout


SAMPLED = {"temperature": 1.0, "top_k": 0, "buckets": [64, 256], "end_ids": [7]}


def _synthetic_report(scenes=("a", "b"), seeds=(1, 2)) -> dict:
    from jscenegen.scene.config import JudgeConfig, SceneRuntimeConfig
    from jscenegen.scene.protocol import protocol_digests

    stats = {"reward": 0.5, "failure_rate": 0.0, "units": 10.0, "reachable": 1.0, "quality": 0.6,
             "unit_penalty": 0.1, "failure_causes": {}}
    return {"schema": "jscenegen.eval/1", "samples": len(seeds),
            "judge": {"backend": "rule", "model": None, "rubric_hash": "e8178fedbec1139e"},
            "protocol": protocol_digests(SceneRuntimeConfig(), JudgeConfig()),
            "sampling": dict(SAMPLED),
            "scenes": [{"scene_id": sid, "seed": 7, "prompt": f"a room {sid}",
                        "scene_sha256": f"{len(sid):064x}", "model": dict(stats, episodes=[
                {"seed": s, "reward": 0.5, "masked": False, "failure_cause": None} for s in seeds])}
                       for sid in scenes],
            "overall": {"model": dict(stats)}}


def _edited(edit) -> dict:
    rep = _synthetic_report()
    edit(rep)
    return rep


def _compare(tmp_path, capsys, before, after):
    for name, rep in (("before.json", before), ("after.json", after)):
        (tmp_path / name).write_text(json.dumps(rep))
    rc = main(["eval", "--compare", str(tmp_path / "before.json"), str(tmp_path / "after.json")])
    captured = capsys.readouterr()
    return rc, captured.err.strip()


def test_a_scene_id_is_one_markdown_cell():
    from jscenegen.eval.report import comparison_markdown

    rep = _synthetic_report(scenes=("a|b\nc",))
    rows = comparison_markdown(rep, rep).splitlines()
    assert rows[2].startswith("| a\\|b c | 0.50 -> 0.50 |") and len(rows) == 4
    # control and bidi characters reached the terminal as they were (a title set, the rest of
    # the line reversed)
    rep = _synthetic_report(scenes=("a\x1b]0;title\x07\u202eb\tc",))
    rows = comparison_markdown(rep, rep).splitlines()
    assert rows[2].startswith("| a\\x1b]0;title\\x07\\u202eb\\tc | 0.50 -> 0.50 |"), rows[2]
    assert not any(c in "\n".join(rows) for c in "\x1b\x07\u202e\t")
    rep = _synthetic_report(scenes=("x" * 10**6,))
    assert comparison_markdown(rep, rep).splitlines()[2].startswith(
        "| " + "x" * 80 + "... (1,000,000 characters) | 0.50 -> 0.50 |")


def test_a_scenes_digest_covers_its_room_and_requested_items():
    """A report kept a scene's id, seed and prompt only: a scene set edited in its rooms or
    requested items (other rewards: the rule judge grades prompt following against them)
    compared as the same scenes."""
    from dataclasses import replace

    from jscenegen.scene.sceneset import record_from_json, record_sha256

    rec = dev_records()[0]
    room = rec.scene.room.model_dump(mode="json")
    room["floor_polygon"] = [[1.5 * x, 1.5 * y] for x, y in room["floor_polygon"]]
    wider = record_from_json({**rec.to_json(), "scene": {**rec.scene.to_json(), "room": room}})
    asked = record_from_json({**rec.to_json(), "requested": [{"category": "bed", "count": 1}]})
    digests = {record_sha256(r) for r in (rec, wider, asked)}
    assert len(digests) == 3 and record_sha256(replace(rec, line=9)) == record_sha256(rec)


def test_a_refused_report_names_its_bad_value_clipped():
    """A 1 MB string where a scene, its scene_id or an episode's `masked` belongs was echoed in
    full in the message (then escaped character by character for the error line)."""
    from jscenegen.eval.report import check_report

    huge = "A" * 10**6
    for edit, why in ((lambda r: r["scenes"].__setitem__(0, huge),
                       "scenes[0] must be an object, got str 'AAA"),
                      (lambda r: r["scenes"][0].update(scene_id=[huge]),
                       "scenes[0].scene_id must be a string, got ['AAA"),
                      (lambda r: r["scenes"][0]["model"]["episodes"][0].update(masked=huge),
                       "scenes[0].model.episodes[0].masked must be true or false, got 'AAA")):
        with pytest.raises(ValueError) as err:
            check_report(_edited(edit), "r.json")
        message = str(err.value)
        assert why in message and len(message) < 1000, message[:200]
        assert re.search(r"AAA\.\.\. \(1,000,00[24] characters\)$", message), message[-80:]


def test_a_report_with_a_huge_scene_row_is_refused_quickly():
    """The duplicate-seed check called list.count per seed: one edited report of a scene with
    100,001 episodes, its last seed repeated, stalled `eval --compare` (and `train --resume`)
    for minutes; its count is now refused before the episodes are read, and the check is
    linear (a Counter) on a row of the most samples a report holds."""
    import time

    from jscenegen.eval.report import check_report
    from jscenegen.grpo.rollout.config import GROUP_MAX

    def one_row(n: int) -> dict:
        eps = [{"seed": i, "reward": 0.0, "masked": False, "failure_cause": None} for i in range(n)]
        eps.append(dict(eps[-1]))
        rep = _synthetic_report(scenes=("a",), seeds=())
        rep["samples"] = n + 1
        rep["scenes"][0]["model"].update(episodes=eps, reward=0.0)
        rep["overall"]["model"]["reward"] = 0.0
        return rep

    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=rf"^r.json: samples must be a positive integer \(episodes "
                                         rf"per scene\) up to {GROUP_MAX} \(a rollout group, as "
                                         r"`eval --samples`\), got 100001$"):
        check_report(one_row(100_000), "r.json")
    assert time.perf_counter() - t0 < 5   # over a minute before
    with pytest.raises(ValueError, match=rf"^r.json: scenes\[0\].model.episodes hold seed "
                                         rf"{GROUP_MAX - 2} more than once"):
        check_report(one_row(GROUP_MAX - 1), "r.json")


def test_the_overall_reward_cell_is_over_the_pairs_its_difference_is_over():
    """With an episode masked after, the cell read each report's own mean beside the paired
    difference: "-0.25 -> 0.60 (diff +0.100 ...)"."""
    from jscenegen.eval.report import comparison_markdown

    before, after = _synthetic_report(), _synthetic_report()
    for row in after["scenes"]:
        for ep in row["model"]["episodes"]:
            ep["reward"] = 0.7
    after["scenes"][0]["model"]["episodes"][0]["masked"] = True
    after["overall"]["model"]["reward"] = 0.7
    before["scenes"][0]["model"]["episodes"][0]["reward"] = -0.1   # only its pair is masked
    before["overall"]["model"]["reward"] = 0.35                     # the report's own mean
    overall = comparison_markdown(before, after).splitlines()[-1]
    assert overall.startswith("| **all** | 0.50 -> 0.70 (diff +0.200, "), overall
    assert overall.split(" | ")[1].endswith("3 pairs)")


def test_compare_whose_plot_cannot_be_drawn_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    """The table printed, then matplotlib's error went out as it was, and an earlier plot at
    --plot stayed beside it (helper-173)."""
    import jscenegen.eval.plots

    def broken(report, out, **kw):
        raise ValueError("Unknown symbol: \\bad\nfound '\\'")

    monkeypatch.setattr(jscenegen.eval.plots, "plot_report", broken)
    plot = tmp_path / "change.png"
    plot.write_bytes(b"an earlier comparison's plot")
    rep = _synthetic_report()
    for name in ("before.json", "after.json"):
        (tmp_path / name).write_text(json.dumps(rep))
    assert main(["eval", "--compare", str(tmp_path / "before.json"), str(tmp_path / "after.json"),
                 "--plot", str(plot)]) == 2
    captured = capsys.readouterr()
    assert "| **all** |" in captured.out and not plot.exists()
    assert captured.err.strip() == (f"error: --plot {plot}: not drawn (ValueError: Unknown symbol: "
                                    "\\bad; found '\\')")


def test_compare_refuses_damaged_and_mismatched_reports_naming_file_and_field(tmp_path, capsys):
    good = _synthetic_report()
    assert _compare(tmp_path, capsys, good, good) == (0, "")
    (tmp_path / "one.json").write_text(json.dumps(good))
    assert main(["eval", "--compare", str(tmp_path / "one.json"), str(tmp_path / "one.json")]) == 2
    assert one_error_line(capsys).endswith("BEFORE and AFTER are the same file")
    damaged = [(lambda r: r["scenes"].append(5), "scenes[2] must be an object"),
               (lambda r: r["scenes"][0].update(scene_id=None), "scenes[0].scene_id must be a string"),
               (lambda r: r["scenes"][1]["model"]["episodes"].__setitem__(1, "x"),
                "scenes[1].model.episodes[1] must be an object"),
               (lambda r: r["scenes"][0]["model"]["episodes"][0].pop("seed"),
                "scenes[0].model.episodes[0].seed must be an integer"),
               (lambda r: r["overall"]["model"].update(reward="high"), "overall.model.reward must be a finite number"),
               # Python's json reads NaN, Infinity and 1e999 (inf): a report never holds them
               (lambda r: r["scenes"][0]["model"]["episodes"][0].update(reward=float("nan")),
                "scenes[0].model.episodes[0].reward must be a finite number, got nan"),
               (lambda r: r["scenes"][0]["model"]["episodes"][0].update(reward=5.0),
                "scenes[0].model.episodes[0].reward 5.0 is outside [-1, 1], the rewards "
                "scene.reward's bounds allow"),
               # read as a reward while scene.reward took any failure reward and penalty
               (lambda r: r["scenes"][0]["model"]["episodes"][0].update(reward=-1e300),
                "scenes[0].model.episodes[0].reward -1e+300 is outside [-1, 1]"),
               (lambda r: r["overall"]["model"].update(quality=1.5),
                "overall.model.quality 1.5 is outside [0, 1] (the grades' mean over their range)"),
               (lambda r: r["scenes"][1]["model"].update(unit_penalty=-0.2),
                "scenes[1].model.unit_penalty -0.2 is outside [0, 1]"),
               (lambda r: r["overall"]["model"].update(reward=-3.0),
                "overall.model.reward -3.0 is outside [-1, 1]"),
               (lambda r: r["overall"]["model"].update(units=float("inf")),
                "overall.model.units must be a finite number or null, got inf"),
               (lambda r: r.update(schema="other/2"), "schema 'other/2' is not 'jscenegen.eval/1'"),
               (lambda r: r["scenes"].append(r["scenes"][0]), "scenes[2].scene_id 'a' is also scenes[0]'s"),
               (lambda r: r.update(samples=5), "scenes[0].model has 2 episodes, samples says 5"),
               # what --plot reads: it ended in a KeyError traceback after the table
               (lambda r: r.pop("samples"), "samples must be a positive integer"),
               (lambda r: r["overall"]["model"].pop("failure_causes"),
                "overall.model.failure_causes must map causes to counts, got None"),
               # an edited report: its summaries no longer are its episodes'
               (lambda r: r["scenes"][0]["model"]["episodes"][0].update(reward=0.9),
                "scenes[0].model.reward is 0.5 but its episodes give 0.7"),
               (lambda r: r["overall"]["model"].update(reward=0.9),
                "overall.model.reward is 0.9 but its episodes give 0.5"),
               (lambda r: r["scenes"][1]["model"]["episodes"][1].update(failure_cause="bad_json"),
                "scenes[1].model.failure_rate is 0.0 but its episodes give 0.5"),
               (lambda r: r["scenes"][0]["model"]["episodes"][1].update(seed=1),
                "scenes[0].model.episodes hold seed 1 more than once"),
               (lambda r: r["scenes"][0]["model"]["episodes"][1].update(seed=2**70),
                "scenes[0].model.episodes[1].seed must be an integer in 0..4294967295, got "
                "1180591620717411303424"),
               # an integer beyond any float: an OverflowError traceback
               (lambda r: r["scenes"][0]["model"]["episodes"][0].update(reward=10**400),
                "scenes[0].model.episodes[0].reward must be a finite number, got 1000"),
               (lambda r: r["overall"]["model"].update(units=-10**400),
                "overall.model.units must be a finite number or null, got -1000"),
               # out of range: the table showed them
               (lambda r: r["scenes"][0]["model"]["episodes"][0].update(units=-5),
                "scenes[0].model.episodes[0].units must be a number >= 0 (budget units spent) or "
                "null, got -5"),
               (lambda r: r["scenes"][1]["model"].update(units=-5.0),
                "scenes[1].model.units -5.0 is outside the units a run can spend (>= 0)"),
               (lambda r: r["overall"]["model"].update(reachable=1.5),
                "overall.model.reachable 1.5 is outside [0, 1]"),
               # `true` compared as the seed 1 ("differs in its seed")
               (lambda r: r["scenes"][0].update(seed=True), "scenes[0].seed must be an integer in "
                                                            "0..4294967295, got True"),
               (lambda r: r["scenes"][1].update(scene_sha256=5), "scenes[1].scene_sha256 must be a "
                                                                 "digest (a string), got 5"),
               (lambda r: r.update(judge="rule"), "judge must be an object (the judge's backend, "
                                                  "model, rubric and settings), got 'rule'"),
               # a list there raised a TypeError traceback, a string an error naming nothing
               (lambda r: r.update(sampling=[1, 2]), "sampling must be an object (the settings "
                                                     "the episodes were drawn with), got [1, 2]"),
               (lambda r: r.update(sampling="oops"), "sampling must be an object"),
               # compared as a sampling difference, or two alike passed unchecked (helper-188)
               (lambda r: r.update(sampling=dict(SAMPLED, end_ids="2")), "sampling.end_ids must "
                "be a non-empty list of token ids (integers >= 0), got '2'"),
               (lambda r: r.update(sampling=dict(SAMPLED, end_ids=[True])), "sampling.end_ids "
                "must be a non-empty list of token ids"),
               # counted as a failure
               (lambda r: r["scenes"][0]["model"]["episodes"][0].update(failure_cause=5),
                "scenes[0].model.episodes[0].failure_cause must be a cause (a non-empty string) "
                "or null, got 5"),
               # "" read as no failure in the summary's check, as a failure in the comparison
               (lambda r: r["scenes"][0]["model"]["episodes"][0].update(failure_cause=""),
                "scenes[0].model.episodes[0].failure_cause must be a cause")]
    for damage, why in damaged:
        rep = json.loads(json.dumps(good))
        damage(rep)
        rc, err = _compare(tmp_path, capsys, good, rep)
        assert rc == 2 and len(err.splitlines()) == 1 and "after.json" in err and why in err, err
    sampled = SAMPLED
    good = _synthetic_report()
    # the decode layout changes no token: reports that differ in it compare
    assert _compare(tmp_path, capsys, good, _edited(
        lambda r: r.update(sampling=dict(sampled, buckets=[32])))) == (0, "")
    assert _compare(tmp_path, capsys, _edited(lambda r: r.update(sampling=dict(
        sampled, cache_tokens=None))), _edited(lambda r: r.update(sampling=dict(
            sampled, cache_tokens=8192)))) == (0, "")
    # the template is compared by its text's hash: one file named by two paths compares
    assert _compare(tmp_path, capsys, _edited(lambda r: r.update(sampling=dict(
        sampled, chat_template_path="t.jinja", chat_template_sha256="ab"))), _edited(
        lambda r: r.update(sampling=dict(sampled, chat_template_path="./t.jinja",
                                         chat_template_sha256="ab")))) == (0, "")
    # the end ids are a set: their order and repeats change no token
    assert _compare(tmp_path, capsys, _edited(lambda r: r.update(sampling=dict(
        sampled, end_ids=[2, 3]))), _edited(lambda r: r.update(sampling=dict(
            sampled, end_ids=[3, 2, 3])))) == (0, "")
    greedy = _edited(lambda r: r.update(sampling=dict(sampled, greedy=True)))   # argmax: T unused
    assert _compare(tmp_path, capsys, greedy, _edited(
        lambda r: r.update(sampling=dict(sampled, greedy=True, temperature=0.7)))) == (0, "")
    (tmp_path / "after.json").write_text(json.dumps(good)[:-1] + ', "overall": {}}')
    assert main(["eval", "--compare", str(tmp_path / "before.json"), str(tmp_path / "after.json")]) == 2
    assert "after.json: not valid JSON: the key 'overall' appears twice in one object" in \
        capsys.readouterr().err
    no_model = _synthetic_report()
    del no_model["scenes"][1]["model"]

    for after, why in ((_synthetic_report(scenes=("a",)), r"1 scene\(s\) only in .*before.json: b"),
                       # compared silently while a one-sided `protocol` was refused
                       (_edited(lambda r: r.pop("sampling")), r"no `sampling` \(the sampling settings\) in "
                        r"\S*after.json \(written by .*re-run `jscenegen eval` for that report$"),
                       (_edited(lambda r: r.update(sampling={})), r"no `sampling` \(the sampling "
                        r"settings\) in \S*after.json"),
                       (_edited(lambda r: r.pop("judge")), r"no `judge` \(the judge\) in "
                        r"\S*after.json \(written"),
                       (_synthetic_report(seeds=(1,)), r"scene a has model episodes of different seeds \(seeds \[1, 2\] in .*before.json, seeds \[1\] in .*after.json\)"),
                       (no_model, "scene b has no model episodes in .*after.json"),
                       (_edited(lambda r: r["judge"].update(backend="http", model="Qwen3-27B")),
                        "graded by different judges \\(rule rubric e8178fedbec1 and http Qwen3-27B "
                        "rubric e8178fedbec1\\): their rewards do not compare"),
                       (_edited(lambda r: r["scenes"][1].update(seed=8)),
                        r"scene b differs in its seed \(another scene set under the same ids\)"),
                       (_edited(lambda r: r["scenes"][0].update(prompt="a kitchen")),
                        "scene a differs in its prompt"),
                       # same id, seed and prompt, another room or requested items: compared
                       (_edited(lambda r: r["scenes"][1].update(scene_sha256="f" * 64)),
                        r"scene b differs in its scene_sha256, the digest of its scene-set record "
                        r"\(room, requested items\) \(another scene set under the same ids\)$"),
                       (_edited(lambda r: r["scenes"][1].pop("scene_sha256")),
                        r"no `scenes\[\].scene_sha256` \(the digest of each scene's record\) in "
                        r"\S*after.json \(written by .*so their scenes \(rooms, requested items\) "
                        r"cannot be shown to be the same; re-run `jscenegen eval` for that report$"),
                       (_edited(lambda r: r.update(sampling=dict(sampled, chat_template_sha256="cd"))),
                        r"sampling.chat_template_sha256 is recorded by one report only \(\S*before.json "
                        r"has none: .*re-run `jscenegen eval` for that report"),
                       # a turn ended at other ids (another model's generation_config.json)
                       (_edited(lambda r: r.update(sampling=dict(sampled, end_ids=[7, 8]))),
                        r"sampled otherwise \(sampling.end_ids \[7\] and \[7, 8\]\)"),
                       # a dtype the logits came from recorded by one report only (the fixture
                       # records none; differing values: test_an_evaluation_in_other_dtypes_is_not_compared)
                       (_edited(lambda r: r.update(sampling=dict(sampled, rollout_dtype="bfloat16"))),
                        r"sampling.rollout_dtype is recorded by one report only"),
                       (_edited(lambda r: r.update(sampling=dict(sampled, temperature=0.1))),
                        r"sampled otherwise \(sampling.temperature 1.0 and 0.1\): the same seeds "
                        "draw other tokens"),
                       # every difference named, not the first one only (helper-85)
                       (_edited(lambda r: r.update(sampling=dict(sampled, temperature=0.1, top_k=5))),
                        r"sampled otherwise \(sampling.temperature 1.0 and 0.1; sampling.top_k "
                        r"0 and 5\): the same seeds draw other tokens")):
        rc, err = _compare(tmp_path, capsys, good, after)
        assert rc == 2 and len(err.splitlines()) == 1 and re.search(why, err), err
    # the HTTP judge's temperature and max_tokens: reports graded at temperature 0 and 1.0
    # compared silently
    http = {"backend": "http", "model": "judge-27b", "rubric_hash": "e8178fedbec1139e",
            "temperature": 0.0, "max_tokens": 1024}
    graded = _edited(lambda r: r.update(judge=dict(http)))
    assert _compare(tmp_path, capsys, graded, graded) == (0, "")
    for after, why in ((_edited(lambda r: r.update(judge=dict(http, temperature=1.0))),
                        r"graded otherwise \(judge.temperature 0.0 and 1.0\): the same episodes "
                        "get other grades$"),
                       (_edited(lambda r: r.update(judge=dict(http, temperature=1.0, max_tokens=64))),
                        r"graded otherwise \(judge.max_tokens 1024 and 64; judge.temperature 0.0 "
                        r"and 1.0\)"),
                       (_edited(lambda r: r.update(judge={k: v for k, v in http.items()
                                                          if k != "max_tokens"})),
                        r"judge.max_tokens is recorded by one report only \(\S*after.json has none: "
                        r".*so their grading cannot be shown to agree; re-run `jscenegen eval` for "
                        "that report$")):
        rc, err = _compare(tmp_path, capsys, graded, after)
        assert rc == 2 and len(err.splitlines()) == 1 and re.search(why, err), err
    # two reports that both lack it compared with exit 0 (helper-170)
    old = _edited(lambda r: [r.pop(k) for k in ("protocol", "sampling")])
    rc, err = _compare(tmp_path, capsys, old, old)
    assert rc == 2 and re.search(r"no `protocol` \(the scene protocol\) in \S*before.json or "
                                 r"\S*after.json .*re-run `jscenegen eval` for both$", err), err


def test_reports_graded_by_one_model_judge_in_renamed_directories_are_refused_saying_so(tmp_path, capsys):
    """The model judge's identity names its directory ("<name>@<digest>", documented), so the
    same weights graded the two reports from directories `ja` and `jb` and --compare said only
    "graded by different judges": it now says that the files are the same and what to do. Other
    weights (another digest), or another rubric beside the rename, keep the plain refusal."""
    digest = "c57a3a46331c3c79"
    model = {"backend": "model", "model": f"ja@{digest}", "rubric_hash": "e8178fedbec1139e",
             "temperature": 0.0, "max_tokens": 64}
    before = _edited(lambda r: r.update(judge=dict(model)))
    rc, err = _compare(tmp_path, capsys, before, _edited(lambda r: r.update(judge=dict(model, model=f"jb@{digest}"))))
    assert rc == 2 and err == (
        f"error: {tmp_path / 'before.json'} vs {tmp_path / 'after.json'}: graded by different judges "
        f"(model ja@{digest} rubric e8178fedbec1 and model jb@{digest} rubric e8178fedbec1): the same "
        "judge files under another directory name (ja -> jb): rename it back and re-run "
        f"`jscenegen eval` for {tmp_path / 'after.json'}")
    http = dict(model, backend="http")   # an HTTP judge's model is the server's name: no digest
    for a, b in ((model, dict(model, model="jb@0000000000000000")),
                 (model, dict(model, model=f"jb@{digest}", rubric_hash="ff")),
                 (http, dict(http, model=f"jb@{digest}"))):
        rc, err = _compare(tmp_path, capsys, _edited(lambda r, j=a: r.update(judge=dict(j))),
                           _edited(lambda r, j=b: r.update(judge=dict(j))))
        assert rc == 2 and err.endswith("their rewards do not compare"), err


def test_an_evaluation_in_other_dtypes_is_not_compared(tmp_path, capsys):
    """A report's `sampling` did not record the dtypes its logits came from: an evaluation with
    rollout.dtype=bfloat16 (or model.compute_dtype, model.param_dtype) drew its tokens from
    other numbers than one in float32 and was compared with it as the same sampling. Now
    recorded and compared; the cache's size and the decode buckets, which change only the
    computation's shapes, are not, nor what argmax reads none of when both decode greedily."""
    scenes = tmp_path / "one.jsonl"
    scenes.write_text(json.dumps(dev_records()[0].to_json()) + "\n")
    reports = {}
    for name, extra in (("f32", []), ("bf16", ["rollout.dtype=bfloat16"]),
                        ("cache", ["sampling.cache_tokens=4096"])):
        out = tmp_path / f"{name}.json"
        assert main(["eval", "--model", str(chat_model_dir()), "--scenes", str(scenes), "--greedy",
                     "--out", str(out), *TINY, *extra]) == 0
        reports[name] = str(out)
        capsys.readouterr()
    assert json.loads((tmp_path / "bf16.json").read_text())["sampling"]["rollout_dtype"] == "bfloat16"
    assert main(["eval", "--compare", reports["f32"], reports["bf16"]]) == 2
    err = one_error_line(capsys)
    assert "sampled otherwise (sampling.rollout_dtype 'float32' and 'bfloat16'): the same seeds " \
        "draw other tokens" in err, err
    assert main(["eval", "--compare", reports["f32"], reports["cache"]]) == 0
    capsys.readouterr()


def test_compare_reads_every_report_eval_can_write(tmp_path, capsys, monkeypatch):
    """A 100 scenes x 100 samples report (~6 MB, more than the 4 MiB of a scene file) is read;
    a report past MAX_REPORT_BYTES is refused naming the file, and `eval` refuses to play more
    episodes than one report holds, before the model loads."""
    from jscenegen.eval import report as report_module
    from jscenegen.grpo.rollout.config import GROUP_MAX
    from jscenegen.paths import write_json
    from jscenegen.scene.schema import MAX_JSON_FILE_BYTES

    assert report_module.MAX_REPORT_EPISODES >= GROUP_MAX * 100   # every sample count on train
    rep = _synthetic_report(scenes=tuple(f"train-{i}" for i in range(100)), seeds=range(100))
    for row in rep["scenes"]:          # the fields of a real episode row
        for ep in row["model"]["episodes"]:
            ep.update(member=ep["seed"], tokens=1439, quality=0.5142857142857143,
                      unit_penalty=0.0625, units=40, reachable=False, grades={
                          k: 5 for k in ("realism", "functionality", "layout", "completeness",
                                         "prompt_following", "reachability", "physical_plausibility")})
    for name in ("before.json", "after.json"):
        write_json(tmp_path / name, rep)   # as `eval` writes it
    assert (tmp_path / "after.json").stat().st_size > MAX_JSON_FILE_BYTES
    assert main(["eval", "--compare", str(tmp_path / "before.json"), str(tmp_path / "after.json")]) == 0
    assert "over 100 scenes, 10000 pairs" in capsys.readouterr().out
    monkeypatch.setattr(report_module, "MAX_REPORT_BYTES", 2**20)
    assert main(["eval", "--compare", str(tmp_path / "before.json"), str(tmp_path / "after.json")]) == 2
    assert re.search(r"before.json: \d+ bytes; a scene or report file may hold at most 1048576 "
                     "bytes$", one_error_line(capsys))
    monkeypatch.undo()
    record = dev_records()[0].to_json()
    scenes = tmp_path / "many.jsonl"
    with scenes.open("w") as f:
        for i in range(101):
            record["scene"]["scene_id"] = f"s{i}"
            f.write(json.dumps(record) + "\n")
    assert main(["eval", "--model", str(tmp_path / "no-model"), "--scenes", str(scenes),
                 "--samples", str(GROUP_MAX), "--out", str(tmp_path / "r.json"), *TINY]) == 2
    assert one_error_line(capsys).endswith(
        "many.jsonl: 101 scenes x 4096 samples = 413,696 episodes, more than one report holds "
        "(409,600, 400 MiB of JSON); evaluate fewer samples or split the scene set")


def test_a_generated_scene_name_that_is_another_scenes_id_is_refused(tmp_path, capsys, cfg):
    """A scene without scene_id is named `scene-<index>` in the report: one such name equal to
    another scene's id made two rows of one name (the comparison pairs by name)."""
    from jscenegen.eval.evaluate import report_scene_ids
    from jscenegen.scene.sceneset import record_from_json

    record = dev_records()[0].to_json()
    scenes = tmp_path / "clash.jsonl"
    lines = []
    for sid in ("kitchen", "scene-2", ""):     # the third, index 2, would be scene-2
        record["scene"]["scene_id"] = sid
        lines.append(json.dumps(record) + "\n")
    scenes.write_text("".join(lines))
    assert main(["eval", "--model", str(tmp_path / "no-model"), "--scenes", str(scenes),
                 "--out", str(tmp_path / "r.json"), *TINY]) == 2
    assert one_error_line(capsys).endswith(
        f"--scenes {scenes}: scene 2 (line 3) has no scene_id, and the name a report gives it, "
        "'scene-2', is the scene_id of scene 1 (line 2); give scene 2 a scene_id")
    with pytest.raises(ValueError, match=r"^the scene set: scene 2 \(line 0\) has no scene_id"):
        evaluate(None, [record_from_json(json.loads(r)) for r in lines],
                 judge=make_judge(cfg.judge, cfg.scene), scene_cfg=cfg.scene, judge_cfg=cfg.judge)
    records = dev_records()[:2]
    assert report_scene_ids(records) == [r.scene.scene_id for r in records]


def test_compare_of_reports_whose_every_pair_is_masked_is_one_error_line(tmp_path, capsys):
    """Every episode of one report masked (the judge failed): nothing pairs up, named on one
    line, the only error the table itself can meet once the reports were checked."""
    masked = _edited(lambda r: [ep.update(masked=True) for row in r["scenes"]
                                for ep in row["model"]["episodes"]])
    for summary in [row["model"] for row in masked["scenes"]] + [masked["overall"]["model"]]:
        summary.update(reward=None, failure_rate=None)
    rc, err = _compare(tmp_path, capsys, _synthetic_report(), masked)
    assert rc == 2 and len(err.splitlines()) == 1 and err.endswith(
        "after.json: cannot compare (the reports share no unmasked (scene_id, seed) episode)"), err


def test_compare_refuses_reports_played_under_other_scene_settings(tmp_path, capsys):
    """Reports of one model and the same episodes under another reward scale (a failure worth
    -0.5, not -1), budget or prompt templates compared with exit 0, the whole difference shown
    as the model's (helper-90): a report records its scene protocol part by part."""
    from jscenegen.scene.config import JudgeConfig, SceneRuntimeConfig
    from jscenegen.scene.protocol import protocol_digests

    def played(**scene) -> dict:
        digests = protocol_digests(SceneRuntimeConfig.model_validate(scene), JudgeConfig())
        return _edited(lambda r: r.update(protocol=digests))

    assert _compare(tmp_path, capsys, played(), played()) == (0, "")
    from jscenegen.eval.report import _PROTOCOL_PARTS  # every part has a name for the message

    assert set(_PROTOCOL_PARTS) == set(protocol_digests(SceneRuntimeConfig(), JudgeConfig()))
    for after, why in (
            (played(reward={"failure_reward": -0.5}), r"played under other scene settings "
             r"\(scene.reward differ\): their rewards do not compare$"),
            (played(budget_units=256, op_costs={"add_object": 4}),
             r"\(scene.budget_units, scene.op_costs differ\)"),
            (_edited(lambda r: r.pop("protocol")), r"no `protocol` \(the scene protocol\) in "
             r"\S*after.json \(written by .*re-run `jscenegen eval` for that report$"),
            (_edited(lambda r: r.update(protocol=[1])), r"after.json \(an evaluation report .*\): protocol must map the scene "
             r"protocol's parts to digests \(strings\), got \[1\]$")):
        rc, err = _compare(tmp_path, capsys, played(), after)
        assert rc == 2 and len(err.splitlines()) == 1 and re.search(why, err), err


def test_outputs_are_checked_before_any_work(tmp_path, capsys):
    """design -o over its --room, and eval --out naming a directory, are refused before the
    model (garbage here) is read."""
    room = tmp_path / "room.json"
    room.write_text(json.dumps(dev_records()[0].scene.room.model_dump(mode="json")))
    before = room.read_text()
    assert main(["design", "--model", str(tmp_path / "nowhere"), "--prompt", "A bedroom.", "--room",
                 str(room), "-o", str(room), *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"-o {room} is the same file as --room {room}" in err and err.count("\n") == 0
    assert room.read_text() == before
    (tmp_path / "outdir").mkdir()
    assert main(["eval", "--model", str(tmp_path / "nowhere"), "--out", str(tmp_path / "outdir"), *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"--out {tmp_path / 'outdir'}: is a directory" in err and err.count("\n") == 0
    assert main(["eval", "--model", str(tmp_path / "nowhere"), "--out", str(room / "r.json"), *TINY]) == 2
    assert f"--out {room / 'r.json'}: {room} is not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("model_dir,prompt,nfc", [
    (chat_model_dir, "<|im_end|>" * 3000, "<|im_end|>" * 3000),
    (nfc_chat_model_dir, "cafe\u0301 " * 1500, "caf\u00e9 " * 1500)], ids=["special-text", "nfc"])
def test_a_prompt_too_long_counts_its_tokens_as_the_episode_encodes_them(tmp_path, capsys,
                                                                         model_dir, prompt, nfc):
    """Special-token text in a prompt is plain text in the episode (`encode_plain`): the count
    said 3,000 tokens (one per `<|im_end|>`) while the episode held 8 times as many. A prompt
    outside the tokenizer's normal form (NFC, as Qwen's) is counted normalised, as the episode
    encodes it (unnormalised it did not round-trip and the count failed)."""
    argv = ["design", "--model", str(model_dir()), "--prompt", prompt,
            "-o", str(tmp_path / "s.json"), "sampling.max_episode_tokens=4096"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    m = re.search(r"the prompt \((\d+) tokens\) makes the episode start at (\d+) tokens.*"
                  r"shorten the prompt by at least (\d+) tokens", err)
    assert m, err
    counted, start, cut = map(int, m.groups())
    assert counted == len(ChatTokenizer.from_dir(model_dir()).encode_plain(nfc))
    assert counted > 3000 and cut == start - 4096 + 1 and cut < counted < start
    assert not (tmp_path / "s.json").exists()


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path, capsys):
    """Ids past the embedding rows: eval ran with exit 0 on them, sft trained on a NaN loss."""
    import shutil

    model = tmp_path / "m"
    shutil.copytree(chat_model_dir(), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 600}))
    argv = ["design", "--model", str(model), "--prompt", "x", "-o", str(tmp_path / "s.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    tokens = ChatTokenizer.from_dir(model).vocab_size
    assert tokens > 600 and err == (
        f"error: {model}: the tokenizer has {tokens} tokens, more than the model's vocab_size 600; "
        "tokenizer and weights must come from the same model"), err


@pytest.mark.parametrize("given", ["run", "run/checkpoints"])
def test_a_run_or_its_checkpoints_directory_as_model_points_at_the_newest_step(tmp_path, capsys,
                                                                             given):
    for step in ("3", "12", "7.corrupt-20261203T000000Z"):
        (tmp_path / "run/checkpoints" / step / "params").mkdir(parents=True)
        (tmp_path / "run/checkpoints" / step / "hf").mkdir()
        (tmp_path / "run/checkpoints" / step / "hf/config.json").write_text("{}")
    for command in (["eval", "--model", str(tmp_path / given)],
                    ["design", "--model", str(tmp_path / given), "--prompt", "A bedroom.", "-o",
                     str(tmp_path / "s.json")]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.strip().endswith("nor a checkpoint step directory (params/ and hf/); its newest "
                                    f"checkpoint step is {tmp_path / 'run/checkpoints/12'}"), err


def test_the_report_bound_stands_for_group_max_on_each_shipped_train_scene():
    from jscenegen.eval.report import MAX_REPORT_EPISODES, SHIPPED_TRAIN_SCENES
    from jscenegen.grpo.rollout.config import GROUP_MAX
    from jscenegen.paths import resolve_data_path
    from jscenegen.scene.sceneset import read_scene_set

    assert len(read_scene_set(resolve_data_path("data/scenes/train.jsonl"))) == SHIPPED_TRAIN_SCENES
    assert MAX_REPORT_EPISODES == GROUP_MAX * SHIPPED_TRAIN_SCENES
