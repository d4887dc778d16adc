"""Rollouts: the G episodes of one scene run concurrently in one batch, token-in/token-out.

One episode is one conversation (scene-protocol.md section 2). Each batch row is one episode
driven through the scene runtime's `Episode` state machine; all rows share one KV cache that is
kept across turns. A round is: every running row generates its role's turn (one compiled decode
loop for the whole batch; rows stop independently), the runtime consumes each turn, and the
environment messages of the rows that go on are appended with the same model forward. Rows
finish at different turns and then sit out (fully masked) until the last row finishes; then
the finished episodes are judged together.

Token accounting (what the trainer relies on):
  - tokens: the exact ids in the order the model saw them; the sampled ids are kept as sampled,
    environment text is tokenised once when it is appended (`ChatTokenizer`), never re-tokenised.
  - roles (grpo.roles codes): ENVIRONMENT for system/user messages and template glue
    (`<|im_start|>assistant\\n`, the newline after `<|im_end|>`); the acting role for the
    assistant content and the end-of-turn token the policy sampled. A turn stopped by a stop
    string (`</action>`) gets its end-of-turn token appended as ENVIRONMENT.
  - policy_mask: true exactly on the policy's tokens; `grpo.algo.roles.role_loss_mask(roles,
    policy_mask, selected)` gives the loss mask of an update.
  - logprobs: log p(token_t | tokens_<t) at the sampling temperature (fp32) on policy tokens,
    0 elsewhere; they feed the drift metric (the trainer recomputes old_logp).

Failures: a truncated turn ("truncated_action" when cut inside an action: an `<action>` opened
after the last `</action>`, or the text ending in the start of one such as "<acti",
`scene.actions.cut_inside_action`; else "truncated_generation") or the episode-token cap
("episode_token_cap") is a policy failure (reward -1); an exception in our runtime, tokenizer
or sampler marks the affected rows "rollout_error" (masked), a prompt that alone reaches the cap
(the policy never acted) "prompt_over_cap" (masked), a judge failure masks the row ("judge_*");
neither stops the batch.

Slots: a decode round takes `max_new_tokens` slots at most and an append the longest row's
new tokens (rounded to a bucket). With the derived `cache_tokens` the cache starts at the first
prompt plus one decode segment (a bucket length) and grows as appends and decode segments
reach its end (`sampler.grown_slots`: at least doubling, contents kept) up to `cache_slots()`,
so attention reads about the slots an episode uses; when a round could not fit even at that
maximum (or with an explicit `cache_tokens`) the cache is first rebuilt from the rows' token
histories (left-aligned again, gaps of earlier rounds dropped) with the same append path.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from jscenegen.generate.sampler import (
    STOP_LENGTH,
    STOP_REASONS,
    STOP_STRING,
    STOP_TOKEN,
    Sampler,
    bucket_length,
    grown_slots,
)
from jscenegen.generate.sampling import row_keys
from jscenegen.generate.stop import ends_at_stop_string
from jscenegen.grpo.algo.roles import ENVIRONMENT, ROLE_CODES, ROLE_NAMES
from jscenegen.grpo.rollout.config import RolloutConfig, SamplingConfig
from jscenegen.grpo.rollout.primary_judge import judge_on_primary
from jscenegen.model.tokenizer.chat import ChatTokenizer, Conversation
from jscenegen.scene.actions import cut_inside_action
from jscenegen.scene.config import JudgeConfig, SceneRuntimeConfig
from jscenegen.scene.episode import Episode
from jscenegen.scene.judge import Judge
from jscenegen.scene.reward import MASKED_FAILURES, POLICY_FAILURES
from jscenegen.scene.sceneset import SceneRecord
from jscenegen.sharding.mesh import fails_the_joined_run, host_array, processes_apart
from jscenegen.sharding.rules import round_up

log = logging.getLogger(__name__)

ForcedPolicy = Callable[[Episode], str]
TurnCallback = Callable[[int, dict, Episode], None]


class RolloutDivergedError(RuntimeError):
    """The processes of a multi-process run disagree on where their episodes stand (one failed
    an episode the others did not): they would drift apart (`RolloutEngine._check_processes_agree`)."""


def _cause_code(cause: str | None) -> int:
    """A failure cause as a number every process computes alike (0: none)."""
    return 0 if cause is None else 1 + (POLICY_FAILURES + MASKED_FAILURES).index(cause)


@dataclass
class Trajectory:
    """One episode as the trainer needs it. Arrays are aligned with `tokens`: entry t is about token t.

    tokens [T] int32; roles [T] int8 (grpo.roles codes); policy_mask [T] bool (the policy's
    tokens); logprobs [T] float32 (rollout log-probs at the sampling temperature, 0 off policy);
    turns: one dict per segment {"role", "start", "end", "stop"} (token range [start, end),
    stop = the sampler's stop reason for policy turns); transcript: chat messages {"role",
    "content", "actor"} (environment contents as encoded, normalised: `ChatTokenizer.normalize`);
    reward / failure_cause / masked / units / grades / metrics from the episode's Outcome, failure_message its detail (the exception of a masked runtime failure); group_id, member, seed identify the sample.
    """

    group_id: int
    member: int
    seed: int
    tokens: np.ndarray
    roles: np.ndarray
    policy_mask: np.ndarray
    logprobs: np.ndarray
    turns: list[dict]
    transcript: list[dict]
    reward: float
    failure_cause: str | None
    masked: bool
    units: int
    grades: dict | None
    metrics: dict | None
    outcome: dict
    failure_message: str = ""

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class GroupRollout:
    """The trajectories of one group and rollout statistics: the group's generated_tokens and
    its batch's wall_s, tokens_per_s, batch_generated_tokens, rounds, cache_rebuilds,
    cache_slots, batch_rows, padding_rows, groups, layout."""

    trajectories: list[Trajectory]
    stats: dict


@dataclass(frozen=True)
class GroupRequest:
    """One group to roll out: `len(seeds)` episodes of `record` (member i uses seeds[i])."""

    record: SceneRecord
    group_id: int
    seeds: tuple[int, ...]


@dataclass
class PlayedGroup:
    """A group whose episodes have ended but are not judged yet (`RolloutEngine.play_group`,
    `play_groups`): judge `episodes`, then `result()` gives the GroupRollout."""

    group_id: int
    rows: list["_Row"]
    stats: dict

    @property
    def episodes(self) -> list[Episode]:
        return [r.episode for r in self.rows]

    def result(self) -> GroupRollout:
        """The trajectories (with the judged outcomes) and statistics; judge `episodes` first."""
        return GroupRollout([RolloutEngine._trajectory(r, self.group_id) for r in self.rows],
                            self.stats)


@dataclass(eq=False)
class _Row:
    member: int
    seed: int
    episode: Episode
    group_id: int = 0
    conv: Conversation | None = None
    tokens: list[int] = field(default_factory=list)
    roles: list[int] = field(default_factory=list)
    policy: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    transcript: list[dict] = field(default_factory=list)
    cached: int = 0
    shown: int = 0

    @property
    def active(self) -> bool:
        return not self.episode.done

    def add(self, ids, role: int, policy: bool, logprobs=None, stop: str | None = None):
        start = len(self.tokens)
        self.tokens.extend(int(i) for i in ids)
        self.roles.extend([role] * len(ids))
        self.policy.extend([policy] * len(ids))
        self.logprobs.extend([0.0] * len(ids) if logprobs is None else [float(x) for x in logprobs])
        name = ROLE_NAMES[role]
        self.turns.append({"role": name, "start": start, "end": len(self.tokens), "stop": stop})

    def fail(self, cause: str, message: str = "") -> None:
        if self.episode.outcome is None:
            self.episode.fail(cause, message)


class RolloutEngine:
    """Runs groups of episodes with one model.

    Args:
      model: QwenForCausalLM or Qwen35ForCausalLM (sharded on `mesh` when given).
      chat: the ChatTokenizer of the model directory.
      cfg: SamplingConfig.
      mesh: the training ("fsdp", "sp") mesh or None.
      rollout: RolloutConfig (default: `auto` layout); the batch is padded with fully masked
        rows to a multiple of the layout's data-parallel size.
    """

    def __init__(self, model, chat: ChatTokenizer, cfg: SamplingConfig, mesh=None,
                 rollout: RolloutConfig | None = None):
        chat.check_fits(model.cfg.vocab_size, "the policy")
        if cfg.max_episode_tokens > model.cfg.context_positions:
            log.warning("sampling.max_episode_tokens=%d is more than the %d positions the model's "
                        "RoPE is made for (max_position_embeddings, times its scaling factor): "
                        "positions past them were never trained (vLLM refuses such a "
                        "max_model_len)", cfg.max_episode_tokens, model.cfg.context_positions)
        self.chat = chat
        self.cfg = cfg
        self.rollout = rollout or RolloutConfig()
        self.sampler = Sampler(model, cfg.params(), stop_token_ids=list(chat.end_ids),
                               stop_strings=cfg.stop_strings,
                               token_bytes=chat.token_bytes() if cfg.stop_strings else None,
                               buckets=cfg.buckets, mesh=mesh, **self.rollout.sampler_options())
        self.slots = cfg.cache_slots()          # the most KV-cache slots a row may get
        # with the derived default the cache starts small and grows (attention reads only
        # the slots the cache has; a 35k-slot cache for a 4k-token episode wastes 8x)
        self.grows = cfg.cache_tokens is None and self.sampler.can_grow

    def set_weights(self, weights) -> dict:
        """Roll out with new weights (a model or its parameter state; call after each train
        step, a skipped one too, since the step donates the arrays the `fsdp` layout may read):
        one reshard into the rollout layout (`Sampler.set_weights`). Returns {"reshard_s",
        "reshard_bytes"}."""
        return self.sampler.set_weights(weights)

    # ---- the cache ------------------------------------------------------------------------
    def _sync(self, rows: list[_Row], pad: int, with_logprobs: bool = False):
        """Append every active row's uncached tokens; rebuild the cache when they do not fit.

        Returns the per-row log-probs of the appended tokens when `with_logprobs`.
        """
        seqs = [r.tokens[r.cached:] if r.active else [] for r in rows] + [[]] * pad
        need = self.sampler.appended_slots(seqs)
        if self._used + need > self._capacity and not self._grow(self._used + need):
            seqs = [r.tokens if r.active else [] for r in rows] + [[]] * pad
            need = self.sampler.appended_slots(seqs)
            if need > self.slots:
                raise RuntimeError(f"histories of {need} slots exceed the cache's {self.slots}; "
                                   "raise sampling.cache_tokens")
            self._rebuild(rows, pad, need)
        res = self.sampler.append(self._cache, self._last, seqs, with_logprobs)
        self._cache, self._last = res[0], res[1]
        self._used += need
        for r in rows:
            if r.active:
                r.cached = len(r.tokens)
        return res[2] if with_logprobs else None

    def _grow(self, slots: int) -> bool:
        """Grow the cache to hold `slots` (`grown_slots`, at most `self.slots`) keeping its
        contents; False when it cannot grow that far."""
        if not self.grows or slots > self.slots:
            return False
        new = grown_slots(slots, self._capacity, self.slots, self.cfg.buckets)
        self._cache = self.sampler.grow_cache(self._cache, new)
        self._capacity = new
        return True

    def _rebuild(self, rows: list[_Row], pad: int, slots: int = 0):
        """A new empty cache of at least `slots` (its capacity grown as `_grow` would); every
        row's history is appended again by the next `_sync`."""
        if slots > self._capacity:
            self._capacity = grown_slots(slots, self._capacity, self.slots, self.cfg.buckets)
        self._cache, self._last = self.sampler.new_cache(len(rows) + pad, self._capacity)
        self._used = 0
        self._rebuilds += 1
        for r in rows:
            r.cached = 0

    def _reserve(self, rows: list[_Row], pad: int, slots: int):
        """Rebuild the cache from the histories when `slots` more would not fit even grown to
        its maximum (the appends and the decode grow it as they go)."""
        if self._used + slots > (self.slots if self.grows else self._capacity):
            self._rebuild(rows, pad)
            self._sync(rows, pad)

    # ---- one group ------------------------------------------------------------------------
    def run_group(self, record: SceneRecord, *, group_id: int, seeds: Sequence[int], judge: Judge,
                  scene_cfg: SceneRuntimeConfig | None = None, judge_cfg: JudgeConfig | None = None,
                  forced: ForcedPolicy | None = None,
                  on_turn: TurnCallback | None = None) -> GroupRollout:
        """Run len(seeds) episodes of `record` (member i uses seeds[i]) and judge them.

        `forced`: instead of sampling, each turn's text is `forced(episode)`, recorded as the
        sampler would have produced it (a text ending with a stop string stops there, its
        end-of-turn token environment; any other gets the end-of-turn token as the policy's)
        and appended through the same cache path with its log-probs under the model
        (scripted drivers and protocol tests). `on_turn(member, message, episode)`
        is called with each new transcript message ({"role", "content", "actor"}) when its
        round ends (interactive use: `jscenegen design`). Never raises for a failure inside
        one episode; see the module docstring for the causes.
        """
        return self.run_groups([GroupRequest(record, group_id, tuple(seeds))], judge=judge,
                               scene_cfg=scene_cfg, judge_cfg=judge_cfg, forced=forced,
                               on_turn=on_turn)[0]

    def run_groups(self, groups: Sequence["GroupRequest"], *, judge: Judge,
                   scene_cfg: SceneRuntimeConfig | None = None, judge_cfg: JudgeConfig | None = None,
                   forced: ForcedPolicy | None = None,
                   on_turn: TurnCallback | None = None) -> list[GroupRollout]:
        """Run several groups in one batch (`rollout.groups_per_batch`) and judge them all in
        one call: every episode of every group is a row of the same cache and decode loop;
        each group is returned on its own, in order. An episode depends only on its record and
        seed, so a group's trajectories are the same whether it runs alone or beside others.
        Rows are padded with fully masked rows to the layout's `row_multiple`. See `run_group`
        for the rest; the stats' wall_s / tokens_per_s include the judging.
        """
        t0 = time.perf_counter()
        played = self.play_groups(groups, scene_cfg=scene_cfg, judge_cfg=judge_cfg,
                                  forced=forced, on_turn=on_turn)
        judge_on_primary([ep for p in played for ep in p.episodes], judge)
        wall = time.perf_counter() - t0
        for p in played:
            p.stats.update(wall_s=wall, tokens_per_s=p.stats["batch_generated_tokens"] / wall
                           if wall > 0 else 0.0)
        return [p.result() for p in played]

    def play_group(self, record: SceneRecord, *, group_id: int, seeds: Sequence[int],
                   scene_cfg: SceneRuntimeConfig | None = None, judge_cfg: JudgeConfig | None = None,
                   forced: ForcedPolicy | None = None,
                   on_turn: TurnCallback | None = None) -> "PlayedGroup":
        """`run_group` without the judging: the episodes end (finished or failed) unjudged, so a
        caller can judge the episodes of many groups in one call (`scene.episode.judge_episodes`,
        the judge's concurrency then spans them all) before `PlayedGroup.result()`."""
        return self.play_groups([GroupRequest(record, group_id, tuple(seeds))],
                                scene_cfg=scene_cfg, judge_cfg=judge_cfg, forced=forced,
                                on_turn=on_turn)[0]

    def play_groups(self, groups: Sequence["GroupRequest"], *,
                    scene_cfg: SceneRuntimeConfig | None = None, judge_cfg: JudgeConfig | None = None,
                    forced: ForcedPolicy | None = None,
                    on_turn: TurnCallback | None = None) -> list["PlayedGroup"]:
        """`run_groups` without the judging (see `play_group`)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        rows = [_Row(i, int(s), Episode(g.record, scene_cfg, judge_cfg), g.group_id)
                for g in groups for i, s in enumerate(g.seeds)]
        mult = self.sampler.row_multiple
        pad = round_up(len(rows), mult) - len(rows)
        keys = np.concatenate([row_keys([r.seed for r in rows]), np.zeros((pad, 2), np.uint32)])
        self._rebuilds, self._used = 0, 0
        grows_before = self.sampler.cache_grows
        for r in rows:
            try:
                system, user = r.episode.system_prompt(), r.episode.first_user_message()
                r.conv, ids = self.chat.start(system, user)   # the contents normalised
                r.transcript += [{"role": m["role"], "content": m["content"], "actor": "environment"}
                                 for m in r.conv.messages]
                r.add(ids, ENVIRONMENT, False)
                if len(r.tokens) >= cfg.max_episode_tokens:   # the policy never acted: masked
                    r.fail("prompt_over_cap", f"the episode starts at {len(r.tokens)} tokens (system "
                                            f"prompt, room and request), at or over "
                                            f"sampling.max_episode_tokens={cfg.max_episode_tokens}")
            except Exception as err:  # our runtime or tokenizer: masked, not the policy's fault
                log.exception("episode start failed")
                r.fail("rollout_error", f"{type(err).__name__}: {err}")
        self._check_processes_agree(rows)
        first = max((len(r.tokens) for r in rows), default=0)
        self._capacity = (min(self.slots, bucket_length(first + self.sampler.segment, cfg.buckets))
                          if self.grows else self.slots)
        self._cache, self._last = self.sampler.new_cache(len(rows) + pad, self._capacity)
        self._show(rows, on_turn)
        generated = {g.group_id: 0 for g in groups}
        rounds = 0
        while any(r.active for r in rows):
            rounds += 1
            try:
                self._sync(rows, pad)
                turns = self._forced_turns(rows, pad, forced) if forced else self._sampled_turns(rows, pad, keys)
            except Exception as err:  # the engine itself failed: every running row is masked
                if fails_the_joined_run(err):
                    raise
                log.exception("rollout engine error")
                for r in rows:
                    if r.active:   # a finished episode is whole: it is judged
                        r.fail("rollout_error", f"{type(err).__name__}: {err}")
                turns = None
            for r, (ids, lps, reason) in (turns or {}).items():
                generated[r.group_id] += len(ids)
                try:
                    self._consume(r, ids, lps, reason)
                except Exception as err:
                    log.exception("turn processing failed")
                    r.fail("rollout_error", f"{type(err).__name__}: {err}")
            self._check_processes_agree(rows)
            if turns is None:
                break
            self._show(rows, on_turn)
        wall = time.perf_counter() - t0
        total = sum(generated.values())
        batch = {"wall_s": wall, "tokens_per_s": total / wall if wall > 0 else 0.0,
                 "batch_generated_tokens": total, "rounds": rounds,
                 "cache_rebuilds": self._rebuilds,
                 "cache_grows": self.sampler.cache_grows - grows_before,
                 "cache_slots": self._capacity,
                 "batch_rows": len(rows) + pad, "padding_rows": pad, "groups": len(groups),
                 "layout": self.sampler.layout.name}
        self._cache = self._last = None
        return [PlayedGroup(g.group_id, [r for r in rows if r.group_id == g.group_id],
                            {"generated_tokens": generated[g.group_id], **batch})
                for g in groups]

    @staticmethod
    def _show(rows: list[_Row], on_turn: TurnCallback | None) -> None:
        if on_turn is None:
            return
        for r in rows:
            for message in r.transcript[r.shown:]:
                on_turn(r.member, message, r.episode)
            r.shown = len(r.transcript)

    def _limits(self, rows: list[_Row], pad: int) -> list[int]:
        cfg = self.cfg
        return [min(cfg.max_new_tokens, cfg.max_episode_tokens - len(r.tokens)) if r.active else 0
                for r in rows] + [0] * pad

    def _sampled_turns(self, rows, pad, keys) -> dict:
        limits = self._limits(rows, pad)
        self._reserve(rows, pad, self.cfg.max_new_tokens)
        out = self.sampler.decode(self._cache, self._last, limits, keys, self.cfg.max_new_tokens,
                                  max_slots=self.slots if self.grows else None)
        self._cache, self._last = out.cache, out.last_logits
        self._used, self._capacity = int(out.cache.length), out.cache.valid.shape[1]
        tokens, lps = host_array(out.tokens), host_array(out.logprobs)
        lengths, reasons = host_array(out.lengths), host_array(out.reason)
        turns = {}
        for i, r in enumerate(rows):
            if r.active:
                n = int(lengths[i])
                turns[r] = (tokens[i, :n].tolist(), lps[i, :n], int(reasons[i]))
                r.cached += n
        return turns

    def _forced_turns(self, rows, pad, forced: ForcedPolicy) -> dict:
        limits = self._limits(rows, pad)
        self._reserve(rows, pad, self.cfg.max_new_tokens)
        planned = {}
        for i, r in enumerate(rows):
            if not r.active:
                continue
            try:
                text, ids = self.chat.encode_content(forced(r.episode))   # as a sampled turn decodes
                at_stop_string = ends_at_stop_string(text, self.cfg.stop_strings,
                                                     len(self.chat.decode(ids[:-1])))
            except Exception as err:  # the driver's own failure: masked like our runtime's
                log.exception("forced policy failed")
                r.fail("rollout_error", f"{type(err).__name__}: {err}")
                continue
            stop = STOP_STRING if at_stop_string else STOP_TOKEN
            if stop == STOP_TOKEN:
                ids.append(self.chat.eot_id)
            reason = stop if len(ids) <= limits[i] else STOP_LENGTH
            planned[r] = (ids[:limits[i]], reason)
            r.tokens.extend(planned[r][0])          # appended below, then handed to _consume
        try:
            lps = self._sync(rows, pad, with_logprobs=True)
        finally:   # taken off again, also when the append raised: _consume records the turn
            for r, (ids, _) in planned.items():
                del r.tokens[len(r.tokens) - len(ids):]
        turns = {}
        for i, r in enumerate(rows):
            if r in planned:
                ids, reason = planned[r]
                turns[r] = (ids, lps[i][len(lps[i]) - len(ids):], reason)
        return turns

    def _consume(self, r: _Row, ids: list[int], lps, reason: int):
        """Record one policy turn, let the runtime consume it, append its environment reply.
        A turn whose log-probs are not finite (NaN or inf in the model's logits: its tokens mean
        nothing) ends the episode as a `rollout_error`, masked."""
        cfg, ep = self.cfg, r.episode
        if not np.isfinite(np.asarray(lps, np.float32)).all():
            r.fail("rollout_error", f"the model's log-probs of a {ep.next_role} turn are not finite "
                                    "(NaN or inf in its logits)")
            return None
        role = ep.next_role
        ended = reason == STOP_TOKEN and bool(ids) and ids[-1] in self.chat.end_ids
        eot = ended and ids[-1] == self.chat.eot_id
        text = self.chat.decode(ids[:-1] if ended else ids)   # what the scene runtime reads
        # another end-of-generation id (`<|endoftext|>`) stays in the conversation's text and
        # transcript, as in its tokens; the environment closes the turn, as after a stop string
        said = text if eot or not ended else self.chat.decode(ids)
        r.add(ids, ROLE_CODES[role], True, lps, STOP_REASONS[reason])
        r.transcript.append({"role": "assistant", "content": said, "actor": role})
        r.conv.add_assistant(said, eot)
        if reason == STOP_LENGTH:
            if len(r.tokens) >= cfg.max_episode_tokens:
                r.fail("episode_token_cap", f"{len(r.tokens)} tokens")
            else:
                cause = "truncated_action" if cut_inside_action(text) else "truncated_generation"
                r.fail(cause, f"the {role} turn reached max_new_tokens={cfg.max_new_tokens}")
            return None
        res = ep.step(text)
        if res.done:
            if not eot and len(r.tokens) < cfg.max_episode_tokens:   # at the cap: left open
                r.add(r.conv.closing_segment(), ENVIRONMENT, False)
            return None
        seg = r.conv.user_segment(res.env_message)
        if len(r.tokens) + len(seg) >= cfg.max_episode_tokens:
            r.fail("episode_token_cap", f"{len(r.tokens)} + {len(seg)} environment tokens")
            return None
        r.add(seg, ENVIRONMENT, False)
        # the message as encoded: normalised by the tokenizer's normaliser (ChatTokenizer.normalize)
        r.transcript.append({"role": "user", "content": r.conv.messages[-1]["content"],
                             "actor": "environment"})
        return None

    @staticmethod
    def _check_processes_agree(rows: list[_Row]) -> None:
        """Every process of a multi-process run plays the same rows, so after each round every
        row stands the same on each (running or not, its length, its failure cause): a row that
        failed on one host only (an error of our runtime or sampler caused by its memory or a
        file) would leave the processes' episodes, and with them their next collectives or
        their batches, apart; then raise RolloutDivergedError on every process. A collective at
        the same points everywhere; free in one process."""
        state = [[int(r.active), len(r.tokens), _cause_code(r.episode.failure_cause)] for r in rows]
        if not (apart := processes_apart(state)):
            return
        failed = [r for r in rows if r.episode.failure_cause in MASKED_FAILURES]
        raise RolloutDivergedError(
            f"process(es) {apart} and process 0 disagree on where the episodes stand after this "
            f"round (this one masks {len(failed)}"
            + (f", first: {failed[0].episode.failure_cause}: "
               f"{failed[0].episode.failure_message[:300]}" if failed else "")
            + "); the processes' episodes would drift apart, so every process stops: see each "
            "process's log for its error")

    @staticmethod
    def _trajectory(r: _Row, group_id: int) -> Trajectory:
        o = r.episode.outcome
        return Trajectory(
            group_id=group_id, member=r.member, seed=r.seed,
            tokens=np.asarray(r.tokens, np.int32), roles=np.asarray(r.roles, np.int8),
            policy_mask=np.asarray(r.policy, bool), logprobs=np.asarray(r.logprobs, np.float32),
            turns=r.turns, transcript=r.transcript, reward=o.reward, failure_cause=o.failure_cause,
            masked=o.masked, units=o.units, grades=o.grades, metrics=o.metrics, outcome=o.to_json(),
            failure_message=r.episode.failure_message,
        )


def trajectory_batch(trajectories: Sequence[Trajectory], length: int | None = None,
                     rows: int | None = None) -> dict[str, np.ndarray]:
    """Right-padded [N, T] host arrays for the trainer: input_ids int32, attention_mask int32,
    roles int8, policy_mask bool, rollout_logp float32, plus [N] reward float32 and masked bool.

    `length` (default: the longest trajectory) and `rows` (default: len(trajectories); extra
    rows are all padding) fix the shape. Raises ValueError when a trajectory is longer or
    there are more trajectories than rows.
    """
    n = rows or len(trajectories)
    if n < len(trajectories):
        raise ValueError(f"{len(trajectories)} trajectories do not fit {n} rows")
    t = length or max(tr.num_tokens for tr in trajectories)
    out = {"input_ids": np.zeros((n, t), np.int32), "attention_mask": np.zeros((n, t), np.int32),
           "roles": np.zeros((n, t), np.int8), "policy_mask": np.zeros((n, t), bool),
           "rollout_logp": np.zeros((n, t), np.float32), "reward": np.zeros(n, np.float32),
           "masked": np.ones(n, bool)}
    for i, tr in enumerate(trajectories):
        k = tr.num_tokens
        if k > t:
            raise ValueError(f"trajectory {tr.group_id}/{tr.member} has {k} tokens > length {t}")
        out["input_ids"][i, :k] = tr.tokens
        out["attention_mask"][i, :k] = 1
        out["roles"][i, :k] = tr.roles
        out["policy_mask"][i, :k] = tr.policy_mask
        out["rollout_logp"][i, :k] = tr.logprobs
        out["reward"][i] = tr.reward
        out["masked"][i] = tr.masked
    return out
