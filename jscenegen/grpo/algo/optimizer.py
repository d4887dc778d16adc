"""AdamW + global-norm clip + LR schedule with the exact update of torch.optim.AdamW.

torch (`torch/optim/adam.py::_single_tensor_adam`, decoupled_weight_decay=True, the CPU path)
and `torch.nn.utils.clip_grad_norm_`, as VERL's actor runs them (reference/verl.md 3.6):
  clip:  coef = min(1, max_norm / (||g||_2 + 1e-6));  g <- g * coef
  step:  t <- t + 1
         p <- p * (1 - lr * wd)                  (decay on every parameter)
         m <- m + (1 - b1) (g - m)               (lerp)
         v <- v * b2 + (1 - b2) g g
         p <- p - (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps)
The operations are done in torch's order, and the optax update is the exact difference
p_new - p, so `optax.apply_updates` lands on torch's fp32 result (the subtraction is exact
while the step is small against p). A non-finite gradient norm skips the step (params and
state unchanged) and is counted by the caller, as VERL's dp_actor does.

The LR is passed per step (`learning_rate=` extra arg): torch's LambdaLR advances even when
the optimizer step is skipped, so its count (`last_epoch`) lives outside the Adam state.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jscenegen.grpo.algo.config import OptimConfig
from jscenegen.model.weights import named_leaves

TORCH_CLIP_EPS = 1e-6


class TorchAdamWState(NamedTuple):
    """count: int32 [] optimizer steps taken (torch state["step"]); mu/nu: exp_avg/exp_avg_sq."""

    count: jax.Array
    mu: Any
    nu: Any


def as_float32(tree):
    """Every leaf of `tree` cast to float32 (gradients of bf16 parameters are clipped, normed
    and stepped in fp32)."""
    return jax.tree.map(lambda g: g.astype(jnp.float32), tree)


def torch_clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """`clip_grad_norm_`: g * min(1, max_norm / (global L2 norm + 1e-6)) (optax omits the 1e-6),
    in float32 (a bf16 gradient is scaled in fp32, as torch scales the fp32 gradients of VERL's
    master weights)."""

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        del params
        updates = as_float32(updates)
        norm = optax.tree_utils.tree_norm(updates)
        coef = jnp.minimum(max_norm / (norm + TORCH_CLIP_EPS), 1.0)
        return jax.tree.map(lambda g: g * coef, updates), state

    return optax.GradientTransformation(init_fn, update_fn)


def _one_minus_power(b: float, t: jax.Array) -> jax.Array:
    """1 - b**t (an Adam bias correction), 0 <= b < 1, for float32 t >= 1: within ~6 float32
    ulps of the exact value (measured up to t = 2^31; ~2 for b <= 0.99), which torch computes
    in double. `1 - float32(b)**t` carried float32(0.999)'s error (1.3e-8 in b, 1.3e-5
    relative in 1 - b): every update ~7e-6 too small. Raises ValueError for b outside [0, 1)."""
    if not 0.0 <= b < 1.0:
        raise ValueError(f"Adam beta {b} is outside [0, 1)")
    if b == 0.0:
        return jnp.ones_like(t)
    return -jnp.expm1(t * jnp.float32(math.log(b)))


def torch_adamw(b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01) -> optax.GradientTransformationExtraArgs:
    """torch.optim.AdamW as an optax transformation; `update(..., params, learning_rate=lr)`.

    Needs `params`. The moments are float32 whatever the parameters' dtype (as VERL's fp32
    master weights keep them; a checkpoint holds fp32 moments), and the update is computed in
    float32; the returned updates are float32 p_new - p, p_new computed in torch's order and
    rounded to the parameter's dtype, so `optax.apply_updates` lands on p_new exactly. torch's
    operation order, not its bits: XLA fuses each leaf's update and may contract a multiply and
    an add, so elements differ from torch.optim.AdamW by about an ulp (tests bound it at
    2.4e-7 x max(1, |p|)); how XLA fuses it (the barrier below changed it) moves a few
    elements by an ulp too.

    `skip` (bool [], optional extra arg): when True the count and moments keep their values and
    every update is 0 (a step skipped for a non-finite gradient). The guarded moments pass an
    optimization barrier before the parameter update reads them, so each moment is read by one
    fusion and, donated, updated in place: otherwise XLA recomputes them inside the parameter's
    fusion from the old values and first copies every moment (one copy of mu and nu per step).
    """

    def init_fn(params):
        def zeros(p):
            return jnp.zeros_like(p, dtype=jnp.float32)
        return TorchAdamWState(jnp.zeros((), jnp.int32), jax.tree.map(zeros, params),
                               jax.tree.map(zeros, params))

    def update_fn(updates, state, params=None, *, learning_rate, skip=None, **extra):
        del extra
        if params is None:
            raise ValueError("torch_adamw needs params (decoupled weight decay)")
        skip = jnp.zeros((), bool) if skip is None else skip
        count = jnp.where(skip, state.count, state.count + 1)
        t = (state.count + 1).astype(jnp.float32)
        lr = jnp.asarray(learning_rate, jnp.float32)
        step_size = lr / _one_minus_power(b1, t)
        bc2_sqrt = jnp.sqrt(_one_minus_power(b2, t))
        decay = 1.0 - lr * weight_decay

        def one(g, p, m_old, v_old):
            g, p32 = g.astype(jnp.float32), p.astype(jnp.float32)
            m = jnp.where(skip, m_old, m_old + (1.0 - b1) * (g - m_old))
            v = jnp.where(skip, v_old, v_old * b2 + ((1.0 - b2) * g) * g)
            m, v = jax.lax.optimization_barrier((m, v))
            denom = jnp.sqrt(v) / bc2_sqrt + eps
            p_new = jnp.where(skip, p32, p32 * decay + (-step_size * m) / denom)
            return p_new.astype(p.dtype).astype(jnp.float32) - p32, m, v   # exact: p + u = p_new

        out = jax.tree.map(one, updates, params, state.mu, state.nu)
        treedef = jax.tree.structure(updates)
        leaves = treedef.flatten_up_to(out)
        new_updates = treedef.unflatten([x[0] for x in leaves])
        mu = treedef.unflatten([x[1] for x in leaves])
        nu = treedef.unflatten([x[2] for x in leaves])
        return new_updates, TorchAdamWState(count, mu, nu)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformationExtraArgs:
    """clip (if cfg.grad_clip > 0) then torch AdamW; call update with learning_rate=lr_at(...)."""
    b1, b2 = cfg.betas
    adam = torch_adamw(b1, b2, cfg.eps, cfg.weight_decay)
    if cfg.grad_clip is not None and cfg.grad_clip > 0:
        return optax.chain(torch_clip_by_global_norm(cfg.grad_clip), adam)
    return optax.chain(adam)


def lr_multiplier(cfg: OptimConfig, step):
    """LambdaLR multiplier at scheduler count `step` (int or int32 array), float32.

    constant: step / max(1, warmup) during warmup, then 1
      (VERL `get_constant_schedule_with_warmup`);
    cosine: warmup as above, then max(min_lr_ratio, (1+min)/2 + (1-min)/2 cos(2 pi cycles p)),
      p = (step - warmup) / max(1, total - warmup) (VERL `get_cosine_schedule_with_warmup`).
    """
    s = jnp.asarray(step, jnp.float32)
    warm = float(cfg.warmup_steps)
    warmup = s / max(1.0, warm)
    if cfg.lr_schedule == "constant":
        after = jnp.ones_like(s)
    else:
        progress = (s - warm) / max(1.0, float(cfg.total_steps) - warm)
        x = jnp.cos(math.pi * float(cfg.num_cycles) * 2.0 * progress)
        lo = cfg.min_lr_ratio
        after = jnp.maximum(lo, x * ((1.0 - lo) * 0.5) + (1.0 + lo) * 0.5)
    return jnp.where(s < warm, warmup, after)


def schedule_ends_early(cfg: OptimConfig, steps: int, steps_key: str) -> str | None:
    """The warning for an LR schedule that does not fit the run's `steps` optimizer steps
    (named by config key `steps_key`): a warmup the run never finishes (it never trains at
    optim.lr), or a cosine schedule shorter than the run (past optim.total_steps the cosine
    climbs back towards optim.lr); None when the schedule fits the run."""
    said = []
    if steps > 1 and cfg.warmup_steps >= steps:   # the last step's scheduler count is steps - 1
        said.append(f"optim.warmup_steps={cfg.warmup_steps} is at or over {steps_key}={steps}: "
                    f"the run ends inside its warmup, its last step at "
                    f"{100 * (steps - 1) / cfg.warmup_steps:.0f}% of optim.lr")
    if cfg.lr_schedule == "cosine" and cfg.total_steps is not None and cfg.total_steps < steps:
        said.append(f"optim.total_steps={cfg.total_steps} is below {steps_key}={steps}: past it "
                    "the cosine LR climbs back towards optim.lr (VERL sizes the schedule to the "
                    "run's steps); raise optim.total_steps with the run's length")
    return "; ".join(said) or None


def lr_at(cfg: OptimConfig, step):
    """Learning rate used by the optimizer step taken at scheduler count `step` (float32)."""
    return cfg.lr * lr_multiplier(cfg, step)


def optimizer_step(tx, grads, opt_state, params, learning_rate):
    """One guarded update.

    Returns (params, opt_state, grad_norm float32 [], skipped bool []): when the global
    gradient norm (before clipping, as clip_grad_norm_ returns it) is not finite, params and
    opt_state come back unchanged and skipped is True (`tx` takes the `skip` extra arg, as
    `make_optimizer`'s does).
    """
    grad_norm = optax.tree_utils.tree_norm(as_float32(grads))
    skipped = ~jnp.isfinite(grad_norm)
    updates, new_state = tx.update(grads, opt_state, params, learning_rate=learning_rate,
                                   skip=skipped)
    new_params = optax.apply_updates(params, updates)
    keep = lambda old, new: jnp.where(skipped, old, new)  # noqa: E731  (-0.0 + 0 is +0.0)
    return jax.tree.map(keep, params, new_params), new_state, grad_norm, skipped


class TrainState(NamedTuple):
    """params: model parameters (pytree); opt_state: the optax state (clip + torch AdamW);
    lr_step: int32 [] LR-scheduler count (torch LambdaLR last_epoch; advances on skipped steps
    too); skipped_steps: int32 [] updates skipped for a non-finite gradient."""

    params: Any
    opt_state: Any
    lr_step: jax.Array
    skipped_steps: jax.Array


def init_train_state(params, optim_cfg: OptimConfig) -> TrainState:
    """Fresh optimizer state (zero moments, count 0) for `params`.

    Called eagerly on parameters placed on a mesh (NamedSharding), every moment takes its
    parameter's sharding (FSDP2: dim 0 over all devices, padded) and the counters are
    replicated on that mesh, so the compiled step's outputs match its inputs and it compiles
    once. (Under `jax.jit` the moments of `zeros_like` are laid out by propagation, which
    replicated them: measured on the 3 x 2 mesh; do not build the state inside jit.)
    """
    tx = make_optimizer(optim_cfg)
    state = TrainState(params, tx.init(params), jnp.zeros((), jnp.int32),
                       jnp.zeros((), jnp.int32))
    leaves = jax.tree.leaves(params)
    sharding = getattr(leaves[0], "sharding", None) if leaves else None
    if isinstance(sharding, NamedSharding) and not isinstance(leaves[0], jax.core.Tracer):
        replicated = NamedSharding(sharding.mesh, PartitionSpec())
        state = jax.tree.map(lambda x: jax.device_put(x, replicated) if x.ndim == 0 else x, state)
    return state


def apply_gradients(tx, optim_cfg: OptimConfig, state: TrainState, grads) -> tuple[TrainState, dict]:
    """One guarded AdamW update of `state` at the LR of its scheduler count (`lr_at`), the
    count advanced whether or not the step was skipped (torch LambdaLR). Returns (new state,
    {"grad_norm": float32 [] before clipping, "skipped": float32 [] 1.0 when a non-finite
    gradient skipped the step, "lr": float32 []})."""
    lr = lr_at(optim_cfg, state.lr_step)
    params, opt_state, grad_norm, skipped = optimizer_step(tx, grads, state.opt_state,
                                                           state.params, lr)
    new_state = TrainState(params, opt_state, state.lr_step + 1,
                           state.skipped_steps + skipped.astype(jnp.int32))
    return new_state, {"grad_norm": grad_norm, "skipped": skipped.astype(jnp.float32), "lr": lr}


def param_names(params) -> list[str]:
    """HF names of the leaves of a params pytree (nested dicts, an nnx.State or an Adam
    moment tree), in leaf order (`model.weights.param_name`)."""
    return list(named_leaves(params))


def adam_state(opt_state) -> TorchAdamWState:
    """The one TorchAdamWState of an optax state tree (count, mu, nu). Raises ValueError
    naming how many it holds otherwise."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, TorchAdamWState))
             if isinstance(s, TorchAdamWState)]
    if len(found) != 1:
        raise ValueError(f"expected one TorchAdamWState in the optimizer state, found {len(found)}")
    return found[0]


