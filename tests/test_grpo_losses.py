"""PPO-clip loss, agg_loss, KL estimators and grpo_loss against the torch reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from jscenegen.grpo.algo.config import LossConfig
from jscenegen.grpo.algo.losses import AGG_MODES, agg_loss, clamp, grpo_loss, kl_penalty, token_means
from jscenegen.parity import torch_reference as ref

B, T = 4, 7
KINDS = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k3+"]
f32 = st.floats(-3, 3, width=32, allow_subnormal=False)


@st.composite
def batches(draw):
    """[B, T] logp/old/adv/mask with an empty row, NaN off-mask and extreme log-ratios."""
    mask = draw(arrays(np.bool_, (B, T)))
    mask[draw(st.integers(0, B - 1))] = False  # one row without trained tokens
    logp = draw(arrays(np.float32, (B, T), elements=st.floats(-8, 0, width=32, allow_subnormal=False)))
    delta = draw(arrays(np.float32, (B, T), elements=st.one_of(
        st.floats(-0.5, 0.5, width=32, allow_subnormal=False), st.sampled_from([-30.0, -21.0, 25.0, 40.0]))))
    adv = draw(arrays(np.float32, (B,), elements=f32))
    adv[np.abs(adv) < 1e-6] = 0.0  # XLA flushes subnormal products to 0, torch keeps them
    adv = np.repeat(adv[:, None], T, 1) * mask
    old = logp - delta
    for a in (logp, old, adv):
        a[~mask] = draw(st.sampled_from([np.nan, np.inf, -np.inf, 0.0]))
    return logp, old, adv, mask.astype(np.float32)


def t(x):
    return torch.tensor(np.asarray(x), dtype=torch.float32)


_agg = {(m, c, leg): jax.jit(lambda x, k, g, n, m=m, c=c, leg=leg: agg_loss(
    x, k, m, g if c else None, n if c else None, legacy=leg)) for m in AGG_MODES
    for c in (False, True) for leg in (False, True)}


@settings(max_examples=15, deadline=None)
@given(data=batches(), counts=st.booleans(), legacy=st.booleans())
def test_agg_loss_matches_torch(data, counts, legacy):
    logp, _, _, mask = data
    g_tok, g_seq = float(mask.sum() + 5), float(B + 2)  # as if more micro-batches existed
    for mode in AGG_MODES:
        got = float(_agg[(mode, counts, legacy)](logp, mask, g_tok, g_seq))
        want = float(ref.agg_loss(t(logp), t(mask), mode, g_tok if counts else None,
                                  g_seq if counts else None, legacy=legacy))
        assert np.isfinite(got)
        assert got == pytest.approx(want, rel=1e-6, abs=1e-6), mode


def test_agg_loss_worked_values():
    x = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [9.0, 9.0, 9.0]])
    m = jnp.array([[0, 1, 1], [0, 1, 0], [0, 0, 0]], jnp.float32)
    assert float(agg_loss(x, m, "token-mean")) == pytest.approx(10 / 3)
    assert float(agg_loss(x, m, "token-sum")) == pytest.approx(10)
    assert float(agg_loss(x, m, "seq-mean-token-sum")) == pytest.approx(10 / 2)
    assert float(agg_loss(x, m, "seq-mean-token-mean")) == pytest.approx((2.5 + 5) / 2)
    assert float(agg_loss(x, m, "seq-mean-token-sum-norm")) == pytest.approx(10 / 2 / 3)
    assert float(agg_loss(x, m, "seq-mean-token-sum-norm", horizon=10, legacy=True)) == pytest.approx(1.0)
    assert float(agg_loss(x, m, "token-mean", global_token_count=8)) == pytest.approx(10 / 8)
    assert float(agg_loss(x, m, "seq-mean-token-sum", global_seq_count=4)) == pytest.approx(10 / 4)
    assert float(agg_loss(x, jnp.zeros_like(m), "token-mean")) == 0.0
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(x, m, "mean")


def policy_loss(logp, old_logp, advantages, mask, clip_low, clip_high, clip_c, agg_mode):
    """The PPO-clip part of `grpo_loss` and the per-token metrics the train step reports."""
    parts = grpo_loss(logp, None, old_logp, advantages, mask, None, clip_low=clip_low,
                      clip_high=clip_high, clip_c=clip_c, agg_mode=agg_mode)
    return parts.pg_loss, token_means(parts.sums)


_pl = {m: jax.jit(jax.value_and_grad(lambda lp, o, a, k, m=m: policy_loss(
    lp, o, a, k, 0.2, 0.28, 3.0, m), has_aux=True)) for m in AGG_MODES}


@settings(max_examples=15, deadline=None)
@given(data=batches())
def test_policy_loss_value_grad_metrics_match_torch(data):
    logp, old, adv, mask = data
    for mode in ("token-mean", "seq-mean-token-mean"):
        (loss, met), grad = _pl[mode](logp, old, adv, mask)
        lp = t(logp).requires_grad_(True)
        on = t(mask).bool()
        z = torch.zeros(B, T)
        lp_s = torch.where(on, lp, z)
        terms = ref.policy_loss_terms(lp_s, torch.where(on, t(old), z), torch.where(on, t(adv), z),
                                      0.2, 0.28, 3.0)
        want = ref.agg_loss(terms[0], t(mask), mode)
        want.backward()
        assert float(loss) == pytest.approx(float(want.detach()), rel=1e-6, abs=1e-6)
        np.testing.assert_allclose(np.asarray(grad), lp.grad.numpy(), rtol=1e-5, atol=1e-7)
        assert np.all(np.isfinite(np.asarray(grad)))
        n = mask.sum() + 1e-8
        assert float(met["clipfrac"]) == pytest.approx(float((terms[2] * on).sum()) / n, abs=1e-6)
        assert float(met["clipfrac_lower"]) == pytest.approx(float((terms[3] * on).sum()) / n, abs=1e-6)
        assert float(met["approx_kl"]) == pytest.approx(float(ref.masked_sum(terms[1].detach(), t(mask))) / n,
                                                        rel=1e-5, abs=1e-6)
        rmax = float(torch.where(on, terms[4].detach(), z).max())
        assert float(met["ratio_max"]) == pytest.approx(rmax, rel=1e-6)


def test_policy_loss_clip_cases():
    # ratio 1.5 with A > 0 is clipped at 1.28; ratio 5 with A < 0 is dual-clipped at c = 3
    logp = jnp.log(jnp.array([[1.0, 1.5, 5.0, 0.5]]))
    adv = jnp.array([[0.0, 2.0, -1.0, -1.0]])
    mask = jnp.array([[0.0, 1.0, 1.0, 1.0]])
    loss, met = policy_loss(logp, jnp.zeros_like(logp), adv, mask, 0.2, 0.28, 3.0, "token-sum")
    # token b: A = 2, ratio 1.5 -> max(-3, -2.56) (clipped); token c: A = -1, ratio 5 ->
    # min(max(5, 1.28), 3) (dual clip); token d: A = -1, ratio 0.5 -> max(0.5, 0.8) (clipped)
    l_a = max(-2 * 1.5, -2 * 1.28)
    l_b = min(max(5.0, 1.28), 3.0)
    l_c = max(0.5, 0.8)
    assert float(loss) == pytest.approx(l_a + l_b + l_c, rel=1e-6)
    assert float(met["clipfrac"]) == pytest.approx(2 / 3)  # tokens b and d hit the clip bound
    assert float(met["clipfrac_lower"]) == pytest.approx(1 / 3)
    assert float(met["ratio_max"]) == pytest.approx(5.0, rel=1e-6)


def test_a_ratio_exactly_on_a_clip_bound_gets_torch_clamps_gradient():
    """jnp.clip passes half the gradient at a bound, torch.clamp all of it: a token whose
    float32 ratio was exactly 1 + clip_high or 1 - clip_low got 3/4 of VERL's gradient."""
    on_bounds = np.log(np.array([[1.2, 0.8]], np.float32))
    assert np.all(np.asarray(jnp.exp(on_bounds)) == np.array([[1.2, 0.8]], np.float32))
    for adv in (1.0, -1.0):
        a = np.full_like(on_bounds, adv)
        old, mask = np.zeros_like(on_bounds), np.ones_like(on_bounds)
        grad = jax.grad(lambda lp: policy_loss(lp, old, a, mask, 0.2, 0.2, 3.0, "token-sum")[0])(on_bounds)
        lp = t(on_bounds).requires_grad_(True)
        ref.agg_loss(ref.policy_loss_terms(lp, t(old), t(a), 0.2, 0.2, 3.0)[0], t(mask), "token-sum").backward()
        np.testing.assert_allclose(np.asarray(grad), lp.grad.numpy(), rtol=1e-6)
    x = np.array([0.5, 1.5, 0.8, 1.2, 1.0], np.float32)
    grad = jax.grad(lambda v: clamp(v, 0.8, 1.2).sum())(x)
    tx = t(x).requires_grad_(True)
    torch.clamp(tx, 0.8, 1.2).sum().backward()
    assert np.array_equal(np.asarray(grad), tx.grad.numpy())
    # NaN keeps its gradient (torch's is 0), so a NaN log-prob skips the update
    value, grad = jax.value_and_grad(lambda v: clamp(v, 0.8, 1.2))(np.float32(np.nan))
    assert np.isnan(value) and float(grad) == 1.0


