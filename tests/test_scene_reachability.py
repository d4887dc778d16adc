"""NumPy reference vs batched JAX reachability: exact agreement on 200 random scenes and objects beyond the walls."""
import numpy as np
import pytest

from jscenegen.scene.catalogue import load_catalogue
from jscenegen.scene.config import MetricsConfig
from jscenegen.scene.reach_inputs import GridSpec, ReachabilityError, encode_scene
from jscenegen.scene.reachability import footprint_mask, reach_numpy
from jscenegen.scene.schema import scene_from_json

from scene_fixtures import N_RANDOM_OBJECTS as N_OBJ
from scene_fixtures import random_scene, thin_mirror

CFG = MetricsConfig(grid_size=96)
# thin mirrors (x, y, yaw) and whether the door reaches them: in open space wherever a row of
# cell centres falls, across the door's start cells (blocking the door: nothing is reached), and
# just beyond the +x wall (its centre cell is off the grid: no footprint, never reached)
THIN = [((2.3, y, 0.0), True) for y in (1.5, 1.525, 1.545, 1.55)] + [
    ((2.3, 1.5, 90.0), True), ((2.31, 1.52, 33.0), True), ((2.0, 0.25, 0.0), False), ((4.03, 1.5, 90.0), False)]


@pytest.fixture(scope="session")
def agreement_batch():
    """200 encoded random scenes, their NumPy results and one compiled JAX call over all of them."""
    from jscenegen.scene.reachability_jax import reach_jax

    spec = GridSpec.from_config(CFG)
    cat = load_catalogue()
    scenes = ([random_scene(s) for s in range(200)] + [thin_mirror(*where) for where, _ in THIN]
              + [_beyond_the_walls(side) for side in ("+x", "+y")])
    inputs = [encode_scene(s, CFG, cat, N_OBJ) for s in scenes]
    ref = [reach_numpy(x, spec) for x in inputs]
    return inputs, ref, reach_jax(inputs, spec)


def _beyond_the_walls(side: str):
    """A 4 x 3 m room with a nightstand just beyond its `side` wall, within an agent's reach of
    the floor: the reference cuts it off its nx x ny grid (unreachable); the padded JAX grid
    must do the same."""
    pos = [4.25, 1.5] if side == "+x" else [2.0, 3.25]
    room = {"floor_polygon": [[0, 0], [4, 0], [4, 3], [0, 3]], "wall_height": 2.6,
            "doors": [{"wall": 0, "offset": 1.0, "width": 0.8, "height": 2.1}]}
    obj = {"id": "o_0", "category": "nightstand", "position": pos, "size": [0.45, 0.4, 0.55],
           "yaw": 0.0, "mount": "floor", "elevation": 0.0}
    return scene_from_json({"room": room, "objects": [obj]})


def test_numpy_and_jax_agree_exactly_on_random_and_beyond_wall_scenes(agreement_batch):
    inputs, ref, out = agreement_batch
    for b, (x, r) in enumerate(zip(inputs, ref)):
        for key in ("floor_cells", "free_cells", "reached_cells", "num_regions", "largest_region_cells"):
            assert int(out[key][b]) == getattr(r, key), (b, key)
        np.testing.assert_array_equal(out["door_start_free"][b], r.door_start_free, err_msg=f"scene {b}")
        np.testing.assert_array_equal(out["object_reachable"][b], r.object_reachable, err_msg=f"scene {b}")


@pytest.mark.slow   # a 31-cell ring over 30 scenes, both kernels: ~10 s on 2 cores
def test_numpy_and_jax_agree_at_the_widest_ring_the_config_allows():
    """An access ring of 31 cells (`scene.config.MAX_RING_CELLS`: the packed kernel's shifts
    stay within one 32-bit word; at 39 cells 1 of 30 random scenes disagreed, helper-173)."""
    from jscenegen.scene.config import MAX_RING_CELLS
    from jscenegen.scene.reachability_jax import reach_jax

    cfg = MetricsConfig(grid_size=96, access_margin_m=(MAX_RING_CELLS + 0.5) * 0.05 - 0.15)
    spec = GridSpec.from_config(cfg)
    assert spec.ring_mm // spec.cell_mm == MAX_RING_CELLS
    cat = load_catalogue()
    inputs = [encode_scene(random_scene(s), cfg, cat, N_OBJ) for s in range(30)]
    out = reach_jax(inputs, spec)
    for b, x in enumerate(inputs):
        r = reach_numpy(x, spec)
        np.testing.assert_array_equal(out["object_reachable"][b], r.object_reachable, err_msg=f"scene {b}")
        assert int(out["reached_cells"][b]) == r.reached_cells, b


