"""`parity grpo-step` on tiny transformers Qwen2/Qwen3 directories: loss and parameters vs torch."""
import json

import pytest

from hf_fixtures import make_hf_dir
from jscenegen.grpo.config import LossConfig
from jscenegen.grpo.parity_step import PARAM_TOL, grpo_step_parity, synthetic_batch
from jscenegen.grpo.roles import DESIGNER, PLANNER


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_parity")
    return {arch: make_hf_dir(root / arch, arch, seed=3) for arch in ("qwen2", "qwen3")}


def test_grpo_step_matches_torch_legacy_micro_batched_kl_entropy(tiny_dirs):
    """Qwen2 (q/k/v biases, untied head), VERL legacy normalisation over 4 micro-batches."""
    cfg = LossConfig(ppo_micro_batch_size=2, loss_scale="legacy", loss_agg_mode="seq-mean-token-mean",
                     use_kl_loss=True, kl_coef=0.1, entropy_coeff=0.01)
    r = grpo_step_parity(str(tiny_dirs["qwen2"]), loss_cfg=cfg, temperature=0.7)
    assert r["ok"] and r["micro_batches"] == 4, r
    assert r["loss_diff"] <= 1e-5 and r["max_param_diff"] <= PARAM_TOL
    assert abs(r["grad_norm_ratio"] - 1) <= 1e-5
    assert r["update_max"] > 9e-7  # the step moved the weights by ~lr
    assert 0 < r["clipfrac"] < 1  # the clip bounds were reached on some tokens


def test_synthetic_batch_layout():
    d = synthetic_batch(100, seed=1, pad_rows=1)
    assert d["input_ids"].shape == (9, 32) and d["attention_mask"][:8, -1].all()
    assert not d["attention_mask"][8].any() and not d["loss_mask"][8].any()
    assert (d["attention_mask"][:, 0] == 0).any()  # some rows are left-padded
    assert set(d["roles"][d["policy_mask"]].tolist()) == {PLANNER, DESIGNER}
    assert (d["loss_mask"] == ((d["roles"] == DESIGNER) & d["policy_mask"])).all()
    adv = d["advantages"][d["loss_mask"] > 0]
    assert (adv > 0).any() and (adv < 0).any()


def test_cli_qwen3_recipe_with_accumulation(tiny_dirs, capsys):
    """Qwen3 (q/k norms, tied embedding): the GRPO100 loss and optimizer, 8 episodes + 1
    all-padding row (as on fsdp=3) in 3 micro-batches."""
    from jscenegen.cli import main

    rc = main(["parity", "grpo-step", "--model", str(tiny_dirs["qwen3"]), "--pad-rows", "1",
               "--loss", "ppo_micro_batch_size=3"])
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and r["ok"] and r["loss_scale"] == "global" and r["micro_batches"] == 3, r
    assert r["loss_diff"] <= 1e-5 and r["max_param_diff"] <= PARAM_TOL
    assert abs(r["grad_norm_ratio"] - 1) <= 1e-5 and r["update_max"] > 9e-7


def test_cli_exits_1_beyond_tolerance(tiny_dirs, capsys, monkeypatch):
    from jscenegen.cli import main
    from jscenegen.grpo import parity_step

    monkeypatch.setattr(parity_step, "LOSS_TOL", -1.0)
    rc = main(["parity", "grpo-step", "--model", str(tiny_dirs["qwen3"]), "--pad-rows", "1",
               "--loss", "ppo_micro_batch_size=3"])
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 1 and not r["ok"]
