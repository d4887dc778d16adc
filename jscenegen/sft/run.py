"""SFT warm start: the scripted expert's episodes as demonstrations, NLL on the policy's tokens.

Demonstrations: the scripted expert (scene/expert.py) plays planner, designer and critic on
generated SFT scenes (`sft_records`: generator seeds of their own, never the train or dev
sets). Each episode is tokenised exactly as a rollout builds it (`ChatTokenizer`: prompt,
then per turn the answer's tokens + the end-of-turn token as the acting role's policy tokens,
then the environment segment the template adds; the same as `RolloutEngine`'s forced turns),
so SFT and GRPO see identical token streams.

Objective: token-mean negative log-likelihood over the policy tokens of all three roles,
  L = -sum_{b,t} m_bt log p(x_bt | x_b,<t) / sum_{b,t} m_bt,
normalised by the whole batch's token count before the micro-batch loop (the same global
normalisation as the GRPO step's token-mean), with the torch-exact AdamW (optimizer.py), on the
("fsdp", "sp") mesh with FSDP2-style parameters (`load_sharded`).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jscenegen.checkpoint.checksums import write_json_atomic
from jscenegen.grpo.algo.config import OptimConfig
from jscenegen.grpo.algo.logprobs import shifted_token_logprobs
from jscenegen.grpo.algo.optimizer import lr_at, make_optimizer, optimizer_step
from jscenegen.grpo.algo.roles import CRITIC, DESIGNER, ENVIRONMENT, PLANNER
from jscenegen.grpo.train.step import HiddenFn, TrainState, init_train_state
from jscenegen.model.tokenizer.chat import ChatTokenizer
from jscenegen.scene.config import SceneRuntimeConfig
from jscenegen.scene.generator import make_record
from jscenegen.scene.sceneset import SceneRecord

SFT_SEED_BASE = 41410  # scene seeds SFT_SEED_BASE * 1000 + i (train: 20260..., dev: 90210...)
ROLE_CODES = {"planner": PLANNER, "designer": DESIGNER, "critic": CRITIC}


def sft_records(n: int, offset: int = 0) -> list[SceneRecord]:
    """`n` generated bedroom scenes of the SFT split: record i has seed SFT_SEED_BASE * 1000 +
    offset + i and id `sft_<offset + i>` (disjoint from the shipped train and dev sets)."""
    if n < 0 or offset < 0:
        raise ValueError(f"n and offset must be >= 0, got n={n}, offset={offset}")
    return [make_record(SFT_SEED_BASE * 1000 + offset + i, f"sft_{offset + i:04d}") for i in range(n)]


@dataclass(frozen=True)
class Demo:
    """One demonstration episode as token arrays aligned with `tokens`.

    tokens [T] int32; roles [T] int8 (grpo.roles codes, ENVIRONMENT for prompts, results and
    template glue); policy_mask [T] bool (the roles' answers + their end-of-turn tokens);
    reward: the judged reward of the expert's episode.
    """

    scene_id: str
    tokens: np.ndarray
    roles: np.ndarray
    policy_mask: np.ndarray
    reward: float


def tokenize_transcript(chat: ChatTokenizer, transcript: Sequence[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens int32 [T], roles int8 [T], policy_mask bool [T]) of a chat transcript
    [{"role", "content", "actor"}] (system, user, then assistant/user alternating) built
    token-in/token-out with `chat` as a rollout builds it.

    Raises ValueError for a transcript that does not start with system + user or whose
    assistant messages lack a policy actor; ChatTemplateError for a template that is not
    prefix-preserving.
    """
    if len(transcript) < 2 or [m["role"] for m in transcript[:2]] != ["system", "user"]:
        raise ValueError("a transcript starts with a system and a user message")
    conv, ids = chat.start(transcript[0]["content"], transcript[1]["content"])
    tokens, roles, policy = list(ids), [ENVIRONMENT] * len(ids), [False] * len(ids)
    for i, m in enumerate(transcript[2:], start=2):
        if m["role"] == "assistant":
            if m.get("actor") not in ROLE_CODES:
                raise ValueError(f"transcript message {i}: assistant actor {m.get('actor')!r} "
                                 f"is not one of {sorted(ROLE_CODES)}")
            seg = chat.encode(m["content"]) + [chat.eot_id]
            conv.add_assistant(m["content"], True)
            code, is_policy = ROLE_CODES[m["actor"]], True
        elif m["role"] == "user":
            seg = conv.user_segment(m["content"])
            code, is_policy = ENVIRONMENT, False
        else:
            raise ValueError(f"transcript message {i}: role {m['role']!r} after the prompt")
        tokens += seg
        roles += [code] * len(seg)
        policy += [is_policy] * len(seg)
    return np.asarray(tokens, np.int32), np.asarray(roles, np.int8), np.asarray(policy, bool)


def build_demos(chat: ChatTokenizer, records: Sequence[SceneRecord],
                scene_cfg: SceneRuntimeConfig | None = None, *, noisy_fraction: float = 0.0,
                noise_m: float = 0.3) -> list[Demo]:
    """Run the scripted expert on each record (rule judge) and tokenise its episode.

    Every record i with (i * noisy_fraction) crossing an integer (an even spread: 0.5 = every
    second record) is played by the imperfect designer (`scene.expert.jitter_ops`, noise
    `noise_m` metres, seed i), so the critic and planner also see flawed scenes.
    """
    from jscenegen.scene.expert import run_scripted_episode

    demos = []
    for i, record in enumerate(records):
        noisy = int((i + 1) * noisy_fraction) > int(i * noisy_fraction)
        episode, transcript = run_scripted_episode(record, scene_cfg, noise_m=noise_m if noisy else 0.0,
                                                   noise_seed=i)
        tokens, roles, policy = tokenize_transcript(chat, transcript)
        reward = episode.outcome.reward if episode.outcome is not None else float("nan")
        demos.append(Demo(record.scene.scene_id, tokens, roles, policy, float(reward)))
    return demos


def demo_batch(demos: Sequence[Demo], length: int) -> dict[str, np.ndarray]:
    """Right-padded [N, length] arrays: input_ids int32, attention_mask int32, loss_mask float32
    (1 on policy tokens, 0 on environment tokens, padding and column 0). Demos longer than
    `length` are truncated (their later tokens are dropped)."""
    n = len(demos)
    out = {"input_ids": np.zeros((n, length), np.int32), "attention_mask": np.zeros((n, length), np.int32),
           "loss_mask": np.zeros((n, length), np.float32)}
    for i, d in enumerate(demos):
        k = min(len(d.tokens), length)
        out["input_ids"][i, :k] = d.tokens[:k]
        out["attention_mask"][i, :k] = 1
        out["loss_mask"][i, :k] = d.policy_mask[:k]
    out["loss_mask"][:, 0] = 0.0
    return out


def _split(x, k):
    return x.reshape(k, x.shape[0] // k, *x.shape[1:])


class SFTStep:
    """Compiled SFT functions for one model and optimizer config.

    `hidden_fn(params, input_ids, attention_mask) -> (hidden [B, T, H], output_embedding [V, H])`
    as in train_step (`nnx_hidden_fn`). Batches: dict of [B, T] arrays input_ids int32,
    attention_mask 0/1, loss_mask float32.
    `step(state, batch) -> (state, metrics)`: one AdamW update of the token-mean NLL over
    loss_mask; metrics: loss (the NLL before the update), grad_norm (before clipping), lr,
    tokens (the masked token count), skipped (1.0 when a non-finite gradient skipped the update),
    all float32 scalars.
    Raises ValueError (at trace time) when B does not split into micro-batches.
    """

    def __init__(self, hidden_fn: HiddenFn, optim_cfg: OptimConfig, *,
                 micro_batch_size: int | None = None, logprob_chunk: int = 256, donate: bool = True):
        self.hidden_fn = hidden_fn
        self.optim_cfg = optim_cfg
        self.micro_batch_size = micro_batch_size
        self.logprob_chunk = logprob_chunk
        self.tx = make_optimizer(optim_cfg)
        self.step = jax.jit(self._step, donate_argnums=0 if donate else ())

    def _num_micro(self, rows: int) -> int:
        m = self.micro_batch_size
        if m is None or m >= rows:
            return 1
        if rows % m:
            raise ValueError(f"batch of {rows} rows does not split into micro-batches of {m} rows")
        return rows // m

    def _masked_logp_sum(self, params, mb):
        hidden, emb = self.hidden_fn(params, mb["input_ids"], mb["attention_mask"])
        logp, _ = shifted_token_logprobs(hidden, emb, mb["input_ids"], 1.0, self.logprob_chunk)
        return jnp.sum(logp * mb["loss_mask"])

    def _grads(self, params, batch):
        k = self._num_micro(batch["input_ids"].shape[0])
        n_tok = jnp.sum(batch["loss_mask"].astype(jnp.float32))
        denom = jnp.maximum(n_tok, 1.0)
        micro = {key: _split(batch[key], k) for key in ("input_ids", "attention_mask", "loss_mask")}
        grad_fn = jax.value_and_grad(lambda p, mb: -self._masked_logp_sum(p, mb) / denom)

        def body(carry, mb):
            grads, loss = carry
            value, g = grad_fn(params, mb)
            return (jax.tree.map(jnp.add, grads, g), loss + value), None

        zero = jnp.zeros((), jnp.float32)
        (grads, loss), _ = jax.lax.scan(body, (jax.tree.map(jnp.zeros_like, params), zero), micro)
        return grads, loss, n_tok

    def _step(self, state: TrainState, batch):
        grads, loss, n_tok = self._grads(state.params, batch)
        lr = lr_at(self.optim_cfg, state.lr_step)
        params, opt_state, grad_norm, skipped = optimizer_step(self.tx, grads, state.opt_state,
                                                               state.params, lr)
        new_state = TrainState(params, opt_state, state.lr_step + 1,
                               state.skipped_steps + skipped.astype(jnp.int32))
        return new_state, {"loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": n_tok,
                           "skipped": skipped.astype(jnp.float32)}


def batch_order(num_demos: int, batch_size: int, steps: int, seed: int) -> np.ndarray:
    """[steps, batch_size] demo indices: consecutive epochs, each a fresh permutation drawn from
    numpy's PCG64 seeded with (seed, epoch); batches may straddle an epoch boundary."""
    need = steps * batch_size
    order = []
    epoch = 0
    while len(order) < need:
        order.extend(np.random.default_rng([seed, epoch]).permutation(num_demos).tolist())
        epoch += 1
    return np.asarray(order[:need], np.int64).reshape(steps, batch_size)


def padded_length(demos: Sequence[Demo], max_seq_len: int, multiple: int) -> int:
    """Row length of every batch: the longest demo (at most max_seq_len), rounded up to `multiple`."""
    longest = min(max(len(d.tokens) for d in demos), max_seq_len)
    return -(-longest // multiple) * multiple


def run_sft(cfg, model_dir: str | Path, out_dir: str | Path, *,
            log: Callable[[dict], None] = lambda row: print(json.dumps(row), flush=True),
            chat_template_path: str | Path | None = None) -> dict:
    """Fine-tune the HF model at `model_dir` on expert demonstrations and write `out_dir`.

    Args:
      cfg: an SFTRunConfig (sections model, mesh, sft, optim, scene).
      model_dir: HF directory (config.json, safetensors, tokenizer with a prefix-preserving
        chat template, or `chat_template_path`).
      out_dir: the HF directory written at the end (atomically; tokenizer files copied), with
        `sft_summary.json` (config, demo statistics, loss history, phase times).
      log: called with one dict per logged step ({"step", "loss", "grad_norm", "lr",
        "tokens", "elapsed_s", "cpu_s": process CPU seconds, all threads}) and once with the
        demo statistics.

    Returns the summary dict. Deterministic for a given config (demo scenes, order, weights).
    Raises ChatTemplateError (template), MeshError (mesh vs devices), ModelConfigError.
    """
    from flax import nnx

    from jscenegen.grpo.train.step import nnx_hidden_fn
    from jscenegen.model.hf_io import save_hf
    from jscenegen.sharding.layout import load_sharded, pad_batch, shard_batch
    from jscenegen.sharding.mesh import make_mesh

    sc = cfg.sft
    t0 = time.perf_counter()
    chat = ChatTokenizer.from_dir(model_dir, chat_template_path)
    demos = build_demos(chat, sft_records(sc.num_demos, sc.scene_offset), cfg.scene,
                        noisy_fraction=sc.noisy_fraction, noise_m=sc.noise_m)
    mesh = make_mesh(cfg.mesh.fsdp, cfg.mesh.sp)
    length = padded_length(demos, sc.max_seq_len, int(np.lcm(sc.seq_multiple, mesh.shape["sp"])))
    lengths = [len(d.tokens) for d in demos]
    demo_stats = {"demos": len(demos), "row_length": length, "mean_tokens": float(np.mean(lengths)),
                  "max_tokens": int(max(lengths)), "truncated": int(sum(n > length for n in lengths)),
                  "policy_tokens_per_demo": float(np.mean([d.policy_mask.sum() for d in demos])),
                  "expert_mean_reward": float(np.nanmean([d.reward for d in demos])),
                  "demo_build_s": time.perf_counter() - t0}
    log({"event": "demos", **demo_stats})

    t1, cpu1 = time.perf_counter(), time.process_time()
    model = load_sharded(model_dir, mesh, param_dtype=cfg.model.param_dtype,
                         compute_dtype=cfg.model.compute_dtype, remat=cfg.model.remat,
                         attn_impl=cfg.model.attention)
    graphdef, params, *rest = nnx.split(model, nnx.Param, ...)
    sft = SFTStep(nnx_hidden_fn(graphdef, *rest), cfg.optim, micro_batch_size=sc.micro_batch_size,
                  logprob_chunk=sc.logprob_chunk)
    order = batch_order(len(demos), sc.batch_size, sc.steps, sc.seed)
    history = []
    with jax.set_mesh(mesh):
        state = init_train_state(params, cfg.optim)
        for step in range(sc.steps):
            arrays = demo_batch([demos[i] for i in order[step]], length)
            batch = shard_batch(pad_batch(arrays, mesh, seq_multiple=length), mesh)
            state, metrics = sft.step(state, batch)
            if step % sc.log_every == 0 or step == sc.steps - 1:
                row = {"step": step, **{k: float(v) for k, v in metrics.items()},
                       "elapsed_s": time.perf_counter() - t1, "cpu_s": time.process_time() - cpu1}
                history.append(row)
                log(row)
    train_s = time.perf_counter() - t1
    nnx.update(model, state.params)
    save_hf(model, out_dir, tokenizer_src=model_dir)
    summary = {"config": cfg.model_dump(mode="json"), "model_dir": str(model_dir), **demo_stats,
               "history": history, "final_loss": history[-1]["loss"], "train_s": train_s,
               "total_s": time.perf_counter() - t0}
    write_json_atomic(Path(out_dir) / "sft_summary.json", summary)
    return summary
