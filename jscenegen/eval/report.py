"""Before/after comparison of two evaluation reports: the paired difference of mean reward per
(scene, sampling seed) with a 95% t interval clustered by scene, and a Markdown table."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np

from jscenegen.config import SEED_MAX, is_seed
from jscenegen.grpo.rollout.config import GREEDY_OFF, GROUP_MAX
from jscenegen.paths import finite_number
from jscenegen.scene.config import REWARD_MAX, REWARD_MIN, UNIT_PENALTY_MAX, JudgeConfig
from jscenegen.scene.judge import (
    JUDGE_IDENTITY_KEYS,
    judge_check_hint,
    judge_failure_text,
    renamed_judge_text,
    renamed_model_judge,
)
from jscenegen.scene.reward import JUDGE_FAILURES, RUNTIME_FAILURES, SETUP_FAILURES
from jscenegen.text import clip_line, clip_text

REPORT_SCHEMA = "jscenegen.eval/1"
# the scenes of the shipped train set, data/scenes/train.jsonl (tests/test_evaluate.py counts them)
SHIPPED_TRAIN_SCENES = 100
# the most episodes (scenes x samples) `jscenegen eval` (or a run's dev evaluation) plays into
# one report: GROUP_MAX (4,096, the most samples per scene) on each shipped train scene; more
# are refused before the model loads (`check_report_episodes`), so that `eval --compare` can
# read every report `eval` writes
MAX_REPORT_EPISODES = GROUP_MAX * SHIPPED_TRAIN_SCENES
# an episode row takes ~0.4 KiB of the indented report with the default 7 grades, its scene's
# share of the rest (prompt, expert row, summaries) less than the remainder
REPORT_BYTES_PER_EPISODE = 1024
MAX_REPORT_BYTES = MAX_REPORT_EPISODES * REPORT_BYTES_PER_EPISODE   # 400 MiB
_STATS = ("reward", "failure_rate", "units", "reachable", "quality", "unit_penalty")
_REWARD_SPAN = (f"[{REWARD_MIN:g}, {REWARD_MAX:g}], the rewards scene.reward's bounds allow "
                "(at most all grades 10 with nothing spent)")
# `sampling` keys that change no drawn token's distribution, only the computation's shapes (the
# decode segments, the KV cache's size: the same tokens up to float rounding), or that name what
# another key records (the template file's path: `chat_template_sha256` holds the text
# rendered); every other recorded key is compared (`comparable_sampling`)
_UNCOMPARED_KEYS = ("buckets", "cache_tokens", "chat_template_path")
# what argmax decoding reads none of (`generate.sampling.sample_tokens`: argmax of the
# untempered logits): the temperature and the filters greedy decoding turns off
_GREEDY_UNUSED_KEYS = ("temperature", *GREEDY_OFF)
# the parts of a report's `protocol` (scene.protocol.protocol_payload) by the settings they hold
_PROTOCOL_PARTS = {
    "prompts_sha256": "the prompt templates (scene.prompts_dir)",
    "action_grammar": "the action grammar (another jscenegen)",
    "op_schemas": "the operations' schemas (another jscenegen)",
    "op_costs": "scene.op_costs", "budget_units": "scene.budget_units",
    "max_objects": "scene.max_objects", "max_planner_turns": "scene.max_planner_turns",
    "max_critique_rounds": "scene.max_critique_rounds", "reward": "scene.reward",
    "metrics": "scene.metrics", "catalogue": "the catalogue (scene.catalogue_path)",
    "grade_keys": "judge.grade_keys", "caps": "the grade caps (scene.metrics)",
    "rules_revision": "the measuring and grading rules (another jscenegen)",
}


def check_report(report, source: str) -> None:
    """Raise ValueError naming `source` and the field unless `report` has the structure that
    `comparison_markdown` reads: `scenes` a list of objects, each with a string `scene_id`
    and optional `model` statistics (`reward`, `failure_rate`, `units`, `reachable`, `quality`,
    `unit_penalty`: finite numbers or null; rates and `quality` in [0, 1], `unit_penalty` in
    [0, UNIT_PENALTY_MAX], `reward` in [REWARD_MIN, REWARD_MAX], the range `scene.reward`'s
    bounds allow: scene/config.py) whose `episodes` are objects with an integer
    `seed` (32-bit, each once), a `reward` in that range, a boolean `masked` and a
    `failure_cause` (a string or null), as many as `samples` (an integer in 1..GROUP_MAX) says
    (counted before they are read),
    `failure_causes` a {cause: count} object, each `scene_id` once;
    `judge` and `sampling` objects and each scene's `scene_sha256` a string when present;
    `overall.model` statistics; the `reward` and `failure_rate` of each summary those of its episodes;
    `schema` REPORT_SCHEMA."""
    def stats(m, where: str, episodes: bool) -> None:
        if not isinstance(m, dict):
            raise ValueError(f"{source}: {where} must be an object, got {type(m).__name__}")
        for key in _STATS:
            if key not in m or not (m[key] is None or finite_number(m[key])):
                raise ValueError(f"{source}: {where}.{key} must be a finite number or null, "
                                 f"got {clip_text(repr(m.get(key)))}")
        causes = m.get("failure_causes")
        if not (isinstance(causes, dict) and all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for k, v in causes.items())):
            raise ValueError(f"{source}: {where}.failure_causes must map causes to counts, got "
                             f"{clip_text(repr(causes))}")
        for key, least, most, span in (
                ("units", 0, math.inf, "the units a run can spend (>= 0)"),
                ("failure_rate", 0, 1, "[0, 1]"), ("reachable", 0, 1, "[0, 1]"),
                ("quality", 0, 1, "[0, 1] (the grades' mean over their range)"),
                ("unit_penalty", 0, UNIT_PENALTY_MAX, f"[0, {UNIT_PENALTY_MAX:g}] (scene.reward."
                                                      "unit_penalty's range)"),
                ("reward", REWARD_MIN, REWARD_MAX, _REWARD_SPAN)):
            if m[key] is not None and not least - 1e-9 <= m[key] <= most + 1e-9:
                raise ValueError(f"{source}: {where}.{key} {m[key]!r} is outside {span}")
        if not episodes:
            return
        eps = m.get("episodes")
        if not isinstance(eps, list):
            raise ValueError(f"{source}: {where}.episodes must be a list, got {type(eps).__name__}")
        if len(eps) != samples:   # before they are walked: a row holds at most GROUP_MAX
            raise ValueError(f"{source}: {where} has {len(eps)} episodes, samples says {samples}")
        for j, ep in enumerate(eps):
            at = f"{where}.episodes[{j}]"
            if not isinstance(ep, dict):
                raise ValueError(f"{source}: {at} must be an object, got {type(ep).__name__}")
            if not is_seed(ep.get("seed")):
                raise ValueError(f"{source}: {at}.seed must be an integer in 0..{SEED_MAX}, "
                                 f"got {clip_text(repr(ep.get('seed')))}")
            if not finite_number(ep.get("reward")):
                raise ValueError(f"{source}: {at}.reward must be a finite number, "
                                 f"got {clip_text(repr(ep.get('reward')))}")
            if not REWARD_MIN - 1e-9 <= ep["reward"] <= REWARD_MAX + 1e-9:
                raise ValueError(f"{source}: {at}.reward {ep['reward']!r} is outside {_REWARD_SPAN}")
            if ep.get("units") is not None and not (finite_number(ep["units"]) and ep["units"] >= 0):
                raise ValueError(f"{source}: {at}.units must be a number >= 0 (budget units "
                                 f"spent) or null, got {clip_text(repr(ep['units']))}")
            if not isinstance(ep.get("masked"), bool):
                raise ValueError(f"{source}: {at}.masked must be true or false, got "
                                 f"{clip_text(repr(ep.get('masked')))}")
            if "failure_cause" not in ep:
                raise ValueError(f"{source}: {at}.failure_cause is missing")
            if not (ep["failure_cause"] is None or (isinstance(ep["failure_cause"], str)
                                                    and ep["failure_cause"])):
                raise ValueError(f"{source}: {at}.failure_cause must be a cause (a non-empty "
                                 f"string) or null, got {clip_text(repr(ep['failure_cause']))}")
        seeds = Counter(ep["seed"] for ep in eps)   # linear: list.count per seed took hours
        twice = next((x for x, n in seeds.items() if n > 1), None)
        if twice is not None:
            raise ValueError(f"{source}: {where}.episodes hold seed {twice} more than once "
                             "(each sampling seed is one episode)")
        _agrees(m, eps, where)

    def _agrees(m: dict, eps: list, where: str) -> None:
        """The summary's reward and failure rate are those of its episodes (`summarize`)."""
        valid = [ep for ep in eps if not ep["masked"]]
        want = {"reward": float(np.mean([ep["reward"] for ep in valid])) if valid else None,
                "failure_rate": (sum(1 for ep in valid if ep["failure_cause"]) / len(valid)
                                 if valid else None)}
        for key, value in want.items():
            got = m[key]
            if (got is None) != (value is None) or (
                    value is not None and not math.isclose(got, value, rel_tol=1e-9, abs_tol=1e-12)):
                raise ValueError(f"{source}: {where}.{key} is {got!r} but its episodes give "
                                 f"{value!r} (an edited report?)")

    if not isinstance(report, dict):
        raise ValueError(f"{source}: an evaluation report must be a JSON object, got {type(report).__name__}")
    if report.get("schema") != REPORT_SCHEMA:
        raise ValueError(f"{source}: schema {clip_text(repr(report.get('schema')))} is not "
                         f"{REPORT_SCHEMA!r} (not a jscenegen evaluation report)")
    protocol = report.get("protocol")
    if protocol is not None and not (isinstance(protocol, dict) and all(
            isinstance(v, str) for v in protocol.values())):
        raise ValueError(f"{source}: protocol must map the scene protocol's parts to digests "
                         f"(strings), got {clip_text(repr(protocol))}")
    samples = report.get("samples")
    if not (isinstance(samples, int) and not isinstance(samples, bool) and 1 <= samples <= GROUP_MAX):
        raise ValueError(f"{source}: samples must be a positive integer (episodes per scene) up "
                         f"to {GROUP_MAX} (a rollout group, as `eval --samples`), got "
                         f"{clip_text(repr(samples))}")
    if report.get("judge") is not None and not isinstance(report["judge"], dict):
        raise ValueError(f"{source}: judge must be an object (the judge's backend, model, rubric "
                         f"and settings), got {clip_text(repr(report['judge']))}")
    if report.get("sampling") is not None and not isinstance(report["sampling"], dict):
        raise ValueError(f"{source}: sampling must be an object (the settings the episodes were "
                         f"drawn with), got {clip_text(repr(report['sampling']))}")
    end_ids = (report.get("sampling") or {}).get("end_ids")
    if end_ids is not None and not (isinstance(end_ids, list) and end_ids and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in end_ids)):
        raise ValueError(f"{source}: sampling.end_ids must be a non-empty list of token ids "
                         f"(integers >= 0), got {clip_text(repr(end_ids))}")
    scenes = report.get("scenes")
    if not isinstance(scenes, list):
        raise ValueError(f"{source}: scenes must be a list, got {type(scenes).__name__}")
    seen: dict[str, int] = {}
    for i, row in enumerate(scenes):
        if not isinstance(row, dict):
            raise ValueError(f"{source}: scenes[{i}] must be an object, got {type(row).__name__} "
                             f"{clip_text(repr(row))}")
        if not isinstance(row.get("scene_id"), str):
            raise ValueError(f"{source}: scenes[{i}].scene_id must be a string, got "
                             f"{clip_text(repr(row.get('scene_id')))}")
        if "seed" in row and not is_seed(row["seed"]):
            raise ValueError(f"{source}: scenes[{i}].seed must be an integer in 0..{SEED_MAX}, "
                             f"got {clip_text(repr(row['seed']))}")
        if "scene_sha256" in row and not isinstance(row["scene_sha256"], str):
            raise ValueError(f"{source}: scenes[{i}].scene_sha256 must be a digest (a string), "
                             f"got {clip_text(repr(row['scene_sha256']))}")
        if (first := seen.setdefault(row["scene_id"], i)) != i:
            raise ValueError(f"{source}: scenes[{i}].scene_id {clip_text(repr(row['scene_id']))} "
                             f"is also scenes[{first}]'s (each scene once)")
        if "model" in row:
            stats(row["model"], f"scenes[{i}].model", episodes=True)
    overall = report.get("overall")
    if not isinstance(overall, dict) or "model" not in overall:
        raise ValueError(f"{source}: overall.model is missing (not a report with model episodes)")
    stats(overall["model"], "overall.model", episodes=False)
    _agrees(overall["model"], [ep for row in scenes if "model" in row
                               for ep in row["model"]["episodes"]], "overall.model")


