"""`RunConfig`: every section of a run, composed from the packages that own them.

YAML keys mirror these sections one to one (`configs/cpu-default.yaml` lists them all); each
key is read in one place: the section's owner.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from pydantic import Field

from jscenegen.config import ConfigError, Section, load_config, override_key
from jscenegen.grpo.algo.config import LossConfig, OptimConfig
from jscenegen.grpo.rollout.config import GROUP_MAX, RolloutConfig, SamplingConfig
from jscenegen.grpo.train.metrics import LoggingConfig
from jscenegen.grpo.train.schedule import ScheduleConfig
from jscenegen.model.options import ModelConfig
from jscenegen.paths import resolve_data_path
from jscenegen.scene.config import JudgeConfig, SceneRuntimeConfig
from jscenegen.sharding.mesh import MeshConfig


class CheckpointConfig(Section):
    save_every: int = Field(10, ge=1, description="save every N attempts (and at the end)")
    keep_last: int = Field(3, ge=1)
    async_save: bool = False


class TrainerConfig(Section):
    eval_every: int = Field(0, ge=0, description="evaluate the dev scenes every N effective "
                            "updates (0: never during training)")
    eval_samples: int = Field(1, ge=1, le=GROUP_MAX,
                              description="episodes per dev scene in an evaluation")
    eval_before_after: bool = Field(False, description="evaluate the dev scenes before the "
                                    "first and after the last update (eval_before/after.json)")
    dump_trajectories: bool = Field(False, description="write every episode to "
                                    "RUN_DIR/trajectories.jsonl (never exported)")
    progress: bool = True


class WarmStartConfig(Section):
    """How the CPU default gets a policy that can act when `model.path` is null: a fresh model
    of `preset` (micro in configs/cpu-default.yaml) created once, then supervised on the
    scripted expert's episodes (cached by config hash)."""

    arch: str = Field("qwen3", pattern="^(qwen2|qwen3|qwen3_5)$", description="qwen2, qwen3 "
                      "or qwen3_5 (the hybrid with a vision tower, `init-model --arch qwen3_5`)")
    preset: str = Field("tiny", pattern="^(micro|tiny|small)$")
    sft_config: str | None = Field("configs/sft-cpu.yaml", description="SFT run config; null: "
                                   "train GRPO from the untrained model")
    sft_overrides: tuple[str, ...] = Field((), description="key=value overrides of the SFT config")


class RunConfig(Section):
    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()
    scene: SceneRuntimeConfig = SceneRuntimeConfig()
    judge: JudgeConfig = JudgeConfig()
    sampling: SamplingConfig = SamplingConfig()
    rollout: RolloutConfig = RolloutConfig()
    loss: LossConfig = LossConfig()
    optim: OptimConfig = OptimConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    trainer: TrainerConfig = TrainerConfig()
    logging: LoggingConfig = LoggingConfig()
    warm_start: WarmStartConfig = WarmStartConfig()


DEFAULT_CONFIG = "configs/cpu-default.yaml"


def load_run_config(config: str | Path | None, overrides: Sequence[str] = (),
                    greedy: bool = False) -> RunConfig:
    """The run config of `config` (default: the CPU default, `DEFAULT_CONFIG`) with dotted
    overrides; `greedy` turns on argmax decoding and turns top-k/top-p off.
    Raises ConfigError naming the file or override and the key."""
    cfg = load_config(config or resolve_data_path(DEFAULT_CONFIG), list(overrides), RunConfig)
    given = [o for o in overrides
             if override_key(o) in ("sampling.greedy", "sampling.top_k", "sampling.top_p")]
    if greedy and given:
        raise ConfigError(f"--greedy sets sampling.greedy, top_k and top_p itself; the override "
                          f"{given[0]} contradicts or repeats it (give one of the two)")
    if greedy:
        sampling = cfg.sampling.model_copy(update={"greedy": True, "top_k": 0, "top_p": 1.0})
        cfg = cfg.model_copy(update={"sampling": sampling})
    return cfg


def config_inputs(cfg: RunConfig, config: str | Path | None) -> dict[str, Path | None]:
    """What a command run with `cfg` (read from `config`, None: the default) reads besides its
    model, {label: path} for `paths.refuse_overwriting_input`: the config file, the prompt
    templates, the catalogue, the chat template, the scene sets, the reference model, and the
    installed jscenegen package (the packaged templates and catalogue live there). A path that
    does not exist is left out (None): nothing there to overwrite."""
    import jscenegen

    def found(path):
        if path is None:
            return None
        try:
            return resolve_data_path(path)
        except FileNotFoundError:
            return None

    return {
        "--config" if config else "the default config": found(config or DEFAULT_CONFIG),
        "scene.prompts_dir": found(cfg.scene.prompts_dir),
        "scene.catalogue_path": found(cfg.scene.catalogue_path),
        "sampling.chat_template_path": found(cfg.sampling.chat_template_path),
        "schedule.train_set": found(cfg.schedule.train_set),
        "schedule.dev_set": found(cfg.schedule.dev_set),
        "model.reference_path": found(cfg.model.reference_path),
        "the jscenegen package": Path(jscenegen.__file__).resolve().parent,
    }


def scene_set_path(name: str, cfg: RunConfig) -> Path:
    """`dev`/`train` -> the config's schedule.dev_set/train_set; anything else is a path.
    Raises FileNotFoundError naming where it looked."""
    path = {"dev": cfg.schedule.dev_set, "train": cfg.schedule.train_set}.get(name, name)
    return resolve_data_path(path)
