"""Evaluation of a policy on a scene set, with the scripted expert as reference.

Every scene is played `samples` times with the seeds `episode_seed(scene seed, member, 0)` (the
schedule's derivation, so evaluation is repeatable and independent of batch neighbours), through
the same `RolloutEngine` the trainer uses (greedy or the configured sampling). The scripted expert
(`scene.expert.run_scripted_episode`) plays each scene once (it is deterministic): it is the
reference row of the report. The finished episodes of all scenes, the model's and the expert's,
are then judged in one call to the configured judge, so a slow (or hanging) HTTP judge is waited
for once, with up to `judge.concurrency` requests in flight, not once per scene.

Statistics are the trainer's rollout metrics (`grpo.rollout.stats.summarize`): masked episodes (judge or
infrastructure failures) are excluded from reward, units and failure rate and counted in
`masked`; policy failures (reward -1) are included.
"""
from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Callable, Sequence

from jscenegen.checkpoint.model_dir import load_chat, load_model
from jscenegen.eval.report import REPORT_SCHEMA
from jscenegen.grpo.rollout.config import GROUP_MAX
from jscenegen.grpo.rollout.engine import RolloutEngine
from jscenegen.grpo.rollout.primary_judge import judge_on_primary
from jscenegen.grpo.rollout.seeds import episode_seed
from jscenegen.grpo.rollout.stats import summarize, zero_spread_share
from jscenegen.scene.config import SAMPLING_JUDGES, JudgeConfig, SceneRuntimeConfig
from jscenegen.scene.expert import run_scripted_episode
from jscenegen.scene.judge import Judge, http_judge_sampling
from jscenegen.scene.protocol import protocol_digests
from jscenegen.scene.sceneset import SceneRecord, record_sha256

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- loading
def load_policy(path: str | Path, mesh, **options):
    """A QwenForCausalLM sharded on `mesh` from an HF directory or a checkpoint step directory
    (`checkpoint.model_dir.load_model`, the errors naming `--model`)."""
    return load_model(path, mesh, **options)


def policy_chat(cfg, model_path: str | Path):
    """The ChatTokenizer of `model_path`'s assets (HF directory or checkpoint step's `hf/`) with
    `sampling.chat_template_path`, checked to be prefix-preserving
    (`checkpoint.model_dir.load_chat`). Loads no weights."""
    return load_chat(model_path, cfg.sampling.chat_template_path)


def policy_mesh(cfg):
    """The mesh an evaluation's policy (and a model judge beside it) runs on: `cfg.mesh`."""
    from jscenegen.sharding.mesh import make_mesh

    return make_mesh(cfg.mesh.fsdp, cfg.mesh.sp)


def policy_engine(cfg, model_path: str | Path, chat=None, mesh=None) -> RolloutEngine:
    """A RolloutEngine for `model_path` (HF directory or checkpoint step) built as the trainer
    builds its own: mesh from `cfg.mesh` (`policy_mesh`, unless `mesh` is given), dtypes/attention from `cfg.model`, sampling from
    `cfg.sampling`, the rollout layout from `cfg.rollout`, the tokenizer and chat template of
    the model's assets (`policy_chat`, unless `chat` is given)."""
    mesh = mesh if mesh is not None else policy_mesh(cfg)
    model = load_policy(model_path, mesh, **cfg.model.build_options())
    chat = chat if chat is not None else policy_chat(cfg, model_path)
    return RolloutEngine(model, chat, cfg.sampling, mesh, cfg.rollout)


def rollout_numerics(sampler) -> dict:
    """The dtypes a sampler's logits come from, as a report's `sampling` records them:
    `param_dtype` (what the weights are held in: model.param_dtype), `rollout_dtype` (what the
    rollout's matmul weights are read in: rollout.dtype, else model.compute_dtype) and
    `compute_dtype` (activations and KV cache: model.compute_dtype). Each changes the
    distribution the tokens are drawn from, not only the rounding (`eval --compare` compares
    them)."""
    return {"param_dtype": ",".join(sampler.param_dtypes),
            "rollout_dtype": str(sampler.weight_dtype), "compute_dtype": str(sampler.cache_dtype)}


class EpisodeTooLong(ValueError):
    """An episode starts at or over `sampling.max_episode_tokens` (`check_episode_fits`)."""


def check_episode_fits(chat, record: SceneRecord, cfg) -> int:
    """Tokens the episode of `record` starts with (the system prompt and the first user
    message, which carries the prompt and the room) under `chat`; returns the count.

    Raises EpisodeTooLong (a ValueError) naming `sampling.max_episode_tokens` when they reach
    it: the episode could not take a single turn (the rollout masks it as `prompt_over_cap`); an
    episode that cannot start at all raises its own error (SceneError, ChatTemplateError). A prompt that
    spells out the tokenizer's special tokens is text like any other (`ChatTokenizer.encode_turns`).
    """
    from jscenegen.scene.episode import Episode

    ep = Episode(record, cfg.scene, cfg.judge)
    _, ids = chat.start(ep.system_prompt(), ep.first_user_message())
    cap = cfg.sampling.max_episode_tokens
    if len(ids) >= cap:
        prompt = len(chat.encode_content(record.scene.prompt)[1])   # as the episode encodes it
        over = len(ids) - cap + 1
        fix = (f"shorten the prompt by at least {over} tokens or raise "
               "sampling.max_episode_tokens" if over < prompt else
               f"the rest alone takes {len(ids) - prompt}: raise sampling.max_episode_tokens")
        raise EpisodeTooLong(f"the prompt ({prompt} tokens) makes the episode start at {len(ids)} "
                         f"tokens with the system prompt and the room, at or over "
                         f"sampling.max_episode_tokens={cap}; {fix}")
    return len(ids)