def check_report_episodes(scenes: int, samples: int, source: str) -> None:
    """Raise ValueError naming `source` (the scene set) when `scenes` x `samples` episodes are
    more than MAX_REPORT_EPISODES: their report could pass MAX_REPORT_BYTES, which
    `read_report` (`eval --compare`) refuses."""
    if scenes * samples > MAX_REPORT_EPISODES:
        raise ValueError(f"{source}: {scenes} scenes x {samples} samples = {scenes * samples:,} "
                         f"episodes, more than one report holds ({MAX_REPORT_EPISODES:,}, "
                         f"{MAX_REPORT_BYTES // 2**20} MiB of JSON); evaluate fewer samples or "
                         "split the scene set")


def read_report(path, label: str | None = None):
    """The parsed JSON of the evaluation report at `path` (not yet checked: `check_report`),
    at most MAX_REPORT_BYTES. Raises SceneError (a ValueError) naming `label` (default: the
    path) when the file is missing, larger or not valid JSON (`schema.read_json_file`)."""
    from jscenegen.scene.schema import read_json_file

    return read_json_file(path, label, max_bytes=MAX_REPORT_BYTES)


def _seed_list(seeds: list[int]) -> str:
    """Sorted seeds for a message: the first 5, then how many more."""
    more = f", ... {len(seeds) - 5} more" if len(seeds) > 5 else ""
    return "seeds [" + ", ".join(str(x) for x in seeds[:5]) + more + "]"


