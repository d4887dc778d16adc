"""optax torch-AdamW + clip + schedules against torch.optim.AdamW, clip_grad_norm_ and
transformers' LR schedules (VERL's formulas)."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jscenegen.grpo.algo.config import OptimConfig
from jscenegen.grpo.algo.optimizer import (
    apply_gradients,
    init_train_state,
    lr_at,
    make_optimizer,
    optimizer_step,
    param_names,
    state_from_canonical,
    state_to_canonical,
)
from jscenegen.parity import torch_reference as ref

SHAPES = {"embed": (7, 5), "layer.bias": (5,), "norm": (5,)}


def _params(seed=0):
    rng = np.random.default_rng(seed)
    p = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    p["norm"] = (1.0 + 0.01 * rng.normal(size=SHAPES["norm"])).astype(np.float32)  # weights near 1
    p["embed"][0, :] = [1e-3, -300.0, 0.0, 40.0, -1.0]
    return p


def _grads(seed, scale=3.0):
    rng = np.random.default_rng(100 + seed)
    return {k: (scale * rng.normal(size=s)).astype(np.float32) for k, s in SHAPES.items()}


def _bound(p):
    return 2.4e-7 * np.maximum(1.0, np.abs(p))


def _run_both(cfg, steps, grad_scale=3.0):
    p0 = _params()
    tparams = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in p0.items()}
    opt, sched = ref.make_torch_optimizer(list(tparams.values()), cfg)
    tx = make_optimizer(cfg)
    params = jax.tree.map(jnp.asarray, p0)
    state = tx.init(params)
    step = jax.jit(lambda g, s, p, lr: optimizer_step(tx, g, s, p, lr))
    for i in range(steps):
        g = _grads(i, grad_scale)
        for k, tp in tparams.items():
            tp.grad = torch.tensor(g[k])
        tnorm = torch.nn.utils.clip_grad_norm_(list(tparams.values()), cfg.grad_clip or float("inf"))
        opt.step()
        sched.step()
        params, state, norm, skipped = step(g, state, params, lr_at(cfg, i))
        assert not bool(skipped)
        assert float(norm) == pytest.approx(float(tnorm), rel=1e-6)
    return params, state, tparams, opt


@pytest.mark.parametrize("cfg", [
    OptimConfig(lr=1e-3, weight_decay=0.01, grad_clip=1.0),
    OptimConfig(lr=1e-6),  # the GRPO100 recipe
    OptimConfig(lr=2e-3, weight_decay=0.1, grad_clip=None, betas=(0.8, 0.99), eps=1e-6,
                lr_schedule="cosine", warmup_steps=1, total_steps=4),
])
def test_adamw_with_clip_equals_torch(cfg):
    params, state, tparams, opt = _run_both(cfg, steps=3)
    for k, tp in tparams.items():
        want = tp.detach().numpy()
        assert np.all(np.abs(np.asarray(params[k]) - want) <= _bound(want)), k
    canon = state_to_canonical(state)
    assert canon["count"] == 3
    for k, tp in tparams.items():
        st = opt.state[tp]
        assert int(st["step"]) == 3
        np.testing.assert_allclose(canon["mu"][k], st["exp_avg"].numpy(), rtol=1e-6, atol=1e-12)
        np.testing.assert_allclose(canon["nu"][k], st["exp_avg_sq"].numpy(), rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.8, 0.95), (0.0, 0.99)])
def test_adam_updates_equal_torchs_to_float32_rounding(betas):
    """The parameter bound above (2.4e-7 x max(1, |p|)) hides an error in small updates: the
    bias corrections were taken as 1 - float32(b)**t, and float32(0.999)'s rounding made every
    update ~7e-6 too small (torch computes them in double). From p = 0 the parameters are the
    updates: equal to torch's within a few ulps, step after step (atol: where they cancel to
    near 0, 1e-6 of one update)."""
    cfg = OptimConfig(lr=1e-3, weight_decay=0.0, grad_clip=None, betas=betas)
    tparam = torch.nn.Parameter(torch.zeros(64))
    opt, _ = ref.make_torch_optimizer([tparam], cfg)
    tx = make_optimizer(cfg)
    params = {"w": jnp.zeros(64, jnp.float32)}
    state = tx.init(params)
    step = jax.jit(lambda g, s, p: optimizer_step(tx, g, s, p, cfg.lr))
    rng = np.random.default_rng(0)
    for _ in range(12):
        g = rng.normal(size=64).astype(np.float32) + 1.0
        tparam.grad = torch.tensor(g)
        opt.step()
        params, state, _, _ = step({"w": g}, state, params)
        np.testing.assert_allclose(np.asarray(params["w"]), tparam.detach().numpy(), rtol=1e-6, atol=1e-9)


def test_a_beta_outside_0_1_is_refused_by_name():
    from jscenegen.grpo.algo.optimizer import torch_adamw

    tx = torch_adamw(b1=1.0)
    with pytest.raises(ValueError, match=r"Adam beta 1.0 is outside \[0, 1\)"):
        tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}), {"w": jnp.ones(2)}, learning_rate=1e-3)


def test_one_step_with_active_clip_moves_parameters():
    cfg = OptimConfig(lr=1e-3, grad_clip=1.0)
    params, _, tparams, _ = _run_both(cfg, steps=1, grad_scale=50.0)
    moved = np.abs(np.asarray(params["layer.bias"]) - _params()["layer.bias"])
    assert np.all(moved > 5e-4)  # Adam's first step is ~lr per coordinate


def test_a_gradient_below_the_clip_norm_is_not_scaled_up():
    """clip_grad_norm_ only shrinks: coef = min(1, max_norm / (norm + 1e-6)). Gradients of norm
    ~0.05 under grad_clip=1.0 enter Adam unscaled: the moments equal torch's (a coefficient of
    ~20 would scale exp_avg by 20 and exp_avg_sq by 400; Adam's update alone barely shows it)."""
    cfg = OptimConfig(lr=1e-3, weight_decay=0.01, grad_clip=1.0)
    params, state, tparams, opt = _run_both(cfg, steps=2, grad_scale=0.01)
    canon = state_to_canonical(state)
    for k, tp in tparams.items():
        st = opt.state[tp]
        np.testing.assert_allclose(canon["mu"][k], st["exp_avg"].numpy(), rtol=1e-6, atol=1e-12)
        np.testing.assert_allclose(canon["nu"][k], st["exp_avg_sq"].numpy(), rtol=1e-6, atol=1e-14)
        want = tp.detach().numpy()
        assert np.all(np.abs(np.asarray(params[k]) - want) <= _bound(want)), k


