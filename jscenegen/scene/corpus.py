"""The protocol's own text, for training the tokenizer of a fresh model (`jscenegen init-model`).

`protocol_texts()` yields, deterministically, for each generated TRAINING scene (the
generator's `train` split, never `dev`) every message of the scripted expert's full episode
(system prompt, first user message with the empty room, planner/designer/critic
answers with their JSON actions, operation results, canonical scenes, metrics, critiques),
and the frozen judge's system and user prompts for the expert's final scene. A byte-level
BPE trained on this sees each piece of the protocol in the proportions an episode has.
"""
from __future__ import annotations

import functools
from typing import Iterator

from .config import JudgeConfig, SceneRuntimeConfig
from .expert import run_scripted_episode
from .generator import make_scene_set
from .judge import JudgeRequest, judge_messages
from .prompts import load_templates

DEFAULT_CORPUS_SCENES = 30
COMPACT_PROMPTS = "configs/prompts-compact"  # the prompt set the CPU default plays


def protocol_texts(n_scenes: int = DEFAULT_CORPUS_SCENES, cfg: SceneRuntimeConfig | None = None,
                   judge_cfg: JudgeConfig | None = None) -> Iterator[str]:
    """Texts (one per chat message) of `n_scenes` scripted-expert episodes on training scenes.

    Args:
      n_scenes: scenes `train_0000` ... of the deterministic generator (seeds
        SPLIT_BASE["train"] * 1000 + i; the first 100 are data/scenes/train.jsonl).
      cfg / judge_cfg: runtime and judge configs (defaults: the protocol's defaults).

    Yields:
      str: each episode's messages in order (system prompt first), then the judge prompts
      of its terminal scene. Same arguments -> the same sequence (no randomness besides the
      generator's seeds). Costs about 0.4 s of CPU per scene.

    Raises:
      ValueError: n_scenes < 1.
    """
    if n_scenes < 1:
        raise ValueError(f"n_scenes must be >= 1, got {n_scenes}")
    cfg = cfg or SceneRuntimeConfig()
    judge_cfg = judge_cfg or JudgeConfig()
    templates = load_templates(cfg.prompts_dir)
    for record in make_scene_set("train", n_scenes):
        episode, chat = run_scripted_episode(record, cfg, judge_cfg)
        for message in chat:
            yield message["content"]
        if episode.finished:
            request = JudgeRequest(episode.scene, record.requested, episode.terminal_metrics)
            for message in judge_messages(request, judge_cfg, templates, cfg.metrics):
                yield message["content"]


def tokenizer_corpus() -> list[str]:
    """What a fresh model's tokenizer is trained on: `protocol_texts` with the packaged prompts
    and with the compact prompt set the CPU default plays (made once per process: ~25 s of
    CPU, the same texts every time)."""
    return list(_tokenizer_corpus())


@functools.cache
def _tokenizer_corpus() -> tuple[str, ...]:
    return (*protocol_texts(), *protocol_texts(cfg=SceneRuntimeConfig(prompts_dir=COMPACT_PROMPTS)))
