"""NumPy reference vs batched JAX reachability: exact agreement on 200 random scenes."""
import numpy as np
import pytest

from jscenegen.scene.catalogue import load_catalogue
from jscenegen.scene.config import MetricsConfig
from jscenegen.scene.reach_inputs import GridSpec, ReachabilityError, encode_scene
from jscenegen.scene.reachability import reach_numpy
from jscenegen.scene.schema import scene_from_json

CFG = MetricsConfig(grid_size=96)
N_OBJ = 12
CATS = sorted(load_catalogue().categories) + ["mystery_box"]


def random_scene(seed: int):
    rng = np.random.default_rng(seed)
    w, d = round(rng.uniform(2.5, 4.8), 2), round(rng.uniform(2.5, 4.8), 2)
    if rng.random() < 0.3:
        nw, nd = round(rng.uniform(0.6, w - 1.5), 2), round(rng.uniform(0.6, d - 1.5), 2)
        poly = [[0, 0], [w, 0], [w, d - nd], [w - nw, d - nd], [w - nw, d], [0, d]]
    else:
        poly = [[0, 0], [w, 0], [w, d], [0, d]]
    lengths = [float(np.hypot(*np.subtract(poly[(i + 1) % len(poly)], poly[i]))) for i in range(len(poly))]
    doors = []
    for _ in range(int(rng.integers(1, 3))):
        i = int(rng.choice([k for k, L in enumerate(lengths) if L > 1.0]))
        doors.append({"wall": i, "offset": round(rng.uniform(0.45, lengths[i] - 0.45), 2), "width": 0.8, "height": 2.1})
    objs = []
    for k in range(int(rng.integers(0, N_OBJ + 1))):
        on_cm = rng.random() < 0.5
        size = [rng.uniform(0.2, 2.2), rng.uniform(0.2, 1.5), rng.choice([0.01, rng.uniform(0.3, 2.2)])]
        pos = [rng.uniform(-0.3, w + 0.3), rng.uniform(-0.3, d + 0.3)]
        if on_cm:
            size = [round(s, 2) or 0.01 for s in size]
            pos = [round(p, 2) for p in pos]
        yaw = float(rng.choice([0, 90, 180, 270])) if rng.random() < 0.6 else float(rng.uniform(0, 360))
        mount, elev = ("wall", round(rng.uniform(0, 2.0), 2)) if rng.random() < 0.15 else ("floor", 0.0)
        objs.append({"id": f"o_{k}", "category": str(rng.choice(CATS)), "position": pos, "size": size,
                     "yaw": yaw, "mount": mount, "elevation": elev})
    return scene_from_json({"room": {"floor_polygon": poly, "wall_height": 2.6, "doors": doors}, "objects": objs})


@pytest.fixture(scope="session")
def agreement_batch():
    """200 encoded random scenes, their NumPy results and one compiled JAX call over all of them."""
    from jscenegen.scene.reachability_jax import reach_jax

    spec = GridSpec.from_config(CFG)
    cat = load_catalogue()
    inputs = [encode_scene(random_scene(s), CFG, cat, N_OBJ) for s in range(200)]
    ref = [reach_numpy(x, spec) for x in inputs]
    return inputs, ref, reach_jax(inputs, spec)


def test_numpy_and_jax_agree_exactly_on_200_random_scenes(agreement_batch):
    inputs, ref, out = agreement_batch
    for b, (x, r) in enumerate(zip(inputs, ref)):
        for key in ("floor_cells", "free_cells", "reached_cells", "num_regions", "largest_region_cells"):
            assert int(out[key][b]) == getattr(r, key), (b, key)
        np.testing.assert_array_equal(out["door_start_free"][b], r.door_start_free, err_msg=f"scene {b}")
        np.testing.assert_array_equal(out["object_reachable"][b], r.object_reachable, err_msg=f"scene {b}")


def test_random_scenes_cover_the_interesting_cases(agreement_batch):
    inputs, ref, _ = agreement_batch
    half = GridSpec.from_config(CFG).cell_mm // 2
    # footprint edges on cell centres (ties of the inside test) occur in axis-aligned 1 cm scenes
    ties = sum(int(np.any((x.corners[: len(x.object_ids)] % (2 * half)) == half)) for x in inputs)
    assert ties >= 20
    assert any(r.num_regions > 1 for r in ref) and any(r.num_regions == 1 for r in ref)
    assert any(not r.door_start_free[: int(x.door_valid.sum())].all() for x, r in zip(inputs, ref))
    assert 0 < sum(int(r.object_reachable.sum()) for r in ref) < sum(int(x.counted.sum()) for x in inputs)


def test_hard_bounds_refuse_degenerate_input():
    cat = load_catalogue()
    big = scene_from_json({"room": {"floor_polygon": [[0, 0], [30, 0], [30, 3], [0, 3]], "wall_height": 2.6}})
    with pytest.raises(ReachabilityError, match="exceeds"):
        encode_scene(big, CFG, cat, N_OBJ)
    many = random_scene(1).model_copy(update={"objects": tuple(random_scene(3).objects) * 3})
    with pytest.raises(ReachabilityError, match="objects"):
        encode_scene(many, CFG, cat, 2)
    far = scene_from_json({"room": {"floor_polygon": [[0, 0], [3, 0], [3, 3], [0, 3]], "wall_height": 2.6},
                           "objects": [{"id": "x_1", "category": "rug", "position": [900.0, 0.0],
                                        "size": [1, 1, 0.01]}]})
    with pytest.raises(ReachabilityError, match="too far"):
        encode_scene(far, CFG, cat, N_OBJ)