@settings(max_examples=10, deadline=None)
@given(logp=arrays(np.float32, (B, T), elements=st.floats(-10, 0, width=32, allow_subnormal=False)),
       delta=arrays(np.float32, (B, T), elements=st.one_of(st.floats(-2, 2, width=32, allow_subnormal=False),
                                                           st.sampled_from([-25.0, 30.0]))))
def test_kl_penalty_value_and_grad_match_torch(logp, delta):
    refl = logp - delta
    for kind in KINDS:
        val, vjp = jax.vjp(lambda x: kl_penalty(x, refl, kind), logp)
        (g,) = vjp(jnp.ones_like(val))
        lp = t(logp).requires_grad_(True)
        want = ref.kl_penalty(lp, t(refl), kind)
        want.sum().backward()
        np.testing.assert_allclose(np.asarray(val), want.detach().numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(g), lp.grad.numpy(), rtol=1e-5, atol=1e-6)
    k3 = np.asarray(kl_penalty(logp, refl, "k3"))
    assert np.all((k3 >= -1e-6) & (k3 <= 10))  # >= 0 up to fp32 rounding
    with pytest.raises(ValueError, match="kl_loss_type"):
        kl_penalty(logp, refl, "full")


def test_k3_plus_has_k2_gradient():
    lp, rl = jnp.array([-1.0, -2.0]), jnp.array([-1.5, -1.0])
    g = jax.grad(lambda x: kl_penalty(x, rl, "k3+").sum())(lp)
    np.testing.assert_allclose(np.asarray(g), np.asarray(lp - rl), rtol=1e-6)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_grpo_loss_matches_torch_actor_loss(mode):
    rng = np.random.default_rng(0)
    logp = rng.uniform(-5, 0, (B, T)).astype(np.float32)
    ent = rng.uniform(0, 3, (B, T)).astype(np.float32)
    old = logp + rng.normal(0, 0.3, (B, T)).astype(np.float32)
    refl = logp + rng.normal(0, 0.5, (B, T)).astype(np.float32)
    mask = (rng.uniform(size=(B, T)) < 0.6).astype(np.float32)
    adv = np.repeat(rng.normal(size=(B, 1)), T, 1).astype(np.float32) * mask
    for a in (old, refl, adv, ent):
        a[mask == 0] = np.nan
    cfg = LossConfig(loss_agg_mode=mode, use_kl_loss=True, kl_coef=0.05, entropy_coeff=0.01,
                     clip_high=0.28)

    def f(lp, e):
        return grpo_loss(lp, e, old, adv, mask, refl, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                         clip_c=cfg.clip_ratio_c, agg_mode=mode, entropy_coeff=cfg.entropy_coeff,
                         use_kl_loss=True, kl_coef=cfg.kl_coef, kl_type=cfg.kl_loss_type).loss

    val, (g_lp, g_e) = jax.value_and_grad(f, argnums=(0, 1))(logp, ent)
    lp, e = t(logp).requires_grad_(True), t(ent).requires_grad_(True)
    want = ref.actor_loss(lp, e, t(old), t(adv), t(mask), t(refl), cfg)
    want.backward()
    assert float(val) == pytest.approx(float(want.detach()), rel=1e-6)
    np.testing.assert_allclose(np.asarray(g_lp), lp.grad.numpy(), rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(np.asarray(g_e), e.grad.numpy(), rtol=1e-5, atol=1e-8)
    assert np.all(np.isfinite(np.asarray(g_lp)))


def test_logprob_drift():
    roll = np.array([[0.0, -1.0, -2.0, np.nan]], np.float32)
    old = np.array([[5.0, -1.5, -1.0, -3.0]], np.float32)
    mask = np.array([[0, 1, 1, 0]], np.float32)

    def drift(m):
        parts = grpo_loss(old, None, old, np.zeros_like(old), m, None, clip_low=0.2,
                          clip_high=0.2, clip_c=3.0, agg_mode="token-mean", rollout_logp=roll)
        return float(token_means(parts.sums)["logprob_drift"])

    assert drift(mask) == pytest.approx(0.75)
    assert drift(np.zeros_like(mask)) == 0.0


def test_dual_clip_lower_fraction_counts_only_losses_strictly_above_the_cap():
    """clipfrac_lower is VERL's torch.gt(l_clip, -A clip_c): a token whose ratio equals clip_c
    exactly (l_clip == -A clip_c) is at the cap, not above it; one just above it is counted."""
    x = np.float32(1.1)
    c = float(jnp.exp(jnp.float32(x)))          # the float32 ratio of log-ratio x, as clip_c
    above = np.nextafter(x, np.float32(2.0))   # ratio one ulp step further: above the cap
    logp = np.array([[x, above]], np.float32)
    adv = np.array([[-0.5, -0.5]], np.float32)   # a power of two: -A ratio is exact
    mask = np.ones_like(logp)
    loss, met = policy_loss(logp, np.zeros_like(logp), adv, mask, 0.2, 0.28, c, "token-sum")
    assert float(jnp.exp(jnp.float32(above))) > c
    assert float(loss) == pytest.approx(2 * 0.5 * c, rel=1e-6)   # both capped at -A clip_c
    assert float(met["clipfrac_lower"]) == 0.5
    assert float(met["clipfrac"]) == 0.0


def test_token_means_entropy_and_kl_are_masked_means_over_the_trained_tokens():
    """token_means' entropy and kl metrics: masked means (VERL masked_mean) of the entropy
    and of the KL estimator against the reference, NaN outside the mask ignored."""
    rng = np.random.default_rng(7)
    logp = rng.uniform(-5, 0, (B, T)).astype(np.float32)
    ent = rng.uniform(0, 3, (B, T)).astype(np.float32)
    refl = logp + rng.normal(0, 0.5, (B, T)).astype(np.float32)
    mask = (rng.uniform(size=(B, T)) < 0.6).astype(np.float32)
    mask[0, :2] = 1.0
    adv = np.repeat(rng.normal(size=(B, 1)), T, 1).astype(np.float32) * mask
    for a in (ent, refl):
        a[mask == 0] = np.nan
    on = mask != 0
    for kind in ("low_var_kl", "k1", "k2"):
        parts = grpo_loss(logp, ent, logp, adv, mask, refl, clip_low=0.2, clip_high=0.28, clip_c=3.0,
                          agg_mode="token-mean", entropy_coeff=0.01, use_kl_loss=True, kl_coef=0.1,
                          kl_type=kind)
        met = token_means(parts.sums)
        kl = ref.kl_penalty(t(logp), t(refl), kind).numpy()
        assert float(met["entropy"]) == pytest.approx(float(ent[on].astype(np.float64).mean()), rel=1e-6)
        assert float(met["kl"]) == pytest.approx(float(kl[on].astype(np.float64).mean()), rel=1e-5, abs=1e-7)
    empty = token_means(grpo_loss(logp, ent, logp, adv, np.zeros_like(mask), refl, clip_low=0.2,
                                  clip_high=0.28, clip_c=3.0, agg_mode="token-mean", use_kl_loss=True,
                                  kl_coef=0.1).sums)
    assert float(empty["entropy"]) == 0.0 and float(empty["kl"]) == 0.0
