"""`jscenegen parity grpo-step`: one GRPO update in jscenegen and in the torch baseline.

The torch side is transformers' torch model on the same HF directory (Qwen2/Qwen3; Qwen3.5 as
Qwen3_5ForConditionalGeneration or Qwen3_5ForCausalLM, text only; fp32, eager attention, VERL's
position ids for left padding), the spec formulas of
`torch_reference` and torch.optim.AdamW + clip_grad_norm_ + transformers' LR schedule
(`torch_reference.make_torch_optimizer`). The batch is fixed
and synthetic: 2 groups of 4 episodes with random rewards (one policy failure, -1), left
padding, environment text and two policy roles (Planner and Designer turns); the update
trains one role. Old log-probs are each side's own recompute plus one shared perturbation
(so the clip bounds are reached); the optional reference log-probs are shared likewise.

Prints one JSON line; exit 1 when beyond the tolerances: |loss diff| <= 1e-5, the grad-norm
ratio within 1 +- 1e-4 (with `--grads`, every gradient element within 1e-4 of the largest
torch one), every trained parameter within 2.4e-7 x max(1, |p|) of torch's after the step
(fp32), every frozen tensor (Qwen3.5's carried vision tower and mtp.*) unchanged. The result
names what the run cannot see (`constant_tensors`, `weight_decay_visible`: `parity.coverage`). The gradient
checks are what catch a gradient off by a constant factor: Adam's first step, lr g / (|g| +
eps), is about lr sign(g) whatever the gradient's size, and clipping rescales it as a whole.
"""
from __future__ import annotations

import numpy as np

from jscenegen.grpo.algo.roles import DESIGNER, ENVIRONMENT, PLANNER
from jscenegen.model.weights import constant_tensors
from jscenegen.parity.coverage import weight_decay_visible

LOSS_TOL = 1e-5   # on `loss_gap`: relative to the loss once |loss| > 1 (token-sum grows with tokens)
PARAM_TOL = 2.4e-7
ADV_TOL = 1e-6   # advantages (unit scale), jscenegen's vectorised formula vs the torch loops
GRAD_NORM_TOL = 1e-4   # on |grad_norm_ratio - 1|
GRADS_TOL = 1e-4   # on grad_max_rel_diff (`--grads`)
PER_TENSOR_FLOOR = 1e-3   # grad_max_rel_diff_per_tensor's least scale, of the largest gradient
# a synthetic episode's first designer token lies within its first MIN_SEQ tokens (left padding
# <= 6, a 3-token prompt, a planner turn <= 5 tokens, 2 environment tokens)
MIN_SEQ = 17
VISION_PREFIX = "model.visual."


def loss_gap(loss_jax: float, loss_torch: float) -> float:
    """|loss_jax - loss_torch| / max(1, |loss_torch|): absolute for losses of order one (the
    token-mean modes), relative for sums that grow with the batch (token-sum)."""
    return abs(loss_jax - loss_torch) / max(1.0, abs(loss_torch))


