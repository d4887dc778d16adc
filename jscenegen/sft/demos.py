"""Demonstrations for the SFT warm start: the scripted expert's episodes, tokenised as rollouts.

The scripted expert (scene/expert.py) plays planner, designer and critic on generated SFT
scenes (`sft_records`: generator seeds of their own, never the train or dev sets). Each
episode is tokenised exactly as a rollout builds it (`ChatTokenizer`: prompt, then per turn the
answer's tokens as the acting role's policy tokens, with the end-of-turn token unless the
answer ends at one of the rollout's stop strings, where the sampler stops and the template's
next segment adds it as environment; then that environment segment; the same as
`RolloutEngine`'s forced turns), so SFT and GRPO see identical token streams and masks.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from jscenegen.generate.stop import ends_at_stop_string
from jscenegen.grpo.algo.roles import ENVIRONMENT, ROLE_CODES
from jscenegen.model.tokenizer.chat import ChatTokenizer
from jscenegen.scene.config import GRADE_KEYS, JudgeConfig, SceneRuntimeConfig
from jscenegen.scene.generator import make_record
from jscenegen.scene.sceneset import SceneRecord
from jscenegen.sharding.rules import round_up

SFT_SEED_BASE = 41410  # scene seeds SFT_SEED_BASE * 1000 + i (train: 20260..., dev: 90210...)


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
    reward: the judged reward of the expert's episode; failure_cause: why that episode failed
    (the runtime's cause, e.g. planner_turn_cap: reward -1), None when it finished.
    """

    scene_id: str
    tokens: np.ndarray
    roles: np.ndarray
    policy_mask: np.ndarray
    reward: float
    failure_cause: str | None = None