def _coverage(report) -> dict[str, list[int] | None]:
    """{scene_id: sorted episode seeds of the model, or None for a scene without `model`}."""
    return {row["scene_id"]: (sorted(ep["seed"] for ep in row["model"]["episodes"]) if "model" in row else None)
            for row in report["scenes"]}


def check_same_episodes(before: dict, after: dict, names: tuple[str, str]) -> None:
    """Raise ValueError naming both files and what differs unless the two (checked) reports
    record their `judge`, `protocol`, `sampling` and each scene's `scene_sha256` (a report
    without one, written by an older jscenegen or edited, is refused), were graded by the same
    judge (backend, model, rubric) with the same settings (the HTTP judge's temperature and
    max_tokens; one recorded by one report only is refused), played under the same scene
    protocol (prompts, costs, budget, reward, metrics, catalogue) and cover the same scenes
    (same seeds, prompts and scene records: rooms, requested items), each with model episodes of the same
    sampling seeds, drawn with the same `sampling` settings (`comparable_sampling`: all but the
    decode layout's `buckets` and `cache_tokens`, the chat template compared by the SHA-256 of
    its text rather than its path, and temperature/top-k/top-p when both decoded greedily; the
    rollout's dtypes included): a comparison of part of the episodes, of rewards on other scales or
    of other sampling rules would be silently biased."""
    b, a = _coverage(before), _coverage(after)
    where = f"{names[0]} vs {names[1]}"

    def recorded(report: dict, key: str) -> bool:
        if key == "scenes[].scene_sha256":   # every scene's (an older jscenegen wrote none)
            return all(row.get("scene_sha256") for row in report["scenes"])
        return bool(report.get(key))

    for key, what, lost in (("judge", "the judge", "their grades cannot be shown to be one judge's"),
                            ("protocol", "the scene protocol",
                             "their rewards cannot be shown to be on one scale"),
                            ("sampling", "the sampling settings",
                             "their sampling cannot be shown to agree"),
                            ("scenes[].scene_sha256", "the digest of each scene's record",
                             "their scenes (rooms, requested items) cannot be shown to be the "
                             "same")):
        missing = [n for n, r in zip(names, (before, after)) if not recorded(r, key)]
        if missing:
            raise ValueError(f"{where}: no `{key}` ({what}) in {' or '.join(missing)} (written "
                             f"by an older jscenegen or edited), so {lost}; re-run `jscenegen "
                             f"eval` for {'both' if len(missing) == 2 else 'that report'}")
    judges = [{k: r["judge"].get(k) for k in JUDGE_IDENTITY_KEYS} for r in (before, after)]
    if judges[0] != judges[1]:
        renamed = renamed_model_judge(*judges) if judges[0]["rubric_hash"] == judges[1]["rubric_hash"] else None
        why = (renamed_judge_text(renamed, f"rename it back and re-run `jscenegen eval` for {names[1]}")
               if renamed else "their rewards do not compare")
        raise ValueError(f"{where}: graded by different judges ({_judge_name(before)} and "
                         f"{_judge_name(after)}): {why}")
    # the judge's sampling settings (the HTTP judge's temperature, max_tokens: recorded beside
    # its identity, `scene.judge.http_judge_sampling`)
    settings = [{k: v for k, v in r["judge"].items() if k not in JUDGE_IDENTITY_KEYS}
                for r in (before, after)]
    if keys := _differing_keys("judge", settings, names, where, "their grading"):
        raise ValueError(f"{where}: graded otherwise ({_shown_values('judge', settings, keys)}): "
                         "the same episodes get other grades")
    protocols = [r.get("protocol") for r in (before, after)]
    if protocols[0] != protocols[1]:
        parts = sorted(k for k in set(protocols[0]) | set(protocols[1])
                       if protocols[0].get(k) != protocols[1].get(k))
        shown = ", ".join(_PROTOCOL_PARTS.get(k, clip_text(k, 40)) for k in parts[:8]) + (
            f" and {len(parts) - 8} more" if len(parts) > 8 else "")
        raise ValueError(f"{where}: played under other scene settings ({shown} differ): their "
                         "rewards do not compare")

    shaping = comparable_sampling(before["sampling"], after["sampling"])
    if keys := _differing_keys("sampling", shaping, names, where, "their sampling"):
        raise ValueError(f"{where}: sampled otherwise ({_shown_values('sampling', shaping, keys)}): "
                         "the same seeds draw other tokens")

    def listed(ids) -> str:
        ids = sorted(ids)
        return ", ".join(_sid(i) for i in ids[:5]) + (f" (+{len(ids) - 5} more)" if len(ids) > 5 else "")

    if set(b) != set(a):
        only_b, only_a = set(b) - set(a), set(a) - set(b)
        parts = ([f"{len(only_b)} scene(s) only in {names[0]}: {listed(only_b)}"] if only_b else []) + (
            [f"{len(only_a)} scene(s) only in {names[1]}: {listed(only_a)}"] if only_a else [])
        raise ValueError(f"{where}: the reports do not cover the same scenes ({len(b)} and {len(a)}); "
                         + "; ".join(parts))
    for sid in b:
        for path, seeds in zip(names, (b[sid], a[sid])):
            if seeds is None:
                raise ValueError(f"{where}: scene {_sid(sid)} has no model episodes in {path}")
        if b[sid] != a[sid]:
            raise ValueError(f"{where}: scene {_sid(sid)} has model episodes of different seeds "
                             f"({_seed_list(b[sid])} in {names[0]}, {_seed_list(a[sid])} in "
                             f"{names[1]})")
    rows_b, rows_a = ({row["scene_id"]: row for row in r["scenes"]} for r in (before, after))
    for sid in b:
        for key, what in (("seed", "seed"), ("prompt", "prompt"),
                          ("scene_sha256", "scene_sha256, the digest of its scene-set record "
                                           "(room, requested items)")):
            if rows_b[sid].get(key) != rows_a[sid].get(key):
                raise ValueError(f"{where}: scene {_sid(sid)} differs in its {what} (another "
                                 "scene set under the same ids)")


