"""Evaluation of a policy on a scene set (issue 7 item 5), with the scripted expert as reference.

Every scene is played `samples` times with the seeds `episode_seed(scene seed, member, 0)` (the
schedule's derivation, so evaluation is repeatable and independent of batch neighbours), through
the same `RolloutEngine` the trainer uses (greedy or the configured sampling), and judged by the
configured judge. The scripted expert (`scene.expert.run_scripted_episode`) plays each scene once
(it is deterministic) and is judged by the same judge: it is the reference row of the report.

Statistics are the trainer's rollout metrics (`grpo.group_metrics.summarize`): masked episodes (judge or
infrastructure failures) are excluded from reward, units and failure rate and counted in
`masked`; policy failures (reward -1) are included.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from jscenegen.checkpoint.store import (
    HF_DIR,
    PARAMS_ITEM,
    CheckpointError,
    check_step,
    iter_arrays,
)
from jscenegen.grpo.rollout.stats import summarize
from jscenegen.grpo.rollout.engine import RolloutEngine
from jscenegen.grpo.train.schedule import episode_seed
from jscenegen.paths import atomic_file
from jscenegen.scene.config import JudgeConfig, SceneRuntimeConfig
from jscenegen.scene.expert import run_scripted_episode
from jscenegen.scene.judge import Judge
from jscenegen.scene.sceneset import SceneRecord

REPORT_SCHEMA = "jscenegen.eval/1"


# ----------------------------------------------------------------------------- loading
def is_checkpoint_dir(path: str | Path) -> bool:
    """True for a training checkpoint step directory (`params/` and `hf/config.json`)."""
    p = Path(path)
    return (p / PARAMS_ITEM).is_dir() and (p / HF_DIR / "config.json").is_file()


def model_assets_dir(path: str | Path) -> Path:
    """The directory holding config.json, tokenizer and chat template: `hf/` of a checkpoint
    step, else `path` itself (an HF model directory)."""
    p = Path(path)
    return p / HF_DIR if is_checkpoint_dir(p) else p


def load_policy(path: str | Path, mesh, *, param_dtype: str = "float32",
                compute_dtype: str = "float32", attn_impl: str = "xla"):
    """A QwenForCausalLM sharded on `mesh` from an HF directory or a checkpoint step directory.

    HF directory: `sharding.layout.load_sharded` (the trainer's path). Checkpoint step
    (`RUN/checkpoints/N/`): the step is verified against its checksums first, the model is
    built from `hf/config.json` and every parameter is read at logical shape with
    `checkpoint.iter_arrays` (one array in host memory at a time), cast to `param_dtype`,
    zero-padded on dim 0 to a multiple of the mesh size and placed in the FSDP layout.
    Raises CheckpointError for an incomplete or corrupt step or a parameter-name mismatch
    (naming the step and the names), FileNotFoundError when `path` is neither.
    """
    from jscenegen.sharding.layout import load_sharded

    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"--model {p}: no such directory")
    if not is_checkpoint_dir(p):
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"--model {p}: neither an HF model directory (config.json) "
                                    f"nor a checkpoint step directory (params/ and hf/)")
        return load_sharded(p, mesh, param_dtype=param_dtype, compute_dtype=compute_dtype,
                            attn_impl=attn_impl)
    return _load_checkpoint(p, mesh, param_dtype, compute_dtype, attn_impl)


def _load_checkpoint(step_dir: Path, mesh, param_dtype: str, compute_dtype: str, attn_impl: str):
    from flax import nnx

    from jscenegen.model.config import QwenConfig
    from jscenegen.model.hf_io import NP_DTYPES, named_params, pad_dim0, place
    from jscenegen.model.qwen import QwenForCausalLM
    from jscenegen.sharding.layout import param_sharding

    status = check_step(step_dir)
    if not status.valid:
        raise CheckpointError(f"checkpoint {step_dir} is not usable: {status.reason}")
    cfg = QwenConfig.from_dir(step_dir / HF_DIR)
    abstract = nnx.eval_shape(lambda: QwenForCausalLM(
        cfg, rngs=nnx.Rngs(0), pad_multiple=mesh.size, param_dtype=param_dtype,
        compute_dtype=compute_dtype, attn_impl=attn_impl))
    targets = named_params(abstract)
    sharding = param_sharding(mesh)
    dtype = NP_DTYPES[param_dtype]
    filled = set()
    for name, arr in iter_arrays(step_dir, "params"):
        if name not in targets:
            raise CheckpointError(f"{step_dir}: parameter {name!r} does not belong to the model "
                                  f"of {step_dir / HF_DIR / 'config.json'}")
        targets[name].set_value(place(pad_dim0(np.asarray(arr).astype(dtype), mesh.size), sharding))
        filled.add(name)
    missing = sorted(set(targets) - filled)
    if missing:
        raise CheckpointError(f"{step_dir}: params lack {missing[:3]} ({len(missing)} missing)")
    return abstract


def policy_engine(cfg, model_path: str | Path) -> RolloutEngine:
    """A RolloutEngine for `model_path` (HF directory or checkpoint step) built as the trainer
    builds its own: mesh from `cfg.mesh`, dtypes/attention from `cfg.model`, sampling from
    `cfg.sampling`, the tokenizer and chat template of the model's assets (checked to be
    prefix-preserving; ValueError names the difference otherwise)."""
    from jscenegen.model.tokenizer.chat import ChatTokenizer
    from jscenegen.sharding.mesh import make_mesh

    mesh = make_mesh(cfg.mesh.fsdp, cfg.mesh.sp)
    model = load_policy(model_path, mesh, param_dtype=cfg.model.param_dtype,
                        compute_dtype=cfg.model.compute_dtype, attn_impl=cfg.model.attention)
    chat = ChatTokenizer.from_dir(model_assets_dir(model_path), cfg.sampling.chat_template_path)
    chat.check_prefix_preserving()
    return RolloutEngine(model, chat, cfg.sampling, mesh)


# ----------------------------------------------------------------------------- statistics
def _episode_row(outcome: dict, **ids) -> dict:
    m = outcome.get("metrics") or {}
    return {**ids, "reward": outcome["reward"], "quality": outcome.get("quality"),
            "unit_penalty": outcome.get("unit_penalty"), "units": outcome["units"],
            "grades": outcome.get("grades"), "failure_cause": outcome["failure_cause"],
            "masked": outcome["masked"], "reachable": m.get("reachable") if m else None}


# ----------------------------------------------------------------------------- evaluation
def evaluate(engine: RolloutEngine | None, records: Sequence[SceneRecord], *, judge: Judge,
             scene_cfg: SceneRuntimeConfig, judge_cfg: JudgeConfig, samples: int = 1,
             scene_ids: Sequence[str] | None = None, with_expert: bool = True,
             progress: Callable[[dict], None] | None = None) -> dict:
    """Evaluate the engine's model (and the scripted expert) on `records`.

    Args:
      engine: RolloutEngine holding the policy (None: expert only).
      records: the scenes, each played with its own seed.
      samples: episodes per scene; member m uses seed `episode_seed(record.seed, m, 0)`.
      scene_ids: names for the report (default: each scene's `scene_id`, else its index).
      progress: called with each finished scene's report row.
    Returns the report dict (without file metadata): {"schema", "samples", "judge",
    "scenes": [{"scene_id", "seed", "prompt", "model": summary + "episodes", "expert":
    summary + "episodes"}], "overall": {"model": summary, "expert": summary}, "wall_s"}.
    Summaries are `summarize(...)` dicts. Raises ValueError when samples < 1 or no records.
    """
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if not records:
        raise ValueError("no scenes to evaluate")
    keys = judge_cfg.grade_keys
    t0 = time.perf_counter()
    rows, all_model, all_expert = [], [], []
    for i, record in enumerate(records):
        sid = scene_ids[i] if scene_ids else (record.scene.scene_id or f"scene-{i}")
        row = {"scene_id": sid, "seed": record.seed, "prompt": record.scene.prompt}
        if engine is not None:
            seeds = [episode_seed(record.seed, m, 0) for m in range(samples)]
            group = engine.run_group(record, group_id=i, seeds=seeds, judge=judge,
                                     scene_cfg=scene_cfg, judge_cfg=judge_cfg)
            outs = [t.outcome for t in group.trajectories]
            all_model += outs
            row["model"] = {**summarize(outs, keys), "episodes": [
                _episode_row(t.outcome, member=t.member, seed=t.seed, tokens=t.num_tokens)
                for t in group.trajectories]}
        if with_expert:
            ep, _ = run_scripted_episode(record, scene_cfg, judge_cfg, judge)
            out = ep.outcome.to_json()
            all_expert.append(out)
            row["expert"] = {**summarize([out], keys), "episodes": [_episode_row(out)]}
        rows.append(row)
        if progress is not None:
            progress(row)
    overall = {}
    if engine is not None:
        overall["model"] = summarize(all_model, keys)
    if with_expert:
        overall["expert"] = summarize(all_expert, keys)
    return {"schema": REPORT_SCHEMA, "samples": samples, "judge": judge.identity(),
            "scenes": rows, "overall": overall, "wall_s": time.perf_counter() - t0}


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


def plot_report(report: dict, out: str | Path, *, before: dict | None = None,
                labels: tuple[str, str] = ("before", "after")) -> Path:
    """Bar plot of per-scene mean reward, written atomically as PNG to `out`: the model (and the
    expert when the report has it), or with `before` (a report of the same scenes) the model
    before and after, labelled `labels`.

    Bars are in reward units ([-1, 1]); a scene whose model episodes all failed shows its
    most frequent failure cause inside the model's bar.
    """

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    rows = report["scenes"]
    x = np.arange(len(rows))
    # (label, colour, per-scene summaries); the last "model" series gets the failure labels
    if before is not None:
        by_id = {r["scene_id"]: r for r in before["scenes"]}
        series = [(labels[0], "tab:orange", [by_id[r["scene_id"]]["model"] for r in rows]),
                  (labels[1], "tab:blue", [r["model"] for r in rows])]
    else:
        series = [(name, colour, [r[name] for r in rows])
                  for name, colour in (("model", "tab:blue"), ("expert", "tab:gray"))
                  if all(name in r for r in rows)]
    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) + 2), 4))
    for k, (label, colour, summaries) in enumerate(series):
        dx = (k - (len(series) - 1) / 2) * width
        vals = [m["reward"] if m["reward"] is not None else 0.0 for m in summaries]
        ax.bar(x + dx, vals, width, label=label, color=colour)
        if label == "expert":
            continue
        for j, m in enumerate(summaries):  # a scene the model always failed: its main cause
            if m["failure_rate"] == 1.0 and m["failure_causes"]:
                cause = max(m["failure_causes"], key=m["failure_causes"].get)
                ax.text(x[j] + dx, -0.5, cause, ha="center", va="center", rotation=90,
                        fontsize=7, color="white")
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.set_ylim(-1.1, 1.3)
    ax.set_xticks(x, [r["scene_id"] for r in rows], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("mean reward")
    ax.set_title(f"dev reward per scene ({report['samples']} sample(s) per scene)")
    ax.legend(loc="upper left", ncol=len(series), fontsize=8)
    fig.tight_layout()
    try:
        with atomic_file(out, suffix=".png") as tmp:
            fig.savefig(tmp, format="png", dpi=110)
    finally:
        plt.close(fig)
    return out
