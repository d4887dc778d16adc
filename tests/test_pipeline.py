"""The CPU default pipeline at small sizes: init model -> SFT warm start -> eval -> GRPO -> eval."""
import json

import pytest

from jscenegen.config import load_config
from jscenegen.paths import resolve_data_path
from jscenegen.pipeline import train_command
from jscenegen.run_config import RunConfig
from jscenegen.scene.sceneset import read_scene_set, write_scene_set


def test_cpu_pipeline_runs_sft_grpo_and_dev_eval(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JSCENEGEN_CACHE", str(tmp_path / "cache"))
    dev = tmp_path / "dev.jsonl"
    write_scene_set(dev, read_scene_set(resolve_data_path("data/scenes/dev.jsonl"))[:2])
    cfg = load_config(resolve_data_path("configs/cpu-default.yaml"), [
        'warm_start.sft_overrides=["sft.num_demos=3","sft.steps=2","optim.total_steps=2",'
        '"optim.warmup_steps=0"]',
        f"schedule.dev_set={dev}", "schedule.num_scenes=1", "schedule.group_size=2",
        "schedule.total_updates=1", "schedule.zero_spread=skip",
        "sampling.max_new_tokens=8", "trainer.eval_samples=1", "trainer.progress=false",
        "logging.swanlab_mode=disabled",
    ], RunConfig)
    run_dir = tmp_path / "run"
    assert train_command(cfg, run_dir, resume=False, max_updates=1, config_source="test") == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["attempts"] == 1
    assert {"init_model_s", "sft_s", "eval_before_s", "grpo_s", "eval_after_s"} <= set(out["phases"])
    sft_dirs = list((tmp_path / "cache" / "models").glob("micro-qwen3-sft-*"))
    assert len(sft_dirs) == 1 and (sft_dirs[0] / "model.safetensors").is_file()
    summary = json.loads((sft_dirs[0] / "sft_summary.json").read_text())
    assert len(summary["history"]) >= 2 and summary["final_loss"] > 0
    before = json.loads((run_dir / "eval_before.json").read_text())
    after = json.loads((run_dir / "eval_after.json").read_text())
    assert [s["scene_id"] for s in before["scenes"]] == ["dev-0", "dev-1"]
    assert before["overall"]["model"]["episodes"] == after["overall"]["model"]["episodes"] == 2
    assert out["dev_before"]["reward"] == before["overall"]["model"]["reward"]
    change = json.loads((run_dir / "eval_change.json").read_text())
    assert change["pairs"] == 2 and out["dev_change"]["diff"] == change["diff"]
    assert change["reward_after"] - change["reward_before"] == pytest.approx(change["diff"])
    assert (run_dir / "eval_after.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((run_dir / "run.json").read_text())["model_dir"] == str(sft_dirs[0].resolve())
    assert (run_dir / "checkpoints" / "1" / "checksums.json").is_file()


def test_a_train_with_a_bad_model_dir_leaves_no_run_directory(tmp_path, capsys):
    from jscenegen.cli import main

    run_dir = tmp_path / "run"
    assert main(["train", "--run-dir", str(run_dir), f"model.path={tmp_path / 'no-model'}",
                 "logging.swanlab_mode=disabled"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no-model" in err and err.count("\n") == 1
    assert not run_dir.exists()  # no empty checkpoints/, no lock file left behind
