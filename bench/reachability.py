"""Reachability throughput: batched JAX kernel (jit + vmap, batch 256) vs the NumPy reference.

Both run in this process on the same 256 scenes: the 100 train rooms (cycled) furnished with
5-20 random objects each (random categories, sizes, poses; seeded). The JAX figure excludes the
one-off compile (printed separately) and is the median of --reps timed calls on the default
devices; the NumPy figure the median of --reps timed passes after an untimed one. Prints
scenes/s for each and, last, a JSON line with "ratio" = JAX / NumPy scenes/s.

    python bench/reachability.py [--batch 256] [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from common import description, positive_int_arg, timed


def furnished_scenes(n: int, seed: int = 0):
    from jscenegen.scene.catalogue import load_catalogue
    from jscenegen.scene.geometry import point_in_polygon
    from jscenegen.scene.sceneset import read_scene_set
    from jscenegen.scene.schema import SceneObject

    records = read_scene_set(Path(__file__).resolve().parents[1] / "data" / "scenes" / "train.jsonl")
    cat = load_catalogue()
    names = sorted(c for c in cat.categories if "floor" in cat.categories[c].mounts)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        scene = records[i % len(records)].scene
        poly = np.asarray(scene.room.floor_polygon)
        objs = []
        while len(objs) < int(rng.integers(5, 21)):
            name = str(rng.choice(names))
            size = cat.categories[name].default_size
            x, y = rng.uniform(poly.min(0), poly.max(0))
            if not point_in_polygon(x, y, scene.room.floor_polygon):
                continue
            yaw = float(rng.choice([0, 90, 180, 270])) if rng.random() < 0.7 else float(rng.uniform(0, 360))
            objs.append(SceneObject(id=f"{name}_{len(objs) + 1}", category=name, position=(round(x, 2), round(y, 2)),
                                    size=size, yaw=yaw))
        out.append(scene.model_copy(update={"objects": tuple(objs)}))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--batch", type=positive_int_arg, default=256)
    ap.add_argument("--reps", type=positive_int_arg, default=3)
    args = ap.parse_args()

    import jax

    from jscenegen.scene.catalogue import load_catalogue
    from jscenegen.scene.config import SceneRuntimeConfig
    from jscenegen.scene.reach_inputs import GridSpec, encode_scene
    from jscenegen.scene.reachability import reach_numpy
    from jscenegen.scene.reachability_jax import batched_reach_fn, stack_inputs

    cfg = SceneRuntimeConfig()
    spec = GridSpec.from_config(cfg.metrics)
    cat = load_catalogue()
    scenes = furnished_scenes(args.batch)
    inputs = [encode_scene(s, cfg.metrics, cat, cfg.max_objects) for s in scenes]
    print(f"devices: {jax.devices()}; grid {spec.grid_size}x{spec.grid_size} cells of {spec.cell_mm} mm, "
          f"{cfg.max_objects} object slots, batch {args.batch}")

    ref = [reach_numpy(x, spec) for x in inputs]   # also the untimed warm-up
    numpy_s = timed(lambda: [reach_numpy(x, spec) for x in inputs], warmup=0, repeats=args.reps)
    numpy_rate = args.batch / numpy_s
    print(f"numpy reference: {numpy_rate:.1f} scenes/s "
          f"(median of {args.reps}: {numpy_s:.2f} s for {args.batch})")

    fn = batched_reach_fn(spec)
    batch = {k: jax.device_put(v) for k, v in stack_inputs(inputs).items()}
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(**batch))
    print(f"jax compile + first call: {time.perf_counter() - t0:.2f} s")
    jax_s = timed(lambda: jax.block_until_ready(fn(**batch)), warmup=0, repeats=args.reps)
    jax_rate = args.batch / jax_s
    agree = all(
        int(out["reached_cells"][b]) == r.reached_cells and int(out["num_regions"][b]) == r.num_regions
        and np.array_equal(np.asarray(out["object_reachable"][b]), r.object_reachable)
        for b, r in enumerate(ref)
    )
    print(f"jax batched: {jax_rate:.1f} scenes/s (median of {args.reps}: {jax_s:.3f} s); agrees with numpy: {agree}")
    print(json.dumps({"ratio": round(jax_rate / numpy_rate, 3), "jax_scenes_per_s": round(jax_rate, 1),
                      "numpy_scenes_per_s": round(numpy_rate, 1), "batch": args.batch, "agree": agree,
                      "backend": jax.default_backend()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
