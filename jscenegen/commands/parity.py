"""`jscenegen parity logits|grpo-step|train`: numbers against the torch baseline, JSON lines out.

Exit 0 when within the stated tolerances, 1 beyond them (the library functions in
jscenegen/parity/ compute and judge; this module parses and prints).
"""
from __future__ import annotations

import argparse
import sys

from jscenegen.commands import finite_float_arg, int_in, seed_arg
from jscenegen.parity import FLOAT32_MAX, ROW_TOKENS_MAX
from jscenegen.paths import json_line

COUNT = int_in(1, 4096)          # rows, groups, updates: parity runs are small
TOKENS = int_in(1, ROW_TOKENS_MAX)


def _check_batch(model, rows: int, seq: int, flags: str, *, micro_rows: int | None = None,
                 backward: bool = True) -> None:
    """Refuse, before any model loads, a batch of more than TOKENS_MAX (2^20) tokens, or one whose
    run would need more than the memory available now (`parity_peak_bytes` of one
    micro-batch of `micro_rows` rows: the logits and eager attention's seq^2 weights), naming
    `flags` and the figures. `model`: the HF model directory, or its `QwenConfig`."""
    from jscenegen.config import TOKENS_MAX
    from jscenegen.grpo.algo.accumulate import num_micro_batches
    from jscenegen.model.config import QwenConfig
    from jscenegen.parity import parity_peak_bytes
    from jscenegen.sharding.rollout import available_memory_bytes

    if rows * seq > TOKENS_MAX:
        raise ValueError(f"{flags}: {rows:,} x {seq:,} = {rows * seq:,} tokens; a parity batch "
                         f"holds at most {TOKENS_MAX:,}")
    cfg = model if isinstance(model, QwenConfig) else QwenConfig.from_dir(model)
    at_once = rows // num_micro_batches(rows, micro_rows, "ppo_micro_batch_size")
    need, have = parity_peak_bytes(cfg, at_once, seq, backward), available_memory_bytes()
    if have is not None and need > have:
        per = f" ({at_once:,} at a time: --loss ppo_micro_batch_size)" if at_once < rows else ""
        raise ValueError(f"{flags}: {rows:,} x {seq:,} tokens{per} need about "
                         f"{need / 2**30:,.1f} GiB for the logits and eager attention weights "
                         f"(seq^2 per head{' and attention layer' if backward else ''}, torch's "
                         f"and JAX's); this host has {have / 2**30:,.1f} GiB available: give "
                         "fewer or shorter rows"
                         f"{', or smaller micro-batches' if backward else ''}")


def _check_temperature(value: float) -> None:
    import math

    from jscenegen.generate.sampling import MIN_TEMPERATURE

    if not (math.isfinite(value) and value >= MIN_TEMPERATURE):
        raise ValueError(f"--temperature must be a finite number >= {MIN_TEMPERATURE}, got {value}")


