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


def test_selection_capacity_is_the_smallest_power_of_two_multiple_that_fits():
    from jscenegen.grpo.algo.logprobs import selection_capacity

    sel = np.zeros((2, 3, 40), np.int32)      # [micro-batches, B, T]
    for most, multiple, want in ((0, 4, 4), (1, 4, 4), (4, 4, 4), (5, 4, 8), (8, 4, 8), (9, 4, 16),
                                 (17, 4, 32), (33, 4, 40), (3, 64, 40), (13, 3, 24)):
        sel[:] = 0
        sel[1, 2, 1:most + 1] = 1             # the fullest row, in the last micro-batch
        sel[0, 0, 1:3] = 1
        got = selection_capacity(sel, multiple=multiple)
        assert got == want, (most, multiple, got)
        assert got >= max(most, 2)


def _fake_hidden_fn(params, input_ids, attention_mask, rows=None):
    """A stand-in model: position t's hidden state is tanh(table[id_t] + pos[t]) (each
    position from its own token, so the selected positions' states equal the full ones)."""
    del attention_mask
    h = jnp.tanh(params["table"][input_ids] + params["pos"][None, : input_ids.shape[1]])
    if rows is not None:
        h = jnp.take_along_axis(h, rows[..., None], axis=1)
    return h, params["emb"]


def test_model_token_logprobs_with_a_capacity_equals_the_full_softmax_and_flags_an_overflow():
    """`select` + `capacity`: the selected entries equal the full log-softmax (NumPy float64)
    of the hidden state before them, the rest 0; one selected token more than the capacity in
    a single row makes every output NaN."""
    from jscenegen.grpo.algo.logprobs import model_token_logprobs

    rng = np.random.default_rng(5)
    params = {"table": rng.normal(size=(V, H)).astype(np.float32),
              "pos": rng.normal(size=(T, H)).astype(np.float32),
              "emb": rng.normal(size=(V, H)).astype(np.float32)}
    ids = rng.integers(0, V, size=(B, T)).astype(np.int32)
    att = np.ones((B, T), np.int32)
    sel = np.zeros((B, T), np.int32)
    sel[0, [2, 3, 7, 9]] = 1
    sel[1, [1, 10]] = 1
    sel[2, 5:10] = 1                               # the fullest row: 5 selected tokens
    f = jax.jit(model_token_logprobs, static_argnums=(0, 4), static_argnames=("capacity", "chunk"))
    lp, ent = f(_fake_hidden_fn, params, ids, att, 1.0, chunk=3, select=sel, capacity=5)
    h = np.tanh(params["table"][ids] + params["pos"][None]).astype(np.float64)
    z = h @ params["emb"].T.astype(np.float64)
    logz = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    on = sel != 0
    b_idx, t_idx = np.nonzero(on)
    want = z[b_idx, t_idx - 1, ids[b_idx, t_idx]] - logz[b_idx, t_idx - 1]
    p = np.exp(z - logz[..., None])
    want_ent = -(p * (z - logz[..., None])).sum(-1)[b_idx, t_idx - 1]
    np.testing.assert_allclose(np.asarray(lp)[on], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent)[on], want_ent, rtol=1e-5, atol=1e-5)
    assert not np.asarray(lp)[~on].any() and not np.asarray(ent)[~on].any()
    lp4, ent4 = f(_fake_hidden_fn, params, ids, att, 1.0, chunk=3, select=sel, capacity=4)
    assert np.all(np.isnan(np.asarray(lp4))) and np.all(np.isnan(np.asarray(ent4)))
