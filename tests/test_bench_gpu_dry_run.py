"""bench/gpu's CPU dry run (`bench_gpu.py --tiny`): the GPU benchmark's own code paths (a bf16
GRPO step with remat, the sampler's decode, the torch and Tunix engines where installed) run on
CPU and report their figures, so the script a GPU session runs first is known to work."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_bench_dry_run_reports_every_engine():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "bench_gpu.py"), "--tiny"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    engines = {x["engine"]: x for x in lines if "engine" in x}
    ours = engines["jscenegen"]
    assert "error" not in ours, ours.get("error")
    assert ours["train_loss_finite"] is True and ours["train_step_s"] > 0
    # the full and the capacity pass agree to bf16 rounding of the hidden states (2e-3 on this
    # CPU); a trained token's log-prob taken from a wrong position would be off by the spread
    # of a random model's log-probs (~1)
    assert ours["train_step_capacity_s"] > 0 and ours["train_logprob_mean_abs"] > 1
    assert ours["train_capacity_logprob_max_abs_diff"] < 2e-2 and ours["train_capacity_logprobs_ok"]
    assert ours["decode_tokens_per_s"] > 0
    assert ours["decode_step_cosines"] == 1   # the RoPE table once per step, as on a GPU
    summary = lines[-1]
    assert summary["bench"] == "gpu" and summary["tiny"] is True
    assert summary["jscenegen_decode_tokens_per_s"] == pytest.approx(ours["decode_tokens_per_s"])
    assert "error" not in engines["torch"] and summary["decode_ratio"] is not None


def test_the_decode_probe_dry_run_times_and_summarises_a_trace(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "decode_probe.py"), "--tiny",
                           "--rows", "2", "3", "--new", "8", "--prompt", "16", "--repeats", "1",
                           "--label", "dry", "--trace", str(tmp_path / "trace")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    timed = [x for x in lines if "ms_per_step" in x]
    assert [x["rows"] for x in timed] == [2, 3] and all(x["label"] == "dry" for x in timed)
    for x in timed:   # two separate timings: no order between them is asserted (load moves them)
        assert x["prefill_s"] > 0 and x["decode_s"] > 0
        assert x["ms_per_step"] == pytest.approx(1e3 * (x["decode_s"] - x["prefill_s"]) / 8)
        assert x["tokens_per_s"] == pytest.approx(x["rows"] * 8 / x["decode_s"])
    traced = [x for x in lines if "busy_us" in x]
    assert traced and all(x["rows"] == 2 and x["events"] > 0 for x in traced)
    kernels = {name for x in traced for name, _count, _us in x["top"]}
    assert any("while" in name for name in kernels), sorted(kernels)[:20]
