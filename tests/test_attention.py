"""model.attention's XLA kernel: forward and the gradients of q, k and v against torch
autodiff of transformers' eager attention formula, grouped-query, with padded rows (queries
with no allowed key) and a causal mask; the cache layout gives the same values; bf16 inputs
give bf16 gradients near the fp32 ones."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jscenegen.model.attention import xla_attention
from jscenegen.model.qwen import full_sequence_inputs

B, S, NQ, NKV, D = 3, 12, 4, 2, 8


def _inputs(seed):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, S, NQ, D)).astype(np.float32)
    k = rng.normal(size=(B, S, NKV, D)).astype(np.float32)
    v = rng.normal(size=(B, S, NKV, D)).astype(np.float32)
    cot = rng.normal(size=(B, S, NQ, D)).astype(np.float32)
    valid = np.ones((B, S), bool)
    valid[1, :5] = False        # left padding: queries 0-4 of row 1 see no real key
    valid[2, 9:] = False        # right padding
    _, mask = full_sequence_inputs(jnp.asarray(valid))
    return q, k, v, cot, np.asarray(mask)


def _torch_eager(q, k, v, mask):
    """transformers' eager_attention_forward (repeat_kv, scaled scores, additive float32-min
    mask, fp32 softmax), [B, S, N, D] in and out."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kt = kt.repeat_interleave(NQ // NKV, dim=1)
    vt = vt.repeat_interleave(NQ // NKV, dim=1)
    scores = qt @ kt.transpose(2, 3) * D ** -0.5
    scores = scores.masked_fill(~mask[:, None], torch.finfo(torch.float32).min)
    return (torch.softmax(scores, dim=-1) @ vt).transpose(1, 2)


@pytest.mark.parametrize("seed", [0, 1])
def test_xla_attention_and_its_gradients_match_torch_eager(seed):
    q, k, v, cot, mask = _inputs(seed)

    def f(q, k, v):
        return jnp.sum(xla_attention(q, k, v, jnp.asarray(mask)) * cot)

    out = jax.jit(xla_attention)(q, k, v, jnp.asarray(mask))
    grads = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    tout = _torch_eager(tq, tk, tv, torch.tensor(mask))
    (tout * torch.tensor(cot)).sum().backward()
    np.testing.assert_allclose(np.asarray(out), tout.detach().numpy(), rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, (tq.grad, tk.grad, tv.grad)):
        np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-5, atol=1e-5)
    # the padded queries of row 1 average v uniformly: their q gradient is exactly zero
    assert np.all(np.asarray(grads[0])[1, :5] == 0)


def test_cache_layout_gives_the_same_values():
    q, k, v, _, mask = _inputs(2)
    plain = xla_attention(q, k, v, jnp.asarray(mask))
    cached = xla_attention(q, jnp.asarray(k).transpose(0, 2, 3, 1), jnp.asarray(v).swapaxes(1, 2),
                           jnp.asarray(mask), cached=True)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(cached))


def test_bf16_inputs_give_bf16_gradients_near_fp32():
    q, k, v, cot, mask = _inputs(3)

    def grads(dtype):
        def f(q, k, v):
            out = xla_attention(q, k, v, jnp.asarray(mask))
            return jnp.sum(out.astype(jnp.float32) * cot)
        return jax.grad(f, argnums=(0, 1, 2))(*(jnp.asarray(x, dtype) for x in (q, k, v)))

    for low, full in zip(grads(jnp.bfloat16), grads(jnp.float32)):
        assert low.dtype == jnp.bfloat16
        scale = float(jnp.max(jnp.abs(full)))
        assert float(jnp.max(jnp.abs(low.astype(jnp.float32) - full))) < 0.05 * scale
