"""What a parity run can see (`jscenegen.parity.coverage`): tensors that hold one value and an
AdamW decay too small to change an fp32 weight are named, and `init-model
--randomise-constant` makes a model whose every tensor varies."""
import json

import numpy as np
import pytest

from jscenegen.model.weights import constant_tensors, named_weights, redraw_constant_tensors
from jscenegen.parity.coverage import coverage_warnings, weight_decay_visible


def test_constant_tensors_are_found_in_arrays_and_torch_tensors():
    import torch

    pairs = [("norm", np.ones(4)), ("bias", torch.zeros(3)), ("w", np.arange(4.0)),
             ("scalar", np.ones(1)), ("nan", np.full(3, np.nan))]
    assert constant_tensors(pairs) == ["norm", "bias"]


def test_the_verl_default_decay_rounds_away_in_fp32_and_a_larger_one_does_not():
    """lr 1e-6 x weight_decay 0.01 moves no fp32 weight (a run without the decay gave the same
    parameters); the README's lr 1e-4 x 0.1 does."""
    import torch

    assert not weight_decay_visible(1e-6, 0.01)
    assert weight_decay_visible(1e-4, 0.1)
    # between 2^-25 and 2^-24 torch's fp32 factor is 1 - 2^-24: some weights move (1.5 does)
    for x in (2.0**-25, 1.5 * 2.0**-25, 2.0**-24):
        moved = not torch.equal(torch.tensor([1.5]).mul_(1 - x), torch.tensor([1.5]))
        assert weight_decay_visible(x, 1.0) == moved == (x > 2.0**-25), x
    p = np.float32([0.02, 1.0, 3.0])
    assert np.array_equal(p - np.float32(1e-6 * 0.01) * p, p)
    assert not np.array_equal(p - np.float32(1e-4 * 0.1) * p, p)
    warnings = coverage_warnings({"constant_tensors": ["a.norm", "b", "c", "d"],
                                  "weight_decay_visible": False})
    assert warnings[0].startswith("4 tensor(s) hold one value each (a.norm, b, c, ...)")
    assert "--randomise-constant" in warnings[0] and "2^-25" in warnings[1]
    assert coverage_warnings({"constant_tensors": [], "weight_decay_visible": True}) == []


def test_redrawing_leaves_no_constant_tensor_and_the_rest_unchanged():
    from flax import nnx

    from jscenegen.model.config import preset_config
    from jscenegen.model.qwen import QwenForCausalLM

    model = QwenForCausalLM(preset_config("qwen2", "micro", vocab_size=300), rngs=nnx.Rngs(0))
    before = {n: np.asarray(v.get_value()).copy() for n, v in named_weights(model).items()}
    constant = constant_tensors(before.items())
    assert "model.norm.weight" in constant and "model.layers.0.self_attn.q_proj.bias" in constant
    assert redraw_constant_tensors(model, seed=1) == constant
    after = {n: np.asarray(v.get_value()) for n, v in named_weights(model).items()}
    assert constant_tensors(after.items()) == []
    for n in before:
        if n in constant:
            assert 0 < np.abs(after[n] - before[n]).max() < 0.5
        else:
            np.testing.assert_array_equal(after[n], before[n])


def test_parity_logits_names_the_constant_tensors_and_warns(tmp_path, capsys):
    """The README's workflow compared a fresh init-model (norms of ones, zero biases): a bias
    or norm weight the formula left out would have passed."""
    from flax import nnx

    from jscenegen.cli import main
    from jscenegen.model.config import preset_config
    from jscenegen.model.hf_io import save_hf
    from jscenegen.model.qwen import QwenForCausalLM

    model = QwenForCausalLM(preset_config("qwen2", "micro", vocab_size=300), rngs=nnx.Rngs(0))
    save_hf(model, tmp_path / "plain")
    redraw_constant_tensors(model, seed=0)
    save_hf(model, tmp_path / "varied")
    for name, constant in (("plain", True), ("varied", False)):
        assert main(["parity", "logits", "--model", str(tmp_path / name), "--batch", "1",
                     "--seq", "16"]) == 0
        captured = capsys.readouterr()
        result = json.loads(captured.out.strip().splitlines()[-1])
        assert bool(result["constant_tensors"]) == constant, result["constant_tensors"]
        assert ("hold one value each" in captured.err) == constant
        if constant:
            assert {"model.norm.weight", "model.layers.0.self_attn.q_proj.bias"} <= set(
                result["constant_tensors"])


@pytest.mark.parametrize("optim, visible", [([], False), (["lr=1e-4", "weight_decay=0.1", "eps=1e-3"], True)])
def test_parity_grpo_step_says_whether_the_decay_is_visible(tiny_hf, capsys, optim, visible):
    from jscenegen.cli import main

    args = ["parity", "grpo-step", "--model", str(tiny_hf["qwen3"])]
    assert main(args + (["--optim", *optim] if optim else [])) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert result["weight_decay_visible"] is visible and result["constant_tensors"] == []
    assert ("2^-25" in captured.err) == (not visible)
