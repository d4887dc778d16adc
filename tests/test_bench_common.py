"""bench/common.py's round rotation, paired ratios, sitting record and atomic JSON write (the
CPU benches' bench/train_step.py and bench/rollout.py report through them)."""
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import common  # noqa: E402


def test_each_round_starts_at_the_next_engine():
    names = ["a", "b", "c"]
    assert [common.round_order(names, r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    calls = []
    common.rounds({n: (lambda r, n=n: calls.append((n, r))) for n in names}, 2, warmup=0)
    assert calls == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1)]


def test_paired_ratios_are_per_round_with_their_range_and_the_ratio_of_medians():
    ours = {"wall_s": [1.0, 2.0, 1.0], "cpu_s": [2.0, 2.0, 2.0]}
    other = {"wall_s": [3.0, 2.0, 1.5], "cpu_s": [4.0, 6.0, 8.0]}
    out = common.paired("vs_x", ours, other)
    assert out["vs_x"] == 1.5 and out["vs_x_min"] == 1.0 and out["vs_x_max"] == 3.0
    assert out["vs_x_rounds"] == [3.0, 1.0, 1.5]
    assert out["vs_x_of_medians"] == 2.0 / 1.0
    assert out["cpu_vs_x"] == 3.0
    assert common.paired("vs_y", ours, None) == {"vs_y": "not installed"}


def test_the_sitting_record_and_the_atomic_json(tmp_path):
    rec = common.sitting_end(common.sitting_start())
    for key in ("commit", "dirty", "cpu_model", "cpu_count", "cores_usable", "utc_start",
                "utc_end", "load_before", "load_after"):
        assert key in rec, key
    assert rec["utc_start"].endswith("Z") and len(rec["load_before"]) == 3
    path = tmp_path / "out.json"
    common.write_json(str(path), {"a": 1})
    common.write_json(str(path), rec)
    assert json.loads(path.read_text()) == rec
    assert os.listdir(tmp_path) == ["out.json"]   # no temporary file left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "out.json"
    common.write_json(str(path), {"a": 1})
    with pytest.raises(TypeError):
        common.write_json(str(path), {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1} and os.listdir(tmp_path) == ["out.json"]