def test_bf16_parameters_keep_fp32_moments_and_round_torchs_fp32_update():
    """model.param_dtype=bfloat16: the moments stay float32 (a checkpoint holds fp32 Adam
    state; they were bf16 and the first save failed) and each step is torch AdamW's on the
    fp32 values of the bf16 parameters, rounded to bf16 (the reference rounds its parameters
    back to bf16 after every step)."""
    import ml_dtypes

    cfg = OptimConfig(lr=1e-2, weight_decay=0.01, grad_clip=1.0)   # steps above bf16's spacing
    p0 = {k: v.astype(ml_dtypes.bfloat16) for k, v in _params().items()}
    tparams = {k: torch.nn.Parameter(torch.tensor(v.astype(np.float32))) for k, v in p0.items()}
    opt, sched = ref.make_torch_optimizer(list(tparams.values()), cfg)
    tx = make_optimizer(cfg)
    params = jax.tree.map(jnp.asarray, p0)
    state = tx.init(params)
    assert {str(x.dtype) for x in jax.tree.leaves(state) if x.ndim} == {"float32"}
    step = jax.jit(lambda g, s, p, lr: optimizer_step(tx, g, s, p, lr))
    for i in range(3):
        g = _grads(i)
        for k, tp in tparams.items():
            tp.grad = torch.tensor(g[k].astype(ml_dtypes.bfloat16).astype(np.float32))
        torch.nn.utils.clip_grad_norm_(list(tparams.values()), cfg.grad_clip)
        opt.step()
        sched.step()
        with torch.no_grad():
            for tp in tparams.values():
                tp.copy_(tp.bfloat16().float())
        bf16_grads = {k: jnp.asarray(v, jnp.bfloat16) for k, v in g.items()}
        params, state, _, skipped = step(bf16_grads, state, params, lr_at(cfg, i))
        assert not bool(skipped)
    canon = state_to_canonical(state)
    for k, tp in tparams.items():
        assert params[k].dtype == jnp.bfloat16
        want = tp.detach().numpy()
        got = np.asarray(params[k].astype(jnp.float32))
        ulp = np.abs(want) * 2.0 ** -7   # one bf16 rounding step either way
        assert np.all(np.abs(got - want) <= ulp), k
        assert (got != _params()[k].astype(ml_dtypes.bfloat16).astype(np.float32)).any(), k
        assert canon["mu"][k].dtype == np.float32
        np.testing.assert_allclose(canon["mu"][k], opt.state[tp]["exp_avg"].numpy(), rtol=1e-5)


