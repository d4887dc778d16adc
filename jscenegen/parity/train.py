"""`jscenegen parity train`: N GRPO updates replayed in jscenegen and in the torch baseline.

Both sides start from the same HF directory and replay the same recorded trajectories, one
group per update (groups in file order, cycled), the role of update k being
`roles[k mod len(roles)]` (D-D-D-P-C, as the trainer's schedule) for the loss mask. The
batch of an update is `build_group_batch` (the trainer's own assembly; advantages from the
group's rewards). Old log-probs are each side's own recompute with its current parameters
plus one shared perturbation N(0, 0.3) on the trained tokens (as `parity grpo-step`, so the
clip bounds are reached). jscenegen runs `GRPOStep.step` with its state carried across
updates; torch runs `torch_reference.grpo_step` (transformers model, spec formulas,
torch.optim.AdamW + transformers' LR schedule, `make_torch_optimizer`) with one optimizer
kept across updates.

Recorded trajectories: a JSONL file, one trajectory a line:
  {"group": int, "member": int, "tokens": [int], "roles": [int 0-3], "policy_mask": [0/1],
   "logprobs": [float] (rollout log-probs, optional), "reward": float, "masked": bool}
(`write_trajectories` writes it). Without a file they are made deterministically: the
scripted expert's episodes on the SFT scenes tokenised with the model's chat template when
the model directory has a tokenizer, else the synthetic token batches of `parity grpo-step`;
rewards are a fixed spread per group with one policy failure (-1).

Prints one JSON line per update (update, role, loss_diff, grad_norm_ratio, max_param_diff =
max |p_jax - p_torch| / max(1, |p_torch|) over all parameters; loss_diff likewise relative
once |loss| > 1, `grpo_step.loss_gap`); the last line adds `worst_loss_diff` and
`worst_grad_norm_gap` (= max |grad_norm_ratio - 1|) over every update. Exit 1 when after the
last update max_param_diff > PARAM_TOL, when at any update loss_diff > LOSS_TOL or
|grad_norm_ratio - 1| > GRAD_NORM_TOL (fp32; the gradient's size is what the parameters
barely show: Adam's step is about lr sign(g)), when a side skipped a step
(`skipped_updates`), or when an update compared nothing (`untrained_updates`): no trained
tokens (cut episodes too short) or a zero gradient (every trained row masked or of zero
advantage, e.g. equal rewards). With `use_kl_loss` the shared reference log-probs are the
initial model's plus N(0, 0.3) on the trained tokens, so the KL term is not ~0.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Sequence

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from jscenegen.config import shown_value, validation_message
from jscenegen.grpo.algo.roles import CRITIC, DESIGNER, ENVIRONMENT, role_from_letter
from jscenegen.grpo.rollout.engine import Trajectory
from jscenegen.model.weights import constant_tensors
from jscenegen.parity import FLOAT32_MAX, ROW_TOKENS_MAX
from jscenegen.parity.coverage import weight_decay_visible
from jscenegen.paths import atomic_file, not_a_file
from jscenegen.sharding.rules import round_up

PARAM_TOL = 1e-6
LOSS_TOL = 1e-6
GRAD_NORM_TOL = 1e-4  # |grad_norm_ratio - 1|
REWARD_SPREAD = (0.8, -1.0, 0.35, 0.55)  # per member, cycled: three levels and a policy failure


def make_trajectory(group: int, member: int, tokens, roles, policy_mask, reward: float,
                    logprobs=None, masked: bool = False) -> Trajectory:
    """A Trajectory holding only what an update reads (tokens [T] int32, roles [T] int8,
    policy_mask [T] bool, logprobs [T] float32 (zeros when None), reward, masked)."""
    tokens = np.asarray(tokens, np.int32)
    lp = np.zeros(tokens.shape, np.float32) if logprobs is None else np.asarray(logprobs, np.float32)
    return Trajectory(group_id=int(group), member=int(member), seed=0, tokens=tokens,
                      roles=np.asarray(roles, np.int8), policy_mask=np.asarray(policy_mask, bool),
                      logprobs=lp, turns=[], transcript=[], reward=float(reward),
                      failure_cause=None, masked=bool(masked), units=0, grades=None,
                      metrics=None, outcome={})


def _reward(member: int) -> float:
    return REWARD_SPREAD[member % len(REWARD_SPREAD)]


def synthetic_trajectories(vocab: int, groups: int, group_size: int, seq: int = 48,
                           seed: int = 0) -> list[Trajectory]:
    """Token streams of `parity_step.synthetic_batch` (unpadded), the last policy turn of each
    episode relabelled as the critic's so every role of D-D-D-P-C has tokens."""
    from jscenegen.parity.grpo_step import synthetic_batch

    out = []
    for g in range(groups):
        data = synthetic_batch(vocab, rows=group_size, seq=seq, group_size=group_size,
                               seed=seed + g)
        for m in range(group_size):
            keep = data["attention_mask"][m] > 0
            roles = data["roles"][m][keep].copy()
            policy = data["policy_mask"][m][keep]
            last = np.flatnonzero(roles == DESIGNER)
            if last.size:
                start = last[-1]
                while start > 0 and roles[start - 1] == DESIGNER:
                    start -= 1
                roles[start:last[-1] + 1] = CRITIC
            out.append(make_trajectory(g, m, data["input_ids"][m][keep], roles, policy,
                                       _reward(m + g)))
    return out


