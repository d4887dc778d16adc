"""bench/common.py's balanced round order, paired ratios, sitting record and JSON write (the
CPU benches' bench/train_step.py and bench/rollout.py report through them)."""
import importlib.util
import json
import os
import re
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


def test_the_sitting_record_and_the_atomic_json(tmp_path, monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    rec = common.sitting_end(common.sitting_start())
    for key in ("commit", "dirty", "cpu_model", "cpu_count", "cores_usable", "utc_start",
                "utc_end", "load_before", "load_after"):
        assert key in rec, key
    assert rec["environment"]["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert "LD_PRELOAD" not in rec["environment"]
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


def _load_bench(name, monkeypatch):
    """bench/<name>.py as a module of its own name, its `from common import ...` answered by
    this file's bench/common.py (no bench/ on sys.path: see `_load_bench_common`)."""
    import sys

    monkeypatch.setitem(sys.modules, "common", common)
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Clock:
    """A stand-in for bench/common.py's `time`: every reading one second after the last (the
    benches' ratios then divide no zero, and nothing depends on how fast this host is)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1.0
        return self.now

    perf_counter = process_time = property(lambda self: self)


def _engine(calls, name):
    """A fake engine that logs (name, round) when run (warm-ups have a negative round)."""
    return lambda r: calls.append((name, r))


def _timed_order(calls, n_rounds):
    """The engine order of each round, as the fake engines were called (warm-ups left out)."""
    return [[n for n, r in calls if r == k] for k in range(n_rounds)]


def test_the_train_step_json_records_each_rounds_engine_order(tmp_path, monkeypatch):
    """bench/train_step.py's --json-out holds `round_orders` and `forward_round_orders`: the
    engine order of each round, as the engines ran (fake engines log their calls)."""
    import sys

    bench = _load_bench("train_step", monkeypatch)
    monkeypatch.setattr(common, "time", _Clock())
    steps, forwards = [], []
    monkeypatch.setattr(bench, "build", lambda tmp: None)
    monkeypatch.setattr(bench, "jax_engine", lambda tmp, batch: (
        _engine(steps, "jscenegen"), _engine(steps, "jscenegen (all logits)"),
        _engine(forwards, "jscenegen")))
    monkeypatch.setattr(bench, "torch_engine", lambda tmp, batch, tuned: (
        _engine(steps, f"torch ({'tuned' if tuned else 'untuned'})"),
        _engine(forwards, f"torch ({'tuned' if tuned else 'untuned'})")))
    monkeypatch.setattr(bench, "tunix_engine", lambda *a: _engine(steps, "tunix"))
    out = tmp_path / "train_step.json"
    monkeypatch.setattr(sys, "argv", ["train_step.py", "--rounds", "4", "--json-out", str(out)])
    bench.main()
    got = json.loads(out.read_text())
    names = ["jscenegen", "jscenegen (all logits)", "torch (untuned)", "torch (tuned)"]
    if importlib.util.find_spec("tunix") is not None:
        names.append("tunix")
    assert got["round_orders"] == _timed_order(steps, 4) == common.round_orders(names, 4)
    assert got["forward_round_orders"] == _timed_order(forwards, 4) == [
        ["jscenegen", "torch (untuned)", "torch (tuned)"],
        ["torch (tuned)", "torch (untuned)", "jscenegen"],
        ["torch (untuned)", "torch (tuned)", "jscenegen"],
        ["jscenegen", "torch (tuned)", "torch (untuned)"]]


def _run_rollout_bench(tmp_path, monkeypatch, n_rounds, reshard_s):
    """bench/rollout.py's main with fake engines that log their calls, the mesh subprocess run
    in this process (on the test session's six CPU devices); `reshard_s`: {layout: the
    seconds of each of its sampler's reshards, in turn}. Returns (its --json-out, the
    one-device calls, the mesh layouts' generate calls, what it printed)."""
    import contextlib
    import io
    import sys
    import types

    import jscenegen.model.hf_io as hf_io

    bench = _load_bench("rollout", monkeypatch)
    monkeypatch.setattr(common, "time", _Clock())
    single, mesh = [], []

    class FakeSampler:
        """Its n-th reshard (the build's is the first; then `set_weights`) takes
        `reshard_s[layout][n]` seconds."""

        def __init__(self, layout):
            self.layout = types.SimpleNamespace(describe=lambda: f"{layout} (fake)")
            self.seconds = iter(reshard_s[layout])
            self.reshard_stats = self.set_weights(model=None)

        def set_weights(self, model):
            self.reshard_stats = {"reshard_s": next(self.seconds), "reshard_bytes": 1000}
            return dict(self.reshard_stats)

    def jscenegen_engine(model, prompts, new, mesh_=None, layout="auto", cache_len=None):
        if mesh_ is not None:
            return _engine(mesh, layout), FakeSampler(layout)
        return _engine(single, "jscenegen" if cache_len is None else "jscenegen_fixed_cache"), None

    def run_mesh_subprocess(argv, **kw):
        assert argv[2:4] == ["--mesh-only", "--rounds"]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            print("MESH " + json.dumps(bench.mesh_layouts(int(argv[4]))))
        return types.SimpleNamespace(returncode=0, stdout=out.getvalue(), stderr="")

    monkeypatch.setattr(bench, "build", lambda tmp, preset="tiny": types.SimpleNamespace(cfg=None))
    monkeypatch.setattr(bench, "jscenegen_engine", jscenegen_engine)
    monkeypatch.setattr(bench, "transformers_engine", lambda tmp, prompts: _engine(single, "transformers"))
    monkeypatch.setattr(bench, "tunix_engine", lambda *a: _engine(single, "tunix"))
    monkeypatch.setattr(bench, "decode_step_bytes", lambda model: 1 << 20)
    monkeypatch.setitem(sys.modules, "weight_stream", types.SimpleNamespace(
        stream_loop=lambda nbytes, steps: (lambda: single.append(("memory floor", None)), nbytes)))
    monkeypatch.setattr(bench, "subprocess", types.SimpleNamespace(run=run_mesh_subprocess))
    monkeypatch.setattr(hf_io, "load_hf", lambda path, mesh=None: None)
    out = tmp_path / "rollout.json"
    monkeypatch.setattr(sys, "argv", ["rollout.py", "--rounds", str(n_rounds), "--json-out", str(out)])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        bench.main()
    return json.loads(out.read_text()), single, mesh, printed.getvalue()


def test_the_rollout_json_records_each_rounds_engine_order(tmp_path, monkeypatch):
    """bench/rollout.py's --json-out holds `round_orders` (the one-device rounds) and
    `mesh_round_orders` (the mesh subprocess's): each round's engine order, as the engines ran."""
    got, single, mesh, _ = _run_rollout_bench(
        tmp_path, monkeypatch, 3, {layout: [0.0] * 5 for layout in ("fsdp", "replicated", "tp")})
    names = ["jscenegen", "jscenegen_fixed_cache", "transformers"]
    if importlib.util.find_spec("tunix") is not None:
        names.append("tunix")
    names.append("memory floor")
    # the memory floor is called without the round: the calls by slices (one warm-up each first)
    ran = [[n for n, _ in single[k * len(names):(k + 1) * len(names)]] for k in range(1, 4)]
    assert got["round_orders"] == ran == common.round_orders(names, 3)
    layouts = ["fsdp", "replicated", "tp"]
    mesh_names = layouts + [f"{layout} reshard" for layout in layouts]
    assert got["mesh_round_orders"] == common.round_orders(mesh_names, 3)
    assert [[n for n in order if n in layouts] for order in got["mesh_round_orders"]] == (
        _timed_order(mesh, 3)) == [["fsdp", "replicated", "tp"], ["replicated", "tp", "fsdp"],
                                   ["tp", "replicated", "fsdp"]]


def test_the_rollout_json_and_summary_give_each_layouts_reshard_seconds(tmp_path, monkeypatch):
    """Beside `replicated_vs_fsdp`, bench/rollout.py reports each mesh layout's reshard as the
    sampler measured it (`reshard_s`): one per round (not the build's, not the warm-up's),
    their median as `mesh_<layout>_reshard_s`, in the JSON and the printed summary."""
    seconds = {"fsdp": [0.0] * 5,          # the build's, the warm-up's, then rounds 0-2
               "replicated": [9.0, 8.0, 0.3, 0.1, 0.2], "tp": [9.0, 8.0, 0.05, 0.07, 0.04]}
    got, _, _, printed = _run_rollout_bench(tmp_path, monkeypatch, 3, seconds)
    assert {k: v for k, v in got.items() if "reshard" in k} == {
        "mesh_fsdp_reshard_s": 0.0, "mesh_fsdp_reshard_s_rounds": [0.0, 0.0, 0.0],
        "mesh_replicated_reshard_s": 0.2, "mesh_replicated_reshard_s_rounds": [0.3, 0.1, 0.2],
        "mesh_tp_reshard_s": 0.05, "mesh_tp_reshard_s_rounds": [0.05, 0.07, 0.04],
        "mesh_fsdp_reshard_bytes": 1000, "mesh_replicated_reshard_bytes": 1000,
        "mesh_tp_reshard_bytes": 1000}
    assert ("reshard after each train step fsdp 0.0000 s, replicated 0.2000 s, tp 0.0500 s "
            "(median of the rounds)") in printed
    assert re.search(r"^  replicated reshard +0\.2000 s \(median.* rounds \[0\.3, 0\.1, 0\.2\]$",
                     printed, re.M)
