"""The GRPO training loop: schedule -> rollout -> advantages -> train step -> metrics -> checkpoint.

The trainer owns no math: the schedule (train/schedule.py) picks the scene, seeds and role;
the rollout engine (grpo/rollout/engine.py) plays the G episodes; train/batch.py turns them
into the update's arrays (advantages: grpo/algo/advantages.py); train/step.py takes the loss
and AdamW step (one mini-batch, one epoch: the loss pass's own log-probs are the old ones);
jscenegen/checkpoint/store.py saves and restores everything needed to continue bit for bit.

Exact resume: sampling keys are derived from the episode seeds and every other piece of state
(parameters, Adam moments and count, LR-schedule count, schedule position) is in the checkpoint,
so a resumed run repeats the straight run's trajectories, updates and metrics. There is no
global PRNG stream to carry.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jscenegen.checkpoint.checksums import file_sha256
from jscenegen.checkpoint.metadata import config_changes, redact, training_metadata
from jscenegen.checkpoint.model_dir import NO_READABLE_WEIGHTS, weights_digest
from jscenegen.checkpoint.resume import (
    ResumeError,
    check_run_identity,
    check_same_reference,
    check_same_run,
    check_same_tokenizer,
    check_step_number,
    checkpoint_position,
    compared_tokenisation_files,
    has_run_identity,
    restore_onto_mesh,
    retire_converted_manifest,
    torch_optimizer_changes,
)
from jscenegen.checkpoint.store import (
    TRAIN_STATE_ITEM,
    CheckpointError,
    CheckpointStore,
    check_step,
    check_step_entries,
    finished_saves,
    read_metadata,
)
from jscenegen.grpo.algo.accumulate import check_padded_micro_batches
from jscenegen.grpo.algo.config import LossConfig
from jscenegen.grpo.algo.logprobs import selection_capacity
from jscenegen.grpo.algo.optimizer import (
    TrainState,
    adam_state,
    init_train_state,
    schedule_ends_early,
    state_from_canonical,
    state_to_canonical,
)
from jscenegen.grpo.algo.roles import ROLE_NAMES
from jscenegen.grpo.rollout.config import GROUP_MAX
from jscenegen.grpo.rollout.engine import GroupRequest, RolloutEngine
from jscenegen.grpo.rollout.judges import build_judge, load_judge
from jscenegen.grpo.rollout.stats import group_metrics
from jscenegen.grpo.train.batch import TRAIN_KEYS, build_group_batch
from jscenegen.grpo.train.metrics import MetricsLogger, truncate_run_logs
from jscenegen.grpo.train.schedule import (
    SCHEDULE_HASH_SETTINGS,
    Schedule,
    SchedulePosition,
    check_extension,
    check_scene_content,
)
from jscenegen.grpo.train.step import GRPOStep
from jscenegen.model.config import QwenConfig
from jscenegen.model.dtypes import np_dtype
from jscenegen.model.functional import hidden_fn, split_params
from jscenegen.model.hf_io import load_hf
from jscenegen.model.loader import build_model
from jscenegen.model.rope import warn_dynamic_rope_drift
from jscenegen.model.tokenizer.chat import ChatTokenizer
from jscenegen.model.weights import (
    Carried,
    CheckpointFormatError,
    named_leaves,
    named_weights,
    param_shapes,
)
from jscenegen.paths import json_sha256, resolve_data_path, write_json
from jscenegen.run_files import RUN_CHECKPOINTS, TRAJECTORIES_LOG, eval_update_stem
from jscenegen.scene.protocol import judge_model_change, protocol_hash, protocol_settings
from jscenegen.scene.reward import JUDGE_FAILURES, RUNTIME_FAILURES
from jscenegen.scene.sceneset import SceneRecord, read_scene_set, scene_set_hash
from jscenegen.sharding.layout import shard_batch
from jscenegen.sharding.mesh import (
    check_same_settings,
    is_primary,
    joined_other_processes,
    make_mesh,
    max_over_processes,
    mesh_shape,
    on_primary,
)
from jscenegen.signals import STOP_REQUESTS, STOP_SIGNALS, raise_if_redelivered, unwind

log = logging.getLogger(__name__)

SEQ_BUCKET = 256  # training sequence lengths are padded to multiples of this (and of sp)


class JudgeDownError(RuntimeError):
    """The judge failed every episode it graded for `judge.max_failed_updates` updates in a row."""


class RolloutDownError(RuntimeError):
    """Every episode failed in our runtime or sampler for `rollout.max_failed_updates` updates
    in a row."""


@dataclasses.dataclass
class RunSummary:
    """What `Trainer.run` did: update attempts made (= the newest checkpoint's N), effective
    updates and optimizer steps, the newest checkpoint's directory, the stopping signal's name
    (None when the run finished or reached its limit) and the updates' wall time in seconds."""

    attempts: int
    effective_updates: int
    optimizer_steps: int
    checkpoint: str | None
    stopped_by_signal: str | None  # the signal's name (SIGTERM, SIGINT) when one stopped the run
    wall_s: float


def train_scenes(cfg) -> tuple[list[SceneRecord], int]:
    """The train scene set (`schedule.train_set`) and how many of its scenes the schedule uses
    (`schedule.num_scenes`, default all). Raises ValueError naming the key when num_scenes
    exceeds the set, or when `rollout.groups_per_batch` asks for more scenes than the schedule
    uses or more episodes per batch than GROUP_MAX, or when `loss.ppo_micro_batch_size` does
    not divide the batch's rows padded for `mesh.fsdp`, and the scene-set reader's errors for
    a missing or malformed file."""
    scenes = read_scene_set(resolve_data_path(cfg.schedule.train_set))
    n = cfg.schedule.num_scenes or len(scenes)
    if n > len(scenes):
        raise ValueError(f"schedule.num_scenes={n}: {cfg.schedule.train_set} holds only "
                         f"{len(scenes)} scenes")
    k = cfg.rollout.groups_per_batch
    if k > n:
        raise ValueError(f"rollout.groups_per_batch={k}: more scenes per batch than the "
                         f"schedule's {n}")
    if k * cfg.schedule.group_size > GROUP_MAX:
        raise ValueError(f"rollout.groups_per_batch={k} x schedule.group_size="
                         f"{cfg.schedule.group_size} episodes per batch: at most {GROUP_MAX}")
    fsdp, _ = mesh_shape(jax.device_count(), cfg.mesh.fsdp, cfg.mesh.sp)
    check_padded_micro_batches(k * cfg.schedule.group_size, fsdp,
                               cfg.loss.ppo_micro_batch_size,
                               "rollout.groups_per_batch x schedule.group_size",
                               "loss.ppo_micro_batch_size")
    return scenes, n


def constant_horizon(cfg) -> LossConfig:
    """The run's (`RunConfig`) `cfg.loss`, with `seq-mean-token-sum-norm`'s unset horizon fixed at
    `sampling.max_episode_tokens`: the batch's padded length changes between updates (a
    multiple of SEQ_BUCKET past the longest episode), VERL's is its fixed response length."""
    loss = cfg.loss
    if loss.loss_agg_mode == "seq-mean-token-sum-norm" and loss.horizon is None:
        return loss.model_copy(update={"horizon": cfg.sampling.max_episode_tokens})
    return loss


def _write_on_primary(write: Callable[[], None]) -> None:
    """Process 0 writes the run's logs and reports; when that fails (a full disk, the metrics
    service), every process raises at once (`on_primary`: process 0 its error, the others
    OSError with its message) rather than the others going on into a collective that waits for
    process 0 until JAX's heartbeat ends them without the reason."""
    on_primary(write, OSError)


def _metrics_logger(run_dir: Path, cfg) -> MetricsLogger:
    """The run's MetricsLogger: process 0 starts swanlab in it, the others log nothing. When
    that start fails on process 0 (a key the cloud refuses, the cloud out of reach), every
    process raises its error (`on_primary`: process 0 its own, the others ValueError with its
    message) rather than the others going on into the next collective, which loses process 0
    and ends them without the reason."""
    made: list[MetricsLogger] = []
    on_primary(lambda: made.append(MetricsLogger(run_dir, cfg.logging,
                                                 redact(cfg.model_dump(mode="json")))))
    return made[0] if made else MetricsLogger(run_dir, cfg.logging, {}, primary=False)


def _tokenisation_files_digest(model_dir: Path, template_override: bool) -> str:
    """Digest of {name: sha256 of its bytes, None when absent, "unreadable"} of the files of
    `model_dir` a resume compares with its checkpoint's copies (`compared_tokenisation_files`),
    so hosts whose copies differ anywhere (a tokenizer_config.json of a newer hub revision)
    are refused together, not one alone inside a collective restore."""
    def digest(f: Path) -> str | None:
        try:
            return file_sha256(f) if f.is_file() else None
        except OSError:
            return "unreadable"

    return json_sha256({name: digest(model_dir / name)
                        for name in compared_tokenisation_files(template_override)})


class Trainer:
    """One GRPO run in `run_dir` with the weights of `model_dir` (or a checkpoint to resume)."""

    def __init__(self, cfg, run_dir: str | Path, model_dir: str | Path, *, resume: bool = False):
        """model_dir: the HF directory of the initial policy (weights, tokenizer, chat template);
        with `resume`, only its config and tokenizer are used (a checkpoint's `hf/` will do) and
        the weights come from the newest complete checkpoint in `run_dir/checkpoints`.

        Raises ResumeError (changed protocol/reward/schedule, a schedule.total_updates below the
        effective updates done, a model directory whose tokenizer or chat template is not the
        checkpoint's `hf/` copy, KL reference weights other than the run trained against, or a
        finished save where a fresh run was asked for: `store.finished_saves`), MeshError,
        CheckpointError, ChatTemplateError.
        """
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.model_dir = Path(model_dir)
        self._weights_digests: dict[Path, str] = {}   # `weights_digest` by directory, once a start
        self.mesh = make_mesh(cfg.mesh.fsdp, cfg.mesh.sp)
        self.scenes, n = train_scenes(cfg)
        self.schedule = Schedule([(f"train-{i:04d}", self.scenes[i].seed) for i in range(n)],
                                 cfg.schedule)
        # a model judge reads its tokenizer and digests its files here (its identity enters the
        # protocol hash); its weights load once the policy's are placed (`load_judge` below)
        self.judge = build_judge(cfg, mesh=self.mesh)
        self.protocol_hash = protocol_hash(cfg.scene, cfg.judge, self.judge.identity())
        self.pos = SchedulePosition()
        check_step_entries(self.run_dir / RUN_CHECKPOINTS)
        self.store = CheckpointStore(self.run_dir / RUN_CHECKPOINTS, keep_last=cfg.checkpoint.keep_last,
                                     async_save=cfg.checkpoint.async_save)
        self.arch = arch = QwenConfig.from_dir(self.model_dir)   # the policy's architecture
        # every tensor the checkpoints hold, and the ones AdamW steps (not Qwen3.5's carried
        # vision tower, unless model.train_vision, nor its MTP head)
        self.shapes = param_shapes(arch, carried=True)
        self.trainable = list(param_shapes(arch, train_vision=cfg.model.train_vision))
        options = cfg.model.build_options()
        if cfg.model.param_dtype == "bfloat16":
            log.warning("model.param_dtype=bfloat16 keeps no fp32 master weights: a step smaller "
                        "than half a bf16 spacing of its weight (|w| x 2^-9, 4e-5 at |w| = 0.02) "
                        "rounds away, and AdamW moves a weight by about optim.lr = %g per step; "
                        "for VERL's numerics keep param_dtype float32 (compute_dtype bfloat16 "
                        "still computes in bf16)", cfg.optim.lr)
        early = schedule_ends_early(cfg.optim, cfg.schedule.total_updates, "schedule.total_updates")
        if early:
            log.warning("%s", early)
        warn_dynamic_rope_drift(arch, cfg.sampling.max_episode_tokens,
                                str(self.model_dir / "config.json"))
        self.chat = ChatTokenizer.from_dir(self.model_dir, cfg.sampling.chat_template_path)
        self.chat.check_prefix_preserving()
        # the tokenizer's pad token is the model's (its embedding row gets no gradient from
        # the lookup, as torch's padding_idx), as VERL's actor sets it, whatever config.json says
        self.arch = arch = arch.with_pad_token_id(self.chat.tokenizer.pad_token_id,
                                                  f"{self.model_dir}: the tokenizer's pad token")
        check_same_settings(self._input_digests(resume), "give every host the same files (one shared "
                            "filesystem, or identical copies)")   # each read them from its own disk
        from jscenegen.eval.evaluate import check_scenes_fit

        check_scenes_fit(self.chat, self.scenes[:n], cfg, str(cfg.schedule.train_set))  # before any weights
        # the KL reference this start trains against, saved in every train state (resumed
        # runs compare it, `_check_saved`); a run without KL carries its checkpoint's forward
        self._kl_reference = self._reference_record() if cfg.loss.use_kl_loss else None
        if resume:
            ck = self._read_checkpoint()
            _write_on_primary(lambda: retire_converted_manifest(self.store.directory))
            self.model = build_model(arch, ck.params.items(), mesh=self.mesh,
                                     source=str(ck.path), **options)
        else:
            if finished_saves(self.store.directory):   # the rule `train` refuses by, too
                raise ResumeError(f"{self.run_dir} already holds checkpoints; pass --resume "
                                  f"{self.run_dir} to continue it, or choose a new --run-dir")
            self.model = load_hf(self.model_dir, mesh=self.mesh, cfg=arch, **options)
        # the sampler's own copy of the weights, in the rollout layout (sharding/rollout.py);
        # resharded once after every train step, skipped or not (`update`)
        self.engine = RolloutEngine(self.model, self.chat, cfg.sampling, self.mesh, cfg.rollout)
        graphdef, params, frozen = split_params(self.model)
        self.step_fn = GRPOStep(hidden_fn(graphdef, frozen), constant_horizon(cfg), cfg.optim,
                                temperature=cfg.sampling.temperature)
        # eager, so every moment carries its parameter's FSDP2 sharding (built under jit they
        # came out replicated) and the counters are replicated: the train step's outputs then
        # match its inputs and it compiles once
        self.state: TrainState = init_train_state(params, cfg.optim)
        self._judge_down: list[str] = []     # the judge failures of the updates in a row it failed
        self._rollout_down: list[str] = []   # the runtime failures of the updates in a row they took
        self._own_checkpoint = False         # resumed from this trainer's own train state
        if resume:
            self._apply_checkpoint(ck)
        else:  # the logs of a start that stopped before its first checkpoint
            _write_on_primary(lambda: truncate_run_logs(self.run_dir, 0))
        self.ref_params = self._reference_params(params, resume) if cfg.loss.use_kl_loss else None
        # the model judge's weights (no-op otherwise), once everything the policy holds on the
        # devices exists (its rollout copy, Adam's moments, the KL reference): its memory check
        # sees what is left beside them
        load_judge(self.judge)
        self.logger = _metrics_logger(self.run_dir, cfg)
        self._signal_received: int | None = None   # this process's own first stop signal
        self._stop_signal: int | None = None       # the stop every process agreed on
        self._replaced_handlers: dict = {}
        self._last_eval: dict | None = None   # the newest evaluation's report

    # ---- state ---------------------------------------------------------------------------
    def _reference_params(self, params, resume: bool):
        """The KL term's frozen reference: `model.reference_path`, else the initial policy
        (a copy of `params` at a fresh start; the run's model directory on resume, not the
        checkpoint's weights). Raises ResumeError when a resumed run's model directory holds
        no weights (a run converted from VERL) and no reference_path is given."""
        path = self.cfg.model.reference_path
        if path is None and not resume:
            return jax.tree.map(jnp.copy, params)  # never donated
        if path is not None:
            self._check_reference(path)
        try:
            ref = load_hf(self._reference_dir(), mesh=self.mesh, **self.cfg.model.build_options())
        except CheckpointFormatError as err:
            if path is not None:
                raise
            raise ResumeError(f"loss.use_kl_loss: the KL reference is the run's initial policy, "
                              f"whose weights are not in {self.model_dir} ({err}); give its HF "
                              "directory as model.reference_path") from None
        return split_params(ref)[1]

    def _reference_dir(self) -> Path:
        """The KL reference's HF directory: model.reference_path, else the run's model
        directory (the initial policy's; on resume too, not the checkpoint's weights)."""
        path = self.cfg.model.reference_path
        return Path(path) if path is not None else self.model_dir

    def _digest_of(self, model_dir: Path) -> str:
        """`weights_digest` of `model_dir`, computed once a start (the cross-host check and the
        KL reference's record both read the reference's)."""
        if model_dir not in self._weights_digests:
            self._weights_digests[model_dir] = weights_digest(model_dir)
        return self._weights_digests[model_dir]

    def _reference_record(self) -> dict | None:
        """{"path": model.reference_path (None: the initial policy, the model directory),
        "weights_digest": `weights_digest` of its directory}; None when that directory holds
        no readable weights (`_reference_params` then names the problem)."""
        digest = self._digest_of(self._reference_dir())
        return (None if digest == NO_READABLE_WEIGHTS else
                {"path": self.cfg.model.reference_path, "weights_digest": digest})

    def _check_reference(self, path: str) -> None:
        """Raise ValueError naming model.reference_path when its config.json describes other
        trained tensors (names or shapes) than the policy's, or computes them otherwise (RoPE,
        norms, activation, layer types: the reference runs on the policy's modules): read
        before any weight, so a wrong reference fails before the run writes a file."""
        try:
            reference = QwenConfig.from_dir(path)
        except (OSError, ValueError) as err:   # a missing or malformed config.json
            raise ValueError(f"model.reference_path: {err}") from None
        want = param_shapes(self.arch, train_vision=self.cfg.model.train_vision)
        got = param_shapes(reference, train_vision=self.cfg.model.train_vision)
        only = sorted(set(want) ^ set(got))
        reshaped = [n for n in want if n in got and tuple(got[n]) != tuple(want[n])]
        if only or reshaped:
            first = (f"{only[0]} is only in the {'policy' if only[0] in want else 'reference'}"
                     if only else f"{reshaped[0]} is {tuple(got[reshaped[0]])} there, "
                     f"{tuple(want[reshaped[0]])} in the policy")
            raise ValueError(f"model.reference_path {path}: the KL reference must have the "
                             f"policy's architecture and size; {first} ({len(only) + len(reshaped)} "
                             "tensors differ)")
        ignored = {"bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "mtp_layers", "vision",
                   "hf_config", "stored_dtypes"}   # ids, storage and carried tensors
        for name in (f.name for f in dataclasses.fields(QwenConfig) if f.name not in ignored):
            if getattr(reference, name) != getattr(self.arch, name):
                raise ValueError(f"model.reference_path {path}: the KL reference is computed with "
                                 f"the policy's modules, but its {name} is "
                                 f"{getattr(reference, name)!r} there, "
                                 f"{getattr(self.arch, name)!r} in the policy")

    def params_by_name(self) -> dict[str, jax.Array]:
        """Every tensor a checkpoint stores: the trained parameters (current values) and the
        model's carried tensors (unchanged since loading, stored dtype)."""
        carried = {n: v[...] for n, v in named_weights(self.model).items() if isinstance(v, Carried)}
        return {**named_leaves(self.state.params), **carried}

    def _input_digests(self, resume: bool) -> dict[str, str]:
        """Digests of what each process of a multi-process run reads from its own disk (the
        config's keys are compared at launch): a host with other scene sets, prompts, catalogue,
        model architecture or tokenizer would play other episodes in one batch, or a different
        number of them (a hang); one with other weights (another fine-tune of the same
        architecture) would load its shards of them into the one model. The HF weights a start
        reads (the initial policy, the KL reference) are compared by `sampled_file_digest` of
        each safetensors file; a resumed checkpoint's files are checked by `CheckpointStore`.
        The tokenizer, chat template and generation config files are compared by their bytes:
        a resume compares each host's with the checkpoint's `hf/` on that host alone
        (`check_same_tokenizer`), and a host refused there would leave the others waiting in
        the restore. {} in one process."""
        if jax.process_count() == 1:
            return {}
        dev = read_scene_set(resolve_data_path(self.cfg.schedule.dev_set))
        weights = {} if resume else {"initial policy's weights (model.path)": self.model_dir}
        if self.cfg.loss.use_kl_loss:
            weights["KL reference's weights (model.reference_path, else model.path)"] = \
                self._reference_dir()
        return {**{name: self._digest_of(d) for name, d in weights.items()},
                "train scene set (the file's scenes)": scene_set_hash(self.scenes),
                "dev scene set (the file's scenes)": scene_set_hash(dev),
                "scene protocol (prompt files, catalogue, rules, judge)": self.protocol_hash,
                "model architecture (config.json)": json_sha256(self.arch.to_hf_dict()),
                "tokenizer or chat template": json_sha256(
                    [self.chat.tokenizer.chat_template, sorted(self.chat.tokenizer.get_vocab().items()),
                     list(self.chat.end_ids)]),
                # every byte a resume compares (`check_same_tokenizer`, one process at a time)
                "copy of the tokenizer files (model.path's tokenizer, chat template and "
                "generation config files)": _tokenisation_files_digest(
                    self.model_dir, bool(self.cfg.sampling.chat_template_path))}

    def _train_state_json(self) -> dict:
        state = {
            "schedule": self.pos.to_json(),
            "lr_step": int(self.state.lr_step),
            "skipped_steps": int(self.state.skipped_steps),
            "num_scenes": len(self.schedule.scene_seeds),
            "schedule_hash": self.schedule.hash(),
            "scenes_hash": scene_set_hash(self.scenes[:len(self.schedule.scene_seeds)]),
            "protocol_hash": self.protocol_hash,
            "reward": self.cfg.scene.reward.model_dump(mode="json"),
            # a resumed run stops after the failed updates a straight one would have (the
            # streaks are cleared where the run stopped for them: fixed, then resumed)
            "failure_streaks": {"judge": list(self._judge_down), "rollout": list(self._rollout_down)},
            "data_iterator": {"scene_index": self.pos.scene_index, "epoch": self.pos.epoch},
            "rng": "none: sampling keys derive from the episode seeds",
        }
        if self._kl_reference is not None:   # the KL reference's weights (`_reference_record`)
            state["kl_reference"] = self._kl_reference
        return state

    def save(self) -> Path:
        adam = state_to_canonical(self.state.opt_state)
        meta = training_metadata(
            config=self.cfg.model_dump(mode="json"), protocol_hash=self.protocol_hash,
            schedule_hash=self.schedule.hash(), optimizer_step=int(adam["count"]),
            effective_updates=self.pos.effective_updates, judge=self.judge.identity(),
            extra={"model_dir": str(self.model_dir)})
        return self.store.save(self.pos.attempts, params=self.params_by_name(), adam=adam,
                               train_state=self._train_state_json(), metadata=meta,
                               hf_assets_dir=self.model_dir, shapes=self.shapes,
                               trainable=self.trainable)

    def _read_checkpoint(self):
        """Newest complete checkpoint, verified, restored onto this mesh, once its train state
        passed `_check_saved` (before any array is read).

        A checkpoint converted from VERL or HF files that did not come from ours carries no
        protocol or schedule of ours: it starts this schedule at its global step.
        """
        dtype = np_dtype(self.cfg.model.param_dtype)
        ck = restore_onto_mesh(self.store, self.shapes, self.mesh, dtype, self.trainable,
                               check_train_state=self._check_saved)
        if not has_run_identity(ck.train_state):
            log.warning("starting from a %s checkpoint converted at step %s: no protocol or "
                        "schedule hash to check", ck.train_state.get("source_format", "unknown"),
                        ck.train_state.get("step"))
        return ck

    def _check_saved(self, step_dir: Path, step: int, saved: dict) -> None:
        """Refuse a step whose train state is malformed, numbered otherwise than its directory
        (`check_step_number`), from a changed run (protocol, reward, schedule, scenes), whose
        `hf/` tokenizer and chat template the model directory no longer holds
        (`check_same_tokenizer`), or, with the KL loss, whose recorded reference weights are
        not the reference directory's (`check_same_reference`)."""
        check_same_tokenizer(self.model_dir, step_dir,
                             template_override=bool(self.cfg.sampling.chat_template_path))
        if not has_run_identity(saved):
            at = check_step_number(step_dir, step, saved)
            if changed := torch_optimizer_changes(read_metadata(step_dir), self.cfg.optim,
                                                  at.lr_step):
                log.warning("%s was converted from a torch run with other AdamW settings: this "
                            "run continues with %s", step_dir, "; ".join(changed))
            return
        try:
            check_run_identity(saved)
        except ValueError as err:
            raise CheckpointError(f"{step_dir / TRAIN_STATE_ITEM}: {err}") from None
        check_step_number(step_dir, step, saved)
        check_same_run(saved, protocol_hash=self.protocol_hash,
                       reward=self.cfg.scene.reward.model_dump(mode="json"),
                       protocol_settings=self._protocol_settings_changed(step_dir, saved))
        try:
            check_extension(saved, self.schedule, *self._schedule_settings_changed(step_dir, saved))
            check_scene_content(saved, self.scenes, self.cfg.schedule.train_set)
        except ValueError as err:
            raise ResumeError(str(err)) from None
        if self._kl_reference is not None:
            check_same_reference(saved, self._kl_reference, self._reference_dir(),
                                 step_dir / TRAIN_STATE_ITEM)

    def _schedule_settings_changed(self, step_dir, saved) -> tuple[list[str], dict | None]:
        """(The settings the schedule hash reads, SCHEDULE_HASH_SETTINGS, that differ from
        those the checkpoint's metadata records, as `config_changes` lists them; that record's
        `schedule` section, None when it has none). Only read when the hash differs."""
        if saved["schedule_hash"] == self.schedule.hash(int(saved["num_scenes"])):
            return [], None
        recorded = read_metadata(step_dir).get("config")
        before = recorded.get("schedule") if isinstance(recorded, dict) else None
        if not isinstance(before, dict):
            return [], None
        now = self.cfg.schedule.model_dump(mode="json")
        def hashed(section: dict) -> dict:
            return {"schedule": {k: section[k] for k in SCHEDULE_HASH_SETTINGS if k in section}}
        return config_changes(hashed(before), hashed(now), only_saved_keys=True), before

    def _protocol_settings_changed(self, step_dir, saved) -> list[str] | None:
        """The settings the protocol hash reads (`protocol_settings`) that differ from those
        the checkpoint's metadata records, and a model judge's other model
        (`judge_model_change`) (only computed when the hash differs; None when it records no
        config)."""
        if saved["protocol_hash"] == self.protocol_hash:
            return []
        metadata = read_metadata(step_dir)
        recorded = metadata.get("config")
        before = protocol_settings(recorded) if isinstance(recorded, dict) else None
        if before is None:
            return None
        # a model judge's files replaced in place change its identity, not its settings
        return config_changes(before, protocol_settings(self.cfg.model_dump(mode="json")),
                              only_saved_keys=True) + judge_model_change(metadata.get("judge"),
                                                                         self.judge.identity())

    def _apply_checkpoint(self, ck) -> None:
        saved = ck.train_state
        opt_state = state_from_canonical(ck.adam, self.state.opt_state)
        at = checkpoint_position(saved)
        lr_step, skipped = at.lr_step, at.skipped_steps
        if not has_run_identity(saved):
            self.pos = SchedulePosition.after_steps(at.step, len(self.schedule.scene_seeds),
                                                    self.cfg.rollout.groups_per_batch)
        else:
            self.pos = self.schedule.extended(SchedulePosition.from_json(saved["schedule"]),
                                              int(saved["num_scenes"]))
            self._own_checkpoint = True
            if self._kl_reference is None:   # no KL now: kept for a later resume with it
                self._kl_reference = saved.get("kl_reference")
            streaks = saved.get("failure_streaks", {})   # checked by check_run_identity
            self._judge_down = list(streaks.get("judge", []))
            self._rollout_down = list(streaks.get("rollout", []))
        if self.cfg.schedule.total_updates < self.pos.effective_updates:
            raise ResumeError(f"schedule.total_updates={self.cfg.schedule.total_updates} is below "
                              f"the {self.pos.effective_updates} effective updates {self.run_dir} "
                              "has done; leave it out to keep the run's total, or raise it to "
                              "extend the run")
        # the counters where the fresh state keeps them (replicated on the mesh): a
        # single-device scalar would give the first step new input shardings, a second compile
        self.state = TrainState(
            self.state.params, opt_state,
            jax.device_put(jnp.asarray(lr_step, jnp.int32), self.state.lr_step.sharding),
            jax.device_put(jnp.asarray(max(skipped, 0), jnp.int32),
                           self.state.skipped_steps.sharding))
        _write_on_primary(lambda: truncate_run_logs(self.run_dir, self.pos.attempts))
        log.info("resumed %s at attempt %d (%d effective updates)", self.run_dir,
                 self.pos.attempts, self.pos.effective_updates)

    # ---- the loop ------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        """The first SIGTERM/SIGINT stops the run after the current update (with a checkpoint);
        a second one stops it at once by unwinding (`signals.unwind`): the update in flight is
        lost, the checkpoints already written are kept. Requests are counted by arrival
        (`signals.STOP_REQUESTS`): a repeat of the same request is ignored, and two that
        arrived during one native call (one handler call) count as two."""
        raise_if_redelivered(signum)
        requests = STOP_REQUESTS.take(signum)
        if not requests:
            return
        name = signal.Signals(signum).name
        if self._signal_received is None:   # not `_stop_signal`: another host's stop, agreed,
            self._signal_received = signum  # is no signal of this one's
            if requests == 1:
                log.warning("%s: stopping after the current update, with a checkpoint (send it "
                            "again to stop at once, losing that update)", name)
                return
            log.warning("%s: two stop requests arrived during one native call: "
                        "stopping at once", name)
        unwind(signum)

    def update(self) -> dict:
        """One attempt: roll out the current scene's group (with `rollout.groups_per_batch` = k,
        the next k scenes' groups in one batch) and step when it has signal; after a step, a
        skipped one included, the sampler's weights are resharded once (`rollout/reshard_s`,
        `rollout/reshard_bytes`)."""
        pos, sched, cfg = self.pos, self.schedule, self.cfg
        k = cfg.rollout.groups_per_batch
        role = sched.role(pos)
        requests = [GroupRequest(self.scenes[sched.scene_at(pos, j)[0]], pos.attempts * k + j,
                                 tuple(sched.seeds(pos, j))) for j in range(k)]
        t0 = time.perf_counter()
        groups = self.engine.run_groups(requests, judge=self.judge, scene_cfg=cfg.scene,
                                        judge_cfg=cfg.judge)
        rollout_s = time.perf_counter() - t0
        trajectories = [t for g in groups for t in g.trajectories]
        batch = build_group_batch(trajectories, role,
                                  row_multiple=self.mesh.shape["fsdp"],
                                  col_multiple=np.lcm(SEQ_BUCKET, self.mesh.shape["sp"]),
                                  eps=cfg.loss.adv_eps, norm_by_std=cfg.loss.norm_adv_by_std,
                                  group_size=cfg.schedule.group_size)
        new_pos, do_step = sched.advance(pos, batch.has_signal, k)
        stats = groups[0].stats
        row = {"attempt": pos.attempts, "scene_index": pos.scene_index, "epoch": pos.epoch,
               "redraw": pos.redraw, "role": ROLE_NAMES[role], "stepped": do_step,
               "has_signal": batch.has_signal, "trained_tokens": batch.trained_tokens,
               "effective_updates": new_pos.effective_updates,
               "rollout/tokens_per_s": stats["tokens_per_s"],
               "rollout/generated_tokens": stats["batch_generated_tokens"],
               "rollout/batch_rows": stats["batch_rows"],
               "rollout/padding_rows": stats["padding_rows"],
               "time/rollout_s": rollout_s}
        row.update(group_metrics(trajectories, cfg.judge.grade_keys))
        self._note_failures(trajectories)
        if do_step:
            t1 = time.perf_counter()
            row.update(self._step(batch))
            row["time/train_s"] = time.perf_counter() - t1
            # the step donated the state it was given, a skipped step's too (its parameters
            # come back unchanged, in new buffers); under `rollout.layout: fsdp` with no cast
            # the sampler reads those very arrays (`Reshard.identity`), so it gets the live
            # ones after every step (a skipped step's reshard elsewhere rewrites equal weights)
            reshard = self.engine.set_weights(self.state.params)
            row["rollout/reshard_s"] = reshard["reshard_s"]
            row["rollout/reshard_bytes"] = reshard["reshard_bytes"]
            if row["train/skipped"]:
                # a non-finite gradient: no optimizer step, so no effective update (the role
                # waits for the next scene)
                new_pos = dataclasses.replace(new_pos, effective_updates=pos.effective_updates)
                row["stepped"], row["effective_updates"] = False, pos.effective_updates
                log.warning("attempt %d: the gradient is not finite; the update is skipped "
                            "(train/skipped), its role trains on the next scene; the LR scheduler "
                            "advanced (as VERL's), so a schedule sized to schedule.total_updates "
                            "ends one update early", pos.attempts)
        self.pos = new_pos
        if cfg.trainer.dump_trajectories:
            _write_on_primary(lambda: self._dump(trajectories, pos))
        return row

    def _note_failures(self, trajectories) -> None:
        """Count the updates in a row whose judged episodes all failed in the judge, and those
        whose episodes all failed in our runtime or sampler (kept with the first one's detail)."""
        causes = [t.failure_cause for t in trajectories]
        failed = [c for c in causes if c in JUDGE_FAILURES]
        if any(c is None for c in causes):
            self._judge_down = []
        elif failed:
            self._judge_down.append(max(set(failed), key=failed.count))
        if causes and all(c in RUNTIME_FAILURES for c in causes):
            self._rollout_down.append(f"{causes[0]}: {trajectories[0].failure_message[:300]}")
        else:
            self._rollout_down = []
        # only the length up to the limit and the last entry are read (they go into every
        # checkpoint: a run that never stops for them would carry the whole history)
        self._judge_down = self._judge_down[-max(self.cfg.judge.max_failed_updates, 1):]
        self._rollout_down = self._rollout_down[-max(self.cfg.rollout.max_failed_updates, 1):]

    def _failed_updates_error(self) -> RuntimeError | None:
        """The error to stop with after `judge.max_failed_updates` updates in a row in which
        the judge failed every episode it graded, or `rollout.max_failed_updates` in which every
        episode failed in our runtime or sampler; else None."""
        for error, streak, key, limit, what, advice in (
                (JudgeDownError, self._judge_down, "judge.max_failed_updates",
                 self.cfg.judge.max_failed_updates, "the judge failed every episode it was asked "
                 "to grade in the last {n} updates (mostly {last}", "fix the judge"),
                (RolloutDownError, self._rollout_down, "rollout.max_failed_updates",
                 self.cfg.rollout.max_failed_updates, "every episode of the last {n} updates "
                 "failed in the rollout itself, not the policy (last: {last}",
                 "JSCENEGEN_DEBUG=1 shows the traceback")):
            if limit and len(streak) >= limit:
                return error(f"{what.format(n=len(streak), last=streak[-1])}; {key}={limit}); "
                             f"stopped with a checkpoint: {advice}, then jscenegen train "
                             f"--resume {self.run_dir}")
        return None

    def _step(self, batch) -> dict:
        # logits of the trained tokens only: a static per-row capacity from the host mask
        cap = selection_capacity(batch.arrays["loss_mask"])
        arrays = shard_batch({k: batch.arrays[k] for k in TRAIN_KEYS}, self.mesh)
        ids, mask, select = arrays["input_ids"], arrays["attention_mask"], arrays["loss_mask"]
        with jax.set_mesh(self.mesh):
            # no old_logp: with one mini-batch and one epoch the step takes the loss pass's own
            # log-probs (stop_gradient), the recompute itself, so the ratio is exactly 1 and no
            # separate forward runs (../shared/specs/grpo.md)
            if self.ref_params is not None:
                arrays["ref_logp"] = self.step_fn.logprobs(self.ref_params, ids, mask, select,
                                                           capacity=cap)[0]
            self.state, metrics = self.step_fn.step(self.state, arrays, capacity=cap)
        metrics = {f"train/{k}": float(v) for k, v in metrics.items()
                   if k != "kl" or self.cfg.loss.use_kl_loss}   # no reference, no KL (as VERL)
        metrics["train/optimizer_step"] = int(adam_state(self.state.opt_state).count)
        return metrics

    def _dump(self, trajectories, pos: SchedulePosition) -> None:
        with open(self.run_dir / TRAJECTORIES_LOG, "a") as f:
            for t in trajectories:
                f.write(json.dumps({"attempt": pos.attempts, "member": t.member, "seed": t.seed,
                                    "reward": t.reward, "failure_cause": t.failure_cause,
                                    "masked": t.masked, "transcript": t.transcript}) + "\n")

    def evaluate_dev(self, name: str) -> dict:
        """Play the dev scenes (`evaluation_samples` episodes each: `trainer.eval_samples`, 1
        under `sampling.greedy`; their fixed seeds) with the
        current weights; write `RUN_DIR/<name>.json` and `.png`; return the report, which holds
        the run's `attempts` (update attempts made: the checkpoint `checkpoints/<attempts>`) and
        `effective_updates`. An evaluation at the same attempt as the previous one (the last
        update's `trainer.eval_every` evaluation, then `eval_after`: the same weights) is not
        played again: that report is written under `name`."""
        from jscenegen.eval.evaluate import evaluate, evaluation_samples
        from jscenegen.eval.plots import plot_or_warn

        if self._last_eval is not None and self._last_eval["attempts"] == self.pos.attempts:
            report = copy.deepcopy(self._last_eval)
        else:
            records = read_scene_set(resolve_data_path(self.cfg.schedule.dev_set))
            samples, t0 = evaluation_samples(self.cfg), time.perf_counter()
            say = self.cfg.trainer.progress and is_primary()
            if say:   # minutes without a line otherwise
                print(f"{name}: playing {len(records)} dev scenes x {samples} episodes",
                      file=sys.stderr, flush=True)
            report = evaluate(self.engine, records, judge=self.judge, scene_cfg=self.cfg.scene,
                              judge_cfg=self.cfg.judge, samples=samples, with_expert=False)
            report["attempts"] = self.pos.attempts
            report["effective_updates"] = self.pos.effective_updates
            self._last_eval = report
            if say:
                reward = report["overall"]["model"]["reward"]
                print(f"{name}: reward {'n/a' if reward is None else f'{reward:+.3f}'} "
                      f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        def write() -> None:
            write_json(self.run_dir / f"{name}.json", report)
            plot_or_warn(report, self.run_dir / f"{name}.png")
        _write_on_primary(write)
        return report

    def run(self, max_updates: int | None = None, progress=None) -> RunSummary:
        """Run until `schedule.total_updates` effective updates or `max_updates` attempts.

        Saves every `checkpoint.save_every` attempts, at the end, and on SIGTERM/SIGINT
        (then returns with `stopped_by_signal`); a second signal raises `Terminated` /
        KeyboardInterrupt at once, without a new checkpoint (and ends the process if the main
        thread cannot take it, `signals.StopRequests`). Must run in the main thread.
        `progress(row)` is called after each attempt.
        """
        t0 = time.perf_counter()
        STOP_REQUESTS.open()
        self._replaced_handlers = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        attempts = 0
        last_saved = None
        if self.schedule.done(self.pos):
            capped = self.pos.effective_updates < self.cfg.schedule.total_updates
            log.warning("%s already finished its schedule (%d of %d effective updates, %d "
                        "attempts); raise %s to extend it", self.run_dir,
                        self.pos.effective_updates, self.cfg.schedule.total_updates,
                        self.pos.attempts,
                        "schedule.max_attempts" if capped else "schedule.total_updates")
        try:
            if (owed := self._owed_evaluation()) is not None:   # cut off by a stop or a kill
                self._evaluate_update(owed, attempt=self.pos.attempts - 1)
                if self._stop_agreed():
                    max_updates = 0
            while not self.schedule.done(self.pos) and (max_updates is None or attempts < max_updates):
                row = self.update()
                attempts += 1
                _write_on_primary(lambda: self.logger.log(row, step=row["attempt"]))
                if progress is not None:
                    progress(row)
                if (failed := self._failed_updates_error()) is not None:   # before a stop: a
                    # resumed run would play one more failing update
                    self._judge_down, self._rollout_down = [], []   # the resume after the fix
                    self.save()
                    self.store.wait_until_finished()
                    raise failed
                if self._stop_agreed():
                    break
                if self.pos.attempts % self.cfg.checkpoint.save_every == 0:
                    last_saved = self.save()
                every = self.cfg.trainer.eval_every
                if every and row["stepped"] and self.pos.effective_updates % every == 0:
                    self._evaluate_update(self.pos.effective_updates, attempt=row["attempt"])
                if self._stop_agreed():   # a signal during the save or the evaluation
                    break
            current = self.store.step_path(self.pos.attempts)
            if attempts == 0 and check_step(current, hash_files=False).valid:
                last_saved = current     # nothing ran: the step resumed from is the last
            elif last_saved is None or last_saved != current:
                last_saved = self.save()
            self.store.wait_until_finished()
            self._stop_agreed()   # a signal during the last save: every process reports the stop
            if (attempts and self._stop_signal is None and self.schedule.done(self.pos)
                    and self.pos.effective_updates < self.cfg.schedule.total_updates):
                log.warning("stopped at schedule.max_attempts=%d attempts with %d of %d effective "
                            "updates (an attempt without an optimizer step had no reward spread, "
                            "no trained token or a non-finite gradient: metrics.jsonl's "
                            "failures/* and train/skipped say why); raise "
                            "schedule.max_attempts to go on", self.cfg.schedule.max_attempts,
                            self.pos.effective_updates, self.cfg.schedule.total_updates)
        finally:
            for s, handler in self._replaced_handlers.items():
                signal.signal(s, handler)
            STOP_REQUESTS.close()
            self.logger.close()
        self._stop_agreed()   # a signal after the last agreement, before the handlers went back
        return RunSummary(attempts=self.pos.attempts, effective_updates=self.pos.effective_updates,
                          optimizer_steps=int(adam_state(self.state.opt_state).count),
                          checkpoint=str(last_saved) if last_saved else None,
                          stopped_by_signal=(signal.Signals(self._stop_signal).name
                                             if self._stop_signal is not None else None),
                          wall_s=time.perf_counter() - t0)

    def _evaluate_update(self, update: int, attempt: int) -> None:
        """The `trainer.eval_every` dev evaluation after effective update `update` (its report
        `eval_update_<update>.json`, its `eval/reward` row at `attempt`)."""
        report = self.evaluate_dev(eval_update_stem(update))
        _write_on_primary(lambda: self.logger.log(
            {"attempt": attempt, "eval/reward": report["overall"]["model"]["reward"]}, step=attempt))

    def _owed_evaluation(self) -> int | None:
        """The effective update whose `trainer.eval_every` evaluation a resumed run still owes:
        the run stands at a multiple of eval_every whose report is missing (a stop during the
        update that reached it comes before the evaluation; a kill during the evaluation comes
        after the checkpoint it resumes from), else None; a checkpoint converted from VERL or HF
        files owes none. Process 0 (which writes the reports) decides for all (a collective)."""
        every, update = self.cfg.trainer.eval_every, self.pos.effective_updates
        owed = bool(every and update and update % every == 0 and self._own_checkpoint
                    and is_primary()
                    and not (self.run_dir / f"{eval_update_stem(update)}.json").is_file())
        return update if max_over_processes(int(owed)) else None

    def _stop_agreed(self) -> bool:
        """Whether a stop signal reached any process (all stop at the same update: a signal
        may reach one host later); a collective, so every process calls it at the same points.
        The agreed signal is `_stop_signal` (what the run reports); `_on_signal` counts this
        process's own signals apart, so its first one still waits for the update in flight."""
        if (agreed := max_over_processes(self._signal_received or 0)):
            self._stop_signal = agreed
        return bool(agreed)

    def close(self, discard_logs: bool = False, failed: bool = False) -> None:
        """End the run's logging (swanlab finished, its console kept off stdout; with
        `discard_logs`, the swanlab directory this start made removed) and the checkpoint
        store; also after a failure, so nothing prints at interpreter exit. `failed`: the
        command ends on an error or a stop that unwound it, which in a multi-process run may be
        this process's alone: a pending `checkpoint.async_save` is then left unfinished
        (`CheckpointStore.close`), as finishing it is a collective that the other processes,
        in another one or gone, would not meet (a mismatch that aborted this process before
        its error line, or waited)."""
        try:
            self.logger.close(discard=discard_logs)
        finally:
            self.store.close(finish=not (failed and joined_other_processes()))
