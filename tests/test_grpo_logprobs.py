"""Chunked token_logprobs against torch log_softmax / entropy on full logits."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jscenegen.grpo.algo.logprobs import shifted_token_logprobs, token_logprobs
from jscenegen.parity import torch_reference as ref

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
    """Entry t is log p(token t | hidden t-1) of the full softmax (NumPy, float64), column 0 is 0."""
    hidden, emb, tokens = _inputs(1)
    lp, ent = shifted_token_logprobs(hidden, emb, tokens, 1.0, 4)
    logits = hidden.astype(np.float64) @ emb.T.astype(np.float64)          # [B, T, V]
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    want = np.take_along_axis(logits[:, :-1], tokens[:, 1:, None], -1)[..., 0] - logz[:, :-1]
    p_all = np.exp(logits - logz[..., None])
    want_ent = -(p_all * (logits - logz[..., None])).sum(-1)[:, :-1]
    assert np.all(np.asarray(lp[:, 0]) == 0) and np.all(np.asarray(ent[:, 0]) == 0)
    np.testing.assert_allclose(np.asarray(lp[:, 1:]), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent[:, 1:]), want_ent, rtol=1e-5, atol=1e-5)


def test_bad_shapes():
    hidden, emb, tokens = _inputs()
    with pytest.raises(ValueError, match="output_embedding"):
        token_logprobs(hidden, emb[:, :4], tokens)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(hidden, emb, tokens, 0.0)
