"""Role codes -> loss mask, and the LossConfig/OptimConfig sections."""
import numpy as np
import pytest

from jscenegen.config import ConfigError, validate_config
from jscenegen.grpo.algo.config import LossConfig, OptimConfig
from jscenegen.grpo.algo.roles import CRITIC, DESIGNER, ENVIRONMENT, PLANNER, role_from_letter, role_loss_mask


def test_role_loss_mask_selects_policy_tokens_of_the_role():
    roles = np.array([[ENVIRONMENT, PLANNER, PLANNER, ENVIRONMENT, DESIGNER, DESIGNER, CRITIC],
                      [DESIGNER, DESIGNER, ENVIRONMENT, DESIGNER, DESIGNER, CRITIC, CRITIC]])
    policy = np.array([[0, 1, 1, 0, 1, 0, 1],
                       [1, 1, 0, 1, 1, 1, 1]])
    got = np.asarray(role_loss_mask(roles, policy, DESIGNER))
    np.testing.assert_array_equal(got, [[0, 0, 0, 0, 1, 0, 0], [0, 1, 0, 1, 1, 0, 0]])
    assert got.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(role_loss_mask(roles, policy, PLANNER))[0], [0, 1, 1, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="not a policy role"):
        role_loss_mask(roles, policy, ENVIRONMENT)
    with pytest.raises(ValueError, match="same"):
        role_loss_mask(roles, policy[:, :3], PLANNER)
    assert [role_from_letter(c) for c in "DDDPC"] == [DESIGNER] * 3 + [PLANNER, CRITIC]
    with pytest.raises(ValueError, match="role letter"):
        role_from_letter("E")


def test_grpo100_config_holds_the_seed_recipe():
    """configs/grpo100.yaml, as loaded, is the recipe of specs/seed.md: PPO clip 0.2/0.2, dual
    clip 3, token-mean over the whole batch, no KL or entropy term; AdamW lr 1e-6, betas
    (0.9, 0.999), eps 1e-8, weight decay 0.01, clip 1.0, constant LR; G = 8, D-D-D-P-C,
    100 effective updates; rollouts at temperature 1.0, top-p 1.0."""
    from jscenegen.paths import resolve_data_path
    from jscenegen.run_config import load_run_config

    cfg = load_run_config(resolve_data_path("configs/grpo100.yaml"))
    loss, optim, sched = cfg.loss, cfg.optim, cfg.schedule
    assert (loss.clip_low, loss.clip_high, loss.clip_ratio_c) == (0.2, 0.2, 3.0)
    assert loss.loss_agg_mode == "token-mean" and loss.loss_scale == "global"
    assert not loss.use_kl_loss and loss.entropy_coeff == 0.0
    assert (optim.lr, optim.betas, optim.eps, optim.weight_decay, optim.grad_clip) == (
        1e-6, (0.9, 0.999), 1e-8, 0.01, 1.0)
    assert optim.lr_schedule == "constant" and optim.warmup_steps == 0
    assert (sched.group_size, sched.roles, sched.total_updates) == (8, "DDDPC", 100)
    assert (cfg.sampling.temperature, cfg.sampling.top_p) == (1.0, 1.0)


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="clip_ratio_c"):
        validate_config({"clip_ratio_c": 0.5}, "x.yaml", LossConfig)
    with pytest.raises(ConfigError, match="unknown key 'clip'"):
        validate_config({"clip": 0.5}, "x.yaml", LossConfig)
    with pytest.raises(ConfigError, match="token-sum"):
        validate_config({"loss_agg_mode": "token-sum", "loss_scale": "legacy"}, "x.yaml", LossConfig)
    # the model-level checks name their key too (they said "lr_schedule cosine needs total_steps")
    with pytest.raises(ConfigError, match=r"total_steps: needed by lr_schedule cosine"):
        validate_config({"lr_schedule": "cosine"}, "x.yaml", OptimConfig)
    with pytest.raises(ConfigError, match=r"betas: each must lie in \[0, 1\), got \[1\.0, 0\.9\]"):
        validate_config({"betas": [1.0, 0.9]}, "x.yaml", OptimConfig)