def register(sub) -> None:
    p = sub.add_parser("parity", help="numbers against the torch baseline")
    kinds = p.add_subparsers(dest="parity_kind", metavar="KIND", required=True)

    lg = kinds.add_parser("logits", help="logits vs transformers' torch model")
    lg.add_argument("--model", required=True, help="HF model directory")
    lg.add_argument("--batch", type=COUNT, default=2)
    lg.add_argument("--seq", type=TOKENS, default=64)
    lg.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    lg.add_argument("--seed", type=seed_arg, default=0)
    lg.set_defaults(func=run_logits)

    gs = kinds.add_parser("grpo-step", help="one GRPO update vs transformers + torch AdamW")
    gs.add_argument("--model", required=True, help="HF model directory")
    gs.add_argument("--seed", type=seed_arg, default=0)
    gs.add_argument("--rows", type=COUNT, default=8, help="episodes (2 groups of rows/2)")
    gs.add_argument("--seq", type=TOKENS, default=32, help="padded tokens per episode")
    gs.add_argument("--pad-rows", type=int_in(0, 4096), default=0,
                    help="extra all-padding rows (as for an fsdp axis that does not divide rows)")
    gs.add_argument("--masked-rows", type=int_in(0, 4095), default=0,
                    help="the last N episodes masked, as a judge or runtime failure masks them "
                         "(advantage 0, out of their group's statistics, still counted by the "
                         "global seq-mean modes)")
    gs.add_argument("--temperature", type=float, default=1.0)
    gs.add_argument("--grads", action="store_true", help="also compare gradients element-wise")
    _add_common(gs)
    gs.set_defaults(func=run_grpo_step)

    tr = kinds.add_parser("train", help="N GRPO updates on recorded trajectories vs "
                          "transformers + torch AdamW")
    tr.add_argument("--model", required=True, help="HF model directory")
    tr.add_argument("--updates", type=COUNT, default=3)
    tr.add_argument("--trajectories", help="JSONL of recorded trajectories (default: made "
                    "deterministically, see `jscenegen.parity.train`)")
    tr.add_argument("--write-trajectories", metavar="FILE",
                    help="also write the trajectories used as JSONL")
    tr.add_argument("--groups", type=COUNT, default=3, help="groups made without --trajectories")
    tr.add_argument("--group-size", type=COUNT, default=4, help="episodes per made group")
    tr.add_argument("--max-tokens", type=TOKENS, default=3072,
                    help="cut expert episodes to this many tokens (their prompt is ~2,100)")
    tr.add_argument("--roles", default="DDDPC", help="role schedule (letters P, D, C)")
    tr.add_argument("--seed", type=seed_arg, default=0)
    tr.add_argument("--temperature", type=float, default=1.0)
    _add_common(tr)
    tr.set_defaults(func=run_train)


def _float32_arg(text: str) -> float:
    """argparse type of a number the fp32 weights can hold: finite, |x| <= float32's largest
    (1e40 became inf in the embedding, every loss then null)."""
    x = finite_float_arg(text)
    if abs(x) > FLOAT32_MAX:
        raise argparse.ArgumentTypeError(f"{x:g} is beyond float32's range (|x| <= {FLOAT32_MAX:.4g})")
    return x


def _add_common(p) -> None:
    p.add_argument("--train-vision", action="store_true",
                   help="Qwen3.5: train the vision tower (zero gradient, AdamW state and decay, "
                        "as VERL with freeze_vision_tower false); default frozen")
    p.add_argument("--perturb-torch", type=_float32_arg, default=0.0,
                   help="add this to one torch embedding weight before the first forward: the "
                        "torch side then differs from the start, so exit 1 shows the comparison "
                        "is live (not which later step would diverge)")
    p.add_argument("--loss", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                   help="LossConfig overrides, e.g. loss_agg_mode=seq-mean-token-mean "
                        "ppo_micro_batch_size=2 use_kl_loss=true (may be repeated)")
    p.add_argument("--optim", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                   help="OptimConfig overrides, e.g. lr=1e-5 (may be repeated)")


def _configs(args):
    from jscenegen.config import apply_overrides, validate_config
    from jscenegen.grpo.algo.config import LossConfig, OptimConfig

    for flag, items in (("--loss", args.loss), ("--optim", args.optim)):
        for item in items:
            if "=" not in item:
                raise ValueError(f"{flag} {item!r}: not of the form KEY=VALUE (e.g. lr=1e-5)")
    _check_temperature(args.temperature)
    return (validate_config(apply_overrides({}, args.loss), "--loss", LossConfig),
            validate_config(apply_overrides({}, args.optim), "--optim", OptimConfig))


def run_logits(args) -> int:
    from jscenegen.parity.logits import logits_parity

    _check_batch(args.model, args.batch, args.seq, "--batch x --seq", backward=False)
    result = logits_parity(args.model, batch=args.batch, seq=args.seq, dtype=args.dtype,
                           seed=args.seed)
    print(json_line(result))
    _warn_coverage(result)
    return 0 if result["ok"] else 1