def comparable_sampling(before: dict, after: dict) -> list[dict]:
    """The rule of which recorded `sampling` settings two reports must share: the two dicts
    with what changes no drawn token taken out (`_UNCOMPARED_KEYS`; the temperature, top-k and
    top-p when both decoded greedily, `_GREEDY_UNUSED_KEYS`) and `end_ids` as a set (their order
    and repeats change no token). Every other key, the rollout's dtypes (`rollout_numerics`)
    included, is compared as recorded."""
    pair = [dict(before), dict(after)]
    both_greedy = all(d.get("greedy") is True for d in pair)
    for d in pair:
        if "end_ids" in d:
            d["end_ids"] = sorted(set(d["end_ids"]))
        for key in _UNCOMPARED_KEYS + (_GREEDY_UNUSED_KEYS if both_greedy else ()):
            d.pop(key, None)
    return pair


def _differing_keys(section: str, pair: list[dict], names: tuple[str, str], where: str,
                    what: str) -> list[str]:
    """The sorted keys whose values differ between the two reports' `section` dicts (`pair`).
    Raises ValueError naming the first that one report does not record (an older jscenegen or
    an edited report: `what` cannot be shown to agree; re-run `jscenegen eval`)."""
    keys = [k for k in sorted(set(pair[0]) | set(pair[1])) if pair[0].get(k) != pair[1].get(k)]
    for key in keys:
        missing = [names[i] for i in (0, 1) if key not in pair[i]]
        if missing:
            raise ValueError(f"{where}: {section}.{clip_text(key, 40)} is recorded by one report "
                             f"only ({missing[0]} has none: written by an older jscenegen or "
                             f"edited), so {what} cannot be shown to agree; re-run `jscenegen "
                             "eval` for that report")
    return keys


