"""Config sections of the GRPO loss and the optimizer (merged into RunConfig by the lead).

Field names follow VERL's actor config where one exists (`clip_ratio_c`, `loss_agg_mode`,
`entropy_coeff`, `kl_loss_type`, `ppo_micro_batch_size`), so a VERL user finds them.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from jscenegen.config import Section

AggMode = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum"
]
KLType = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k3+", "low_var_kl+"]


class LossConfig(Section):
    """PPO-clip policy loss, its aggregation, KL and entropy terms (specs/grpo.md)."""

    clip_low: float = Field(0.2, gt=0, lt=1, description="epsilon_low: ratio clipped at 1 - clip_low")
    clip_high: float = Field(0.2, gt=0, description="epsilon_high: ratio clipped at 1 + clip_high")
    clip_ratio_c: float = Field(3.0, gt=1, description="dual-clip bound for A < 0 (VERL clip_ratio_c)")
    loss_agg_mode: AggMode = "token-mean"
    loss_scale: Literal["global", "legacy"] = Field(
        "global",
        description="global: VERL 0.9 engine (mini-batch-wide token/sequence counts); "
        "legacy: VERL 0.4-0.8 dp_actor (each micro-batch normalised by itself, averaged)",
    )
    horizon: int | None = Field(
        None, gt=0, description="seq-mean-token-sum-norm divisor; None = padded length T"
    )
    use_kl_loss: bool = False
    kl_coef: float = Field(0.001, ge=0, description="beta of the KL loss term (VERL kl_loss_coef)")
    kl_loss_type: KLType = "low_var_kl"
    entropy_coeff: float = 0.0
    ppo_micro_batch_size: int | None = Field(
        None, gt=0, description="rows per micro-batch (gradient accumulation); None = whole batch"
    )
    logprob_chunk: int = Field(256, gt=0, description="tokens per chunk of the log-softmax")
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
    """AdamW + grad-norm clip + LR schedule, the torch.optim.AdamW update (specs/grpo.md)."""

    lr: float = Field(1e-6, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    grad_clip: float | None = Field(1.0, description="max global grad norm; null or <= 0: no clip")
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    total_steps: int | None = Field(None, gt=0, description="schedule length (cosine needs it)")
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    num_cycles: float = 0.5

    @model_validator(mode="after")
    def _check(self):
        b1, b2 = self.betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"betas must lie in [0, 1), got {self.betas}")
        if self.lr_schedule == "cosine" and self.total_steps is None:
            raise ValueError("lr_schedule cosine needs total_steps")
        return self
