"""A small torch implementation of ../shared/specs/grpo.md, written independently of the JAX code.

It is the yardstick of the tests and of `jscenegen parity grpo-step`: the formulas are
written as VERL writes them (verl/trainer/ppo/core_algos.py, verl/utils/torch_functional.py,
verl/workers/actor/dp_actor.py, verl/workers/utils/losses.py), in torch, row by row where
that is the clearest. torch is imported lazily so the package never needs it.

Its defaults mirror VERL's actor (the parity tests hold them). `bench/train_step.py` also
times it with `TUNED_STEP`'s options, which change how much work a step does, not what it
computes: logits only at the positions whose next token is trained (transformers'
`logits_to_keep`), no division by a temperature of 1, the fused AdamW and foreach grad-norm
clipping.
"""
from __future__ import annotations

# grpo_step options a torch user tuning for speed would turn on (bench/train_step.py's tuned
# torch line); the parity tests use the defaults (VERL's eager formulas)
TUNED_STEP = {"trained_logits_only": True, "divide_at_unit_temperature": False,
              "optimizer_impl": "fused", "clip_foreach": True}


def _torch():
    import torch

    return torch


def grpo_advantages(scores, group_ids, valid, eps=1e-6, norm_by_std=True):
    """Per-episode advantages with Python loops over groups (torch.std, unbiased)."""
    torch = _torch()
    scores = torch.as_tensor(scores, dtype=torch.float32)
    out = torch.zeros_like(scores)
    ids = [int(i) for i in group_ids]
    ok = [bool(v) and bool(torch.isfinite(s)) for v, s in zip(valid, scores)]
    for g in sorted(set(ids)):
        members = [i for i, x in enumerate(ids) if x == g]
        good = [i for i in members if ok[i]]
        if len(members) == 1:
            if good:
                i = good[0]
                out[i] = scores[i] / (1.0 + eps) if norm_by_std else scores[i]
            continue
        if len(good) < 2:
            continue
        s = scores[good]
        mean, std = s.mean(), s.std()
        for i in good:
            out[i] = (scores[i] - mean) / (std + eps) if norm_by_std else scores[i] - mean
    return out


def masked_sum(x, mask):
    """sum(x * mask) over the entries where mask != 0 (NaN elsewhere ignored): VERL's
    `masked_sum`; torch tensors of one shape, returns a 0-d tensor."""
    torch = _torch()
    return torch.where(mask.bool(), x * mask, torch.zeros_like(x)).sum()


def agg_loss(loss_mat, mask, mode, batch_num_tokens=None, global_batch_size=None, horizon=None,
             legacy=False):
    """VERL agg_loss (0.9.1 with global info; legacy=True: 0.7-0.8 sum-norm)."""
    torch = _torch()
    mask = mask.float()
    lm = torch.where(mask.bool(), loss_mat * mask, torch.zeros_like(loss_mat))
    if mode == "token-sum":
        return lm.sum()
    if mode == "token-mean":
        n = mask.sum() if batch_num_tokens is None else torch.tensor(float(batch_num_tokens))
        return lm.sum() / torch.clamp(n, min=1.0)
    seq_sums, seq_means, nonempty = [], [], 0
    for r in range(lm.shape[0]):
        cnt = mask[r].sum()
        if cnt > 0:
            nonempty += 1
            seq_sums.append(lm[r].sum())
            seq_means.append(lm[r].sum() / (cnt + 1e-8))
    g = float(nonempty if global_batch_size is None else global_batch_size)
    g = max(g, 1.0)
    total_sum = torch.stack(seq_sums).sum() if seq_sums else lm.sum() * 0
    if mode == "seq-mean-token-sum":
        return total_sum / g
    if mode == "seq-mean-token-mean":
        return (torch.stack(seq_means).sum() if seq_means else lm.sum() * 0) / g
    if mode == "seq-mean-token-sum-norm":
        h = float(loss_mat.shape[-1] if horizon is None else horizon)
        return total_sum / h if legacy else total_sum / g / h
    raise ValueError(mode)


