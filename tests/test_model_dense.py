"""model.dense: forward and both gradients against torch.nn.functional.linear, for layers wider
and narrower than their input (the backward pass picks its formulation by width), fp32 and
bf16 inputs with fp32 output; a bf16 train step on CPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jscenegen.model.dense import dense


@pytest.mark.parametrize("d_in,d_out", [(6, 10), (10, 6), (8, 8)])
def test_dense_matches_torch_linear_and_its_gradients(d_in, d_out):
    rng = np.random.default_rng(d_in * 100 + d_out)
    x = rng.normal(size=(2, 5, d_in)).astype(np.float32)
    w = rng.normal(size=(d_out, d_in)).astype(np.float32)
    cot = rng.normal(size=(2, 5, d_out)).astype(np.float32)

    def f(x, w):
        return jnp.sum(dense(x, w) * cot)

    y = jax.jit(dense)(x, w)
    gx, gw = jax.jit(jax.grad(f, argnums=(0, 1)))(x, w)
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    ty = torch.nn.functional.linear(tx, tw)
    (ty * torch.tensor(cot)).sum().backward()
    np.testing.assert_allclose(np.asarray(y), ty.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gx), tx.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gw), tw.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_dense_bf16_inputs_give_fp32_logits_and_bf16_gradients():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(3, 4)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(7, 4)), jnp.bfloat16)
    y = dense(x, w, jnp.float32)
    assert y.dtype == jnp.float32
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32).T
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-6, atol=1e-6)
    gx, gw = jax.grad(lambda x, w: jnp.sum(dense(x, w, jnp.float32) ** 2), argnums=(0, 1))(x, w)
    assert gx.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(gw, np.float32), 2 * want.T @ np.asarray(x, np.float32),
                               rtol=2e-2, atol=2e-2)


def test_a_bf16_train_step_runs_on_cpu_and_follows_the_fp32_one():
    """compute_dtype bfloat16 on XLA:CPU: the whole GRPO step (forward, every projection's
    backward, AdamW) runs (the narrower-operand form of dW once made XLA:CPU emit a bf16 x bf16
    -> f32 dot its fallback kernel refuses) and its loss and gradient norm follow the fp32
    step's to bf16 precision."""
    from flax import nnx

    from jscenegen.grpo.algo.config import LossConfig, OptimConfig
    from jscenegen.grpo.algo.optimizer import init_train_state
    from jscenegen.grpo.train.step import GRPOStep
    from jscenegen.model.config import preset_config
    from jscenegen.model.functional import hidden_fn
    from jscenegen.model.qwen import QwenForCausalLM

    cfg = preset_config("qwen3", "micro", vocab_size=512)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 512, (2, 32)).astype(np.int32)
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids),
             "loss_mask": np.r_[np.zeros(16), np.ones(16)][None].repeat(2, 0).astype(np.float32),
             "advantages": np.asarray([[1.0], [-1.0]], np.float32).repeat(32, 1),
             "old_logprobs": np.full((2, 32), -6.2, np.float32),
             "episode_mask": np.ones(2, np.float32)}
    out = {}
    for dtype in ("float32", "bfloat16"):
        model = QwenForCausalLM(cfg, rngs=nnx.Rngs(0), param_dtype="float32", compute_dtype=dtype)
        graphdef, params, *rest = nnx.split(model, nnx.Param, ...)
        step = GRPOStep(hidden_fn(graphdef, *rest), LossConfig(), OptimConfig(), donate=False)
        _, metrics = step.step(init_train_state(params, OptimConfig()), batch)
        out[dtype] = {k: float(metrics[k]) for k in ("loss", "grad_norm")}
    assert np.isfinite(list(out["bfloat16"].values())).all()
    for k in ("loss", "grad_norm"):
        np.testing.assert_allclose(out["bfloat16"][k], out["float32"][k], rtol=0.05)
