"""jscenegen.model.gated_delta against itself (chunked == recurrent == decode steps) and against
transformers' torch kernels (`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`
in models/qwen3_5/modeling_qwen3_5.py): outputs, final states, gradients, padding, state map.

Relative error everywhere: rel(a, b) = max|a - b| / max|b| (b the reference). Tolerances: fp32
values 1e-5, gradients 1e-4. Inputs have the model's value ranges: q/k L2-normalised (transformers'
`l2norm`), beta = sigmoid(N(0, 1)), g = -exp(A_log) * softplus(a + dt_bias) with
A_log = log(U(0.01, 16)) per head, dt_bias = 1 + 0.1 N(0, 1), a ~ N(0, 1), so some heads decay
by up to e^-50 per token. Shapes are fixed and few (B 2, H 4 (not divisible by 3), Dk 16 != Dv 8,
T in {1, 63, 64, 130}) so that the jitted functions below compile once per shape.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

from jscenegen.model.gated_delta import (
    gated_delta_chunked,
    gated_delta_prefix,
    gated_delta_recurrent,
    gated_delta_segment,
    gated_delta_state_map,
    gated_delta_step,
    unit_lower_inverse,
)
from jscenegen.model.qwen35 import l2norm

torch = pytest.importorskip("torch")
qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

B, H, DK, DV = 2, 4, 16, 8
TOL, GRAD_TOL = 1e-5, 1e-4

chunked = jax.jit(gated_delta_chunked, static_argnames="chunk_size")
recurrent = jax.jit(gated_delta_recurrent)
step = jax.jit(gated_delta_step)
state_map = jax.jit(gated_delta_state_map, static_argnames="chunk_size")


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def make_inputs(seed: int, t: int, h: int = H, hk: int | None = None,
                a_high: float = 16.0) -> dict[str, np.ndarray]:
    """Realistic inputs; q/k have `hk` heads (default h), v/g/beta/state have `h` (value heads).
    exp(A_log) ~ U(0.01, a_high): 16 as Qwen3.5's initialisation; a small a_high gives the
    slowly decaying heads that carry a state across many chunks."""
    rng = np.random.default_rng(seed)
    hk = h if hk is None else hk

    def unit(shape):
        x = torch.from_numpy(rng.normal(size=shape).astype(np.float32))
        return qwen3_5.l2norm(x, dim=-1, eps=1e-6).numpy()

    a_log = np.log(rng.uniform(0.01, a_high, h))
    dt_bias = 1.0 + 0.1 * rng.normal(size=h)
    a = rng.normal(size=(B, t, h))
    g = -np.exp(a_log) * np.logaddexp(0.0, a + dt_bias)
    f32 = np.float32
    return {"q": unit((B, t, hk, DK)), "k": unit((B, t, hk, DK)),
            "v": rng.normal(size=(B, t, h, DV)).astype(f32), "g": g.astype(f32),
            "beta": (1.0 / (1.0 + np.exp(-rng.normal(size=(B, t, h))))).astype(f32),
            "state": rng.normal(size=(B, h, DK, DV)).astype(f32)}


def args(x: dict) -> tuple:
    return x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"]


def torch_run(fn, x: dict, grad: bool = False):
    tx = {n: torch.from_numpy(a.copy()).requires_grad_(grad) for n, a in x.items()}
    o, s = fn(tx["q"], tx["k"], tx["v"], tx["g"], tx["beta"], initial_state=tx["state"],
              output_final_state=True, use_qk_l2norm_in_kernel=False)
    return o, s, tx


def decode(x: dict) -> tuple[np.ndarray, np.ndarray]:
    """Token by token through `gated_delta_step`, as the sampler decodes."""
    s, outs = jnp.asarray(x["state"]), []
    for i in range(x["q"].shape[1]):
        o, s = step(*(x[n][:, i] for n in ("q", "k", "v", "g", "beta")), s)
        outs.append(o)
    return np.stack(outs, axis=1), np.asarray(s)


@functools.cache
def case(t: int, a_high: float = 16.0) -> dict:
    x = make_inputs(t, t, a_high=a_high)
    return {"x": x, "chunked": chunked(*args(x)), "recurrent": recurrent(*args(x))}


DECAYS = pytest.mark.parametrize("a_high", [16.0, 0.3], ids=["init_decay", "slow_decay"])


@DECAYS
@pytest.mark.parametrize("t", [1, 63, 64, 130])
def test_chunked_recurrent_and_decode_agree(t, a_high):
    c = case(t, a_high)
    (o_c, s_c), (o_r, s_r) = c["chunked"], c["recurrent"]
    o_d, s_d = decode(c["x"])
    assert o_c.shape == (B, t, H, DV) and s_c.shape == (B, H, DK, DV)
    assert o_c.dtype == s_c.dtype == jnp.float32
    assert rel(o_c, o_r) < TOL and rel(s_c, s_r) < TOL
    assert rel(o_d, o_r) < TOL and rel(s_d, s_r) < TOL
    # the initial state matters (a kernel ignoring it would fail here)
    assert rel(chunked(*args(c["x"])[:5], jnp.zeros_like(s_c))[0], o_r) > 1e-3


@DECAYS
@pytest.mark.parametrize("t", [1, 63, 64, 130])
def test_matches_transformers_kernels(t, a_high):
    c = case(t, a_high)
    (o_c, s_c), (o_r, s_r) = c["chunked"], c["recurrent"]
    for fn in (qwen3_5.torch_chunk_gated_delta_rule, qwen3_5.torch_recurrent_gated_delta_rule):
        with torch.no_grad():
            o_t, s_t, _ = torch_run(fn, c["x"])
        for o, s in ((o_c, s_c), (o_r, s_r)):
            assert rel(o, o_t.numpy()) < TOL and rel(s, s_t.numpy()) < TOL, fn.__name__


def test_a_weak_decay_after_a_strong_one_keeps_the_state_exact():
    """Decays of -30 per token for most of a chunk, then -0.01: the decay from a late token to
    the chunk's end is a small number that differences of the chunk's cumulative sums (~-1800,
    float32 ulp 1e-4) would round by ~1e-4 relative; summed directly it is exact. Final state
    and outputs against the token-by-token rule and transformers' recurrent kernel."""
    x = make_inputs(21, 128)
    g = np.full((B, 128, H), -30.0, np.float32)
    g[:, 60:64] = -0.01
    g[:, 124:] = -0.01
    x["g"] = g
    o_c, s_c = chunked(*args(x))
    o_r, s_r = recurrent(*args(x))
    with torch.no_grad():
        o_t, s_t, _ = torch_run(qwen3_5.torch_recurrent_gated_delta_rule, x)
    assert rel(s_c, s_r) < TOL and rel(o_c, o_r) < TOL
    assert rel(s_c, s_t.numpy()) < TOL and rel(o_c, o_t.numpy()) < TOL