def policy_loss_terms(logp, old_logp, adv, clip_low, clip_high, clip_c):
    """compute_policy_loss_vanilla per token: (loss, neg_kl, clipped, clipped_lower, ratio)."""
    torch = _torch()
    neg_kl = torch.clamp(logp - old_logp, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip1 = torch.maximum(pg1, pg2)
    pg3 = -adv * clip_c
    clip2 = torch.min(pg3, clip1)
    loss = torch.where(adv < 0, clip2, clip1)
    return loss, -neg_kl, pg2 > pg1, (clip1 > pg3) & (adv < 0), ratio


def kl_penalty(logp, ref_logp, kind):
    """VERL kl_penalty_forward (and the '+' straight-through variants)."""
    torch = _torch()
    if kind.endswith("+"):
        fwd = kl_penalty(logp, ref_logp, kind[:-1])
        k2 = 0.5 * (logp - ref_logp).square()
        return k2 - k2.detach() + fwd.detach()
    if kind in ("kl", "k1"):
        return logp - ref_logp
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logp - ref_logp).square()
    if kind in ("low_var_kl", "k3"):
        kl = torch.clamp(ref_logp - logp, min=-20, max=20)
        return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    raise ValueError(kind)


def logprobs_from_logits(logits, tokens, temperature=1.0, with_entropy=True,
                         divide_at_unit_temperature=True):
    """(logp, entropy) per position [B, T] float32 from logits [B, T, V] and tokens [B, T]
    (VERL torch_functional); entropy is None without `with_entropy` (VERL 0.6+ computes it
    only when entropy_coeff != 0: a softmax and a sum over [B, T, V] saved).
    `divide_at_unit_temperature` False skips the division when temperature is 1 (the same
    values, one pass over the logits fewer forward and backward)."""
    torch = _torch()
    z = logits.float()
    if divide_at_unit_temperature or temperature != 1.0:
        z = z / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp, None
    p = torch.softmax(z, dim=-1)
    entropy = torch.logsumexp(z, dim=-1) - (p * z).sum(-1)
    return logp, entropy


def shifted_logprobs(model, input_ids, attention_mask, temperature=1.0, with_entropy=True,
                     keep=None, divide_at_unit_temperature=True):
    """transformers causal LM -> aligned (logp, entropy) [B, T] with column 0 = 0 (entropy
    None without `with_entropy`).

    Positions are clip(cumsum(mask) - 1, 0), as VERL builds position_ids for left padding.
    `keep`: None (VERL: logits at every position) or a 1-D long tensor of the positions p
    (0 <= p < T - 1) whose logits are made (transformers' `logits_to_keep`: the output head
    and the softmax run there only); column p + 1 gets those positions' values, the other
    columns 0. `divide_at_unit_temperature`: as in `logprobs_from_logits`.
    """
    torch = _torch()
    pos = torch.clamp(attention_mask.long().cumsum(-1) - 1, min=0)
    if keep is not None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos,
                       logits_to_keep=keep).logits
        logp, ent = logprobs_from_logits(logits, input_ids[:, keep + 1], temperature,
                                         with_entropy, divide_at_unit_temperature)
        zeros = torch.zeros(input_ids.shape, dtype=logp.dtype, device=logp.device)
        return (zeros.index_copy(1, keep + 1, logp),
                None if ent is None else zeros.index_copy(1, keep + 1, ent))
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos).logits
    logp, ent = logprobs_from_logits(logits[:, :-1], input_ids[:, 1:], temperature, with_entropy,
                                     divide_at_unit_temperature)
    zero = torch.zeros(logp.shape[0], 1, dtype=logp.dtype, device=logp.device)
    return torch.cat([zero, logp], 1), None if ent is None else torch.cat([zero, ent], 1)


