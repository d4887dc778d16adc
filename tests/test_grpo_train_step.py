"""The micro-batched GRPO step: accumulation equivalence, NaN handling, skipping, KL, sharding.

A tiny causal stand-in model (embedding, running mean, one tanh layer, untied head) keeps the
compiles small; the Qwen model runs through the same step in test_grpo_parity.py.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jscenegen.grpo.algo.config import LossConfig, OptimConfig
from jscenegen.grpo.algo.losses import kl_penalty
from jscenegen.grpo.algo.optimizer import init_train_state
from jscenegen.grpo.train.step import GRPOStep

B, T, H, V = 8, 12, 12, 24


def hidden_fn(params, input_ids, attention_mask, rows=None):
    m = attention_mask.astype(jnp.float32)[..., None]
    e = params["embed"][input_ids] * m
    run = jnp.cumsum(e, axis=1) / jnp.maximum(jnp.cumsum(m, axis=1), 1.0)
    if rows is not None:
        run = jnp.take_along_axis(run, rows[..., None], axis=1)
    return jnp.tanh(run @ params["w"].T + params["b"]), params["head"]


def make_params(seed):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    return {"embed": jax.random.normal(k[0], (V, H)), "w": jax.random.normal(k[1], (H, H)) / 3,
            "b": 0.1 * jax.random.normal(k[2], (H,)), "head": jax.random.normal(k[3], (V, H))}


def make_batch(seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    am = np.ones((B, T), np.int32)
    for r, pad in enumerate([0, 3, 1, 0, 5, 2, 0, 4]):  # left padding
        am[r, :pad] = 0
    mask = (rng.uniform(size=(B, T)) < 0.6).astype(np.float32) * am
    mask[:, 0] = 0
    mask[6] = 0  # an episode with no trained token
    adv = np.repeat(rng.normal(size=(B, 1)), T, 1).astype(np.float32) * mask
    old = rng.uniform(-4, -2, (B, T)).astype(np.float32)
    ref = rng.uniform(-4, -2, (B, T)).astype(np.float32)
    return {"input_ids": ids, "attention_mask": am, "loss_mask": mask, "advantages": adv,
            "old_logp": old, "ref_logp": ref, "episode_mask": np.ones(B, np.float32)}


TEST_OPTIM = OptimConfig(lr=1e-2)


@functools.lru_cache(maxsize=None)
def steps(loss_cfg, optim_cfg=TEST_OPTIM):
    """One GRPOStep (and its compiled functions) per configuration, shared by the tests."""
    return GRPOStep(hidden_fn, loss_cfg, optim_cfg, temperature=0.9, donate=False)


def _rel(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    scale = max(float(jnp.max(jnp.abs(x))) for x in la)
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(la, lb)) / scale


def _padded(batch, rows):
    """`batch` with `rows` all-padding rows appended (as for an fsdp axis that does not divide B)."""
    return {k: np.concatenate([v, np.zeros((rows, *v.shape[1:]), v.dtype)]) for k, v in batch.items()}


@pytest.mark.parametrize("mode", [
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm",
    pytest.param("seq-mean-token-sum", marks=pytest.mark.slow),
    pytest.param("token-sum", marks=pytest.mark.slow),
])
def test_one_vs_four_micro_batches_same_gradient(mode):
    """8 rows in one micro-batch == the same 8 rows + 4 all-padding rows in 4 micro-batches."""
    params, batch = make_params(0), make_batch(0)
    kw = dict(loss_agg_mode=mode, use_kl_loss=True, kl_coef=0.1, entropy_coeff=0.01, logprob_chunk=5)
    g1, l1, _, s1 = steps(LossConfig(**kw)).grads(params, batch)
    g4, l4, _, s4 = steps(LossConfig(ppo_micro_batch_size=3, **kw)).grads(params, _padded(batch, 4))
    assert _rel(g1, g4) <= 1e-6
    assert float(l1) == pytest.approx(float(l4), rel=1e-6)
    assert float(s1["tokens"]) == float(s4["tokens"]) == batch["loss_mask"].sum()
    assert float(jnp.max(jnp.abs(g1["w"]))) > 1e-4  # a real gradient


def test_legacy_averages_per_micro_batch_objectives():
    params, batch = make_params(1), make_batch(1)
    legacy4 = steps(LossConfig(loss_scale="legacy", ppo_micro_batch_size=2)).grads(params, batch)[0]
    one = steps(LossConfig(loss_scale="legacy"))
    parts = [one.grads(params, {k: v[2 * i:2 * i + 2] for k, v in batch.items()})[0] for i in range(4)]
    mean = jax.tree.map(lambda *g: sum(g) / 4, *parts)
    assert _rel(legacy4, mean) <= 1e-6
    glob = steps(LossConfig()).grads(params, batch)[0]
    assert _rel(legacy4, glob) > 1e-2  # the two normalisations are different objectives
    # all-padding rows (to fill the mesh) add micro-batches that are not VERL's: no weight
    padded = steps(LossConfig(loss_scale="legacy", ppo_micro_batch_size=2)).grads(
        params, _padded(batch, 4))[0]
    assert _rel(padded, legacy4) <= 1e-6


@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("micro", [None, 4])
def test_global_sequence_modes_count_a_masked_episode_in_g(mode, micro):
    """A masked episode (judge failure: no token attended or trained, episode_mask 1) is one of
    the mini-batch's G episodes and a padding row is not: the loss is VERL 0.9's agg_loss with
    global_batch_size = 8 (the torch reference), not 8/7 of it (G from the attended rows)."""
    import torch

    from jscenegen.parity import torch_reference as ref

    params, batch = make_params(9), make_batch(9)
    for key in ("input_ids", "attention_mask", "loss_mask", "advantages"):
        batch[key][7] = 0                                   # episode 7 masked
    batch = _padded(batch, 4)                               # + 4 padding rows, episode_mask 0
    del batch["old_logp"]   # on-policy: ratio 1, so the per-token loss is -A on the mask
    cfg = LossConfig(loss_agg_mode=mode, ppo_micro_batch_size=micro, horizon=T)
    _, loss, pg, _ = steps(cfg).grads(params, batch)
    mask = torch.from_numpy(batch["loss_mask"])
    want = ref.agg_loss(-torch.from_numpy(batch["advantages"]), mask, mode,
                        global_batch_size=8, horizon=T)
    assert float(loss) == float(pg) == pytest.approx(float(want), rel=1e-6)
    assert abs(float(want)) > 1e-3   # the masked row's weight would show: 8/7 of it otherwise


def test_legacy_counts_a_micro_batch_of_masked_episodes_in_k():
    """legacy: a micro-batch whose episodes are all masked (nothing attended or trained) is
    still one of VERL's k micro-batches (its static gradient accumulation count; the rows are
    present there), so it adds 0 with weight 1/k; padding-only micro-batches are not counted."""
    params, batch = make_params(1), make_batch(1)
    for key in ("input_ids", "attention_mask", "loss_mask", "advantages"):
        batch[key][6:] = 0                                  # episodes 6 and 7 masked
    legacy4 = steps(LossConfig(loss_scale="legacy", ppo_micro_batch_size=2)).grads(
        params, _padded(batch, 2))[0]
    one = steps(LossConfig(loss_scale="legacy"))
    parts = [one.grads(params, {k: v[2 * i:2 * i + 2] for k, v in batch.items()})[0] for i in range(3)]
    assert _rel(legacy4, jax.tree.map(lambda *g: sum(g) / 4, *parts)) <= 1e-6   # not / 3


def test_bf16_gradients_are_accumulated_in_fp32():
    """64 micro-batches of a bf16 parameter, each gradient 1 +- 0.01: the sum is the float32 sum
    of the micro-batches' (bf16) gradients, returned as float32 (a bf16 accumulator stopped
    at 64 exactly: every contribution below 2^-8 of the running sum rounded away)."""
    from jscenegen.grpo.algo.accumulate import accumulate_grads

    x = 1.0 + 1e-2 * np.random.default_rng(0).normal(size=(64, 1, 4)).astype(np.float32)

    def loss(p, mb):
        return jnp.sum(p["w"].astype(jnp.float32) * mb[0]), ()

    grads, _, _ = accumulate_grads(loss, {"w": jnp.ones(4, jnp.bfloat16)}, jnp.asarray(x), ())
    want = np.zeros(4, np.float32)
    for g in np.asarray(jnp.asarray(x[:, 0]).astype(jnp.bfloat16), np.float32):
        want += g                                           # fp32 running sum, as the scan
    assert grads["w"].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(grads["w"]), want, rtol=1e-6)
    assert np.abs(want - 64).max() > 0.05                   # what bf16 accumulation lost


@pytest.mark.parametrize("micro", [None, 2])
def test_a_bf16_models_step_gradient_is_fp32(micro):
    """GRPOStep (and SFT, the same accumulate_grads) hands the optimizer float32 gradients
    for bf16 parameters, one micro-batch or several."""
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), make_params(10))
    grads, loss, _, _ = steps(LossConfig(ppo_micro_batch_size=micro)).grads(params, make_batch(10))
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
    assert np.isfinite(float(loss)) and float(jnp.max(jnp.abs(grads["w"]))) > 1e-4


def _leaves_equal(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_nan_outside_the_mask_changes_nothing():
    params, batch = make_params(2), make_batch(2)
    cfg = LossConfig(use_kl_loss=True, ppo_micro_batch_size=4)
    assert cfg == LossConfig(use_kl_loss=True, ppo_micro_batch_size=4)  # lru_cache key
    dirty = dict(batch)
    off = batch["loss_mask"] == 0
    for key, bad in (("old_logp", np.nan), ("advantages", np.inf), ("ref_logp", -np.inf)):
        dirty[key] = np.where(off, bad, batch[key]).astype(np.float32)
    st = steps(cfg)
    clean_g, clean_l, _, _ = st.grads(params, batch)
    dirty_g, dirty_l, _, _ = st.grads(params, dirty)
    assert float(clean_l) == float(dirty_l)
    assert _leaves_equal(clean_g, dirty_g)
    new, met = st.step(init_train_state(params, st.optim_cfg), dirty)
    assert float(met["skipped"]) == 0 and int(new.skipped_steps) == 0
    assert all(np.isfinite(float(v)) for v in met.values())


def test_non_finite_trained_position_skips_the_update():
    params, batch = make_params(3), make_batch(3)
    st = steps(LossConfig())
    state = init_train_state(params, st.optim_cfg)
    state, met = st.step(state, batch)  # one good step so the Adam moments are non-zero
    assert float(met["skipped"]) == 0
    bad = dict(batch)
    r, c = np.argwhere(batch["loss_mask"] > 0)[0]
    bad["advantages"] = batch["advantages"].copy()
    bad["advantages"][r, c] = np.nan
    before = jax.tree.map(np.asarray, state)
    after, met = st.step(state, bad)
    assert float(met["skipped"]) == 1 and int(after.skipped_steps) == 1
    assert not np.isfinite(float(met["grad_norm"]))
    assert _leaves_equal(before.params, after.params)
    assert _leaves_equal(before.opt_state, after.opt_state)
    assert int(after.lr_step) == int(before.lr_step) + 1  # the LR scheduler still steps


def test_k3_kl_step_moves_towards_reference():
    params, ref_params, batch = make_params(4), make_params(5), make_batch(4)
    cfg = LossConfig(use_kl_loss=True, kl_coef=1.0, kl_loss_type="k3")
    st = steps(cfg, OptimConfig(lr=3e-2, weight_decay=0.0))
    ref_logp, _ = st.logprobs(ref_params, batch["input_ids"], batch["attention_mask"])
    b = dict(batch, advantages=np.zeros((B, T), np.float32), ref_logp=np.asarray(ref_logp))
    del b["old_logp"]
    mask = b["loss_mask"]

    def kl(p):
        lp, _ = st.logprobs(p, b["input_ids"], b["attention_mask"])
        return float(jnp.sum(kl_penalty(lp, ref_logp, "k3") * mask) / mask.sum())

    state = init_train_state(params, st.optim_cfg)
    kls = [kl(params)]
    for _ in range(3):
        state, met = st.step(state, b)
        kls.append(kl(state.params))
    assert float(met["kl"]) == pytest.approx(kls[-2], rel=1e-5)  # metric = KL before the step
    assert kls[0] > 0.1 and kls[1] < kls[0] and kls[3] < kls[2] < kls[1]


def test_recomputed_old_logp_gives_ratio_one():
    params, batch = make_params(6), make_batch(6)
    st = steps(LossConfig(use_kl_loss=True, ppo_micro_batch_size=4))
    old, _ = st.logprobs(params, batch["input_ids"], batch["attention_mask"])
    _, met = st.step(init_train_state(params, st.optim_cfg), dict(batch, old_logp=np.asarray(old)))
    # the loss pass and the recompute are separate XLA programs: equal up to fp32 rounding
    assert abs(float(met["ratio_max"]) - 1.0) <= 2e-6 and float(met["clipfrac"]) == 0.0
    shortcut = {k: v for k, v in batch.items() if k != "old_logp"}
    shortcut["rollout_logp"] = np.asarray(old) + 0.25 * batch["loss_mask"]  # sampler drift
    shortcut["rollout_logp"][batch["loss_mask"] == 0] = np.nan
    _, met = st.step(init_train_state(params, st.optim_cfg), shortcut)
    assert float(met["ratio_max"]) == 1.0 and float(met["approx_kl"]) == 0.0
    assert float(met["logprob_drift"]) == pytest.approx(0.25, rel=1e-4)


def test_step_keeps_the_callers_sharding():
    mesh = Mesh(np.array(jax.devices()).reshape(3, 2), ("fsdp", "sp"))
    rows = NamedSharding(mesh, P(("fsdp", "sp")))
    params = {k: jax.device_put(v, rows) for k, v in make_params(7).items()}
    batch = {k: jax.device_put(v[:6], NamedSharding(mesh, P("fsdp"))) for k, v in make_batch(7).items()}
    st = steps(LossConfig())
    state = init_train_state(params, st.optim_cfg)
    new, met = st.step(state, batch)
    assert np.isfinite(float(met["loss"]))
    for name in params:
        assert new.params[name].sharding.is_equivalent_to(rows, params[name].ndim), name
        assert new.opt_state[1].mu[name].sharding.is_equivalent_to(rows, params[name].ndim), name


def test_bad_micro_batch_size_raises():
    with pytest.raises(ValueError, match="ppo_micro_batch_size=3"):
        steps(LossConfig(ppo_micro_batch_size=3)).grads(make_params(0), make_batch(0))


@pytest.mark.parametrize("micro", [None, 4])
def test_logits_of_the_trained_tokens_only_give_the_same_update(micro):
    """`capacity`: each row's trained tokens gathered into [B, capacity] (no logits for the
    others) gives the full pass's loss, gradient and metrics; the recompute is 0 elsewhere."""
    from jscenegen.grpo.algo.logprobs import selection_capacity

    params, batch = make_params(8), make_batch(8)
    cap = selection_capacity(batch["loss_mask"], multiple=4)
    assert batch["loss_mask"].sum(axis=1).max() <= cap < T
    st = steps(LossConfig(use_kl_loss=True, kl_coef=0.1, entropy_coeff=0.01, logprob_chunk=5,
                          ppo_micro_batch_size=micro))
    g_full, l_full, _, s_full = st.grads(params, batch)
    g_sel, l_sel, _, s_sel = st.grads(params, batch, capacity=cap)
    assert _rel(g_full, g_sel) <= 1e-6 and float(jnp.max(jnp.abs(g_sel["w"]))) > 1e-4
    assert float(l_sel) == pytest.approx(float(l_full), rel=1e-6, abs=1e-7)
    for key in s_full:
        assert float(s_sel[key]) == pytest.approx(float(s_full[key]), rel=1e-5, abs=1e-6), key
    full, _ = st.logprobs(params, batch["input_ids"], batch["attention_mask"])
    sel, _ = st.logprobs(params, batch["input_ids"], batch["attention_mask"], batch["loss_mask"],
                         capacity=cap)
    on = batch["loss_mask"] > 0
    np.testing.assert_allclose(np.asarray(sel)[on], np.asarray(full)[on], atol=1e-6)
    assert not np.asarray(sel)[~on].any()
    # a capacity below a row's trained count cannot pass unnoticed: the update is skipped
    _, met = st.step(init_train_state(params, st.optim_cfg), batch, capacity=2)
    assert float(met["skipped"]) == 1


