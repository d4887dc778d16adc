"""bench/common.py's balanced round order, paired ratios, sitting record and JSON write (the
CPU benches' bench/train_step.py and bench/rollout.py report through them)."""
import importlib.util
import json
import os
from collections import Counter
from pathlib import Path

import pytest


def _load_bench_common():
    """bench/common.py as a module of its own name: bench/ on sys.path would shadow the
    `convert` package with bench/convert.py for every later test in the process."""
    path = Path(__file__).resolve().parents[1] / "bench" / "common.py"
    spec = importlib.util.spec_from_file_location("bench_common", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


common = _load_bench_common()


def _neighbours(orders):
    """How often each engine ran right after each other one (ordered pairs) in `orders`."""
    return Counter((o[i], o[i + 1]) for o in orders for i in range(len(o) - 1))


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7])
def test_the_order_is_balanced_for_carry_over(n):
    """A Williams design: over balanced_rounds(n) rounds (n for an even n, 2n for an odd one)
    every engine runs right after every other engine equally often, and at every place
    equally often; a rotation (each engine always after the same one) fails this."""
    names = [chr(ord("a") + k) for k in range(n)]
    period = common.balanced_rounds(n)
    assert period == (n if n % 2 == 0 else 2 * n)
    orders = [common.round_order(names, r) for r in range(period)]
    assert all(sorted(o) == names for o in orders)
    times = period * (n - 1) // (n * (n - 1))   # each of the n(n-1) ordered pairs
    assert _neighbours(orders) == {(a, b): times for a in names for b in names if a != b}
    places = Counter((o[i], i) for o in orders for i in range(n))
    assert places == {(a, i): period // n for a in names for i in range(n)}
    # periodic; for an odd n, over any even number of rounds from 0 (a sequence and its
    # mirror) each direction as often as the other
    assert [common.round_order(names, r + period) for r in range(period)] == orders
    for even in range(2, period + 1, 2) if n % 2 else ():
        pairs = _neighbours(orders[:even])
        assert all(pairs[a, b] == pairs[b, a] for a, b in pairs), even


def test_rounds_runs_the_engines_in_round_order():
    names = ["a", "b", "c"]
    calls = []
    common.rounds({n: (lambda r, n=n: calls.append((n, r))) for n in names}, 2, warmup=0)
    assert calls == [(n, r) for r in range(2) for n in common.round_order(names, r)]
    assert calls == [("a", 0), ("b", 0), ("c", 0), ("c", 1), ("b", 1), ("a", 1)]


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


def test_the_json_is_the_projects_strict_json_and_a_link_is_not_written_through(tmp_path):
    """The benches write through jscenegen.paths.write_json: a non-finite float is null
    (strict JSON, as every other file jscenegen writes), and a symbolic link at the target is
    refused, not followed."""
    path = tmp_path / "out.json"
    common.write_json(str(path), {"vs_x": float("nan"), "rounds": [1.5, float("inf")]})
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()
    assert json.loads(path.read_text()) == {"vs_x": None, "rounds": [1.5, None]}
    target = tmp_path / "elsewhere.json"
    target.write_text("{}")
    (tmp_path / "link.json").symlink_to(target)
    with pytest.raises(ValueError, match="symbolic link"):
        common.write_json(str(tmp_path / "link.json"), {"a": 1})
    assert target.read_text() == "{}"