def _shown_values(section: str, pair: list[dict], keys: list[str]) -> str:
    """'sampling.temperature 1.0 and 0.1; sampling.top_k 0 and 5': each key's two values."""
    return "; ".join(f"{section}.{clip_text(k, 40)} {clip_text(repr(pair[0][k]))} and "
                     f"{clip_text(repr(pair[1][k]))}" for k in keys)


def _sid(scene_id: str) -> str:
    """A report's scene id for a message: cut to 80 characters (a report's ids have no bound)."""
    return clip_text(scene_id, 80)


def _judge_name(report: dict) -> str:
    judge = report.get("judge")
    if not isinstance(judge, dict):
        return "an unnamed judge"
    rubric = str(judge.get("rubric_hash") or "")[:12]
    return (f"{clip_text(str(judge.get('backend')), 40)} {clip_text(str(judge.get('model') or ''), 80)} "
            f"rubric {rubric}").replace("  ", " ")


def compare_reports(before: dict, after: dict) -> dict:
    """Paired change of the model's dev reward between two `evaluate` reports.

    Episodes are paired by (scene_id, seed): the same scenes and sampling seeds before and
    after (the trainer's evaluations), both unmasked. Returns {"pairs", "scenes" (scenes with
    at least one pair), "reward_before", "reward_after" (means over the pairs), "diff" (mean of
    after - before over the pairs), "diff_ci95" [lo, hi], "per_scene" {scene_id: mean diff},
    "failure_rate_before", "failure_rate_after"}.

    The interval is clustered by scene: a scene's episodes share its effect, so they are not
    independent draws. It is diff +- t(0.975, scenes - 1) * se with the cluster-robust standard
    error se = sqrt(S / (S - 1) * sum_s (n_s / N)^2 (d_s - diff)^2) (S scenes, n_s pairs and
    mean difference d_s in scene s, N pairs): when every scene has the same number of pairs
    this is the t interval over the S scene means (their mean is then `diff`). None with a
    single scene, which has no spread between scenes. Raises ValueError when no episode pairs
    up.
    """
    def episodes(report):
        return {(row["scene_id"], ep["seed"]): ep for row in report["scenes"]
                for ep in row.get("model", {}).get("episodes", [])}

    b, a = episodes(before), episodes(after)
    keys = [k for k in b if k in a and not b[k]["masked"] and not a[k]["masked"]]
    if not keys:
        raise ValueError("the reports share no unmasked (scene_id, seed) episode")
    diffs = np.array([a[k]["reward"] - b[k]["reward"] for k in keys], np.float64)
    mean = float(diffs.mean())
    per_scene: dict[str, list[float]] = {}
    for k, d in zip(keys, diffs):
        per_scene.setdefault(k[0], []).append(float(d))
    ci = _scene_clustered_ci95(per_scene, mean, len(keys))
    failed = lambda eps: float(np.mean([e["failure_cause"] is not None for e in eps]))  # noqa: E731
    return {"pairs": len(keys), "scenes": len(per_scene),
            "reward_before": float(np.mean([b[k]["reward"] for k in keys])),
            "reward_after": float(np.mean([a[k]["reward"] for k in keys])),
            "diff": mean, "diff_ci95": ci,
            "per_scene": {sid: float(np.mean(v)) for sid, v in per_scene.items()},
            "failure_rate_before": failed([b[k] for k in keys]),
            "failure_rate_after": failed([a[k] for k in keys])}