def check_scenes_fit(chat, records: list[SceneRecord], cfg, source: str, sample: int = 8) -> None:
    """Refuse scenes that cannot take a single turn: when every one of the first `sample` of
    `records` whose episode can start starts it at or over `sampling.max_episode_tokens`
    (`check_episode_fits`; no episode could take a turn), raise ValueError
    naming `source` (the scene set) and the first; when only some do, warn naming the first
    and their count. A scene whose episode cannot start at all (another error) is left to the
    rollout, which reports it, and is not counted."""
    failing, checked = [], 0
    for i, record in enumerate(records[:sample]):
        try:
            check_episode_fits(chat, record, cfg)
        except EpisodeTooLong as err:
            failing.append((record.scene.scene_id or f"scene {i + 1}", err))
        except Exception:   # an episode that cannot start at all: the rollout reports it
            continue
        checked += 1
    if not failing:
        return
    where = f"{source}: {failing[0][0]}"
    among = f"the first {min(len(records), sample)} scene(s)"
    if len(failing) == checked:
        raise ValueError(f"{where}: {failing[0][1]} (all {checked} of {among} that start do: "
                         "no episode could take a turn)")
    log.warning("%s: %s (%d of the %d of %s that start; their episodes are masked as "
                "prompt_over_cap)", where, failing[0][1], len(failing), checked, among)


# ----------------------------------------------------------------------------- statistics
def _episode_row(outcome: dict, **ids) -> dict:
    m = outcome.get("metrics") or {}
    return {**ids, "reward": outcome["reward"], "quality": outcome.get("quality"),
            "unit_penalty": outcome.get("unit_penalty"), "units": outcome["units"],
            "grades": outcome.get("grades"), "failure_cause": outcome["failure_cause"],
            "masked": outcome["masked"], "reachable": m.get("reachable") if m else None}


def _model_measured(outcomes: list[dict]) -> bool:
    """Some episode of the scene was left unmasked, so the model's overall row has a reward of
    the scene. When none was (the prompt alone reaches `sampling.max_episode_tokens`, our
    sampler or scene runtime failed, the judge failed on every one), the expert's overall row
    leaves the scene out as well, so the two rows average the same scenes."""
    return any(not o["masked"] for o in outcomes)


# ----------------------------------------------------------------------------- evaluation
def report_scene_ids(records: Sequence[SceneRecord], source: str = "the scene set") -> list[str]:
    """The name of each record in a report: its `scene_id`, else `scene-<index>` (0-based).
    Raises ValueError naming `source` (the scene-set file), the index and line when a
    generated name is another record's `scene_id` (a report names each scene once;
    `read_scene_set` already refuses a `scene_id` given twice)."""
    given = {r.scene.scene_id: (i, r.line) for i, r in enumerate(records) if r.scene.scene_id}
    ids = []
    for i, record in enumerate(records):
        sid = record.scene.scene_id or f"scene-{i}"
        if not record.scene.scene_id and sid in given:
            j, line = given[sid]
            raise ValueError(f"{source}: scene {i} (line {record.line}) has no scene_id, and the "
                             f"name a report gives it, {sid!r}, is the scene_id of scene {j} "
                             f"(line {line}); give scene {i} a scene_id")
        ids.append(sid)
    return ids


def check_samples(samples: int) -> None:
    """Raise ValueError unless 1 <= samples <= GROUP_MAX episodes per scene (a scene's episodes
    are one rollout group, bounded as the trainer's `schedule.group_size`)."""
    if not 1 <= samples <= GROUP_MAX:
        raise ValueError(f"samples must lie in 1..{GROUP_MAX} episodes per scene, got {samples}")


def evaluation_samples(cfg, given: int | None = None) -> int:
    """Episodes per scene in an evaluation under the run config `cfg` (`jscenegen eval` and a
    run's dev evaluations): `given` (eval's --samples) when given, else 1 under greedy decoding
    (`sampling.greedy`: argmax ignores the sampling seed, so every episode of a scene would be
    the same one, and `eval --compare` would count its copies as pairs), else
    `trainer.eval_samples`. Warns (one log line) when greedy decoding is given more than one
    sample; the range is checked by `check_samples`."""
    greedy = cfg.sampling.greedy
    if given is None:
        return 1 if greedy else cfg.trainer.eval_samples
    if greedy and given > 1:
        log.warning("--greedy with --samples %d: argmax decoding ignores the seed, so the %d "
                    "episodes of a scene are identical (and `eval --compare` would count them "
                    "as %d pairs)", given, given, given)
    return given