def trained_positions(loss_mask):
    """The positions p whose logits a loss mask [B, T] reads (token p + 1 trained in some
    row) as a 1-D long tensor, for `shifted_logprobs(keep=...)`; None when no token is
    trained (nothing to trim)."""
    torch = _torch()
    keep = torch.nonzero(loss_mask[:, 1:].bool().any(0)).squeeze(-1)
    return keep if keep.numel() else None


def actor_loss(logp, entropy, old_logp, adv, mask, ref_logp, cfg, *, batch_num_tokens=None,
               global_batch_size=None):
    """pg_loss - entropy_coeff agg(H) + kl_coef agg(KL) for one micro-batch (torch tensors)."""
    torch = _torch()
    on = mask.bool()
    zero = torch.zeros_like(logp)
    logp = torch.where(on, logp, zero)
    old_logp = torch.where(on, old_logp, zero)
    adv = torch.where(on, adv, zero)
    legacy = cfg.loss_scale == "legacy"
    kw = dict(batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size,
              horizon=cfg.horizon, legacy=legacy)
    pg, _, _, _, _ = policy_loss_terms(logp, old_logp, adv, cfg.clip_low, cfg.clip_high,
                                       cfg.clip_ratio_c)
    loss = agg_loss(pg, mask, cfg.loss_agg_mode, **kw)
    if cfg.entropy_coeff != 0:
        loss = loss - cfg.entropy_coeff * agg_loss(torch.where(on, entropy, zero), mask,
                                                   cfg.loss_agg_mode, **kw)
    if cfg.use_kl_loss:
        kl = kl_penalty(logp, torch.where(on, ref_logp, logp), cfg.kl_loss_type)
        loss = loss + cfg.kl_coef * agg_loss(kl, mask, cfg.loss_agg_mode, **kw)
    return loss


def make_torch_optimizer(params, optim_cfg, impl=None):
    """torch.optim.AdamW (one param group, decay on everything) + a LambdaLR, as VERL builds them.

    `impl`: None (torch's default: on CPU the per-tensor loop), "fused" or "foreach" (the
    same update in one or a few multi-tensor kernels).

    The schedule comes from transformers, not from jscenegen's formula: `constant` is
    `get_constant_schedule_with_warmup` (VERL's function of that name is the same code);
    `cosine` is `get_cosine_with_min_lr_schedule_with_warmup(min_lr_rate=min_lr_ratio)`, which
    equals VERL's `get_cosine_schedule_with_warmup` (init_lr_ratio None: warmup from 0):
    (1 + cos)/2 (1 - m) + m there, max(m, cos (1 - m)/2 + (1 + m)/2) in VERL, the same value
    (the floor never binds) up to double rounding. Returns (optimizer, scheduler).
    """
    import transformers

    torch = _torch()
    if impl not in (None, "fused", "foreach"):
        raise ValueError(f"optimizer impl {impl!r}: None, 'fused' or 'foreach'")
    opt = torch.optim.AdamW(params, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas),
                            eps=optim_cfg.eps, weight_decay=optim_cfg.weight_decay,
                            **({impl: True} if impl else {}))
    if optim_cfg.lr_schedule == "constant":
        sched = transformers.get_constant_schedule_with_warmup(opt, optim_cfg.warmup_steps)
    else:
        sched = transformers.get_cosine_with_min_lr_schedule_with_warmup(
            opt, optim_cfg.warmup_steps, optim_cfg.total_steps,
            num_cycles=optim_cfg.num_cycles, min_lr_rate=optim_cfg.min_lr_ratio)
    return opt, sched