def t_975(df: int) -> float:
    """Student's t 97.5% quantile with `df` degrees of freedom (a 95% two-sided interval;
    scipy's `t.ppf`): the one quantile of this interval and bench/train_seeds.py's."""
    from scipy.stats import t

    return float(t.ppf(0.975, df))


def _scene_clustered_ci95(per_scene: dict[str, list[float]], mean: float,
                          pairs: int) -> list[float] | None:
    """[lo, hi], the 95% t interval of `mean` (the pair mean) clustered by scene
    (`compare_reports`), or None for one scene."""
    scenes = len(per_scene)
    if scenes < 2:
        return None
    terms = np.array([len(v) / pairs * (float(np.mean(v)) - mean) for v in per_scene.values()])
    se = float(np.sqrt(scenes / (scenes - 1) * np.sum(terms ** 2)))
    half = t_975(scenes - 1) * se
    return [mean - half, mean + half]


def interval_text(change: dict) -> str:
    """The 95% interval of a `compare_reports` result with what it is over, for a table cell:
    '95% CI [+0.100, +0.300] over 9 scenes, 144 pairs' (a t interval clustered by scene), or
    '95% CI n/a (one scene), 16 pairs'."""
    ci, scenes = change["diff_ci95"], change["scenes"]
    shown = ("95% CI n/a (one scene)" if ci is None else
             f"95% CI [{ci[0]:+.3f}, {ci[1]:+.3f}] over {scenes} scenes")
    return f"{shown}, {change['pairs']} pair{'' if change['pairs'] == 1 else 's'}"