def test_columns_after_the_last_trained_token_change_nothing():
    """The trainer drops the columns after every row's last trained token (`build_group_batch`):
    for a causal model the loss, gradient and metrics are those of the whole batch."""
    params, batch = make_params(3), make_batch(3)
    batch["loss_mask"][:, 8:] = 0
    batch["advantages"][:, 8:] = 0
    st = steps(LossConfig(use_kl_loss=True, kl_coef=0.1, entropy_coeff=0.01, logprob_chunk=5))
    g_whole, l_whole, _, s_whole = st.grads(params, batch)
    g_cut, l_cut, _, s_cut = st.grads(params, {k: v[:, :8] if v.ndim == 2 else v
                                               for k, v in batch.items()})
    assert _rel(g_whole, g_cut) <= 1e-6
    assert float(l_cut) == pytest.approx(float(l_whole), rel=1e-6)
    for key in s_whole:
        assert float(s_cut[key]) == pytest.approx(float(s_whole[key]), rel=1e-5, abs=1e-7), key


def test_the_model_is_asked_for_the_positions_before_the_trained_tokens_only():
    """With a capacity the model computes [B, capacity] hidden states (`rows=`: each row's
    trained positions less one, in order, then filler), never the whole [B, T]."""
    from jscenegen.grpo.algo.logprobs import model_token_logprobs

    params, batch = make_params(8), make_batch(8)
    asked = []

    def recording(params, input_ids, attention_mask, rows=None):
        asked.append(None if rows is None else np.asarray(rows))
        return hidden_fn(params, input_ids, attention_mask, rows)

    model_token_logprobs(recording, params, jnp.asarray(batch["input_ids"]),
                         jnp.asarray(batch["attention_mask"]), select=jnp.asarray(batch["loss_mask"]),
                         capacity=8)
    (rows,) = asked
    assert rows.shape == (B, 8)
    for r in range(B):
        trained = np.flatnonzero(batch["loss_mask"][r])
        np.testing.assert_array_equal(rows[r, :len(trained)], trained - 1)


