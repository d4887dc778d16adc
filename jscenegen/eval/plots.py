"""Plots of evaluation reports (matplotlib, Agg backend, written atomically as PNG)."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from jscenegen.paths import atomic_file
from jscenegen.scene.reward import POLICY_FAILURES
from jscenegen.text import clip_text

log = logging.getLogger(__name__)

MAX_BARS = 60
"""Scenes a plot shows (the report's first ones): the figure grows with them (0.9 inch each)."""
MAX_LABEL_CHARS = 40
"""Characters of a scene id a plot shows (`text.clip_text`): a report's ids have no bound, and
matplotlib's time grows with a label's length (3 minutes for a 2,000,000-character id)."""


def plot_report(report: dict, out: str | Path, *, before: dict | None = None,
                labels: tuple[str, str] = ("before", "after")) -> Path:
    """Bar plot of per-scene mean reward, written atomically as PNG to `out`: the model (and the
    expert when the report has it), or with `before` (a report of the same scenes) the model
    before and after, labelled `labels`.

    Bars are in reward units ([-1, 1]); a scene whose model episodes all failed shows its
    most frequent failure cause inside the model's bar (each of the before and after bars;
    `main_failure_cause`); one whose episodes were all masked has no bar and says "masked".
    The report's first MAX_BARS scenes are drawn (the title says so when there are more);
    scene ids are shown as plain text (matplotlib would read `$...$` as math), cut to
    MAX_LABEL_CHARS characters.
    """

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    rows = report["scenes"][:MAX_BARS]
    x = np.arange(len(rows))
    # (label, colour, per-scene summaries); every series but the expert's (the model, or the
    # model before and after) gets the failure labels
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
        vals = [m["reward"] if m["reward"] is not None else np.nan for m in summaries]
        ax.bar(x + dx, vals, width, label=label, color=colour)
        if label == "expert":
            continue
        for j, m in enumerate(summaries):
            cause = "masked" if m["reward"] is None else main_failure_cause(m)
            if cause is not None:
                ax.text(x[j] + dx, -0.5, cause, ha="center", va="center", rotation=90, fontsize=7,
                        color="black" if m["reward"] is None else "white", parse_math=False)
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.set_ylim(-1.1, 1.3)
    ax.set_xticks(x, [clip_text(r["scene_id"], MAX_LABEL_CHARS) for r in rows], rotation=30,
                  ha="right", fontsize=7, parse_math=False)
    ax.set_ylabel("mean reward")
    shown = (f", the first {len(rows)} of {len(report['scenes'])} scenes"
             if len(report["scenes"]) > len(rows) else "")
    ax.set_title(f"reward per scene ({report['samples']} sample(s) per scene{shown})")
    ax.legend(loc="upper left", ncol=len(series), fontsize=8)
    fig.tight_layout()
    try:
        with atomic_file(out, suffix=".png") as tmp:
            fig.savefig(tmp, format="png", dpi=110)
    finally:
        plt.close(fig)
    return out


def plot_or_warn(report: dict, out: str | Path, **kwargs) -> bool:
    """`plot_report`, for a run that must go on without its plot: an error is logged as a
    warning naming `out` (`discard_plot`) and False returned. A stop signal is no Exception
    and still ends the run."""
    try:
        plot_report(report, out, **kwargs)
    except Exception as err:   # matplotlib's many errors
        log.warning("plot %s not drawn (%s)", out, discard_plot(out, err))
        return False
    return True


def discard_plot(out: str | Path, err: Exception) -> str:
    """After `plot_report` raised `err`: an earlier plot at `out` removed (it would pass for
    this report's); returns the error in one clipped line ("TypeName: message")."""
    out = Path(out)
    if out.is_file():
        out.unlink()
    return f"{type(err).__name__}: {clip_text(str(err), 300)}"


def main_failure_cause(summary: dict) -> str | None:
    """The label of a scene whose every unmasked episode failed (`failure_rate` 1.0, a bar at
    the failure reward): the policy failure (`scene.reward.POLICY_FAILURES`) the most of them
    had. `failure_causes` also counts masked judge/runtime failures, which the bar does not
    show; None when the scene did not always fail."""
    causes = {c: n for c, n in (summary.get("failure_causes") or {}).items() if c in POLICY_FAILURES}
    if summary.get("failure_rate") != 1.0 or not causes:
        return None
    return max(causes, key=causes.get)