def _cell_text(text: str) -> str:
    """`text` as one Markdown table cell: line breaks as spaces, cut to 80 characters, control
    and bidirectional characters escaped (`text.clip_line`: a scene id cannot drive the
    terminal the table is printed on), pipes escaped."""
    return clip_line(" ".join(text.splitlines()), 80).replace("|", "\\|")


def comparison_markdown(before: dict, after: dict) -> str:
    """A Markdown table of two `evaluate` reports of the same scenes: per scene and overall,
    mean reward, failure rate, mean units, reachable rate, and the reward's quality and unit
    penalty parts, before -> after; the overall row's reward is over the episode pairs
    unmasked in both (`compare_reports`), with their difference, its 95% interval (t,
    clustered by scene; "n/a (one scene)" for one) and the numbers of scenes and pairs."""
    change = compare_reports(before, after)

    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)

    def cells(b: dict, a: dict) -> list[str]:
        return [f"{f(b['reward'])} -> {f(a['reward'])}", f"{f(b['failure_rate'])} -> {f(a['failure_rate'])}",
                f"{f(b['units'], '{:.1f}')} -> {f(a['units'], '{:.1f}')}",
                f"{f(b['reachable'])} -> {f(a['reachable'])}", f"{f(b['quality'])} -> {f(a['quality'])}",
                f"{f(b['unit_penalty'], '{:.3f}')} -> {f(a['unit_penalty'], '{:.3f}')}"]

    lines = ["| scene | reward | failure rate | units | reachable | quality | unit penalty |",
             "|---|---|---|---|---|---|---|"]
    after_rows = {r["scene_id"]: r for r in after["scenes"]}
    for row in before["scenes"]:
        other = after_rows.get(row["scene_id"])
        if other is not None and "model" in row and "model" in other:
            lines.append("| " + " | ".join([_cell_text(row["scene_id"]),
                                            *cells(row["model"], other["model"])]) + " |")
    overall = cells(before["overall"]["model"], after["overall"]["model"])
    # the reward over the pairs the difference is taken on (episodes unmasked in both), so
    # before + diff = after in the cell; the other columns are each report's own
    overall[0] = (f"{f(change['reward_before'])} -> {f(change['reward_after'])} (diff "
                  f"{change['diff']:+.3f}, {interval_text(change)})")
    lines.append("| **all** | " + " | ".join(overall) + " |")
    return "\n".join(lines)