def test_steps_of_equal_models_and_configs_share_their_compiled_functions():
    """A second trainer of one run in a process (a resume) re-traced and re-lowered every
    step function (~5 s for the tiny model): equal model structures and configs now share
    them; any difference (config, temperature, concrete frozen arrays) does not."""
    from flax import nnx

    from jscenegen.model.config import preset_config
    from jscenegen.model.functional import hidden_fn as model_hidden_fn
    from jscenegen.model.functional import split_params
    from jscenegen.model.qwen import QwenForCausalLM

    def step_of(seed, loss=None, temperature=1.0):
        model = QwenForCausalLM(preset_config("qwen3", "micro", vocab_size=256), rngs=nnx.Rngs(seed))
        graphdef, _, frozen = split_params(model)
        return GRPOStep(model_hidden_fn(graphdef, frozen), loss or LossConfig(), OptimConfig(),
                        temperature=temperature)

    first = step_of(0)
    assert step_of(1).step is first.step and step_of(2).logprobs is first.logprobs
    assert step_of(3, loss=LossConfig(clip_high=0.28)).step is not first.step
    assert step_of(4, temperature=0.7).step is not first.step
    graphdef = split_params(QwenForCausalLM(preset_config("qwen3", "micro", vocab_size=256),
                                            rngs=nnx.Rngs(5)))[0]
    concrete = {"x": jnp.zeros(3)}
    assert model_hidden_fn(graphdef, concrete) != model_hidden_fn(graphdef, concrete)