def test_random_scenes_cover_the_interesting_cases(agreement_batch):
    inputs, ref, _ = agreement_batch
    half = GridSpec.from_config(CFG).cell_mm // 2
    # footprint edges on cell centres (ties of the inside test) occur in axis-aligned 1 cm scenes
    ties = sum(int(np.any((x.corners[: len(x.object_ids)] % (2 * half)) == half)) for x in inputs)
    assert ties >= 20
    assert any(r.num_regions > 1 for r in ref) and any(r.num_regions == 1 for r in ref)
    assert any(not r.door_start_free[: int(x.door_valid.sum())].all() for x, r in zip(inputs, ref))
    assert 0 < sum(int(r.object_reachable.sum()) for r in ref) < sum(int(x.counted.sum()) for x in inputs)
    for x, r in zip(inputs[-2:], ref[-2:]):   # the two objects beyond the +x / +y walls
        assert x.counted[0] and not r.object_reachable[0]
    for (where, reached), r in zip(THIN, ref[200:]):   # thin mirrors block and are reached
        assert r.object_reachable[0] == reached, where
        assert r.door_start_free[0] == (where != (2.0, 0.25, 0.0)), where


def test_a_box_holding_no_cell_centre_is_the_cell_holding_its_centre():
    """A 3 cm mirror between two rows of cell centres is one cell, the one holding its centre
    (a centre on a cell boundary goes to the cell above / right of it); wherever a row of
    centres crosses it, it is those cells."""
    spec = GridSpec.from_config(CFG)

    def cells(x, y, yaw=0.0):
        inp = encode_scene(thin_mirror(x, y, yaw), CFG, load_catalogue(), 1)
        return np.argwhere(footprint_mask(inp.corners[0], inp.centres[0], inp.nx, inp.ny, spec.cell_mm)).tolist()

    assert cells(2.3, 1.5) == [[30, 46]]       # centre (2300, 1500) mm: on a corner of four cells
    assert cells(2.3, 1.545) == [[30, 46]]
    assert cells(2.29, 1.55) == [[31, 45]]
    assert cells(2.3, 1.525) == [[30, ix] for ix in range(42, 50)]   # centres 2125..2475 mm
    assert cells(4.03, 1.5, 90.0) == []        # beyond the x = 4 m wall: off the 80-cell grid


def test_hard_bounds_refuse_degenerate_input():
    cat = load_catalogue()
    door = [{"wall": 0, "offset": 1.0, "width": 0.9, "height": 2.1}]
    big = scene_from_json({"room": {"floor_polygon": [[0, 0], [30, 0], [30, 3], [0, 3]], "wall_height": 2.6,
                                    "doors": door}})
    with pytest.raises(ReachabilityError, match="exceeds"):
        encode_scene(big, CFG, cat, N_OBJ)
    many = random_scene(1).model_copy(update={"objects": tuple(random_scene(3).objects) * 3})
    with pytest.raises(ReachabilityError, match="objects"):
        encode_scene(many, CFG, cat, 2)
    far = scene_from_json({"room": {"floor_polygon": [[0, 0], [3, 0], [3, 3], [0, 3]], "wall_height": 2.6,
                                    "doors": door},
                           "objects": [{"id": "x_1", "category": "rug", "position": [900.0, 0.0],
                                        "size": [1, 1, 0.01]}]})
    with pytest.raises(ReachabilityError, match=r"object x_1: a corner lies 900\.\d m from the room's grid origin; the measuring grid's 32-bit arithmetic reaches [\d.]+ m"):
        encode_scene(far, CFG, cat, N_OBJ)