def test_non_finite_gradient_is_skipped_and_state_unchanged():
    cfg = OptimConfig(lr=1e-3)
    tx = make_optimizer(cfg)
    params = jax.tree.map(jnp.asarray, _params())
    state = tx.init(params)
    params, state, _, _ = optimizer_step(tx, _grads(0), state, params, 1e-3)
    for bad in (np.nan, np.inf):
        g = _grads(1)
        g["norm"][2] = bad
        p2, s2, norm, skipped = optimizer_step(tx, g, state, params, 1e-3)
        assert bool(skipped) and not np.isfinite(float(norm))
        for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((p2, s2))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_donated_update_copies_no_parameter_or_moment():
    """Each moment is read by one fusion and updated in place: XLA used to recompute the moments
    inside the parameters' fusions and so copied every mu and nu before the update."""
    cfg = OptimConfig(lr=1e-3)
    state = init_train_state(jax.tree.map(jnp.asarray, _params()), cfg)
    step = jax.jit(functools.partial(apply_gradients, make_optimizer(cfg), cfg), donate_argnums=0)
    hlo = step.lower(state, _grads(0)).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    inputs = dict(re.findall(r"%(\S+) = (\S+)\{?[^ ]* parameter\(\d+\)", entry))
    copied = {name for name in re.findall(r" copy\(%(\S+)\)", entry)
              if name in inputs and not inputs[name].endswith("[]")}
    assert len(inputs) == 1 + 3 * len(SHAPES) + 2 + len(SHAPES)   # count, params/mu/nu, 2 counters, grads
    assert copied == set()


@pytest.mark.parametrize("cfg", [
    OptimConfig(lr=1e-6, warmup_steps=3),
    OptimConfig(lr=1e-6),
    OptimConfig(lr=1e-5, lr_schedule="cosine", warmup_steps=2, total_steps=10, min_lr_ratio=0.1),
    OptimConfig(lr=1e-5, lr_schedule="cosine", total_steps=7),
    OptimConfig(lr=1e-5, lr_schedule="cosine", warmup_steps=1, total_steps=9, min_lr_ratio=0.2,
                num_cycles=1.0),
])
def test_schedule_equals_transformers_schedulers(cfg):
    """jscenegen's LR (the jitted float32 `lr_at` and the double `lr_schedule.lr_lambda` a
    converted checkpoint resumes at) at each scheduler count equals the LR that transformers'
    `get_constant_schedule_with_warmup` / `get_cosine_with_min_lr_schedule_with_warmup`
    (VERL's formulas: the torch reference builds its LambdaLR from them, not from ours)
    give torch.optim.AdamW, read before each optimizer step."""
    from jscenegen.lr_schedule import lr_lambda

    p = torch.nn.Parameter(torch.zeros(1))
    opt, sched = ref.make_torch_optimizer([p], cfg)
    assert sched.lr_lambdas[0].func.__module__.startswith("transformers.")   # not our lambda
    for s in range(14):
        want = opt.param_groups[0]["lr"]
        assert float(lr_at(cfg, s)) == pytest.approx(want, abs=1e-6 * cfg.lr), s
        assert cfg.lr * lr_lambda(cfg, s) == pytest.approx(want, rel=1e-12, abs=1e-20), s
        opt.step()
        sched.step()