def expert_trajectories(model_dir: str | Path, groups: int, group_size: int,
                        max_tokens: int) -> list[Trajectory]:
    """The scripted expert's episodes on SFT scenes (one scene per member), tokenised with the
    model directory's chat template as a rollout builds them, cut to `max_tokens` tokens.
    Raises the tokenizer's errors (ChatTemplateError for a template that is not
    prefix-preserving)."""
    from jscenegen.grpo.rollout.config import DEFAULT_STOP_STRINGS
    from jscenegen.model.tokenizer.chat import ChatTokenizer
    from jscenegen.sft.demos import build_demos, sft_records

    # parity train takes no template option: the model directory's own is the one to fix
    chat = ChatTokenizer.from_dir(model_dir, option="a chat_template.jinja in the model directory")
    demos = build_demos(chat, sft_records(group_size), stop_strings=DEFAULT_STOP_STRINGS)
    out = []
    for g in range(groups):
        for m, d in enumerate(demos):
            k = min(len(d.tokens), max_tokens)
            out.append(make_trajectory(g, m, d.tokens[:k], d.roles[:k], d.policy_mask[:k],
                                       _reward(m + g)))
    return out


def write_trajectories(path: str | Path, trajectories: Sequence[Trajectory]) -> None:
    """Write `trajectories` as the JSONL format of the module doc (atomically)."""
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for t in trajectories:
            f.write(json.dumps({"group": t.group_id, "member": t.member,
                                "tokens": t.tokens.tolist(), "roles": t.roles.tolist(),
                                "policy_mask": t.policy_mask.astype(int).tolist(),
                                "logprobs": t.logprobs.tolist(), "reward": t.reward,
                                "masked": t.masked}) + "\n")


def _within_float32(x: float) -> float:
    if abs(x) > FLOAT32_MAX:
        raise ValueError(f"{x!r} is beyond float32's range (+-3.4e38), in which both engines read it")
    return x


_Float32 = Annotated[float, AfterValidator(_within_float32)]


