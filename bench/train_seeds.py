"""The CPU default over several run seeds: does GRPO improve the dev reward over the SFT warm start?

Runs `jscenegen train [--config C] schedule.seed=S` for each seed in one cache (the SFT warm
start is made once and shared: `schedule.seed` changes the rollouts' sampling only), reads each
run's `eval_change.json` (the paired before/after difference over the dev scenes x sampling
seeds) and prints, per seed, the difference with its 95% interval, then the mean of the
per-seed differences with a Student-t interval over the seeds (what one run on a new machine
should expect, the spread between runs included).

Prints every figure and, last, one JSON line. Not a test: it takes ~20-30 minutes per seed on 2
idle cores.

    python bench/train_seeds.py --seeds 0 1 2 --out /tmp/seeds
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import description

from jscenegen.commands import seed_arg
from jscenegen.eval.report import t_975


def run_seed(seed: int, out: Path, config: str | None, overrides: list[str]) -> dict:
    run_dir = out / f"seed-{seed}"
    cmd = [sys.executable, "-m", "jscenegen.cli", "train", "--run-dir", str(run_dir),
           f"schedule.seed={seed}", "trainer.progress=false", *overrides]
    if config:
        cmd[4:4] = ["--config", config]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    change = json.loads((run_dir / "eval_change.json").read_text())
    return {"seed": seed, "wall_s": round(wall, 1), "phases": summary.get("phases", {}),
            "reward_before": change["reward_before"], "reward_after": change["reward_after"],
            "diff": change["diff"], "diff_ci95": change["diff_ci95"], "pairs": change["pairs"],
            "scenes": change["scenes"],
            "failure_rate_before": change["failure_rate_before"],
            "failure_rate_after": change["failure_rate_after"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument("--seeds", type=seed_arg, nargs="+", default=[0, 1, 2],
                        help="run seeds, each once (default: 0 1 2)")
    parser.add_argument("--out", default="runs/seeds", help="run directories and the cache")
    parser.add_argument("--config", default=None, help="run config (default: the CPU default)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = parser.parse_args()
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds: each seed once (a seed's run directory is seed-<N>), got {args.seeds}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("JSCENEGEN_CACHE", str(out / "cache"))
    load0 = os.getloadavg()[0]
    rows = []
    for seed in args.seeds:
        row = run_seed(seed, out, args.config, args.overrides)
        rows.append(row)
        ci = row["diff_ci95"]   # t over the scenes, clustered by scene; none for one scene
        shown = f"[{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "[n/a (one scene)]"
        print(f"seed {seed}: dev reward {row['reward_before']:+.3f} -> {row['reward_after']:+.3f}, "
              f"diff {row['diff']:+.3f} {shown} ({row['scenes']} scenes, {row['pairs']} pairs), failure rate {row['failure_rate_before']:.2f} -> "
              f"{row['failure_rate_after']:.2f}, {row['wall_s']:.0f} s", flush=True)
    diffs = [r["diff"] for r in rows]
    mean = statistics.fmean(diffs)
    ci95 = None   # one seed has no spread: no interval (null in the JSON)
    if len(diffs) > 1:
        half = t_975(len(diffs) - 1) * statistics.stdev(diffs) / len(diffs) ** 0.5
        ci95 = [mean - half, mean + half]
    shown = f"[{ci95[0]:+.3f}, {ci95[1]:+.3f}]" if ci95 else "none (one seed)"
    print(f"over {len(diffs)} seeds: mean diff {mean:+.3f}, 95% t interval {shown}; load average "
          f"{load0:.1f} -> {os.getloadavg()[0]:.1f}")
    print(json.dumps({"bench": "train_seeds", "seeds": rows, "mean_diff": mean,
                      "mean_diff_ci95": ci95,
                      "load_avg_1min": [load0, os.getloadavg()[0]]}))


if __name__ == "__main__":
    main()