def synthetic_batch(vocab: int, *, rows: int = 8, seq: int = 32, group_size: int | None = None,
                    selected: int = DESIGNER, seed: int = 0, pad_rows: int = 0,
                    masked_rows: int = 0, adv_eps: float = 1e-6,
                    norm_adv_by_std: bool = True) -> dict:
    """A fixed GRPO batch as numpy arrays.

    `rows` episodes in groups of `group_size` (default rows / 2: two groups; advantages with
    `adv_eps` and `norm_adv_by_std` as `loss.*` sets them), then `pad_rows` all-padding rows (zero
    attention and loss masks, as rows are padded to a multiple of the mesh's fsdp axis).
    The last `masked_rows` episodes are masked as `build_group_batch` masks a judge or runtime
    failure: not valid (out of their group's statistics, advantage 0), ids, attention and loss
    masks zeroed, but still episodes (`episode_mask` 1).
    Returns input_ids/attention_mask [R, seq] int32 (left padding of 0-6 tokens), roles
    [rows, seq] int32, policy_mask [rows, seq] bool, scores/valid/group_ids/episode_advantages
    [rows], episode_mask [R] float32 (1 on the `rows` episodes, 0 on the padding rows), and
    loss_mask/advantages [rows, seq] float32 for role `selected`, plus old_delta/ref_delta
    [rows, seq] float32 perturbations (N(0, 0.3)) for the old/reference log-probs.
    Raises ValueError when `masked_rows` is not below `rows`.
    """
    if not 0 <= masked_rows < rows:
        raise ValueError(f"masked_rows {masked_rows}: 0 to rows - 1 = {rows - 1} episodes")
    from jscenegen.grpo.algo.advantages import grpo_outcome_advantages
    from jscenegen.grpo.algo.roles import role_loss_mask

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (rows, seq)).astype(np.int32)
    mask = np.ones((rows, seq), np.int32)
    roles = np.full((rows, seq), ENVIRONMENT, np.int32)
    policy = np.zeros((rows, seq), bool)
    for r in range(rows):
        pad = int(rng.integers(0, 7))
        mask[r, :pad] = 0
        ids[r, :pad] = 0
        t = pad + 3  # system/scene prompt
        for role in (PLANNER, DESIGNER, DESIGNER):
            turn = int(rng.integers(3, 6))
            roles[r, t:t + turn] = role
            policy[r, t:t + turn] = True
            t += turn + 2  # environment observation after each turn
    group_size = group_size or max(rows // 2, 1)
    groups = np.repeat(np.arange(rows // group_size), group_size)
    scores = rng.uniform(0, 1, rows).astype(np.float32)
    scores[1] = -1.0  # a policy failure is an ordinary member
    valid = np.ones(rows, bool)
    valid[rows - masked_rows:] = False
    for a in (ids, mask, roles, policy):
        a[rows - masked_rows:] = 0
    adv = np.asarray(grpo_outcome_advantages(scores, groups, valid, eps=adv_eps,
                                             norm_by_std=norm_adv_by_std, group_size=group_size))
    loss_mask = np.asarray(role_loss_mask(roles, policy, selected)) * mask
    episode_adv = adv
    adv = adv[:, None] * loss_mask
    if pad_rows:
        extra = lambda a: np.concatenate([a, np.zeros((pad_rows, *a.shape[1:]), a.dtype)])  # noqa: E731
        ids, mask, roles, policy, loss_mask, adv = map(extra, (ids, mask, roles, policy, loss_mask, adv))
    episode_mask = np.r_[np.ones(rows), np.zeros(pad_rows)].astype(np.float32)
    return {
        "input_ids": ids, "attention_mask": mask, "roles": roles, "policy_mask": policy,
        "scores": scores, "valid": valid, "group_ids": groups, "episode_mask": episode_mask,
        "episode_advantages": episode_adv.astype(np.float32),
        "loss_mask": loss_mask.astype(np.float32),
        "advantages": adv.astype(np.float32),
        "old_delta": rng.normal(0, 0.3, (rows + pad_rows, seq)).astype(np.float32),
        "ref_delta": rng.normal(0, 0.3, (rows + pad_rows, seq)).astype(np.float32),
    }


def torch_policy(model_dir: str, model_type: str, *, train_vision: bool = False,
                 perturbation: float = 0.0):
    """transformers' torch model of `model_dir` as the torch baseline trains it: fp32, eager
    attention (`logits.torch_model`: Qwen3_5ForConditionalGeneration for qwen3_5, fed text
    only), the vision tower frozen (requires_grad False: no gradient, no AdamW state, as for
    jscenegen's carried tower) unless `train_vision`, and `perturbation` added to one
    embedding weight (`torch_reference.perturb_embedding`)."""
    from jscenegen.parity import torch_reference as ref
    from jscenegen.parity.logits import torch_model

    tmodel = torch_model(str(model_dir), model_type, "float32")
    for name, p in tmodel.named_parameters():
        if name.startswith(VISION_PREFIX) and not train_vision:
            p.requires_grad_(False)
    ref.perturb_embedding(tmodel, perturbation)
    return tmodel


def trained_names(tmodel) -> set[str]:
    """Names of the torch parameters the baseline trains (requires_grad)."""
    return {n for n, p in tmodel.named_parameters() if p.requires_grad}


def frozen_unchanged(model, model_dir: str, tmodel, torch_before: dict) -> bool:
    """True when no frozen tensor moved: jscenegen's carried ones (vision tower, mtp.*) still
    equal the HF file's bitwise (`hf_io.iter_hf_tensors`), and torch's frozen parameters
    equal `torch_before` ({name: array} taken before the updates)."""
    from jscenegen.model.hf_io import iter_hf_tensors
    from jscenegen.model.weights import Carried, named_weights

    carried = {n: v for n, v in named_weights(model).items() if isinstance(v, Carried)}
    ok = all(np.array_equal(np.asarray(carried[n][...])[: carried[n].rows], a)
             for n, a in iter_hf_tensors(model_dir, model.cfg) if n in carried)
    return ok and all(np.array_equal(p.detach().numpy(), torch_before[n])
                      for n, p in tmodel.named_parameters() if not p.requires_grad)


def jax_policy(model_dir: str, loss_cfg, optim_cfg, temperature: float, train_vision: bool):
    """(model, params, names, step): the fp32 jscenegen side of a parity run, loaded from
    `model_dir`, its trainable `nnx.Param` state, their HF names and the uncompiled GRPOStep
    (no donation: the caller keeps the parameters to compare)."""
    from jscenegen.grpo.algo.optimizer import param_names
    from jscenegen.grpo.train.step import GRPOStep
    from jscenegen.model.functional import hidden_fn, split_params
    from jscenegen.model.hf_io import load_hf

    model = load_hf(model_dir, param_dtype="float32", compute_dtype="float32",
                    train_vision=train_vision)
    graphdef, params, frozen = split_params(model)
    step = GRPOStep(hidden_fn(graphdef, frozen), loss_cfg, optim_cfg,
                    temperature=temperature, donate=False)
    return model, params, param_names(params), step


def require_a_learning_rate(optim_cfg, updates: int) -> None:
    """Raise ValueError when the learning rate (`lr_at`) is 0 at every one of the first
    `updates` scheduler steps: no parameter would move, so a parity run would compare nothing
    and pass."""
    from jscenegen.grpo.algo.optimizer import lr_at

    if any(float(lr_at(optim_cfg, k)) != 0.0 for k in range(updates)):
        return
    which = ("the update's learning rate is 0" if updates == 1 else
             f"the learning rate is 0 at all {updates} updates")
    raise ValueError(f"{which} (optim lr={optim_cfg.lr}, warmup_steps={optim_cfg.warmup_steps}): "
                     "no parameter moves, so nothing would be compared; give a learning rate > 0 "
                     + ("at step 0" if updates == 1 else "within them"))


def grpo_step_parity(model_dir: str, *, loss_cfg=None, optim_cfg=None, temperature: float = 1.0,
                     seed: int = 0, rows: int = 8, seq: int = 32, pad_rows: int = 0,
                     masked_rows: int = 0, compare_grads: bool = False, torch_perturbation: float = 0.0,
                     train_vision: bool = False) -> dict:
    """Run one update both ways; returns the comparison (see module doc) with `ok`.

    With `compare_grads` the accumulated gradients are also compared element-wise
    (`grad_max_rel_diff` = max |g_jax - g_torch| / max |g_torch|; one more compile), and
    each trained tensor against its own largest gradient, floored at PER_TENSOR_FLOOR of the
    largest of all (`grad_max_rel_diff_per_tensor`, the largest such ratio, and
    `grad_worst_tensor`, its name; reported, not part of `ok`).
    `torch_perturbation` is added to one element of torch's input embedding first (shows the
    comparison can fail; `ref.perturb_embedding`). `masked_rows`: that many of the `rows`
    episodes masked as a judge failure is (`synthetic_batch`); they stay episodes of the
    mini-batch (the sequence modes' G counts them on both sides).

    Qwen3.5: transformers' Qwen3_5ForConditionalGeneration (qwen3_5) or Qwen3_5ForCausalLM,
    fed text with explicit position ids. The trained tensors are compared (`trained_tensors`);
    the frozen ones (the vision tower unless `train_vision`, and mtp.*, which transformers
    never builds) must be unchanged on both sides (`frozen_unchanged`). With `train_vision`
    the tower is trained on both sides with a zero gradient (VERL's dummy image): AdamW
    decays it, p (1 - lr wd), in both.

    Micro-batching: jscenegen uses `loss_cfg.ppo_micro_batch_size` (one micro-batch when it
    covers the rows); torch uses the same row blocks, with VERL 0.9's global or the legacy
    per-micro-batch normalisation as configured. Advantages follow `loss_cfg.adv_eps` and
    `norm_adv_by_std`; both sides train on jscenegen's, and the torch loops' own are compared
    (`advantages_max_diff`). `lr` is the rate the update used (the schedule at step 0).
    Raises ValueError when that rate is 0 (nothing would move), for `seq` < MIN_SEQ (no token
    trained) and a micro-batch size that does not divide the rows; ImportError without
    torch, and the loaders' errors for a bad directory.
    """
    import jax
    import torch

    from jscenegen.grpo.algo.accumulate import num_micro_batches
    from jscenegen.grpo.algo.config import LossConfig, OptimConfig
    from jscenegen.grpo.algo.optimizer import init_train_state, lr_at
    from jscenegen.parity import torch_reference as ref

    loss_cfg = loss_cfg or LossConfig()
    optim_cfg = optim_cfg or OptimConfig()
    require_a_learning_rate(optim_cfg, 1)
    lr = float(lr_at(optim_cfg, 0))
    if seq < MIN_SEQ:
        raise ValueError(f"seq {seq}: the synthetic episodes need >= {MIN_SEQ} tokens to train one")
    k = num_micro_batches(rows + pad_rows, loss_cfg.ppo_micro_batch_size, "ppo_micro_batch_size")
    model, params, names, step = jax_policy(model_dir, loss_cfg, optim_cfg, temperature,
                                            train_vision)
    data = synthetic_batch(model.cfg.vocab_size, rows=rows, seq=seq, seed=seed, pad_rows=pad_rows,
                           masked_rows=masked_rows, adv_eps=loss_cfg.adv_eps, norm_adv_by_std=loss_cfg.norm_adv_by_std)
    t_adv = ref.grpo_advantages(data["scores"], data["group_ids"], data["valid"],
                                loss_cfg.adv_eps, loss_cfg.norm_adv_by_std).numpy()
    adv_diff = float(np.max(np.abs(data["episode_advantages"] - t_adv)))
    rows = rows + pad_rows
    on = data["loss_mask"] > 0

    jax_old, _ = step.logprobs(params, data["input_ids"], data["attention_mask"])
    jax_old = np.asarray(jax_old)
    batch = {k: data[k] for k in ("input_ids", "attention_mask", "loss_mask", "advantages",
                                  "episode_mask")}
    batch["old_logp"] = np.where(on, jax_old + data["old_delta"], 0.0).astype(np.float32)
    if loss_cfg.use_kl_loss:
        batch["ref_logp"] = np.where(on, jax_old + data["ref_delta"], 0.0).astype(np.float32)
    state, metrics = step.step(init_train_state(params, optim_cfg), batch)
    jax_new = dict(zip(names, (np.asarray(x) for x in jax.tree.leaves(state.params))))

    torch.manual_seed(0)
    tmodel = torch_policy(model_dir, model.cfg.model_type, train_vision=train_vision,
                          perturbation=torch_perturbation)
    torch_frozen = {n: p.detach().numpy().copy() for n, p in tmodel.named_parameters()
                    if not p.requires_grad}
    tb = {"input_ids": torch.from_numpy(data["input_ids"].astype(np.int64)),
          "attention_mask": torch.from_numpy(data["attention_mask"].astype(np.int64))}
    with torch.no_grad():
        t_old, _ = ref.shifted_logprobs(tmodel, tb["input_ids"], tb["attention_mask"], temperature)
    t_old = t_old.numpy()
    for key in ("loss_mask", "advantages"):
        tb[key] = torch.from_numpy(data[key])
    tb["old_logp"] = torch.from_numpy(np.where(on, t_old + data["old_delta"], 0.0).astype(np.float32))
    if loss_cfg.use_kl_loss:
        tb["ref_logp"] = torch.from_numpy(
            np.where(on, t_old + data["ref_delta"], 0.0).astype(np.float32))
    t_metrics, t_grads, _, _ = ref.grpo_step(
        tmodel, tb, loss_cfg, optim_cfg, temperature=temperature,
        num_micro_batches=k, return_grads=compare_grads, episodes=rows - pad_rows)
    t_new = {n: p.detach().numpy() for n, p in tmodel.named_parameters() if p.requires_grad}

    missing = sorted(set(t_new) ^ set(jax_new))
    if missing:
        raise ValueError(f"trained parameter names differ between jscenegen and transformers: "
                         f"{missing[:5]}")
    rel = {n: np.abs(jax_new[n] - t_new[n]) / np.maximum(1.0, np.abs(t_new[n])) for n in names}
    worst = max(names, key=lambda n: float(rel[n].max()))
    worst_idx = np.unravel_index(int(np.argmax(rel[worst])), rel[worst].shape)
    param_diff = float(rel[worst][worst_idx])
    p0 = dict(zip(names, (np.asarray(x) for x in jax.tree.leaves(params))))
    upd_scale = max(float(np.max(np.abs(t_new[n] - p0[n]))) for n in names)
    upd_diff = max(float(np.max(np.abs((jax_new[n] - p0[n]) - (t_new[n] - p0[n])))) for n in names)
    loss_diff = loss_gap(float(metrics["loss"]), t_metrics["loss"])
    from jscenegen.model.weights import named_weights

    result = {
        "model_type": model.cfg.model_type, "train_vision": train_vision,
        "loss_jax": float(metrics["loss"]), "loss_torch": t_metrics["loss"], "loss_diff": loss_diff,
        "grad_norm_jax": float(metrics["grad_norm"]), "grad_norm_torch": t_metrics["grad_norm"],
        "grad_norm_ratio": float(metrics["grad_norm"]) / t_metrics["grad_norm"],
        "max_param_diff": param_diff, "worst_param": f"{worst}{list(map(int, worst_idx))}",
        "update_max": upd_scale, "update_max_diff": upd_diff,
        "old_logp_max_diff": float(np.max(np.abs(jax_old - t_old)[data["attention_mask"] > 0])),
        "clipfrac": float(metrics["clipfrac"]), "trained_tokens": int(on.sum()),
        "loss_agg_mode": loss_cfg.loss_agg_mode, "loss_scale": loss_cfg.loss_scale,
        "micro_batches": k, "rows": rows, "pad_rows": pad_rows, "masked_rows": masked_rows,
        "lr": lr,
        "norm_adv_by_std": loss_cfg.norm_adv_by_std, "advantages_max_diff": adv_diff,
        "trained_tensors": len(names), "frozen_tensors": len(named_weights(model)) - len(names),
        "frozen_unchanged": frozen_unchanged(model, model_dir, tmodel, torch_frozen),
        "tolerances": {"loss_diff": LOSS_TOL, "max_param_diff": PARAM_TOL,
                       "advantages_max_diff": ADV_TOL, "grad_norm_ratio": GRAD_NORM_TOL},
        "constant_tensors": constant_tensors(p0.items()),
        "weight_decay_visible": weight_decay_visible(lr, optim_cfg.weight_decay),
    }
    if train_vision:  # the tower's whole update is AdamW's decay, p (1 - lr wd), on both sides
        vision = [n for n in names if n.startswith(VISION_PREFIX)]
        result["vision_update_max"] = max(float(np.max(np.abs(t_new[n] - p0[n]))) for n in vision)
        result["vision_update_max_diff"] = max(
            float(np.max(np.abs((jax_new[n] - p0[n]) - (t_new[n] - p0[n])))) for n in vision)
    if compare_grads:
        grads = step.grads(params, batch)[0]
        jax_grads = dict(zip(names, (np.asarray(x) for x in jax.tree.leaves(grads))))
        g_scale = max(float(np.max(np.abs(g))) for g in t_grads.values())
        result["grad_max_rel_diff"] = max(
            float(np.max(np.abs(jax_grads[n] - t_grads[n]))) for n in names) / g_scale
        # against each tensor's own largest gradient (floored at 1e-3 of the global one, below
        # which fp32 rounding of the sums shows): an error in a tensor whose gradients are
        # small beside the embedding's (Qwen3.5's A_log, dt_bias) hides in the global scale
        own = {n: float(np.max(np.abs(jax_grads[n] - t_grads[n])))
               / max(float(np.max(np.abs(t_grads[n]))), PER_TENSOR_FLOOR * g_scale) for n in names}
        worst_own = max(own, key=own.get)
        result["grad_max_rel_diff_per_tensor"] = own[worst_own]
        result["grad_worst_tensor"] = worst_own
        # Adam's first step is lr g / (|g| + eps): near g = 0 a grad difference is amplified
        result["worst_param_grads"] = [float(jax_grads[worst][worst_idx]),
                                       float(t_grads[worst][worst_idx])]
        result["tolerances"]["grad_max_rel_diff"] = GRADS_TOL
    grads_ok = result.get("grad_max_rel_diff", 0.0) <= GRADS_TOL
    result["ok"] = bool(loss_diff <= LOSS_TOL and param_diff <= PARAM_TOL and adv_diff <= ADV_TOL
                        and abs(result["grad_norm_ratio"] - 1) <= GRAD_NORM_TOL and grads_ok
                        and result["frozen_unchanged"]
                        and not t_metrics["skipped"] and float(metrics["skipped"]) == 0)
    return result
