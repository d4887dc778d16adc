"""Leave-one-out reachability in one pass equals the reference run once per left-out object."""
import dataclasses

import numpy as np
import pytest

from jscenegen.scene.blockers import label_components, leave_one_out
from jscenegen.scene.catalogue import load_catalogue
from jscenegen.scene.config import MetricsConfig
from jscenegen.scene.metrics import measure
from jscenegen.scene.reach_inputs import GridSpec, encode_scene
from jscenegen.scene.reachability import _components, reach_numpy

from scene_fixtures import (
    N_RANDOM_OBJECTS,
    crowded_scene,
    enclosure,
    nightstand_gap,
    random_scene,
    stacked_scene,
    thin_mirror,
)

CFG = MetricsConfig(grid_size=96)
FIELDS = ("free_cells", "reached_cells", "num_regions", "largest_region_cells")


def descendants(inp, k):
    """k and the slots standing on it, directly or not, found by walking up from each slot."""
    out = {k}
    for i in range(len(inp.parent)):
        at, seen = int(inp.parent[i]), {i}
        while at >= 0 and at not in seen:
            if at == k:
                out.add(i)
            seen.add(at)
            at = int(inp.parent[at])
    return sorted(out)


def per_object_reference(inp, spec):
    """What the blocker search ran before: the reference once per object, that object left out
    with everything standing on it (rules revision 6: a lamp on a nightstand blocks too)."""
    out = []
    for k in range(len(inp.counted)):
        blocking, counted = inp.blocking.copy(), inp.counted.copy()
        gone = descendants(inp, k)
        blocking[gone] = counted[gone] = False
        out.append(reach_numpy(dataclasses.replace(inp, blocking=blocking, counted=counted), spec))
    return out


@pytest.fixture(scope="module")
def compared():
    """(base, one-pass, per-object reference) for 14 random scenes, the enclosure, 20 crowded
    objects and a mirror thinner than the cell pitch across the door's start cells."""
    cat = load_catalogue()
    cases = [(random_scene(s), CFG, N_RANDOM_OBJECTS) for s in range(14)]
    cases += [(enclosure(), CFG, 5), (crowded_scene(20, seed=3), MetricsConfig(), 20),
              (thin_mirror(2.0, 0.25), CFG, 2), (nightstand_gap(True), CFG, 4)]
    cases += [(stacked_scene(s), CFG, 32) for s in range(8)]   # children on parents, two levels
    out = []
    for s, cfg, slots in cases:
        spec = GridSpec.from_config(cfg)
        inp = encode_scene(s, cfg, cat, slots)
        out.append((inp, reach_numpy(inp, spec), leave_one_out(inp, spec), per_object_reference(inp, spec)))
    return out


def test_leave_one_out_equals_the_per_object_reference(compared):
    for case, (inp, _, fast, ref) in enumerate(compared):
        for k, r in enumerate(ref):
            for key in FIELDS:
                assert getattr(fast, key)[k] == getattr(r, key), (case, k, key)
            np.testing.assert_array_equal(fast.door_start_free[k], r.door_start_free, err_msg=f"{case} {k}")
            np.testing.assert_array_equal(fast.object_reachable[k], r.object_reachable, err_msg=f"{case} {k}")


def test_the_compared_scenes_cover_every_kind_of_change(compared):
    """Leaving an object out joins regions, adds a region (the enclosure), frees a door start and
    makes other objects reachable, each somewhere in the set; otherwise equality proves little."""
    seen = {"joins": 0, "adds_region": 0, "frees_door": 0, "reaches_more": 0}
    for inp, base, _, ref in compared:
        for k in np.nonzero(inp.blocking)[0]:
            r = ref[k]
            seen["joins"] += r.num_regions < base.num_regions
            seen["adds_region"] += r.num_regions > base.num_regions
            seen["frees_door"] += int(r.door_start_free.sum() > base.door_start_free.sum())
            others = base.object_reachable.sum() - base.object_reachable[k]
            seen["reaches_more"] += int(r.object_reachable.sum() > others)
    assert all(v >= 2 for k, v in seen.items() if k != "adds_region") and seen["adds_region"] >= 1, seen


@pytest.mark.parametrize("lamp", [False, True])
def test_a_parent_is_left_out_with_what_stands_on_it(lamp):
    """Since rules revision 6 a lamp on a nightstand blocks too: removing the nightstand alone
    freed nothing, so neither was a blocker (['wardrobe_1'] with the lamp). Leaving out the
    nightstand leaves out its lamp, as moving or removing it in the scene would."""
    m = measure(nightstand_gap(lamp), blockers=True)
    assert m["num_regions"] == 2 and not m["reachable"]
    assert m["blockers"] == ["nightstand_1", "wardrobe_1"]
    cat = load_catalogue()
    inp = encode_scene(nightstand_gap(lamp), CFG, cat, 4)
    spec = GridSpec.from_config(CFG)
    fast, base = leave_one_out(inp, spec), reach_numpy(inp, spec)
    assert fast.num_regions[1] == 1 < base.num_regions   # without the nightstand (and its lamp)
    if lamp:
        assert fast.num_regions[2] == base.num_regions   # without the lamp alone: still cut off


def test_stacked_scenes_join_regions_through_a_group(compared):
    """The stacked scenes are worth comparing: somewhere a parent left out with its children
    changes reachability while the parent's own cells were covered by a child too."""
    changed = 0
    for inp, base, _, ref in compared:
        for k in np.nonzero(inp.blocking)[0]:
            kids = [i for i in range(len(inp.parent)) if inp.parent[i] == k and inp.blocking[i]]
            if kids and (ref[k].num_regions != base.num_regions
                         or ref[k].reached_cells != base.reached_cells):
                changed += 1
    assert changed >= 3, changed


def test_enclosure_blockers():
    m = measure(enclosure(), blockers=True)
    # the door reaches the ring outside the benches, not the dresser inside; its front faces
    # bench_4, so removing bench_3 behind it reaches nothing new
    assert m["num_regions"] == 1 and m["unreachable_objects"] == ["dresser_1"]
    assert m["blockers"] == ["bench_1", "bench_2", "bench_4"]


@pytest.mark.parametrize("seed", range(6))
def test_labels_partition_like_scipy_labelling(seed):
    rng = np.random.default_rng(seed)
    mask = rng.random((37, 53)) < 0.55
    labels, count = label_components(mask.astype(np.int8))
    ref = _components(mask)
    assert count == ref.max()
    # the same partition: a one-to-one map between label values over the masked cells
    pairs = set(zip(labels[mask].tolist(), ref[mask].tolist()))
    assert len(pairs) == count and (labels[~mask] == -1).all()
    # neighbours join exactly when their keys are equal (a path never changes key)
    keys = np.where(mask, rng.integers(1, 3, mask.shape), 0)
    lab, _ = label_components(keys)
    for a, b, ka, kb in ((lab[:, :-1], lab[:, 1:], keys[:, :-1], keys[:, 1:]), (lab[:-1], lab[1:], keys[:-1], keys[1:])):
        both = (ka > 0) & (kb > 0)
        assert ((a == b)[both] == (ka == kb)[both]).all()