def tokenize_transcript(chat: ChatTokenizer, transcript: Sequence[dict], *,
                        stop_strings: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens int32 [T], roles int8 [T], policy_mask bool [T]) of a chat transcript
    [{"role", "content", "actor"}] (system, user, then assistant/user alternating) built
    token-in/token-out with `chat` as a rollout with these `stop_strings` builds it (an answer
    ending with one has no end-of-turn token of the policy's: the environment adds it). Every
    content is normalised first (`ChatTokenizer.normalize`), as a rollout's are.

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
            content, answer = chat.encode_content(m["content"])   # as the tokens decode, like a rollout's turn
            try:
                eot = not ends_at_stop_string(content, stop_strings,
                                              len(chat.decode(answer[:-1])))
            except ValueError as err:
                raise ValueError(f"transcript message {i} ({m['actor']}): {err}; choose stop "
                                 "strings the expert's answers hold only at their end "
                                 "(sft.stop_strings, sampling.stop_strings)") from None
            seg = answer + ([chat.eot_id] if eot else [])
            conv.add_assistant(content, eot)
            code, is_policy = ROLE_CODES[m["actor"]], True
        elif m["role"] == "user":
            seg = conv.user_segment(m["content"])
            code, is_policy = ENVIRONMENT, False
        else:
            raise ValueError(f"transcript message {i}: role {m['role']!r} after the prompt")
        tokens += seg
        roles += [code] * len(seg)
        policy += [is_policy] * len(seg)
    closing = conv.closing_segment() if transcript[-1]["role"] == "assistant" else []
    tokens += closing
    roles += [ENVIRONMENT] * len(closing)
    policy += [False] * len(closing)
    return np.asarray(tokens, np.int32), np.asarray(roles, np.int8), np.asarray(policy, bool)


def build_demos(chat: ChatTokenizer, records: Sequence[SceneRecord],
                scene_cfg: SceneRuntimeConfig | None = None, *, noisy_fraction: float = 0.0,
                noise_m: float = 0.3, stop_strings: Sequence[str],
                grade_keys: Sequence[str] = GRADE_KEYS) -> list[Demo]:
    """Run the scripted expert on each record (rule judge) and tokenise its episode as a
    rollout with `stop_strings` records it (`tokenize_transcript`), in the protocol of a
    judge grading `grade_keys` (the rollouts' judge.grade_keys, in their order: the system
    and critic prompts name them, and the expert's critiques hold exactly these; a subset of
    `scene.config.GRADE_KEYS`, by which the expert grades).

    Every record i with (i * noisy_fraction) crossing an integer (an even spread: 0.5 = every
    second record) is played by the imperfect designer (`scene.expert.jitter_ops`, noise
    `noise_m` metres, seed i), so the critic and planner also see flawed scenes. Episodes the
    expert failed in `scene_cfg` are returned too, with their `failure_cause`
    (`drop_failed_episodes`).
    """
    from jscenegen.scene.expert import run_scripted_episode

    judge_cfg = JudgeConfig(grade_keys=tuple(grade_keys))
    demos = []
    for i, record in enumerate(records):
        noisy = int((i + 1) * noisy_fraction) > int(i * noisy_fraction)
        episode, transcript = run_scripted_episode(record, scene_cfg, judge_cfg,
                                                   noise_m=noise_m if noisy else 0.0, noise_seed=i)
        tokens, roles, policy = tokenize_transcript(chat, transcript, stop_strings=stop_strings)
        outcome = episode.outcome
        demos.append(Demo(record.scene.scene_id, tokens, roles, policy,
                          float(outcome.reward if outcome is not None else float("nan")),
                          outcome.failure_cause if outcome is not None else None))
    return demos


def drop_failed_episodes(demos: Sequence[Demo]) -> tuple[list[Demo], dict]:
    """The demos whose expert episode finished (no `failure_cause`), and {"expert_failures":
    {cause: demos dropped}} (empty when none failed): a failed episode (the expert cannot
    finish under the scene settings, e.g. planner_turn_cap when scene.max_planner_turns or
    scene.max_critique_rounds leave it no turn to finish in) would teach what earns reward -1."""
    kept = [d for d in demos if d.failure_cause is None]
    causes = Counter(d.failure_cause for d in demos if d.failure_cause is not None)
    return kept, {"expert_failures": dict(sorted(causes.items()))}


def demo_batch(demos: Sequence[Demo], length: int, max_tokens: int | None = None) -> dict[str, np.ndarray]:
    """Right-padded [N, length] arrays: input_ids int32, attention_mask int32, loss_mask float32
    (1 on policy tokens, 0 on environment tokens, padding and column 0). Demos longer than
    `max_tokens` (default `length`; `sft.max_seq_len`, which `length` rounds up) are truncated
    there (their later tokens are dropped)."""
    n = len(demos)
    keep = length if max_tokens is None else min(length, max_tokens)
    out = {"input_ids": np.zeros((n, length), np.int32), "attention_mask": np.zeros((n, length), np.int32),
           "loss_mask": np.zeros((n, length), np.float32)}
    for i, d in enumerate(demos):
        k = min(len(d.tokens), keep)
        out["input_ids"][i, :k] = d.tokens[:k]
        out["attention_mask"][i, :k] = 1
        out["loss_mask"][i, :k] = d.policy_mask[:k]
    out["loss_mask"][:, 0] = 0.0
    return out


def truncation_losses(demos: Sequence[Demo], max_tokens: int) -> dict:
    """What `demo_batch` drops at `max_tokens`: {"truncated": demos longer, "policy_tokens_cut":
    {role: policy tokens past the cut} (each policy role, 0 included), "cut_mid_answer": demos
    whose cut falls inside an answer (the kept part trains a prefix without its end)}."""
    cut = {name: 0 for name in ROLE_CODES}
    truncated = mid = 0
    for d in (d for d in demos if len(d.tokens) > max_tokens):
        truncated += 1
        for name, code in ROLE_CODES.items():
            cut[name] += int(np.sum(d.policy_mask[max_tokens:] & (d.roles[max_tokens:] == code)))
        mid += int(d.policy_mask[max_tokens - 1] and d.policy_mask[max_tokens])
    return {"truncated": truncated, "policy_tokens_cut": cut, "cut_mid_answer": mid}


def answer_lengths(demo: Demo) -> list[tuple[str, int]]:
    """(role name, tokens) of each policy turn of `demo`, in order: each maximal run of policy
    tokens of one role (the answer and its end-of-turn token when the policy emits it: what a
    rollout's turn must fit in `sampling.max_new_tokens`)."""
    names = {code: name for name, code in ROLE_CODES.items()}
    m, roles = demo.policy_mask, demo.roles
    same = m[:-1] & m[1:] & (roles[:-1] == roles[1:])   # token i and i + 1: one turn
    starts = np.flatnonzero(m & ~np.r_[False, same])
    ends = np.flatnonzero(m & ~np.r_[same, False]) + 1
    return [(names[int(roles[a])], int(b - a)) for a, b in zip(starts, ends)]


def drop_over_answer_cap(demos: Sequence[Demo], cap: int | None) -> tuple[list[Demo], dict]:
    """The demos whose every answer fits the rollouts' per-turn cap `cap` (`answer_lengths`:
    at most `cap` tokens; None: no cap, all kept), and their statistics: {"max_answer_tokens":
    cap, "demos_over_answer_cap": demos dropped, "answers_over_cap": {role: answers longer
    than cap} (each policy role, 0 included), "longest_answer": {role: its longest answer's
    tokens, 0 when it never answered}} over all the demos given."""
    over = {name: 0 for name in ROLE_CODES}
    longest = {name: 0 for name in ROLE_CODES}
    kept = []
    for d in demos:
        fits = True
        for name, n in answer_lengths(d):
            longest[name] = max(longest[name], n)
            if cap is not None and n > cap:
                over[name] += 1
                fits = False
        if fits:
            kept.append(d)
    return kept, {"max_answer_tokens": cap, "demos_over_answer_cap": len(demos) - len(kept),
                  "answers_over_cap": over, "longest_answer": longest}


def batch_indices(num_demos: int, batch_size: int, seed: int) -> Iterator[np.ndarray]:
    """Endless [batch_size] demo-index batches: consecutive epochs, each a fresh permutation
    drawn from numpy's PCG64 seeded with (seed, epoch); batches may straddle an epoch boundary.
    Made as they are taken, so any number of steps costs nothing up front."""
    pending: list[int] = []
    epoch = 0
    while True:
        while len(pending) < batch_size:
            pending.extend(np.random.default_rng([seed, epoch]).permutation(num_demos).tolist())
            epoch += 1
        yield np.asarray(pending[:batch_size], np.int64)
        del pending[:batch_size]


def padded_length(demos: Sequence[Demo], max_seq_len: int, multiple: int, cap: int) -> int:
    """Row length of every batch: the longest demo (at most max_seq_len) rounded up to
    `multiple`, but no longer than `cap` (max_seq_len rounded up to what the mesh needs)."""
    longest = min(max(len(d.tokens) for d in demos), max_seq_len)
    return min(round_up(longest, multiple), cap)
