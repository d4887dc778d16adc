"""Before/after comparison of two evaluation reports: the paired difference of mean reward per
(scene, sampling seed) with a normal-approximation 95% interval, and a Markdown table."""
from __future__ import annotations

import numpy as np


def compare_reports(before: dict, after: dict, *, z: float = 1.96) -> dict:
    """Paired change of the model's dev reward between two `evaluate` reports.

    Episodes are paired by (scene_id, seed): the same scenes and sampling seeds before and
    after (the trainer's evaluations), both unmasked. Returns {"pairs", "reward_before",
    "reward_after", "diff" (mean of after - before), "diff_ci95" [lo, hi] (normal
    approximation, mean +- z * sd / sqrt(pairs), over scenes and sampling seeds), "per_scene"
    {scene_id: diff}, "failure_rate_before", "failure_rate_after"}. Raises ValueError when no
    episode pairs up.
    """
    def episodes(report):
        return {(row["scene_id"], ep["seed"]): ep for row in report["scenes"]
                for ep in row.get("model", {}).get("episodes", [])}

    b, a = episodes(before), episodes(after)
    keys = [k for k in b if k in a and not b[k]["masked"] and not a[k]["masked"]]
    if not keys:
        raise ValueError("the reports share no unmasked (scene_id, seed) episode")
    diffs = np.array([a[k]["reward"] - b[k]["reward"] for k in keys], np.float64)
    half = z * diffs.std(ddof=1) / np.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
    per_scene: dict[str, list[float]] = {}
    for k, d in zip(keys, diffs):
        per_scene.setdefault(k[0], []).append(float(d))
    failed = lambda eps: float(np.mean([e["failure_cause"] is not None for e in eps]))  # noqa: E731
    return {"pairs": len(keys),
            "reward_before": float(np.mean([b[k]["reward"] for k in keys])),
            "reward_after": float(np.mean([a[k]["reward"] for k in keys])),
            "diff": float(diffs.mean()), "diff_ci95": [float(diffs.mean() - half), float(diffs.mean() + half)],
            "per_scene": {sid: float(np.mean(v)) for sid, v in per_scene.items()},
            "failure_rate_before": failed([b[k] for k in keys]),
            "failure_rate_after": failed([a[k] for k in keys])}


def comparison_markdown(before: dict, after: dict) -> str:
    """A Markdown table of two `evaluate` reports of the same scenes: per scene and overall,
    mean reward, failure rate, mean units, reachable rate, and the reward's quality and unit
    penalty parts, before -> after; the overall row adds the paired difference with its 95%
    interval (`compare_reports`)."""
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
            lines.append("| " + " | ".join([row["scene_id"], *cells(row["model"], other["model"])]) + " |")
    lo, hi = change["diff_ci95"]
    overall = cells(before["overall"]["model"], after["overall"]["model"])
    overall[0] += f" (diff {change['diff']:+.3f}, 95% CI [{lo:+.3f}, {hi:+.3f}], {change['pairs']} pairs)"
    lines.append("| **all** | " + " | ".join(overall) + " |")
    return "\n".join(lines)
