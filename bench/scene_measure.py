"""Measuring a scene: time vs object count up to the cap, refusal time beyond it, and the
one-pass leave-one-out blocker search against the per-object flood fills it replaced.

For each object count, two seeded scenes in a 6.0 x 5.0 m room with two doors: "furniture"
(random catalogue categories at their default sizes, random poses: the crowded scenes of the
issue's probes) and "small" (0.1-0.5 m boxes, many separate regions and pockets). Per scene:
`measure(scene, blockers=True)` wall time (median of --reps), the blocker pass alone
(blockers.leave_one_out) and the old per-object pass (reach_numpy once per blocking object, that
object left out) in the same process, their ratio, and whether both find the same blockers.
Then refusals: 129 objects in memory, a 39 MB file of 200k objects (the probe), a file just
under the read bound (4 MiB) packed with objects, and a 100k-deep nested file. Optionally
(--jax) the same leave-one-out batched through the JAX kernel (one scene per left-out object),
and (--cli) `jscenegen scene check` end to end. Last line: one JSON object.

    python bench/scene_measure.py [--counts 10,50,100,128] [--reps 3] [--old-max 128] [--jax] [--cli]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import description, int_in, positive_int_arg, timed

ROOT = Path(__file__).resolve().parents[1]
W, D = 6.0, 5.0


def room() -> dict:
    return {"type": "bedroom", "floor_polygon": [[0, 0], [W, 0], [W, D], [0, D]], "wall_height": 2.6,
            "doors": [{"wall": 0, "offset": 1.0, "width": 0.9, "height": 2.1},
                      {"wall": 2, "offset": 3.0, "width": 0.9, "height": 2.1}]}


def scene_json(kind: str, n: int, seed: int) -> dict:
    from jscenegen.scene.catalogue import load_catalogue

    cat = load_catalogue()
    names = sorted(c for c in cat.categories if "floor" in cat.categories[c].mounts)
    rng = np.random.default_rng(seed)
    objs = []
    for k in range(n):
        name = str(rng.choice(names))
        if kind == "furniture":
            size = list(cat.categories[name].default_size)
        else:
            size = [round(float(rng.uniform(0.1, 0.5)), 2), round(float(rng.uniform(0.1, 0.5)), 2),
                    round(float(rng.uniform(0.3, 2.0)), 2)]
        yaw = float(rng.choice([0, 90, 180, 270])) if rng.random() < 0.7 else round(float(rng.uniform(0, 360)), 1)
        objs.append({"id": f"{name}_{k + 1}", "category": name, "size": size, "yaw": yaw,
                     "position": [round(float(rng.uniform(0.1, W - 0.1)), 2), round(float(rng.uniform(0.1, D - 0.1)), 2)]})
    return {"room": room(), "objects": objs}


def blockers_from(inp, res, rows, n_doors: int) -> list[str]:
    """The blocker rule of metrics._reach_block over per-object results rows[k] (k left out)."""
    from jscenegen.scene.blockers import left_out

    counted = [i for i in range(len(inp.object_ids)) if inp.counted[i]]
    group = left_out(inp)
    found = []
    for k in range(len(inp.object_ids)):
        if not inp.blocking[k]:
            continue
        others = [i for i in counted if not group[k, i]]
        regions, reach, doors = rows(k)
        if (regions < res.num_regions or reach[others].sum() > res.object_reachable[others].sum()
                or doors[:n_doors].sum() > res.door_start_free[:n_doors].sum()):
            found.append(inp.object_ids[k])
    return sorted(found)


def old_pass(inp, spec):
    """The per-object path this replaced: the reference once per blocking object, left out
    with what stands on it (blockers.left_out)."""
    from jscenegen.scene.blockers import left_out
    from jscenegen.scene.reachability import reach_numpy

    out = {}
    group = left_out(inp)
    for k in range(len(inp.object_ids)):
        if inp.blocking[k]:
            blocking, counted = inp.blocking.copy(), inp.counted.copy()
            blocking[group[k]] = counted[group[k]] = False
            out[k] = reach_numpy(dataclasses.replace(inp, blocking=blocking, counted=counted), spec)
    return out


def refusal_s(fn) -> tuple[float, str]:
    t0 = time.perf_counter()
    try:
        fn()
    except ValueError as err:  # SceneError and ReachabilityError
        return time.perf_counter() - t0, str(err).splitlines()[0]
    raise AssertionError("not refused")


def _counts(text: str) -> list[int]:
    """argparse type of --counts: comma-separated object counts, each 1..128."""
    try:
        counts = [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated integers") from None
    if not counts or not all(1 <= n <= 128 for n in counts):
        raise argparse.ArgumentTypeError(f"{text}: each count must be in 1..128")
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--counts", type=_counts, default="10,50,100,128",
                    help="object counts, comma-separated, each 1..128")
    ap.add_argument("--reps", type=positive_int_arg, default=3)
    ap.add_argument("--old-max", type=int_in(0), default=128,
                    help="largest count to run the old per-object pass on")
    ap.add_argument("--jax", action="store_true", help="also batch the leave-one-out through the JAX kernel")
    ap.add_argument("--cli", action="store_true", help="also time `jscenegen scene check` end to end")
    args = ap.parse_args()

    from jscenegen.scene.blockers import leave_one_out
    from jscenegen.scene.catalogue import load_catalogue
    from jscenegen.scene.config import SceneRuntimeConfig
    from jscenegen.scene.metrics import measure
    from jscenegen.scene.reach_inputs import GridSpec, encode_scene
    from jscenegen.scene.reachability import reach_numpy
    from jscenegen.scene.schema import MAX_JSON_FILE_BYTES, MAX_SCENE_OBJECTS, load_scene, scene_from_json

    cfg = SceneRuntimeConfig()
    spec = GridSpec.from_config(cfg.metrics)
    cat = load_catalogue()
    rows, agree = [], True
    print(f"measure(scene, blockers=True); cap {MAX_SCENE_OBJECTS} objects; median of {args.reps}")
    print(f"{'kind':>9} {'objects':>7} {'measure s':>9} {'blocker pass s':>14} {'old pass s':>10} {'ratio':>7}  same")
    for n in args.counts:
        for kind in ("furniture", "small"):
            scene = scene_from_json(scene_json(kind, n, seed=n), f"{kind}_{n}")
            total = timed(lambda: measure(scene, cfg, cat, blockers=True), warmup=0, repeats=args.reps)
            inp = encode_scene(scene, cfg.metrics, cat, n)
            res = reach_numpy(inp, spec)
            new_s = timed(lambda: leave_one_out(inp, spec), warmup=0, repeats=args.reps)
            loo = leave_one_out(inp, spec)
            nd = len(scene.room.doors)
            new_blockers = blockers_from(inp, res, lambda k: (loo.num_regions[k], loo.object_reachable[k],
                                                              loo.door_start_free[k]), nd)
            row = {"kind": kind, "objects": n, "measure_s": round(total, 4), "blocker_pass_s": round(new_s, 4),
                   "blockers": len(new_blockers)}
            if n <= args.old_max:
                old = old_pass(inp, spec)
                old_s = timed(lambda: old_pass(inp, spec), warmup=0, repeats=args.reps)
                old_blockers = blockers_from(inp, res, lambda k: (old[k].num_regions, old[k].object_reachable,
                                                                  old[k].door_start_free), nd)
                same = old_blockers == new_blockers
                agree &= same
                row.update(old_pass_s=round(old_s, 3), ratio=round(old_s / new_s, 1), same=same)
            rows.append(row)
            print(f"{kind:>9} {n:>7} {total:>9.3f} {new_s:>14.4f} {row.get('old_pass_s', float('nan')):>10.3f} "
                  f"{row.get('ratio', float('nan')):>7.1f}  {row.get('same', '-')}")

    refusals = {}
    big = scene_from_json(scene_json("furniture", MAX_SCENE_OBJECTS, seed=1), "cap")
    over = big.model_copy(update={"objects": big.objects + big.objects[:1]})
    refusals["measure_129_objects_s"], msg = refusal_s(lambda: measure(over, cfg, cat, blockers=True))
    print(f"refused in {refusals['measure_129_objects_s'] * 1e3:.2f} ms: {msg}")
    with tempfile.TemporaryDirectory() as tmp:
        huge = Path(tmp) / "huge.json"
        probe = scene_json("small", 200_000, seed=2)
        for o in probe["objects"]:  # about the probe's 39 MB
            o["description"] = "a small object placed at random by the stress test, nothing else"
        huge.write_text(json.dumps(probe))
        mb = huge.stat().st_size / 1e6
        refusals["file_200k_objects_s"], msg = refusal_s(lambda: load_scene(huge))
        print(f"{mb:.0f} MB file, 200k objects: refused in {refusals['file_200k_objects_s'] * 1e3:.2f} ms: {msg}")
        packed = Path(tmp) / "packed.json"
        one = {"id": "x", "category": "plant", "position": [1, 1], "size": [1, 1, 1]}
        count = (MAX_JSON_FILE_BYTES - 300) // (len(json.dumps(one)) + 2)
        packed.write_text(json.dumps({"room": room(), "objects": [one] * count}))
        refusals["file_at_read_bound_s"], msg = refusal_s(lambda: load_scene(packed))
        print(f"{packed.stat().st_size / 1e6:.1f} MB file, {count} objects: refused in "
              f"{refusals['file_at_read_bound_s'] * 1e3:.0f} ms: {msg}")
        deep = Path(tmp) / "deep.json"
        deep.write_text("[" * 100_000 + "]" * 100_000)
        refusals["nested_100k_s"], msg = refusal_s(lambda: load_scene(deep))
        print(f"100k-deep nesting: refused in {refusals['nested_100k_s'] * 1e3:.1f} ms: {msg}")
        cli = {}
        if args.cli:
            capped = Path(tmp) / "cap.json"
            capped.write_text(json.dumps(big.to_json()))
            for name, path in (("cli_cap_scene_s", capped), ("cli_39mb_file_s", huge)):
                t0 = time.perf_counter()
                p = subprocess.run([sys.executable, "-m", "jscenegen.cli", "scene", "check", str(path)],
                                   capture_output=True, text=True, cwd=ROOT)
                cli[name] = round(time.perf_counter() - t0, 3)
                print(f"jscenegen scene check {path.name}: exit {p.returncode} in {cli[name]:.2f} s "
                      "(Python start-up and command imports included)")

    jax_row = {}
    if args.jax:
        import jax

        from jscenegen.scene.reachability_jax import batched_reach_fn, stack_inputs

        n = 40  # the runtime's object cap: the most objects an episode's scene holds
        scene = scene_from_json(scene_json("small", n, seed=n), "jax")
        inp = encode_scene(scene, cfg.metrics, cat, n)
        variants = []
        for k in range(n):
            blocking, counted = inp.blocking.copy(), inp.counted.copy()
            blocking[k] = counted[k] = False
            variants.append(dataclasses.replace(inp, blocking=blocking, counted=counted))
        fn = batched_reach_fn(spec)
        batch = {k: jax.device_put(v) for k, v in stack_inputs(variants).items()}
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(**batch))
        compile_s = time.perf_counter() - t0
        jax_s = timed(lambda: jax.block_until_ready(fn(**batch)), warmup=0, repeats=args.reps)
        new_s = timed(lambda: leave_one_out(inp, spec), warmup=0, repeats=args.reps)
        loo = leave_one_out(inp, spec)
        same = bool(np.array_equal(np.asarray(out["num_regions"]), loo.num_regions)
                    and np.array_equal(np.asarray(out["object_reachable"]), loo.object_reachable))
        jax_row = {"objects": n, "jax_batched_s": round(jax_s, 4), "jax_compile_s": round(compile_s, 2),
                   "numpy_one_pass_s": round(new_s, 4), "same": same, "backend": jax.default_backend()}
        print(f"leave-one-out at {n} objects: JAX kernel, {n} scenes batched, {jax_s:.3f} s "
              f"(compile {compile_s:.1f} s, {jax.default_backend()}); NumPy one pass {new_s:.4f} s; same: {same}")

    largest = max(r["objects"] for r in rows)
    at_largest = [r["ratio"] for r in rows if r["objects"] == largest and "ratio" in r]
    print(json.dumps({
        "cap_objects": MAX_SCENE_OBJECTS,
        "max_measure_s": max(r["measure_s"] for r in rows),
        "max_refusal_s": round(max(refusals.values()), 4),
        "largest_count": largest,
        "min_ratio_at_largest": min(at_largest) if at_largest else None,
        "same_blockers": agree,
        "rows": rows, "refusals": {k: round(v, 4) for k, v in refusals.items()}, **cli,
        **({"jax": jax_row} if jax_row else {}),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