class TrajectoryLine(BaseModel):
    """One line of a trajectories file (the module doc's format), strictly typed: no string for
    a number or a flag, finite floats within float32's range (both engines read them as
    float32: 1e308 would become inf)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    group: int
    member: int
    tokens: list[Annotated[int, Field(ge=0, lt=2**31)]] = Field(min_length=2, max_length=ROW_TOKENS_MAX)
    roles: list[int]
    policy_mask: list[Annotated[int, Field(ge=0, le=1)]]
    reward: _Float32
    logprobs: list[_Float32] | None = None
    masked: bool = False


def _field_error(err: ValidationError) -> str:
    """The first error of `err` as `'field'[index]: message`."""
    e = err.errors()[0]
    where = "".join(f"[{p}]" if isinstance(p, int) else f"{p!r}" for p in e["loc"][:2])
    text = validation_message(e)
    if e["loc"] and "input" in e:
        text += f" (got {shown_value(e['input'])})"
    return f"{where}: {text}" if where else text


def read_trajectories(path: str | Path, vocab: int | None = None) -> list[Trajectory]:
    """Read the JSONL format of the module doc. Raises ValueError naming file, line and field
    for a missing or non-regular file, text that is not UTF-8 JSON, a missing key or a value
    of the wrong type (strict: `"masked": "no"` is not a flag, NaN is not a reward), a length
    that differs from `tokens`, a role code outside 0-3 or a token id outside [0, vocab)."""
    if why := not_a_file(path):   # a named pipe would block the read
        raise ValueError(f"{path}: {why}")
    out = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            where = f"{path}:{n}"
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")   # a leading byte-order mark is not JSON
            except UnicodeDecodeError as err:
                raise ValueError(f"{where}: not UTF-8 text ({err.reason} at byte {err.start})") from None
            if not line.strip():
                continue
            try:
                d = TrajectoryLine.model_validate_json(line)
            except ValidationError as err:
                raise ValueError(f"{where}: {_field_error(err)}") from None
            tokens = np.asarray(d.tokens, np.int64)
            for key in ("roles", "policy_mask", "logprobs"):
                values = getattr(d, key)
                if values is not None and len(values) != tokens.size:
                    raise ValueError(f"{where}: {key!r} has {len(values)} entries, "
                                     f"'tokens' has {tokens.size}")
            roles = np.asarray(d.roles, np.int64)
            if roles.min() < ENVIRONMENT or roles.max() > CRITIC:
                raise ValueError(f"{where}: 'roles' must be codes 0-3 (environment, planner, "
                                 f"designer, critic), got {sorted(set(roles.tolist()))}")
            if tokens.min() < 0 or (vocab is not None and tokens.max() >= vocab):
                raise ValueError(f"{where}: 'tokens' must lie in [0, {vocab}), got "
                                 f"[{tokens.min()}, {tokens.max()}]")
            out.append(make_trajectory(d.group, d.member, tokens, roles, d.policy_mask,
                                       d.reward, d.logprobs, d.masked))
    if not out:
        raise ValueError(f"{path}: no trajectories")
    return out


def group_trajectories(trajectories: Sequence[Trajectory]) -> list[list[Trajectory]]:
    """Trajectories by group id, groups in order of first appearance."""
    groups: dict[int, list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t)
    return list(groups.values())


def _by_name(names, tree) -> dict[str, np.ndarray]:
    import jax

    return dict(zip(names, (np.asarray(x) for x in jax.tree.leaves(tree))))


def train_parity(model_dir: str | Path, trajectories: Sequence[Trajectory], *, updates: int = 3,
                 roles: str = "DDDPC", loss_cfg=None, optim_cfg=None, temperature: float = 1.0,
                 seed: int = 0, torch_perturbation: float = 0.0, col_multiple: int = 16,
                 train_vision: bool = False):
    """Yield one comparison dict per update (see module doc); the last one carries `ok`.

    `torch_perturbation` is added to one element of torch's input embedding before the
    first update (a self-check that the comparison can fail). Every update is padded to the
    longest trajectory (one compile per group size). Qwen3.5 and `train_vision`: as
    `grpo_step.grpo_step_parity` (trained tensors compared, frozen ones unchanged on both
    sides, `frozen_unchanged` in the last line). Raises ValueError for parameter names
    that differ between the two models, or GRPOStep's for a group that does not split into
    `ppo_micro_batch_size` micro-batches.
    """
    import jax
    import torch

    from jscenegen.grpo.algo.accumulate import num_micro_batches
    from jscenegen.grpo.algo.config import LossConfig, OptimConfig
    from jscenegen.grpo.algo.optimizer import init_train_state, lr_at
    from jscenegen.grpo.train.batch import build_group_batch
    from jscenegen.parity import torch_reference as ref
    from jscenegen.parity.grpo_step import (
        frozen_unchanged,
        jax_policy,
        loss_gap,
        require_a_learning_rate,
        torch_policy,
        trained_names,
    )

    loss_cfg = loss_cfg or LossConfig()
    optim_cfg = optim_cfg or OptimConfig()
    require_a_learning_rate(optim_cfg, updates)
    groups = group_trajectories(trajectories)
    model, params, names, step = jax_policy(model_dir, loss_cfg, optim_cfg, temperature,
                                            train_vision)
    state = init_train_state(params, optim_cfg)

    torch.manual_seed(0)
    tmodel = torch_policy(str(model_dir), model.cfg.model_type, train_vision=train_vision,
                          perturbation=torch_perturbation)
    torch_frozen = {n: p.detach().numpy().copy() for n, p in tmodel.named_parameters()
                    if not p.requires_grad}
    t_names = trained_names(tmodel)
    if t_names != set(names):
        raise ValueError("trained parameter names differ between jscenegen and transformers: "
                         f"{sorted(t_names ^ set(names))[:5]}")
    optimizer = scheduler = None
    # one padded length for all updates (one compile)
    length = max(t.num_tokens for t in trajectories)
    length = round_up(length, col_multiple)
    rng = np.random.default_rng(seed)
    untrained = 0  # updates without tokens or gradient (they compare nothing but weight decay)
    skipped = 0    # updates either side skipped for a non-finite gradient
    worst_loss_diff = worst_grad_norm_gap = 0.0   # over every update: a role's own error counts
    for k in range(updates):
        role = role_from_letter(roles[k % len(roles)])
        group = groups[k % len(groups)]
        data = build_group_batch(group, role, row_multiple=1, col_multiple=length,
                                 eps=loss_cfg.adv_eps, norm_by_std=loss_cfg.norm_adv_by_std,
                                 trim=False).arrays
        on = data["loss_mask"] > 0
        delta = rng.normal(0, 0.3, on.shape).astype(np.float32)

        jax_old, _ = step.logprobs(state.params, data["input_ids"], data["attention_mask"])
        batch = {key: data[key] for key in ("input_ids", "attention_mask", "loss_mask",
                                            "advantages", "episode_mask")}
        batch["old_logp"] = np.where(on, np.asarray(jax_old) + delta, 0.0).astype(np.float32)
        if loss_cfg.use_kl_loss:
            # the initial model's log-probs, shared, plus a shared N(0, 0.3) on the trained
            # tokens: the policy starts at the reference, so the KL term and its gradient would
            # be ~1e-10 and a wrong estimator or sign would pass (as in `parity grpo-step`)
            initial = np.asarray(step.logprobs(params, data["input_ids"], data["attention_mask"])[0])
            ref_delta = rng.normal(0, 0.3, on.shape).astype(np.float32)
            batch["ref_logp"] = np.where(on, initial + ref_delta, initial).astype(np.float32)
        state, metrics = step.step(state, batch)

        tb = {key: torch.from_numpy(np.asarray(data[key]).astype(np.int64))
              for key in ("input_ids", "attention_mask")}
        with torch.no_grad():
            t_old, _ = ref.shifted_logprobs(tmodel, tb["input_ids"], tb["attention_mask"],
                                            temperature)
        for key in ("loss_mask", "advantages"):
            tb[key] = torch.from_numpy(np.array(data[key], np.float32))
        tb["old_logp"] = torch.from_numpy(
            np.where(on, t_old.numpy() + delta, 0.0).astype(np.float32))
        if loss_cfg.use_kl_loss:
            tb["ref_logp"] = torch.from_numpy(batch["ref_logp"])
        t_metrics, _, optimizer, scheduler = ref.grpo_step(
            tmodel, tb, loss_cfg, optim_cfg, temperature=temperature,
            num_micro_batches=num_micro_batches(len(group), loss_cfg.ppo_micro_batch_size,
                                                "ppo_micro_batch_size"),
            optimizer=optimizer, scheduler=scheduler, episodes=len(group))

        jax_p = _by_name(names, state.params)
        t_p = {n: p.detach().numpy() for n, p in tmodel.named_parameters() if p.requires_grad}
        rel = {n: float(np.max(np.abs(jax_p[n] - t_p[n]) / np.maximum(1.0, np.abs(t_p[n]))))
               for n in names}
        worst = max(rel, key=rel.get)
        result = {
            "update": k + 1, "role": roles[k % len(roles)],
            "trained_tokens": int(on.sum()),
            "loss_jax": float(metrics["loss"]), "loss_torch": t_metrics["loss"],
            "loss_diff": loss_gap(float(metrics["loss"]), t_metrics["loss"]),
            "grad_norm_ratio": float(metrics["grad_norm"]) / t_metrics["grad_norm"]
            if t_metrics["grad_norm"] else None,  # None: no trained token, both norms 0
            "max_param_diff": rel[worst], "worst_param": worst,
            "clipfrac": float(metrics["clipfrac"]),
        }
        untrained += int(not on.any() or not t_metrics["grad_norm"])
        worst_loss_diff = max(worst_loss_diff, result["loss_diff"])
        if result["grad_norm_ratio"] is not None:   # None: untrained, counted there
            worst_grad_norm_gap = max(worst_grad_norm_gap, abs(result["grad_norm_ratio"] - 1))
        skipped += int(bool(t_metrics["skipped"]) or float(metrics["skipped"]) != 0)
        if k == updates - 1:
            result["untrained_updates"] = untrained
            result["skipped_updates"] = skipped
            result["worst_loss_diff"] = worst_loss_diff
            result["worst_grad_norm_gap"] = worst_grad_norm_gap
            result["trained_tensors"] = len(names)
            result["constant_tensors"] = constant_tensors(_by_name(names, params).items())
            result["weight_decay_visible"] = weight_decay_visible(   # at the largest lr applied
                max(float(lr_at(optim_cfg, i)) for i in range(updates)), optim_cfg.weight_decay)
            result["frozen_unchanged"] = frozen_unchanged(model, str(model_dir), tmodel,
                                                          torch_frozen)
            result["tolerances"] = {"loss_diff": LOSS_TOL, "max_param_diff": PARAM_TOL,
                                    "grad_norm_ratio": GRAD_NORM_TOL}
            result["ok"] = bool(untrained == 0 and skipped == 0 and worst_loss_diff <= LOSS_TOL
                                and result["frozen_unchanged"]
                                and result["max_param_diff"] <= PARAM_TOL
                                and worst_grad_norm_gap <= GRAD_NORM_TOL)
        yield result
    jax.clear_caches()


def default_trajectories(model_dir: str | Path, groups: int, group_size: int,
                         max_tokens: int) -> list[Trajectory]:
    """Expert episodes when `model_dir` has a tokenizer, else synthetic ones (module doc)."""
    from jscenegen.model.config import QwenConfig

    d = Path(model_dir)
    if (d / "tokenizer.json").exists() or (d / "tokenizer_config.json").exists():
        return expert_trajectories(d, groups, group_size, max_tokens)
    vocab = QwenConfig.from_dir(d).vocab_size
    return synthetic_trajectories(vocab, groups, group_size)
