"""grpo_outcome_advantages against the torch loop implementation of specs/grpo.md."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jscenegen.grpo.algo.advantages import check_group_sizes, grpo_outcome_advantages
from jscenegen.grpo.algo.losses import grpo_loss
from jscenegen.parity import torch_reference as ref

LAYOUTS = [
    [0, 0, 0, 0, 1, 1, 1, 1],  # 2 groups of 4 (the GRPO100 shape, halved)
    [3, 3, 5, 5, 5, 7, 9, 9],  # sizes 2, 3, 1 (declared singleton), 2
    [0, 1, 0, 1, 0, 1, 0, 1],  # interleaved members
]

score = st.one_of(
    st.sampled_from([-1.0, 0.0, 0.25, 0.5, 0.75, 1.0]),  # failures and ties
    st.floats(-2, 2, allow_nan=False, width=32, allow_subnormal=False),
    st.sampled_from([math.nan, math.inf]),
)


@settings(max_examples=40, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    scores=st.lists(score, min_size=8, max_size=8),
    valid=st.lists(st.booleans(), min_size=8, max_size=8),
    norm=st.booleans(),
)
def test_matches_torch_reference(layout, scores, valid, norm):
    got = np.asarray(grpo_outcome_advantages(np.float32(scores), np.array(layout), np.array(valid),
                                             norm_by_std=norm))
    want = ref.grpo_advantages(np.float32(scores), layout, valid, norm_by_std=norm).numpy()
    assert np.all(np.isfinite(got))
    # a group whose valid scores differ by a rounding error has an ill-conditioned std
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_worked_example():
    s = np.float32([1.0, 0.0, 0.5, -1.0, 0.3, 0.3, 0.3, 0.3])
    got = np.asarray(grpo_outcome_advantages(s, np.array([0] * 4 + [1] * 4), np.ones(8, bool)))
    g = s[:4]
    want = (g - g.mean()) / (g.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(got[:4], want, rtol=1e-6)
    assert np.all(got[4:] == 0.0)


def test_constant_groups_give_exact_zero_and_zero_policy_gradient():
    vals = np.float32([0.1, 0.7, -1.0, 0.123456])
    s = np.repeat(vals, 4)
    ids = np.repeat(np.arange(4), 4)
    adv = grpo_outcome_advantages(s, ids, np.ones(16, bool))
    assert np.all(np.asarray(adv) == 0.0)
    key = jax.random.PRNGKey(0)
    logp = jax.random.normal(key, (16, 6)) - 2.0
    old = logp + 0.3 * jax.random.normal(jax.random.PRNGKey(1), (16, 6))
    mask = jnp.ones((16, 6)).at[:, 0].set(0.0)
    adv_tok = jnp.broadcast_to(adv[:, None], (16, 6)) * mask
    grad = jax.grad(lambda lp: grpo_loss(lp, None, old, adv_tok, mask, None, clip_low=0.2, clip_high=0.2,
                                         clip_c=3.0, agg_mode="token-mean").pg_loss)(logp)
    assert np.all(np.asarray(grad) == 0.0)


def test_invalid_members_and_small_groups():
    s = np.float32([1.0, 2.0, np.nan, 4.0, 5.0, 6.0, 7.0, 8.0])
    valid = np.array([1, 1, 1, 0, 1, 0, 0, 0], bool)
    ids = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    got = np.asarray(grpo_outcome_advantages(s, ids, valid))
    # group 0: NaN and the invalid 4.0 are left out: stats over [1, 2]
    np.testing.assert_allclose(got[:2], [-1 / (math.sqrt(0.5) + 1e-6) / 2, 1 / (math.sqrt(0.5) + 1e-6) / 2], rtol=1e-6)
    assert got[2] == 0.0 and got[3] == 0.0
    # group 1: one valid member of four -> all 0
    assert np.all(got[4:] == 0.0)


def test_declared_singleton_is_uncentred():
    got = np.asarray(grpo_outcome_advantages(np.float32([0.8, -1.0]), np.array([0, 1]), np.ones(2, bool)))
    np.testing.assert_allclose(got, np.float32([0.8, -1.0]) / np.float32(1 + 1e-6), rtol=0)
    got = np.asarray(grpo_outcome_advantages(np.float32([0.8]), np.array([0]), np.ones(1, bool),
                                             norm_by_std=False))
    assert got[0] == np.float32(0.8)


def test_dr_grpo_does_not_divide():
    s = np.float32([1.0, 0.0, 0.0, 3.0])
    got = np.asarray(grpo_outcome_advantages(s, np.zeros(4, int), np.ones(4, bool), norm_by_std=False))
    np.testing.assert_allclose(got, s - 1.0, atol=1e-7)


def test_group_size_mismatch_raises():
    with pytest.raises(ValueError, match="declared group size 4"):
        grpo_outcome_advantages(np.zeros(7, np.float32), np.array([0] * 4 + [1] * 3), np.ones(7, bool),
                                group_size=4)
    check_group_sizes(np.array([0] * 4 + [1] * 4), 4)
    with pytest.raises(ValueError, match="must all be"):
        grpo_outcome_advantages(np.zeros(4, np.float32), np.zeros(3, int), np.ones(4, bool))


def test_jit():
    f = jax.jit(grpo_outcome_advantages, static_argnames=("eps", "norm_by_std"))
    s = np.float32([1, 2, 3, 4])
    np.testing.assert_allclose(f(s, np.array([0, 0, 1, 1]), np.ones(4, bool)),
                               grpo_outcome_advantages(s, np.array([0, 0, 1, 1]), np.ones(4, bool)))


def test_eps_is_added_to_the_std_not_to_the_variance():
    """(s - mean) / (std + eps), VERL's formula: for groups whose scores differ by ~1e-3 the
    variance (~1e-6) is of the size of eps, so sqrt(var + eps) would shrink them ~1.5x."""
    rng = np.random.default_rng(11)
    s = (0.5 + 1e-3 * rng.normal(size=8)).astype(np.float32)
    ids = np.repeat([0, 1], 4)
    got = np.asarray(grpo_outcome_advantages(s, ids, np.ones(8, bool)))
    want = np.empty(8)
    for sl in (slice(0, 4), slice(4, 8)):
        g = s[sl].astype(np.float64)
        want[sl] = (g - g.mean()) / (g.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-3)
    assert np.abs(got).max() > 0.5


@pytest.mark.parametrize("size", [3, 5, 6, 7, 8])
def test_equal_scores_give_exact_zero_for_every_group_size(size):
    """A group whose valid scores are all equal gets exactly 0 (no rounding residue of the
    float32 mean), for group sizes whose mean of equal scores does not round back exactly."""
    vals = np.random.default_rng(size).uniform(-1, 1, 16).astype(np.float32)
    s = np.repeat(vals, size)
    ids = np.repeat(np.arange(16), size)
    valid = np.ones(16 * size, bool)
    valid[::size + 1] = False   # an invalid member here and there: fewer valid, still equal
    adv = np.asarray(grpo_outcome_advantages(s, ids, valid))
    assert np.all(adv == 0.0)