def evaluate(engine: RolloutEngine | None, records: Sequence[SceneRecord], *, judge: Judge,
             scene_cfg: SceneRuntimeConfig, judge_cfg: JudgeConfig, samples: int = 1,
             with_expert: bool = True,
             progress: Callable[[dict], None] | None = None) -> dict:
    """Evaluate the engine's model (and the scripted expert) on `records`.

    Args:
      engine: RolloutEngine holding the policy (None: expert only).
      records: the scenes, each played with its own seed.
      samples: episodes per scene; member m uses seed `episode_seed(record.seed, m, 0)`.
      Scenes are named in the report by their `scene_id` (else `scene-<index>`:
      `report_scene_ids`), so reports of `jscenegen eval` and of a run's evaluations compare
      (`eval --compare`).
      progress: called with each scene's report row once every scene is judged.
    Returns the report dict (without file metadata): {"schema", "samples", "judge" (the judge's
    identity, and for the HTTP and model judges its `temperature` and `max_tokens`:
    `scene.judge.http_judge_sampling`),
    "protocol" (`scene.protocol.protocol_digests`: the scene settings the episodes were played
    and rewarded under), "sampling" (the engine's `sampling` config plus
    `chat_template_sha256`, the SHA-256 of the template text the episodes were rendered with,
    `end_ids`, the ids a sampled turn ended at (`ChatTokenizer.end_ids`), and the dtypes the
    logits were computed in, `rollout_numerics`, with an engine),
    "scenes": [{"scene_id", "seed", "prompt", "scene_sha256" (`sceneset.record_sha256`: the
    digest of the scene's record, room and requested items included), "model": summary +
    "episodes", "expert": summary + "episodes"}], "overall": {"model": summary, "expert": summary}, "wall_s"};
    `overall.expert` leaves out the scenes whose model episodes were all masked (any cause:
    `prompt_over_cap`, `rollout_error`, a judge failure), which `overall.model` has no reward of.
    Summaries are `summarize(...)` dicts. Raises ValueError when samples is outside
    1..GROUP_MAX (`check_samples`), there are no records, or a generated scene name is another
    record's scene_id (`report_scene_ids`).
    """
    check_samples(samples)
    if not records:
        raise ValueError("no scenes to evaluate")
    scene_ids = report_scene_ids(records)
    keys = judge_cfg.grade_keys
    t0 = time.perf_counter()
    played, experts = [], []
    for i, record in enumerate(records):
        if engine is not None:
            seeds = [episode_seed(record.seed, m, 0) for m in range(samples)]
            played.append(engine.play_group(record, group_id=i, seeds=seeds,
                                            scene_cfg=scene_cfg, judge_cfg=judge_cfg))
        if with_expert:
            experts.append(run_scripted_episode(record, scene_cfg, judge_cfg, judged=False)[0])
    # every scene's finished episodes in one call: a slow judge's requests overlap, up to
    # judge.concurrency, instead of waiting scene after scene; process 0 alone grades in a
    # multi-process run (a run's dev evaluations), as for the training rollouts
    judge_on_primary([ep for g in played for ep in g.episodes] + experts, judge)
    rows, all_model, all_expert, model_groups = [], [], [], []
    for i, record in enumerate(records):
        row = {"scene_id": scene_ids[i], "seed": record.seed, "prompt": record.scene.prompt,
               "scene_sha256": record_sha256(record)}
        if engine is not None:
            group = played[i].result()
            outs = [t.outcome for t in group.trajectories]
            all_model += outs
            model_groups.append(outs)
            row["model"] = {**summarize(outs, keys), "episodes": [
                _episode_row(t.outcome, member=t.member, seed=t.seed, tokens=t.num_tokens)
                for t in group.trajectories]}
        if with_expert:
            out = experts[i].outcome.to_json()
            if engine is None or _model_measured(outs):
                all_expert.append(out)
            row["expert"] = {**summarize([out], keys), "episodes": [_episode_row(out)]}
        rows.append(row)
        if progress is not None:
            progress(row)
    overall = {}
    if engine is not None:
        overall["model"] = summarize(all_model, keys)
        overall["model"]["zero_spread_scenes"] = zero_spread_share(
            [o["reward"] for o in outs if not o["masked"]] for outs in model_groups)
    if with_expert:
        overall["expert"] = summarize(all_expert, keys)
    judged_by = judge.identity()
    if judged_by.get("backend") in SAMPLING_JUDGES:   # what it samples with, beside who it is
        judged_by = {**judged_by, **http_judge_sampling(judge_cfg)}
    report = {"schema": REPORT_SCHEMA, "samples": samples, "judge": judged_by,
              "protocol": protocol_digests(scene_cfg, judge_cfg),
              "scenes": rows, "overall": overall, "wall_s": time.perf_counter() - t0}
    if engine is not None:
        template = engine.chat.tokenizer.chat_template.encode()
        report["sampling"] = {**engine.cfg.model_dump(mode="json"),
                              "chat_template_sha256": hashlib.sha256(template).hexdigest(),
                              "end_ids": list(engine.chat.end_ids),
                              **rollout_numerics(engine.sampler)}
    return report
