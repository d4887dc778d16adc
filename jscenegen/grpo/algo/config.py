"""Config sections of the GRPO loss and the optimizer.

Field names follow VERL's actor config where one exists (`clip_ratio_c`, `loss_agg_mode`,
`entropy_coeff`, `kl_loss_type`, `ppo_micro_batch_size`), so a VERL user finds them.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from jscenegen.config import STEPS_MAX, TOKENS_MAX, Section

AggMode = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum"
]
KLType = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k3+", "low_var_kl+"]


class LossConfig(Section):
    """PPO-clip policy loss, its aggregation, KL and entropy terms (../shared/specs/grpo.md,
    the team's spec outside this repository)."""

    clip_low: float = Field(0.2, gt=0, lt=1, description="epsilon_low: ratio clipped at 1 - clip_low")
    clip_high: float = Field(0.2, gt=0, description="epsilon_high: ratio clipped at 1 + clip_high")
    clip_ratio_c: float = Field(3.0, gt=1, description="dual-clip bound for A < 0 (VERL clip_ratio_c)")
    loss_agg_mode: AggMode = Field(
        "token-mean", description="how per-token losses (policy, entropy and KL alike) reduce to "
        "a scalar, as VERL's actor.loss_agg_mode: token-mean sum/tokens; seq-mean-token-sum "
        "per-episode sums averaged over episodes; seq-mean-token-mean per-episode means averaged; "
        "seq-mean-token-sum-norm per-episode sums / episodes / horizon; token-sum the plain sum")
    loss_scale: Literal["global", "legacy"] = Field(
        "global",
        description="global: VERL 0.9 engine (mini-batch-wide token/sequence counts); "
        "legacy: VERL 0.4-0.8 dp_actor (each micro-batch normalised by itself, averaged)",
    )
    horizon: int | None = Field(
        None, gt=0, le=TOKENS_MAX, description="seq-mean-token-sum-norm divisor; null = padded length T "
        "(train: sampling.max_episode_tokens, a constant as VERL's response length)"
    )
    use_kl_loss: bool = Field(False, description="add kl_coef x the aggregated KL to a frozen "
                              "reference to the loss (VERL actor.use_kl_loss); the reference: "
                              "model.reference_path, else the run's initial policy (on --resume "
                              "read again from the run's model directory)")
    kl_coef: float = Field(0.001, ge=0, description="beta of the KL loss term (VERL kl_loss_coef)")
    kl_loss_type: KLType = Field(
        "low_var_kl", description="per-token KL estimator, VERL's kl_loss_type (d = logp - "
        "ref_logp): kl/k1 d; abs |d|; mse/k2 d^2/2; low_var_kl/k3 exp(-d) + d - 1 (clamped as "
        "VERL); k1+/k3+/low_var_kl+ the base estimator's value with k2's gradient "
        "(straight-through, VERL >= 0.6)")
    entropy_coeff: float = Field(0.0, description="weight of the entropy bonus: the loss subtracts "
                                 "entropy_coeff x the aggregated entropy of the temperature-scaled "
                                 "distribution (VERL actor.entropy_coeff); 0: no entropy term")
    ppo_micro_batch_size: int | None = Field(
        None, gt=0, description="rows per micro-batch (gradient accumulation); null = whole "
        "batch; must divide the batch's rows (groups_per_batch x group_size) padded to a multiple "
        "of mesh.fsdp (8 episodes on fsdp=3: 9 rows)"
    )
    logprob_chunk: int = Field(256, gt=0, le=TOKENS_MAX, description="tokens per chunk of the log-softmax")
    norm_adv_by_std: bool = Field(True, description="GRPO (true) or Dr. GRPO (false) advantages")
    adv_eps: float = Field(1e-6, gt=0, description="epsilon added to the group std")

    @model_validator(mode="after")
    def _token_sum_is_global(self):
        if self.loss_agg_mode == "token-sum" and self.loss_scale == "legacy":
            raise ValueError(
                "loss_agg_mode token-sum exists only in VERL 0.9 (loss_scale: global), "
                "not with loss_scale: legacy"
            )
        return self


class OptimConfig(Section):
    """AdamW + grad-norm clip + LR schedule, the torch.optim.AdamW update
    (../shared/specs/grpo.md, the team's spec outside this repository)."""

    lr: float = Field(1e-6, ge=0, le=1, description="base learning rate; the schedule multiplies "
                      "it (VERL actor.optim.lr)")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW (beta1, beta2): decay "
                                       "rates of the first and second moment estimates, each in "
                                       "[0, 1) (torch.optim.AdamW betas)")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon, added to the bias-corrected sqrt of "
                       "the second moment (torch.optim.AdamW eps)")
    weight_decay: float = Field(0.01, ge=0, description="decoupled weight decay: each step scales "
                                "every parameter by 1 - lr x weight_decay (torch.optim.AdamW; "
                                "no parameter is exempt, as in VERL); in float32 that factor is "
                                "exactly 1 while lr x weight_decay < 2^-25 (~3e-8), so at lr "
                                "1e-6 a decay of 0.01 changes nothing, in torch too")
    grad_clip: float | None = Field(1.0, description="max global grad norm; null or <= 0: no clip")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="LR multiplier after the warmup (VERL's lr_scheduler_type, "
        "formerly warmup_style): constant: 1; cosine: max(m, (1 + m)/2 + (1 - m)/2 cos(2 pi "
        "num_cycles p)), m = min_lr_ratio, p = (step - warmup_steps) / (total_steps - warmup_steps) "
        "(VERL's get_cosine_schedule_with_warmup: transformers' cosine with warmup plus the floor)")
    warmup_steps: int = Field(0, ge=0, le=STEPS_MAX, description="optimizer steps of linear warmup: the step at "
                              "scheduler count s < warmup_steps uses lr x s / warmup_steps (the "
                              "first at 0, as VERL); VERL's lr_warmup_steps")
    total_steps: int | None = Field(None, gt=0, le=STEPS_MAX, description="schedule length "
                                    "(cosine needs it; below the run's optimizer steps, "
                                    "schedule.total_updates or sft.steps, the LR climbs back up "
                                    "past it: warned)")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine: the LR's floor as a "
                                "fraction of lr, reached at total_steps with num_cycles 0.5 "
                                "(VERL min_lr_ratio)")
    num_cycles: float = Field(0.5, description="cosine: cosine periods over the steps after warmup "
                              "(0.5: one half-cosine from lr down to min_lr_ratio x lr; "
                              "transformers/VERL num_cycles)")

    @model_validator(mode="after")
    def _check(self):
        b1, b2 = self.betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"betas: each must lie in [0, 1), got {list(self.betas)}")
        if self.lr_schedule == "cosine" and self.total_steps is None:
            raise ValueError("total_steps: needed by lr_schedule cosine (the optimizer steps the "
                             "cosine spans; VERL's total_training_steps: for `train`, "
                             "schedule.total_updates)")
        return self