def grpo_step(model, batch, loss_cfg, optim_cfg, *, temperature=1.0, num_micro_batches=1,
              optimizer=None, scheduler=None, return_grads=False, episodes=None,
              trained_logits_only=False, divide_at_unit_temperature=True, optimizer_impl=None,
              clip_foreach=None):
    """One GRPO update of a transformers model, VERL style.

    Speed options (`TUNED_STEP`; the defaults are VERL's): `trained_logits_only` makes each
    micro-batch's logits only at the positions its loss mask reads (`trained_positions`);
    `divide_at_unit_temperature` as in `logprobs_from_logits`; `optimizer_impl` as
    `make_torch_optimizer`'s impl (when the optimizer is made here); `clip_foreach` is
    `clip_grad_norm_`'s foreach (None: torch's default, per tensor on CPU).

    The parameters with `requires_grad` are trained (a frozen vision tower is not: no
    gradient, no AdamW state, no decay); a trained one the forward never reaches gets a zero
    gradient (VERL's dummy image), so AdamW decays it.

    Returns (metrics {loss, grad_norm, skipped}, grads {name: np.ndarray before clipping} or
    None, optimizer, scheduler).

    batch: dict of torch tensors input_ids/attention_mask/loss_mask/advantages/old_logp
    [B, T] (ref_logp when use_kl_loss). `episodes`: how many of the B rows are the
    mini-batch's episodes (VERL's ppo_mini_batch_size x n, masked ones included: what the
    caller declared, not read from the arrays), the rows after them padding; None: all B.
    Micro-batches are contiguous row blocks; with loss_scale global each micro loss uses the
    whole batch's token count and global_batch_size = episodes (VERL 0.9.1 engine) and the
    losses are summed; legacy divides each by its own counts and by k, the micro-batches
    holding an episode (VERL's gradient accumulation count; an all-padding one adds 0 and
    counts in no normaliser).
    """
    torch = _torch()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # frozen: no state
    params = [p for _, p in named]
    if optimizer is None:
        optimizer, scheduler = make_torch_optimizer(params, optim_cfg, optimizer_impl)
    mask = batch["loss_mask"].float()
    n_tok = float(mask.sum())
    b = mask.shape[0]
    n_seq = float(b if episodes is None else episodes)
    rows = b // num_micro_batches
    optimizer.zero_grad()
    total = 0.0
    legacy = loss_cfg.loss_scale == "legacy"
    # legacy's 1/k: micro-batches holding an episode (padding rows count in no normaliser)
    k_real = sum(i * rows < n_seq for i in range(num_micro_batches))
    for i in range(num_micro_batches):
        sl = slice(i * rows, (i + 1) * rows)
        logp, ent = shifted_logprobs(
            model, batch["input_ids"][sl], batch["attention_mask"][sl], temperature,
            with_entropy=loss_cfg.entropy_coeff != 0,
            keep=trained_positions(mask[sl]) if trained_logits_only else None,
            divide_at_unit_temperature=divide_at_unit_temperature)
        ref = batch.get("ref_logp")
        loss = actor_loss(
            logp, ent, batch["old_logp"][sl], batch["advantages"][sl], mask[sl],
            None if ref is None else ref[sl], loss_cfg,
            batch_num_tokens=None if legacy else n_tok,
            global_batch_size=None if legacy else n_seq,
        )
        if legacy:
            loss = loss / max(k_real, 1)
        loss.backward()
        total += float(loss.detach())
    for _, p in named:
        # A trained parameter the text forward never reaches (Qwen3.5's vision tower with
        # train_vision) gets a zero gradient, as VERL gives it by running the tower on a dummy
        # image: AdamW then keeps state for it and decays it (a None grad would skip it).
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = ({n: p.grad.detach().numpy().copy() for n, p in named} if return_grads else None)
    max_norm = optim_cfg.grad_clip if optim_cfg.grad_clip and optim_cfg.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=clip_foreach)
    skipped = not bool(torch.isfinite(grad_norm))
    if skipped:
        optimizer.zero_grad()
    else:
        optimizer.step()
    scheduler.step()
    metrics = {"loss": total, "grad_norm": float(grad_norm), "skipped": skipped}
    return metrics, grads, optimizer, scheduler


def perturb_embedding(model, delta: float) -> None:
    """Add `delta` to element [1, 0] of a transformers model's input embedding (in place; a
    no-op for 0). The parity commands use it to show their comparison can fail."""
    if delta:
        torch = _torch()
        with torch.no_grad():
            model.get_input_embeddings().weight[1, 0] += delta