def state_to_canonical(opt_state) -> dict:
    """{"count": int32 [], "mu": {name: array}, "nu": {name: array}} (torch step/exp_avg/
    exp_avg_sq), names as `param_names`: the state's own arrays (jax.Arrays on their mesh, at
    their stored, possibly padded, shape; no host copy, so it works for arrays that span
    processes). Raises ValueError unless the state holds one TorchAdamWState."""
    st = adam_state(opt_state)
    return {"count": st.count, "mu": named_leaves(st.mu), "nu": named_leaves(st.nu)}


def state_from_canonical(canonical: dict, opt_state):
    """Return `opt_state` with count/mu/nu replaced from a canonical dict.

    Each array (NumPy, or a jax.Array on any mesh) must match the existing leaf's shape; it is
    copied into that leaf's dtype and sharding, never aliased.
    Raises KeyError naming a missing parameter, ValueError for a shape mismatch.
    """
    st = adam_state(opt_state)
    names = param_names(st.mu)

    def load(kind, tree):
        leaves = jax.tree.leaves(tree)
        out = []
        for name, old in zip(names, leaves):
            if name not in canonical[kind]:
                raise KeyError(f"optimizer state {kind!r} has no entry for parameter {name!r}")
            arr = canonical[kind][name]
            if arr.shape != old.shape:
                raise ValueError(f"optimizer state {kind}[{name!r}]: shape {arr.shape}, expected {old.shape}")
            if isinstance(arr, jax.Array):  # placed on device copies (may span other processes)
                out.append(jax.device_put(arr.astype(old.dtype), old.sharding, may_alias=False))
            else:
                out.append(jax.device_put(np.array(arr, dtype=old.dtype, copy=True), old.sharding))
        return jax.tree.unflatten(jax.tree.structure(tree), out)

    new = TorchAdamWState(
        jax.device_put(jnp.asarray(int(canonical["count"]), jnp.int32), st.count.sharding),
        load("mu", st.mu),
        load("nu", st.nu),
    )
    return jax.tree.map(
        lambda s: new if isinstance(s, TorchAdamWState) else s,
        opt_state,
        is_leaf=lambda x: isinstance(x, TorchAdamWState),
    )
