"""`jscenegen sft`: fine-tune an HF model on expert demonstrations and write an HF directory.

Builds the demonstrations (sft/demos.py), loads the model in the FSDP2 layout on the
("fsdp", "sp") mesh, runs `SFTStep` for the configured steps and saves the result atomically.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from jscenegen.grpo.algo.accumulate import check_padded_micro_batches
from jscenegen.grpo.algo.logprobs import selection_capacity
from jscenegen.grpo.algo.optimizer import init_train_state, schedule_ends_early
from jscenegen.model.tokenizer.chat import ChatTokenizer
from jscenegen.paths import json_document, json_line, require_new_dir
from jscenegen.sft.config import BATCH_TOKENS_MAX
from jscenegen.sft.demos import (
    batch_indices,
    build_demos,
    demo_batch,
    drop_failed_episodes,
    drop_over_answer_cap,
    padded_length,
    sft_records,
    truncation_losses,
)
from jscenegen.sft.step import SFTStep
from jscenegen.sharding.rules import round_up

SFT_TEMPLATE_OPTION = "--chat-template"   # how `jscenegen sft` takes a replacement chat template


def check_sft_inputs(cfg, chat_template_path: str | None = None,
                     template_option: str = SFT_TEMPLATE_OPTION):
    """The checks of an SFT's inputs that need no model, so a command fails before making or
    loading one: the mesh against the devices, the batch against its micro-batches and the
    row budget, the scene catalogue and prompt templates, the generated SFT scenes against
    them (a request the catalogue does not know, a room that does not fit scene.metrics'
    measuring grid: the expert could not play it), the replacement chat template's file
    (`chat.read_template`; `template_option`: how the command's user passes it, named in its
    errors). Returns the mesh. Raises MeshError, ValueError (ChatTemplateError, SceneError)
    naming the setting, file or scene."""
    from jscenegen.model.tokenizer.chat import read_template
    from jscenegen.scene.catalogue import load_catalogue
    from jscenegen.scene.prompts import load_templates
    from jscenegen.scene.sceneset import check_records_usable
    from jscenegen.scene.schema import MAX_SCENE_OBJECTS
    from jscenegen.sharding.layout import pad_rows
    from jscenegen.sharding.mesh import make_mesh

    sc = cfg.sft
    mesh = make_mesh(cfg.mesh.fsdp, cfg.mesh.sp)
    check_padded_micro_batches(sc.batch_size, mesh.shape["fsdp"], sc.micro_batch_size,
                               "sft.batch_size", "sft.micro_batch_size")
    longest = round_up(sc.max_seq_len, mesh.shape["sp"])
    rows = pad_rows(sc.batch_size, mesh)
    if rows * longest > BATCH_TOKENS_MAX:   # the config checked batch_size x max_seq_len; the mesh pads both
        raise ValueError(f"sft.batch_size={sc.batch_size} and sft.max_seq_len={sc.max_seq_len}: "
                         f"{rows} rows x {longest} tokens once padded for the mesh = "
                         f"{rows * longest:,} tokens per step: at most {BATCH_TOKENS_MAX:,}")
    catalogue = load_catalogue(cfg.scene.catalogue_path)
    load_templates(cfg.scene.prompts_dir)
    # scene.max_objects below a request only refuses the expert's extra adds: not checked
    check_records_usable(sft_records(sc.num_demos, sc.scene_offset), catalogue, cfg.scene.metrics,
                         f"the SFT scenes (sft.num_demos={sc.num_demos}, "
                         f"sft.scene_offset={sc.scene_offset})", max_objects=MAX_SCENE_OBJECTS)
    read_template(chat_template_path, template_option)
    return mesh


def run_sft(cfg, model_dir: str | Path, out_dir: str | Path, *,
            log: Callable[[dict], None] = lambda row: print(json_line(row), flush=True),
            chat_template_path: str | Path | None = None, mesh=None,
            template_option: str = SFT_TEMPLATE_OPTION) -> dict:
    """Fine-tune the HF model at `model_dir` on expert demonstrations and write `out_dir`.

    Args:
      cfg: an SFTRunConfig (sections model, mesh, sft, optim, scene).
      model_dir: HF directory (config.json, safetensors, tokenizer with a prefix-preserving
        chat template, or `chat_template_path`).
      out_dir: the HF directory written at the end (atomically; tokenizer files copied, and
        `chat_template_path` as its `chat_template.jinja`, so every later load renders the
        template it was trained on), with `sft_summary.json` (config, chat template, demo
        statistics, loss history, phase times).
      mesh: the mesh `check_sft_inputs(cfg, chat_template_path, template_option)` returned,
        when the caller ran it already (before making a fresh model); None: run_sft runs it.
      template_option: how the command's user passes `chat_template_path` (`sft`'s
        --chat-template, a train warm start's sampling.chat_template_path), named in the
        template's errors.
      log: called with one dict per logged step ({"step", "loss", "grad_norm", "lr",
        "tokens", "elapsed_s", "cpu_s": process CPU seconds, all threads}) and once with the
        demo statistics.

    Returns the summary dict. Deterministic for a given config (demo scenes, order, weights).
    Demonstrations whose expert episode failed under `cfg.scene` (`drop_failed_episodes`), and
    those holding an answer longer than `sft.max_answer_tokens` (when set), are dropped,
    counted (per failure cause, per role) in the demo statistics, with a warning.

    Raises FileExistsError for an `out_dir` that exists and is not empty (before any work:
    `paths.require_new_dir`), ValueError when the expert failed every episode, no
    demonstration fits `sft.max_answer_tokens` or none has a policy token within the row length (before training) or the last step's loss is not finite (diverged: nothing is
    written),
    ChatTemplateError (template), MeshError (mesh vs devices), ModelConfigError and the
    loader's errors for a bad `model_dir`.
    """
    from flax import nnx

    from jscenegen.model.config import QwenConfig
    from jscenegen.model.functional import hidden_fn, split_params
    from jscenegen.model.hf_io import load_hf, save_hf
    from jscenegen.sharding.layout import pad_batch, shard_batch

    sc = cfg.sft
    t0 = time.perf_counter()
    require_new_dir(out_dir)
    early = schedule_ends_early(cfg.optim, sc.steps, "sft.steps")
    if early:
        logging.getLogger(__name__).warning("%s", early)
    if mesh is None:
        mesh = check_sft_inputs(cfg, chat_template_path, template_option)
    multiple = int(np.lcm(sc.seq_multiple, mesh.shape["sp"]))   # of every row's length
    longest = round_up(sc.max_seq_len, mesh.shape["sp"])   # rows' cap
    QwenConfig.from_dir(model_dir)  # a missing directory or bad config.json, not the tokenizer, named
    chat = ChatTokenizer.from_dir(model_dir, chat_template_path, option=template_option)
    model = load_hf(model_dir, mesh=mesh, **cfg.model.build_options())  # bad weights fail here, first
    chat.check_fits(model.cfg.vocab_size, str(model_dir))
    demos = build_demos(chat, sft_records(sc.num_demos, sc.scene_offset), cfg.scene,
                        noisy_fraction=sc.noisy_fraction, noise_m=sc.noise_m,
                        stop_strings=sc.stop_strings, grade_keys=sc.grade_keys)
    demos, failed_stats = _finished_by_the_expert(demos)
    demos, cap_stats = _fitting_the_answer_cap(demos, sc.max_answer_tokens)
    length = padded_length(demos, sc.max_seq_len, multiple, longest)
    lengths = [len(d.tokens) for d in demos]
    demo_stats = {"demos": len(demos), "row_length": length, "mean_tokens": float(np.mean(lengths)),
                  "max_tokens": int(max(lengths)), **truncation_losses(demos, sc.max_seq_len),
                  "policy_tokens_per_demo": float(np.mean([d.policy_mask.sum() for d in demos])),
                  "expert_mean_reward": float(np.nanmean([d.reward for d in demos])),
                  **failed_stats, **cap_stats,
                  "demo_build_s": time.perf_counter() - t0}
    log({"event": "demos", **demo_stats})
    kept = min(length, sc.max_seq_len)
    if not any(d.policy_mask[:kept].any() for d in demos):
        raise ValueError(f"sft.max_seq_len={sc.max_seq_len}: no demonstration has a policy token "
                         f"within its first {kept} tokens (the system prompt and the room come "
                         f"first: {min(lengths)} tokens in the shortest demo); nothing would train")

    t1, cpu1 = time.perf_counter(), time.process_time()
    graphdef, params, frozen = split_params(model)  # carried tensors (Qwen3.5) never train
    sft = SFTStep(hidden_fn(graphdef, frozen), cfg.optim, micro_batch_size=sc.micro_batch_size,
                  logprob_chunk=sc.logprob_chunk)
    order = batch_indices(len(demos), sc.batch_size, sc.seed)
    history = []
    with jax.set_mesh(mesh):
        state = init_train_state(params, cfg.optim)
        for step in range(sc.steps):
            arrays = demo_batch([demos[i] for i in next(order)], length, sc.max_seq_len)
            batch = shard_batch(pad_batch(arrays, mesh, seq_multiple=length), mesh)
            # logits of the policy tokens only; the capacity's power-of-two buckets compile a
            # few steps (CPU default: 512 for most batches, 1,024 for the 2% of demos past 512)
            capacity = selection_capacity(arrays["loss_mask"])
            state, metrics = sft.step(state, batch, capacity=capacity)
            if step % sc.log_every == 0 or step == sc.steps - 1:
                row = {"step": step, **{k: float(v) for k, v in metrics.items()},
                       "elapsed_s": time.perf_counter() - t1, "cpu_s": time.process_time() - cpu1}
                history.append(row)
                log(row)
        after = [float(x) for x in sft.check(state.params, batch, capacity=capacity)]   # as written
    train_s = time.perf_counter() - t1
    _check_trained(cfg, history[-1], int(state.skipped_steps), *after)
    nnx.update(model, state.params)
    summary = {"config": cfg.model_dump(mode="json"), "model_dir": str(model_dir),
               "chat_template_path": None if chat_template_path is None else str(chat_template_path),
               **demo_stats,
               "history": history, "final_loss": history[-1]["loss"],
               "loss_after_last_step": after[0], "train_s": train_s,
               "total_s": time.perf_counter() - t0}
    extra = {"sft_summary.json": json_document(summary)}
    if chat_template_path is not None:   # transformers reads chat_template.jinja before the config's
        extra["chat_template.jinja"] = chat.tokenizer.chat_template
    save_hf(model, out_dir, dtype="float32", tokenizer_src=model_dir,   # fp32 master weights
            extra_files=extra)
    return summary


def _finished_by_the_expert(demos: list) -> tuple[list, dict]:
    """`drop_failed_episodes(demos)`, with one warning line naming how many were dropped and
    why. Raises ValueError naming the scene settings when the expert failed every episode."""
    kept, stats = drop_failed_episodes(demos)
    causes = ", ".join(f"{cause} {n}" for cause, n in stats["expert_failures"].items())
    if not kept:
        raise ValueError(f"sft: the scripted expert failed every one of the {len(demos)} "
                         f"demonstrations under the scene settings ({causes}); nothing to "
                         "imitate: give it the planner turns and critique rounds it plays "
                         "(scene.max_planner_turns, scene.max_critique_rounds; a train warm "
                         "start plays in the run's scene settings)")
    if len(kept) < len(demos):
        logging.getLogger(__name__).warning(
            "sft: %d of %d demonstrations dropped: the scripted expert failed them under the "
            "scene settings (%s), and they would teach what earns reward -1",
            len(demos) - len(kept), len(demos), causes)
    return kept, stats


def _fitting_the_answer_cap(demos: list, cap: int | None) -> tuple[list, dict]:
    """`drop_over_answer_cap(demos, cap)`, with one warning line naming how many demos were
    dropped and their over-cap answers per role. Raises ValueError naming sft.max_answer_tokens
    when none is left."""
    kept, stats = drop_over_answer_cap(demos, cap)
    over = ", ".join(f"{role} {n}" for role, n in stats["answers_over_cap"].items() if n)
    longest = ", ".join(f"{role} {n}" for role, n in stats["longest_answer"].items())
    if not kept:
        raise ValueError(f"sft.max_answer_tokens={cap} (a train warm start: the run's "
                         f"sampling.max_new_tokens): every one of the {len(demos)} demonstrations "
                         f"holds a longer answer (longest answers in tokens: {longest}); raise "
                         "it to train on them")
    if stats["demos_over_answer_cap"]:
        logging.getLogger(__name__).warning(
            "sft: %d of %d demonstrations dropped: they hold answers longer than "
            "sft.max_answer_tokens=%d, the rollouts' per-turn cap, which no rollout could "
            "finish (answers over it: %s; longest answers in tokens: %s)",
            stats["demos_over_answer_cap"], len(demos), cap, over, longest)
    return kept, stats


def _check_trained(cfg, last: dict, skipped: int, loss_after: float, grad_norm_after: float) -> None:
    """Refuse to write weights that diverged: the last step's (`last`, its log row) loss is
    not finite or its gradient was (the step was skipped: the weights as they are give no
    finite gradient), or the last batch's loss or gradient at the updated weights (what is
    written; the logged values come before each update) is not finite. Warn when earlier steps were skipped, or when every step ran at learning
    rate 0 (a warmup longer than the run: `sft.steps=1` with any `optim.warmup_steps`), so the
    weights written are the input's."""
    import math

    from jscenegen.grpo.algo.optimizer import lr_at

    log = logging.getLogger(__name__)
    steps, optim = cfg.sft.steps, cfg.optim
    if not math.isfinite(last["loss"]) or last["skipped"]:
        what = (f"loss is {last['loss']}" if not math.isfinite(last["loss"])
                else "gradient is not finite")
        raise ValueError(f"sft: the last step's {what}: training diverged ({skipped} of {steps} "
                         f"steps skipped for non-finite gradients; optim.lr={optim.lr:g}); "
                         "nothing written")
    if not (math.isfinite(loss_after) and math.isfinite(grad_norm_after)):
        raise ValueError(f"sft: at the weights after the last step its batch has loss "
                         f"{loss_after} and gradient norm {grad_norm_after}: the last update "
                         f"diverged (optim.lr={optim.lr:g}, optim.weight_decay="
                         f"{optim.weight_decay:g}); nothing written")
    if skipped:
        log.warning("sft: %d of %d steps were skipped (non-finite gradients)", skipped, steps)
    # the learning rate peaks at the end of the warmup (or at the last step, within it)
    if float(lr_at(optim, min(steps - 1, optim.warmup_steps))) == 0.0:
        log.warning("sft: every step ran at learning rate 0 (sft.steps=%d, optim.warmup_steps=%d, "
                    "optim.lr=%g): the weights written are the input's", steps,
                    optim.warmup_steps, optim.lr)
