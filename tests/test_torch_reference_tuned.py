"""torch_reference's speed options (`TUNED_STEP`, bench/train_step.py's tuned torch line) do the
same update as its VERL defaults: loss, grad norm, gradients and new parameters."""
import numpy as np
import pytest

from jscenegen.grpo.algo.config import LossConfig, OptimConfig
from jscenegen.parity import torch_reference as ref

from hf_fixtures import make_hf_dir

torch = pytest.importorskip("torch")


def _batch(vocab, rows, seq, suffix: bool, seed=0):
    rng = np.random.default_rng(seed)
    mask = np.zeros((rows, seq), np.float32)
    for r in range(rows):   # a suffix from one column, or a span per row (role turns)
        lo = seq // 2 if suffix else int(rng.integers(3, seq // 2))
        hi = seq if suffix else int(rng.integers(lo + 1, seq))
        mask[r, lo:hi] = 1.0
    adv = np.where(np.arange(rows) % 2 == 0, 1.0, -1.0)[:, None] * mask
    old = mask * (-np.log(vocab) + rng.normal(0, 0.3, (rows, seq)))
    return {"input_ids": torch.from_numpy(rng.integers(0, vocab, (rows, seq))),
            "attention_mask": torch.ones(rows, seq, dtype=torch.long),
            "loss_mask": torch.from_numpy(mask), "advantages": torch.from_numpy(adv).float(),
            "old_logp": torch.from_numpy(old).float()}


@pytest.mark.parametrize("suffix,temperature,entropy_coeff,micro",
                         [(True, 1.0, 0.0, 1), (False, 0.7, 0.01, 2)])
def test_tuned_step_equals_the_verl_default(tmp_path, monkeypatch, suffix, temperature,
                                           entropy_coeff, micro):
    """The same update, and the tuned step does less work: its output head runs at the
    trained positions only (the rows each micro-batch makes logits for, recorded by a hook on
    lm_head), and its options reach torch (fused AdamW, foreach clip)."""
    from transformers import AutoModelForCausalLM

    path = make_hf_dir(tmp_path / "m", "qwen3", seed=5)
    rows, seq = 4, 24
    batch = _batch(1003, rows, seq, suffix)
    loss_cfg, optim = LossConfig(entropy_coeff=entropy_coeff), OptimConfig(lr=1e-3)
    clip = torch.nn.utils.clip_grad_norm_
    foreach = []
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_",
                        lambda *a, **kw: foreach.append(kw.get("foreach")) or clip(*a, **kw))
    out, head_lengths = {}, {}
    for name, kw in (("default", {}), ("tuned", ref.TUNED_STEP)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        lengths = head_lengths[name] = []
        model.get_output_embeddings().register_forward_hook(
            lambda mod, args, result, lengths=lengths: lengths.append(result.shape[1]))
        metrics, grads, opt, _ = ref.grpo_step(model, batch, loss_cfg, optim, temperature=temperature,
                                              num_micro_batches=micro, return_grads=True, **kw)
        out[name] = (metrics, grads, {n: p.detach().numpy().copy()
                                      for n, p in model.named_parameters()}, opt)
    (m0, g0, p0, opt0), (m1, g1, p1, opt1) = out["default"], out["tuned"]
    assert opt1.defaults["fused"] and not opt0.defaults["fused"]
    assert foreach == [None, True]   # torch's default, then TUNED_STEP's clip_foreach
    per = rows // micro
    kept = [len(ref.trained_positions(batch["loss_mask"][i * per:(i + 1) * per]))
            for i in range(micro)]
    assert head_lengths == {"default": [seq] * micro, "tuned": kept}
    assert all(k < seq - 1 for k in kept)
    if suffix:   # trained from seq // 2 on: the positions before each trained token
        assert kept == [seq - seq // 2] * micro
    assert abs(m0["loss"] - m1["loss"]) < 1e-6 and abs(m0["grad_norm"] - m1["grad_norm"]) < 1e-5
    for n in g0:
        np.testing.assert_allclose(g1[n], g0[n], rtol=1e-4, atol=1e-7, err_msg=n)
        np.testing.assert_allclose(p1[n], p0[n], rtol=1e-5, atol=1e-7, err_msg=n)


def test_trained_positions_are_those_whose_next_token_is_trained():
    mask = torch.zeros(2, 8)
    mask[0, 5:] = 1
    mask[1, 3:5] = 1
    assert ref.trained_positions(mask).tolist() == [2, 3, 4, 5, 6]
    assert ref.trained_positions(torch.zeros(2, 8)) is None
