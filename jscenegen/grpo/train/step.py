"""The GRPO update: log-prob recompute, micro-batched loss + gradient, guarded AdamW step.

Composes the pure pieces (logprobs, losses, optimizer); it owns no math of its own. The model
enters as `hidden_fn(params, input_ids, attention_mask, rows=None) -> (hidden [B, T, H] (or
[B, C, H] at the positions rows [B, C]), output_embedding [V, H])` over a params pytree (`model.functional.hidden_fn` adapts a QwenForCausalLM), so parameters and
their optimizer state are plain pytrees that the caller shards; nothing here places arrays.

Batch (dict of [B, T] arrays, entry t about token t, column 0 never trained):
  input_ids int32, attention_mask 0/1, loss_mask float32 (selected role's policy tokens),
  advantages float32 (per token, A_b * mask), old_logp float32 (optional: without it the
  on-policy shortcut old_logp = stop_gradient(logp) of VERL's legacy worker is used: with one
  mini-batch and one epoch it is the recompute itself, bitwise, so the ratio is exactly 1 and
  no separate forward pass is needed; a separately compiled recompute (`GRPOStep.logprobs`)
  agrees only to fp32 rounding), ref_logp float32 (needed when use_kl_loss), rollout_logp
  float32 (optional: the sampler's log-probs, for the `logprob_drift` metric = mean
  |rollout_logp - old_logp| over trained tokens). Entries outside loss_mask may be NaN.
  Plus episode_mask [B] float32: 1 on a row that is an episode of the mini-batch (one masked
  for a judge or runtime failure included, though it attends and trains nothing), 0 on a row
  added to pad the mesh.

Only the trained tokens' logits are made when the caller passes `capacity` (static, from the
host loss mask: `selection_capacity`): the loss, its metrics and the old/reference log-probs
concern those tokens only (the log-probs of the others come back 0).

Micro-batches are contiguous row blocks of `ppo_micro_batch_size` rows, run in one jit by
`lax.scan` (one micro-batch: no loop), gradients summed in float32 (bf16 parameters too). loss_scale global (VERL 0.9 engine): every micro-batch divides by
the token count (token-mean) or episode count G (sequence modes) of the whole batch, both fixed
before the loop; G = sum(episode_mask): every episode, rows without trained tokens and masked
episodes included (VERL's ppo_mini_batch_size x n), the rows added to fill the mesh in no
normaliser. loss_scale legacy (VERL 0.4-0.8 dp_actor): each micro-batch is normalised by its
own counts (sequence modes: its rows with a trained token, VERL 0.7-0.8) and weighted 1/k, k
the micro-batches holding an episode (VERL's gradient accumulation count: its micro-batches
hold every row, a masked one too; a micro-batch of padding rows only is not one of VERL's).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jscenegen.grpo.algo.accumulate import accumulate_grads, num_micro_batches, split_micro
from jscenegen.grpo.algo.config import LossConfig, OptimConfig
from jscenegen.grpo.algo.logprobs import model_token_logprobs
from jscenegen.grpo.algo.losses import grpo_loss, token_means
from jscenegen.grpo.algo.optimizer import TrainState, apply_gradients, make_optimizer
from jscenegen.model.functional import HiddenFn, shared

_SUM_KEYS = ("tokens", "clipped", "clipped_lower", "neg_log_ratio", "entropy", "kl",
             "ratio_max", "drift")


def _combine(total: tuple, new: tuple) -> tuple:
    """Accumulate (pg_loss, sums) over micro-batches: sums add, `ratio_max` is a max."""
    sums = {key: (jnp.maximum(total[1][key], new[1][key]) if key == "ratio_max"
                  else total[1][key] + new[1][key]) for key in total[1]}
    return total[0] + new[0], sums


class GRPOStep:
    """Compiled functions of one GRPO configuration, shared by every GRPOStep of an equal
    model function (`model.functional.hidden_fn` of the same model structure), loss and
    optimizer config, temperature and donation: a second one in the process reuses the first
    one's traces and executables.

    `logprobs(params, input_ids, attention_mask, select=None, capacity=None) -> (logp,
    entropy)` [B, T] float32, column 0 = 0: the old/reference log-prob recompute,
    micro-batched like the loss pass; with `select` (the loss mask) and a static `capacity`,
    only the selected entries (others 0).
    `grads(params, batch, capacity=None) -> (grads, loss, pg_loss, sums)`: the accumulated
    float32 gradient of the objective and masked metric sums, without an update.
    `step(state, batch, capacity=None) -> (state, metrics)`: one update (`capacity`: logits
    of the trained tokens only, see the module docstring); metrics are float32 scalars named
    loss, pg_loss, clipfrac, clipfrac_lower, approx_kl, ratio_max, entropy, kl,
    logprob_drift, grad_norm, skipped, lr, tokens (clipfrac, approx_kl, entropy, kl are means
    over all trained tokens).
    With `donate` the input state's buffers are reused for the output: do not read them after
    the call, nor the NNX model the params were split from (`nnx.update(model, state.params)`
    re-attaches the new ones). `ppo_micro_batch_size` should be a multiple of the mesh's fsdp
    size so each micro-batch spreads over every fsdp shard.
    Raises ValueError (at trace time) when rows do not split into micro-batches or a batch
    key is missing.
    """

    def __init__(self, hidden_fn: HiddenFn, loss_cfg: LossConfig, optim_cfg: OptimConfig, *,
                 temperature: float = 1.0, donate: bool = True):
        self.hidden_fn = hidden_fn
        self.loss_cfg = loss_cfg
        self.optim_cfg = optim_cfg
        self.temperature = float(temperature)
        self.tx = make_optimizer(optim_cfg)
        key = ("grpo_step", hidden_fn, loss_cfg.model_dump_json(), optim_cfg.model_dump_json(),
               self.temperature, donate)
        # an equal step's traces and executables (they read only what the key holds)
        self.logprobs, self.grads, self.step = shared(key, lambda: (
            jax.jit(self._logprobs, static_argnames=("capacity",)),
            jax.jit(self._grads, static_argnames=("capacity",)),
            jax.jit(self._step, donate_argnums=0 if donate else (), static_argnames=("capacity",))))

    def _micro_logprobs(self, params, input_ids, attention_mask, select=None, capacity=None):
        return model_token_logprobs(self.hidden_fn, params, input_ids, attention_mask,
                                    self.temperature, self.loss_cfg.logprob_chunk, select, capacity)

    def _num_micro(self, rows: int) -> int:
        return num_micro_batches(rows, self.loss_cfg.ppo_micro_batch_size, "ppo_micro_batch_size")

    def _logprobs(self, params, input_ids, attention_mask, select=None, capacity=None):
        k = self._num_micro(input_ids.shape[0])
        select = attention_mask if select is None else select
        out = jax.lax.map(lambda xs: self._micro_logprobs(params, *xs, capacity=capacity),
                          split_micro((input_ids, attention_mask, select), k))
        return tuple(x.reshape(input_ids.shape) for x in out)

    def _grads(self, params, batch: dict, capacity=None):
        cfg = self.loss_cfg
        for key in ("input_ids", "attention_mask", "loss_mask", "advantages", "episode_mask"):
            if key not in batch:
                raise ValueError(f"GRPO batch has no {key!r}")
        if cfg.use_kl_loss and "ref_logp" not in batch:
            raise ValueError("use_kl_loss is on but the GRPO batch has no 'ref_logp'")
        k = self._num_micro(batch["input_ids"].shape[0])
        legacy = cfg.loss_scale == "legacy"
        mask = batch["loss_mask"].astype(jnp.float32)
        n_tok = jnp.sum(mask)
        episode = batch["episode_mask"].astype(jnp.float32)                  # [B]
        n_seq = jnp.sum(episode)        # masked episodes included, padding rows not (VERL 0.9)
        # legacy's 1/k: the micro-batches holding an episode (all-padding ones are not VERL's)
        k_real = jnp.maximum(jnp.sum(jnp.any(episode.reshape(k, -1) != 0, axis=1)), 1)

        def micro_loss(params, mb):
            logp, ent = self._micro_logprobs(params, mb["input_ids"], mb["attention_mask"],
                                             mb["loss_mask"], capacity)
            old = mb["old_logp"] if "old_logp" in mb else jax.lax.stop_gradient(logp)
            parts = grpo_loss(
                logp, ent, old, mb["advantages"], mb["loss_mask"], mb.get("ref_logp"),
                clip_low=cfg.clip_low, clip_high=cfg.clip_high, clip_c=cfg.clip_ratio_c,
                agg_mode=cfg.loss_agg_mode, entropy_coeff=cfg.entropy_coeff,
                use_kl_loss=cfg.use_kl_loss, kl_coef=cfg.kl_coef, kl_type=cfg.kl_loss_type,
                global_token_count=None if legacy else n_tok,
                global_seq_count=None if legacy else n_seq,
                horizon=cfg.horizon, legacy=legacy, rollout_logp=mb.get("rollout_logp"),
            )
            scale = 1.0 / k_real if legacy else 1.0
            return parts.loss * scale, (parts.pg_loss * scale, parts.sums)

        zero = jnp.zeros((), jnp.float32)
        grads, loss, (pg, sums) = accumulate_grads(
            micro_loss, params, split_micro(batch, k), (zero, {key: zero for key in _SUM_KEYS}),
            _combine)
        return grads, loss, pg, sums

    def _step(self, state: TrainState, batch: dict, capacity=None):
        grads, loss, pg, sums = self._grads(state.params, batch, capacity)
        new_state, update = apply_gradients(self.tx, self.optim_cfg, state, grads)
        metrics = {"loss": loss, "pg_loss": pg, **token_means(sums), **update,
                   "tokens": sums["tokens"]}
        return new_state, metrics