def test_grouped_value_heads_match_transformers():
    """2 key heads serving 4 value heads: we repeat q/k per group (each key head serves
    consecutive value heads, as `repeat_interleave`); torch gets the unrepeated q/k."""
    x = make_inputs(7, 63, h=H, hk=2)
    rep = dict(x, q=np.repeat(x["q"], H // 2, axis=2), k=np.repeat(x["k"], H // 2, axis=2))
    assert not np.array_equal(rep["q"], np.tile(x["q"], (1, 1, H // 2, 1)))
    o_c, s_c = chunked(*args(rep))
    o_r, s_r = recurrent(*args(rep))
    for fn in (qwen3_5.torch_chunk_gated_delta_rule, qwen3_5.torch_recurrent_gated_delta_rule):
        with torch.no_grad():
            o_t, s_t, _ = torch_run(fn, x)
        for o, s in ((o_c, s_c), (o_r, s_r)):
            assert rel(o, o_t.numpy()) < TOL and rel(s, s_t.numpy()) < TOL, fn.__name__


@functools.cache
def grad_of_functional(kernel):
    """jit(grad) of (inputs..., w_o, w_s) -> sum(o * w_o) + sum(final * w_s), w.r.t. the inputs."""
    def f(q, k, v, g, beta, state, w_o, w_s):
        o, s = kernel(q, k, v, g, beta, state)
        return jnp.sum(o * w_o) + jnp.sum(s * w_s)
    return jax.jit(jax.grad(f, argnums=tuple(range(6))))


@DECAYS
def test_gradients_chunked_recurrent_and_torch_agree(a_high):
    """d/d(q, k, v, g, beta, state) of sum(o * w_o) + sum(final * w_s), T = 130 (3 chunks, the
    last one padded): chunked == recurrent == torch autograd of the chunked torch kernel."""
    x = case(130, a_high)["x"]
    rng = np.random.default_rng(1)
    w_o = rng.normal(size=(B, 130, H, DV)).astype(np.float32)
    w_s = rng.normal(size=(B, H, DK, DV)).astype(np.float32)
    g_c = grad_of_functional(gated_delta_chunked)(*args(x), w_o, w_s)
    g_r = grad_of_functional(gated_delta_recurrent)(*args(x), w_o, w_s)
    o_t, s_t, tx = torch_run(qwen3_5.torch_chunk_gated_delta_rule, x, grad=True)
    ((o_t * torch.from_numpy(w_o)).sum() + (s_t * torch.from_numpy(w_s)).sum()).backward()
    for name, gc, gr in zip(("q", "k", "v", "g", "beta", "state"), g_c, g_r):
        gt = tx[name].grad.numpy()
        assert np.abs(gr).max() > 0, name
        assert rel(gc, gr) < GRAD_TOL, name
        assert rel(gc, gt) < GRAD_TOL, name


def test_padding_positions_leave_the_state_unchanged():
    """beta = 0 and g = 0 positions (with garbage q/k/v) inserted at the start, in the middle
    and at the end: same final state and same outputs at the real positions. Exact for the
    token-by-token kernels; the chunked one regroups tokens into other chunks (rel 1e-5)."""
    real = case(63)["x"]
    rng = np.random.default_rng(3)
    where = np.sort(np.concatenate([[0, 1, 2], 30 + np.arange(30), 63 + 33 + np.arange(34)]))
    keep = np.setdiff1d(np.arange(130), where)                  # the 63 real positions
    padded = {}
    for n in ("q", "k", "v", "g", "beta"):
        a = real[n]
        full = rng.normal(size=(B, 130, *a.shape[2:])).astype(np.float32)
        if n in ("g", "beta"):
            full[:] = 0.0
        full[:, keep] = a
        padded[n] = full
    padded["state"] = real["state"]
    o_r, s_r = case(63)["recurrent"]
    o_rp, s_rp = recurrent(*args(padded))
    np.testing.assert_array_equal(s_rp, s_r)
    np.testing.assert_array_equal(np.asarray(o_rp)[:, keep], o_r)
    o_d, s_d = decode(real)
    o_dp, s_dp = decode(padded)
    np.testing.assert_array_equal(s_dp, s_d)
    np.testing.assert_array_equal(o_dp[:, keep], o_d)
    o_cp, s_cp = chunked(*args(padded))
    o_c, s_c = case(63)["chunked"]
    assert rel(s_cp, s_c) < TOL and rel(np.asarray(o_cp)[:, keep], o_c) < TOL
    # padding that only extends the sequence keeps the chunked state bit-exact (same chunks)
    tail = {n: np.concatenate([real[n], padded[n][:, 63:]], axis=1) if n != "state" else real[n]
            for n in padded}
    for n in ("g", "beta"):
        tail[n][:, 63:] = 0.0
    o_ct, s_ct = chunked(*args(tail))
    np.testing.assert_array_equal(s_ct, s_c)
    np.testing.assert_array_equal(np.asarray(o_ct)[:, :63], o_c)


def test_state_map_is_the_affine_dependence_on_the_entering_state():
    """o(S0) = o(0) + q_eff S0 and final(S0) = transition S0 + final(0), and two shards composed
    with it equal the unsharded 130-token sequence (shards of 63 and 67 tokens). Slowly
    decaying heads, so that the state entering the second shard still matters at its end."""
    x = case(130, 0.3)["x"]
    first = {n: a[:, :63] if n != "state" else a for n, a in x.items()}
    second = {n: a[:, 63:] if n != "state" else a for n, a in x.items()}
    zero = np.zeros_like(x["state"])
    q_eff, transition = state_map(second["q"], second["k"], second["g"], second["beta"])
    assert q_eff.shape == (B, 67, H, DK) and transition.shape == (B, H, DK, DK)
    o_0, f_0 = chunked(*args(second)[:5], zero)
    o_s, f_s = chunked(*args(second))
    s0 = x["state"]
    assert rel(o_s, o_0 + jnp.einsum("bthk,bhkv->bthv", q_eff, s0)) < TOL
    assert rel(f_s, jnp.einsum("bhkj,bhjv->bhkv", transition, s0) + f_0) < TOL
    # the entering state is not negligible in this case (the identities are not vacuous)
    assert rel(o_s, o_0) > 1e-3 and rel(f_s, f_0) > 1e-3
    # context parallel: shard 2 runs from a zero state while shard 1 runs, then is corrected
    o_1, f_1 = chunked(*args(first))
    o_2 = o_0 + jnp.einsum("bthk,bhkv->bthv", q_eff, f_1)
    f_2 = jnp.einsum("bhkj,bhjv->bhkv", transition, f_1) + f_0
    o_full, f_full = case(130, 0.3)["recurrent"]
    assert rel(jnp.concatenate([o_1, o_2], axis=1), o_full) < TOL
    assert rel(f_2, f_full) < TOL


def test_segments_composed_by_their_maps_equal_the_whole_sequence():
    """Context parallelism over 3 shards (43 + 43 + 44 of the 130 tokens, an entering state):
    each shard's `gated_delta_segment` from zero, the states composed in order by
    `gated_delta_prefix`, outputs corrected by q_eff S_in: the recurrent reference's outputs and
    final state. The segment's maps are `gated_delta_state_map`'s (one pass, extra columns)."""
    x = case(130, 0.3)["x"]
    cuts = [(0, 43), (43, 86), (86, 130)]
    parts = [jax.jit(gated_delta_segment, static_argnames="chunk_size")(
        *(x[n][:, a:b] for n in ("q", "k", "v", "g", "beta")), chunk_size=16) for a, b in cuts]
    states = gated_delta_prefix(jnp.stack([p[3] for p in parts]), jnp.stack([p[1] for p in parts]),
                                x["state"])
    assert states.shape == (4, B, H, DK, DV)
    np.testing.assert_array_equal(states[0], x["state"])
    o = jnp.concatenate([p[0] + jnp.einsum("bthk,bhkv->bthv", p[2], s_in)
                         for p, s_in in zip(parts, states[:3])], axis=1)
    o_full, f_full = case(130, 0.3)["recurrent"]
    assert rel(o, o_full) < TOL and rel(states[3], f_full) < TOL
    q_eff, transition = state_map(*(x[n][:, 43:86] for n in ("q", "k", "g", "beta")), chunk_size=16)
    assert rel(parts[1][2], q_eff) < TOL and rel(parts[1][3], transition) < TOL


def test_l2norm_matches_transformers_down_to_vectors_near_its_epsilon():
    """Norms from 1 down to 1e-4 (sum of squares 1e-8, below the 1e-6 epsilon): any other
    epsilon, or one inside the square root's other side, moves the small rows by far over 1e-6."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(6, 3, DK)).astype(np.float32)
    x /= np.linalg.norm(x, axis=-1, keepdims=True)
    x *= np.logspace(0, -4, 6, dtype=np.float32)[:, None, None]
    want = qwen3_5.l2norm(torch.from_numpy(x), dim=-1, eps=1e-6).numpy()
    got = np.asarray(jax.jit(l2norm)(x))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    assert np.linalg.norm(got[-1], axis=-1).max() < 0.2      # the epsilon dominates there


@pytest.mark.parametrize("c", [5, 64])
def test_unit_lower_inverse_matches_lapack(c):
    rng = np.random.default_rng(c)
    a = rng.uniform(-0.5, 0.5, (3, c, c)).astype(np.float32)
    ours = np.asarray(jax.jit(unit_lower_inverse)(a))
    lower = np.tril(a.astype(np.float64), -1) + np.eye(c)
    ref = np.stack([scipy.linalg.solve_triangular(m, np.eye(c), lower=True, unit_diagonal=True)
                    for m in lower])
    assert rel(ours, ref) < TOL
    np.testing.assert_array_equal(np.triu(ours, 1), 0.0)


def test_low_precision_inputs_are_upcast():
    x = case(63)["x"]
    low = {n: a.astype(jnp.bfloat16) for n, a in x.items()}
    o, s = chunked(*args(low))
    o_ref, s_ref = chunked(*(np.asarray(a, np.float32) for a in args(low)))
    assert o.dtype == s.dtype == jnp.float32
    np.testing.assert_array_equal(o, o_ref)
    np.testing.assert_array_equal(s, s_ref)
