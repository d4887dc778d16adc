"""Chunked token_logprobs against torch log_softmax / entropy on full logits."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jscenegen.parity import torch_reference as ref
from jscenegen.grpo.algo.logprobs import shifted_token_logprobs, token_logprobs

B, T, H, V = 3, 11, 8, 37


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(B, T, H)).astype(np.float32)
    emb = rng.normal(size=(V, H)).astype(np.float32)
    tokens = rng.integers(0, V, size=(B, T)).astype(np.int32)
    return hidden, emb, tokens


@pytest.mark.parametrize("chunk,temperature", [(4, 0.7), (T, 1.0), (64, 1.3)])
def test_matches_torch_full_logits(chunk, temperature):
    hidden, emb, tokens = _inputs()

    def f(h, w):
        lp, ent = token_logprobs(h, w, tokens, temperature, chunk)
        return jnp.sum(lp * 0.3) + jnp.sum(ent * 0.1), (lp, ent)

    (_, (lp, ent)), (gh, gw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(hidden, emb)
    th = torch.tensor(hidden, requires_grad=True)
    tw = torch.tensor(emb, requires_grad=True)
    want_lp, want_ent = ref.logprobs_from_logits(th @ tw.T, torch.tensor(tokens), temperature)
    (want_lp.sum() * 0.3 + want_ent.sum() * 0.1).backward()
    assert lp.dtype == jnp.float32 and lp.shape == (B, T)
    np.testing.assert_allclose(np.asarray(lp), want_lp.detach().numpy(), rtol=1e-5, atol=1e-5)
    # torch's lse - sum(p z) cancels two terms of size |z|: 2e-6 * max|z| absolute error
    np.testing.assert_allclose(np.asarray(ent), want_ent.detach().numpy(), rtol=1e-5, atol=3e-5)
    np.testing.assert_allclose(np.asarray(gh), th.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gw), tw.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_no_full_logits_in_the_program():
    """With chunk c the largest fp32 logits buffer is [B, c, V], never [B, T, V]."""
    hidden, emb, tokens = _inputs()
    big = 1024
    jhid = jnp.zeros((1, big, H))
    jtok = jnp.zeros((1, big), jnp.int32)
    f = jax.jit(jax.grad(lambda h: token_logprobs(h, jnp.asarray(emb), jtok, 1.0, 64)[0].sum()))
    text = f.lower(jhid).compile().as_text()
    assert f"f32[1,{big},{V}]" not in text and f"f32[1,64,{V}]" in text


def test_shifted_alignment():
    hidden, emb, tokens = _inputs(1)
    lp, ent = shifted_token_logprobs(hidden, emb, tokens, 1.0, 4)
    direct, _ = token_logprobs(hidden[:, :-1], emb, tokens[:, 1:], 1.0, 4)
    assert np.all(np.asarray(lp[:, 0]) == 0) and np.all(np.asarray(ent[:, 0]) == 0)
    np.testing.assert_array_equal(np.asarray(lp[:, 1:]), np.asarray(direct))
    logits = hidden[0, 2] @ emb.T
    want = logits[tokens[0, 3]] - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    assert float(lp[0, 3]) == pytest.approx(float(want), rel=1e-5)


def test_bad_shapes():
    hidden, emb, tokens = _inputs()
    with pytest.raises(ValueError, match="output_embedding"):
        token_logprobs(hidden, emb[:, :4], tokens)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(hidden, emb, tokens, 0.0)