def run_grpo_step(args) -> int:
    from jscenegen.parity.grpo_step import MIN_SEQ, grpo_step_parity, require_a_learning_rate

    if args.rows % 2 or args.rows < 4:
        raise ValueError(f"--rows {args.rows}: the rows form 2 groups of rows/2; give an even "
                         "number >= 4 (a group of one has advantage 0: nothing would be compared)")
    if args.seq < MIN_SEQ:
        raise ValueError(f"--seq {args.seq}: the synthetic episodes reach their first designer "
                         f"token within {MIN_SEQ} tokens; give --seq >= {MIN_SEQ}")
    if args.masked_rows >= args.rows:
        raise ValueError(f"--masked-rows {args.masked_rows}: below --rows {args.rows} (an update "
                         "with every episode masked trains nothing)")
    loss_cfg, optim_cfg = _configs(args)
    require_a_learning_rate(optim_cfg, 1)   # before the model's config.json is read
    _check_batch(args.model, args.rows + args.pad_rows, args.seq, "(--rows + --pad-rows) x --seq",
                 micro_rows=loss_cfg.ppo_micro_batch_size)
    result = grpo_step_parity(args.model, loss_cfg=loss_cfg, optim_cfg=optim_cfg,
                              temperature=args.temperature, seed=args.seed, rows=args.rows,
                              seq=args.seq, pad_rows=args.pad_rows, masked_rows=args.masked_rows,
                              compare_grads=args.grads,
                              torch_perturbation=args.perturb_torch, train_vision=args.train_vision)
    print(json_line(result))
    _warn_coverage(result)
    return 0 if result["ok"] else 1


def run_train(args) -> int:
    from jscenegen.grpo.algo.roles import role_from_letter
    from jscenegen.model.config import QwenConfig
    from jscenegen.parity.grpo_step import require_a_learning_rate
    from jscenegen.parity.train import (
        default_trajectories,
        group_trajectories,
        read_trajectories,
        train_parity,
        write_trajectories,
    )
    from jscenegen.paths import check_output_file, refuse_overwriting_input

    for letter in args.roles:
        try:
            role_from_letter(letter)
        except ValueError as err:
            raise ValueError(f"--roles {args.roles!r}: {err}") from None
    if args.write_trajectories is not None:   # written before the updates run: refuse what would fail now
        check_output_file(args.write_trajectories, "--write-trajectories")
        refuse_overwriting_input(args.write_trajectories, "--write-trajectories",
                                 {"--trajectories": args.trajectories, "--model": args.model})
    loss_cfg, optim_cfg = _configs(args)
    require_a_learning_rate(optim_cfg, args.updates)
    model_cfg = QwenConfig.from_dir(args.model)
    if args.trajectories:
        trajs = read_trajectories(args.trajectories, model_cfg.vocab_size)
        source, padded_to = f"{args.trajectories}:", "the file's longest trajectory"
    else:
        trajs = default_trajectories(args.model, args.groups, args.group_size, args.max_tokens)
        if not any(t.policy_mask.any() for t in trajs):   # every update would train nothing
            raise ValueError(f"--max-tokens {args.max_tokens}: the expert episodes' first "
                             f"{args.max_tokens} tokens hold no policy token (their prompt comes "
                             "first), so no update would train; raise it")
        source, padded_to = "--group-size x --max-tokens:", "the longest episode"
    longest = max(len(t.tokens) for t in trajs)   # every update is padded to it (one compile)
    for group in group_trajectories(trajs):       # one group is one update's batch
        _check_batch(model_cfg, len(group), longest,
                     f"{source} group {group[0].group_id} (padded to {padded_to})",
                     micro_rows=loss_cfg.ppo_micro_batch_size)
    if args.write_trajectories is not None:
        write_trajectories(args.write_trajectories, trajs)
    ok = False
    for result in train_parity(args.model, trajs, updates=args.updates, roles=args.roles,
                               loss_cfg=loss_cfg, optim_cfg=optim_cfg,
                               temperature=args.temperature, seed=args.seed,
                               torch_perturbation=args.perturb_torch,
                               train_vision=args.train_vision):
        print(json_line(result), flush=True)
        ok = result.get("ok", False)
    _warn_coverage(result)
    return 0 if ok else 1


def _warn_coverage(result: dict) -> None:
    """What the run could not see, on stderr (`parity.coverage`)."""
    from jscenegen.parity.coverage import coverage_warnings
    from jscenegen.text import terminal_line

    for line in coverage_warnings(result):
        print(terminal_line(f"warning: {line}"), file=sys.stderr)
