"""The SFT update: token-mean NLL over the policy tokens, micro-batched, guarded AdamW step.

Objective: token-mean negative log-likelihood over the policy tokens of all three roles,
  L = -sum_{b,t} m_bt log p(x_bt | x_b,<t) / sum_{b,t} m_bt,
normalised by the whole batch's token count before the micro-batch loop (the same global
normalisation as the GRPO step's token-mean), with the torch-exact AdamW (grpo/algo/optimizer.py)
and the GRPO step's gradient accumulation (grpo/algo/accumulate.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jscenegen.grpo.algo.accumulate import accumulate_grads, num_micro_batches, split_micro
from jscenegen.grpo.algo.config import OptimConfig
from jscenegen.grpo.algo.logprobs import model_token_logprobs
from jscenegen.grpo.algo.optimizer import TrainState, apply_gradients, as_float32, make_optimizer
from jscenegen.model.functional import HiddenFn, shared

BATCH_KEYS = ("input_ids", "attention_mask", "loss_mask")


class SFTStep:
    """Compiled SFT functions for one model and optimizer config (shared, like GRPOStep's, by
    every SFTStep of an equal model function and the same options).

    `hidden_fn(params, input_ids, attention_mask, rows=None) -> (hidden [B, T, H] (or [B, C, H]
    at the positions rows [B, C]), output_embedding [V, H])` (`model.functional.hidden_fn`). Batches: dict of [B, T] arrays input_ids int32,
    attention_mask 0/1, loss_mask float32.
    `step(state, batch, capacity=None) -> (state, metrics)`: one AdamW update of the token-mean
    NLL over loss_mask (with a static `capacity` >= every row's loss-mask count,
    `grpo.algo.logprobs.selection_capacity`: logits of the masked tokens only); metrics: loss (the NLL before the update), grad_norm (before clipping), lr,
    tokens (the masked token count), skipped (1.0 when a non-finite gradient skipped the update),
    all float32 scalars. `check(params, batch, capacity=None) -> (loss, grad_norm)`: the same
    without an update (what an SFT run asks of the weights it writes).
    Raises ValueError (at trace time) when B does not split into micro-batches.
    """

    def __init__(self, hidden_fn: HiddenFn, optim_cfg: OptimConfig, *,
                 micro_batch_size: int | None = None, logprob_chunk: int = 256, donate: bool = True):
        self.hidden_fn = hidden_fn
        self.optim_cfg = optim_cfg
        self.micro_batch_size = micro_batch_size
        self.logprob_chunk = logprob_chunk
        self.tx = make_optimizer(optim_cfg)
        key = ("sft_step", hidden_fn, optim_cfg.model_dump_json(), micro_batch_size,
               logprob_chunk, donate)
        self.step = shared(key, lambda: jax.jit(self._step, donate_argnums=0 if donate else (),
                                                static_argnames=("capacity",)))
        self.check = shared(key + ("check",),
                            lambda: jax.jit(self._check, static_argnames=("capacity",)))

    def _masked_logp_sum(self, params, mb, capacity=None):
        logp, _ = model_token_logprobs(self.hidden_fn, params, mb["input_ids"],
                                       mb["attention_mask"], 1.0, self.logprob_chunk,
                                       select=mb["loss_mask"], capacity=capacity)
        return jnp.sum(logp * mb["loss_mask"])

    def _grads(self, params, batch, capacity=None):
        k = num_micro_batches(batch["input_ids"].shape[0], self.micro_batch_size)
        n_tok = jnp.sum(batch["loss_mask"].astype(jnp.float32))
        denom = jnp.maximum(n_tok, 1.0)

        def micro_loss(params, mb):
            return -self._masked_logp_sum(params, mb, capacity) / denom, ()

        micro = split_micro({key: batch[key] for key in BATCH_KEYS}, k)
        grads, loss, _ = accumulate_grads(micro_loss, params, micro, ())
        return grads, loss, n_tok

    def _check(self, params, batch, capacity=None) -> tuple[jax.Array, jax.Array]:
        """(loss, gradient norm) of `batch` at `params`, float32 [] each, without an update."""
        grads, loss, _ = self._grads(params, batch, capacity)
        return loss, optax.tree_utils.tree_norm(as_float32(grads))

    def _step(self, state: TrainState, batch, capacity=None):
        grads, loss, n_tok = self._grads(state.params, batch, capacity)
        new_state, update = apply_gradients(self.tx, self.optim_cfg, state, grads)
        return new_state, {"loss": loss, "grad_norm": update["grad_norm"], "lr": update["lr"],
                           "tokens": n_tok, "skipped": update["skipped"]}