def ungraded_judge_failures(report: dict) -> str:
    """'judge_timeout x3, ...' when the report's episodes met the judge only as failures (no
    episode graded, at least one judge failure), else ''."""
    summaries = report["overall"].values()
    if any(s["quality"] is not None for s in summaries):
        return ""
    failed = Counter()
    for s in summaries:
        failed.update({k: c for k, c in s["failure_causes"].items() if k in JUDGE_FAILURES})
    return ", ".join(f"{k} x{c}" for k, c in sorted(failed.items()))


def masked_why(causes, judge_cfg: JudgeConfig) -> str:
    """What failed for the masked `causes` ('rollout_error', ...), one clause per kind present
    (scene.reward's kinds), joined by '; ' ('' for none); a judge failure's clause says what to
    check for the backend of `judge_cfg` (`scene.judge.judge_check_hint`)."""
    kinds = ((RUNTIME_FAILURES, "jscenegen's sampler or scene runtime failed, not the policy "
                                "(the log line above names the error; JSCENEGEN_DEBUG=1 adds its "
                                "traceback)"),
             (JUDGE_FAILURES, f"the judge failed ({judge_check_hint(judge_cfg)})"),
             (SETUP_FAILURES, "the prompt alone reaches sampling.max_episode_tokens"))
    return "; ".join(why for kind, why in kinds if any(c in kind for c in causes))


def masked_scene_error(cause: str | None, masked: bool, message: str, judge_info: dict, out,
                       judge_cfg: JudgeConfig) -> str | None:
    """The error line (without "error: ") of a command that played one episode and wrote its
    scene to `out` (`design`, `scene furnish`), when the episode was masked: its reward is
    then no measure of the scene (the command prints it null, design beside `"masked": true`, and exits 1).
    A judge failure (`cause` in JUDGE_FAILURES) names the judge's detail (`judge_info`) and
    what to check for its backend; another masked failure its `message` and `masked_why`.
    None for an episode that was not masked."""
    if cause in JUDGE_FAILURES:
        return (f"the judge did not grade the scene ({judge_failure_text(cause, judge_info)}); "
                f"{out} holds it ({judge_check_hint(judge_cfg)})")
    if masked:
        return (f"the episode was masked ({cause}: {clip_text(message, 300)}): "
                f"{masked_why([cause], judge_cfg)}; {out} holds the scene as it stood")
    return None


def unmeasured_model(report: dict, judge_cfg: JudgeConfig) -> str:
    """When the report has model episodes and none of them was left unmasked (its
    `overall.model.reward` is null: every one failed in our sampler or scene runtime, in the
    judge, or started at the token cap), what masked them: 'every one of the 2 model episodes
    was masked (rollout_error x2): jscenegen's sampler ...'; else ''. An evaluation that
    measured no reward of the model is a failed evaluation, whatever the expert's row holds."""
    m = report["overall"].get("model")
    if m is None or m["reward"] is not None or not m["episodes"]:
        return ""
    causes = dict(sorted(m["failure_causes"].items()))
    counted = ", ".join(f"{k} x{c}" for k, c in causes.items())
    n = m["episodes"]
    return (f"{'the one model episode was' if n == 1 else f'every one of the {n} model episodes was'} "
            f"masked ({counted}): {masked_why(causes, judge_cfg)}")
