"""Config of the SFT warm start (`jscenegen sft`): the `sft:` section and the command's whole file.

`SFTRunConfig` is self-contained (sections `model`, `mesh`, `sft`, `optim`, `scene`) so
`configs/sft-cpu.yaml` runs on its own; the GRPO run config can embed `SFTConfig` as is.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from jscenegen.config import SEED_MAX, STEPS_MAX, TOKENS_MAX, Section
from jscenegen.grpo.algo.config import OptimConfig
from jscenegen.grpo.rollout.config import DEFAULT_STOP_STRINGS, StopStrings
from jscenegen.model.names import ARCHS, PRESET_NAMES
from jscenegen.model.options import ModelConfig
from jscenegen.scene.config import GRADE_KEYS, SceneRuntimeConfig
from jscenegen.sharding.mesh import MeshConfig

SFT_SCENES_MAX = 1_000_000   # SFT scene indices (scene_offset + i): the generator's bound per set
BATCH_TOKENS_MAX = 1 << 24   # rows x tokens of one step: 8 x a large SFT batch (256 rows of 8,192)


def check_expert_grade_keys(grade_keys, key: str) -> None:
    """Refuse (ValueError naming `key`) grade keys the scripted expert's critic cannot give:
    none, a repeated one, or one the rule judge, by which it grades, does not know."""
    if not grade_keys or len(set(grade_keys)) != len(grade_keys):
        raise ValueError(f"{key} {list(grade_keys)}: must be distinct and non-empty")
    if unknown := [k for k in grade_keys if k not in GRADE_KEYS]:
        raise ValueError(f"{key} {list(grade_keys)}: the scripted expert's critic grades as the "
                         f"rule judge does, which knows only {', '.join(GRADE_KEYS)}, not "
                         f"{', '.join(unknown)}")


class SFTConfig(Section):
    """Demonstrations, batch shape and loop length of supervised fine-tuning on expert episodes."""

    num_demos: int = Field(48, ge=1, le=SFT_SCENES_MAX,
                           description="scripted-expert episodes on generated SFT scenes")
    scene_offset: int = Field(0, ge=0, le=SFT_SCENES_MAX, description="index of the first SFT scene (seeds "
                              "SFT_SEED_BASE * 1000 + offset + i; never the train/dev sets)")
    noisy_fraction: float = Field(0.0, ge=0, le=1, description="share of demos played by an "
                                  "imperfect designer (positions jittered) so the critic and "
                                  "planner also see flawed scenes")
    noise_m: float = Field(0.3, ge=0, le=10, description="position jitter of the imperfect "
                           "designer (m, at most 10: beyond the longest room the default "
                           "scene.metrics measure, 6.4 m = grid_size 128 x cell_m 0.05; "
                           "grid_size 512 measures 25.6 m)")
    steps: int = Field(40, ge=1, le=STEPS_MAX, description="optimizer steps (batches cycle over "
                       "shuffled epochs; a cosine optim.total_steps below it is warned)")
    batch_size: int = Field(3, ge=1, description="demos (rows) per optimizer step")
    micro_batch_size: int | None = Field(None, ge=1, description="rows per micro-batch "
                                         "(gradient accumulation); null = the whole batch; must "
                                         "divide batch_size padded to a multiple of mesh.fsdp")
    max_seq_len: int = Field(3072, ge=16, le=TOKENS_MAX, description="tokens per row; longer demos are "
                             "truncated (their tail turns are lost; counted in the log)")
    seq_multiple: int = Field(128, ge=1, le=TOKENS_MAX, description="rows are padded to a multiple of this "
                              "(and of mesh.sp), but to no more than max_seq_len (rounded up to "
                              "mesh.sp): one compiled shape")
    logprob_chunk: int = Field(256, gt=0, le=TOKENS_MAX, description="tokens per chunk of the log-softmax")
    stop_strings: StopStrings = Field(
        DEFAULT_STOP_STRINGS,
        description="the rollouts' sampling.stop_strings: an answer ending with one is tokenised "
        "as the sampler stops it, its end-of-turn token environment (not trained); a train "
        "warm start takes the run's")
    max_answer_tokens: int | None = Field(
        None, ge=1, le=TOKENS_MAX,
        description="the rollouts' per-turn cap (sampling.max_new_tokens): a demo holding an "
        "answer longer than this (its end-of-turn token included) is dropped, as no rollout "
        "could finish it (counted per role in the log and sft_summary.json; none left is "
        "refused); null: no cap; a train warm start takes the run's sampling.max_new_tokens")
    grade_keys: tuple[str, ...] = Field(
        GRADE_KEYS, description="the rollouts' judge.grade_keys, in their order: the system "
        "prompt and the critic's prompt name them, and the expert's critiques grade exactly "
        "these (a subset of the rule judge's seven, by which it grades); a train warm start "
        "takes the run's")
    log_every: int = Field(5, ge=1, description="log the loss every this many steps")
    seed: int = Field(0, ge=0, le=SEED_MAX, description="demo order (shuffling), and the weights "
                      "of the fresh model `jscenegen sft` creates when model.path is null (the "
                      "train warm start's fresh model is always made with seed 0)")
    out_dir: str = Field("runs/sft/model", description="the HF directory written at the end")
    init_arch: Literal[ARCHS] = Field(
        "qwen3", description="architecture of the fresh model `jscenegen sft` creates when "
        "model.path is null (the train warm start creates its own from warm_start.arch)")
    init_preset: Literal[PRESET_NAMES] = Field(
        "tiny", description="preset of that fresh model (the train warm start: warm_start.preset)")

    @model_validator(mode="after")
    def _check(self):
        if self.scene_offset + self.num_demos > SFT_SCENES_MAX:
            raise ValueError(f"scene_offset {self.scene_offset} + num_demos {self.num_demos} "
                             f"passes the {SFT_SCENES_MAX:,} SFT scenes the generator makes")
        check_expert_grade_keys(self.grade_keys, "sft.grade_keys")
        if self.batch_size * self.max_seq_len > BATCH_TOKENS_MAX:   # rows are at most max_seq_len
            raise ValueError(f"batch_size {self.batch_size} x max_seq_len {self.max_seq_len} = "
                             f"{self.batch_size * self.max_seq_len:,} tokens per step: at most "
                             f"{BATCH_TOKENS_MAX:,} (host arrays of that many tokens per step)")
        return self


class SFTOptimConfig(OptimConfig):
    """OptimConfig with defaults for fine-tuning a tiny fresh model (lr 1e-3, short warmup, no
    weight decay) instead of GRPO's 1e-6."""

    lr: float = Field(1e-3, ge=0, le=1, description=OptimConfig.model_fields["lr"].description)
    warmup_steps: int = Field(4, ge=0, le=STEPS_MAX,
                              description=OptimConfig.model_fields["warmup_steps"].description)
    weight_decay: float = Field(0.0, ge=0,
                                description=OptimConfig.model_fields["weight_decay"].description)


class SFTRunConfig(Section):
    """The whole file of `jscenegen sft --config`: model (model.path = the HF directory to start
    from; null = a fresh init-model), mesh, sft, optim (torch AdamW; tiny models want ~1e-3)
    and scene (the runtime the expert plays in)."""

    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()
    sft: SFTConfig = SFTConfig()
    optim: SFTOptimConfig = SFTOptimConfig()
    scene: SceneRuntimeConfig = SceneRuntimeConfig()