def test_cosine_schedule_values_of_verls_formula():
    """VERL's get_cosine_schedule_with_warmup (warmup 2, total 10, min_lr_ratio 0.1) worked by
    hand: warmup from 0, half a cosine down to the floor, past the total back up."""
    cfg = OptimConfig(lr=1.0, lr_schedule="cosine", warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    want = {0: 0.0, 1: 0.5, 2: 1.0, 4: 0.55 + 0.45 * np.cos(np.pi / 4), 6: 0.55, 10: 0.1,
            11: 0.55 + 0.45 * np.cos(1.125 * np.pi)}
    p = torch.nn.Parameter(torch.zeros(1))
    opt, sched = ref.make_torch_optimizer([p], cfg)
    got = {}
    for s in range(12):
        got[s] = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
    for s, value in want.items():
        assert got[s] == pytest.approx(value, abs=1e-12), s
        assert float(lr_at(cfg, s)) == pytest.approx(value, abs=1e-6), s


def test_canonical_roundtrip_and_resume_from_torch_state():
    """Load torch's step/exp_avg/exp_avg_sq after 2 steps; our third step equals torch's."""
    cfg = OptimConfig(lr=1e-3)
    _, _, tparams, opt = _run_both(cfg, steps=2)
    tx = make_optimizer(cfg)
    params = {k: jnp.asarray(tp.detach().numpy()) for k, tp in tparams.items()}
    canon = {"count": 2,
             "mu": {k: opt.state[tp]["exp_avg"].numpy() for k, tp in tparams.items()},
             "nu": {k: opt.state[tp]["exp_avg_sq"].numpy() for k, tp in tparams.items()}}
    state = state_from_canonical(canon, tx.init(params))
    back = state_to_canonical(state)
    assert back["count"] == 2
    for k in SHAPES:
        np.testing.assert_array_equal(back["mu"][k], canon["mu"][k])
    g = _grads(2)
    for k, tp in tparams.items():
        tp.grad = torch.tensor(g[k])
    torch.nn.utils.clip_grad_norm_(list(tparams.values()), 1.0)
    opt.step()
    new, _, _, _ = optimizer_step(tx, g, state, params, lr_at(cfg, 2))
    for k, tp in tparams.items():
        want = tp.detach().numpy()
        assert np.all(np.abs(np.asarray(new[k]) - want) <= _bound(want)), k
    with pytest.raises(KeyError, match="norm"):
        state_from_canonical({"count": 1, "mu": {k: v for k, v in canon["mu"].items() if k != "norm"},
                              "nu": canon["nu"]}, tx.init(params))


def test_param_names_of_nnx_state():
    from flax import nnx

    class Lin(nnx.Module):
        def __init__(self):
            self.weight = nnx.Param(jnp.zeros((2, 2)))

    class Model(nnx.Module):
        def __init__(self):
            self.layers = nnx.List([Lin(), Lin()])

    _, st = nnx.split(Model(), nnx.Param)
    assert param_names(st) == ["layers.0.weight", "layers.1.weight"]
