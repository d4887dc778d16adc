"""Known-answer scenes for collisions, bounds, openings and reachability; rotation/shift invariance."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jscenegen.scene.catalogue import load_catalogue
from jscenegen.scene.judge_rule import rule_grades
from jscenegen.scene.metrics import measure
from jscenegen.scene.schema import scene_from_json

from scene_fixtures import KNOWN, obj, random_scene, scene, thin_mirror, transform

EMPTY_WALKABLE = (74 * 54) / (80 * 60)  # floor eroded by 3 cells on each side of an 80 x 60 cell room


def m(name):
    return measure(KNOWN[name](), blockers=True)


def test_empty_room():
    r = m("empty")
    assert r["reachable"] and not r["door_blocked"]
    assert r["num_regions"] == 1
    assert r["reachable_object_ratio"] == 1.0 and r["door_connected_ratio"] == 1.0
    assert r["largest_region_ratio"] == 1.0
    assert r["walkable_ratio"] == pytest.approx(EMPTY_WALKABLE, abs=1e-6)


def test_wardrobe_across_door_blocks_everything():
    r = m("wardrobe_door")
    assert r["door_blocked"] and r["door_walk_blocked"] == [0]
    assert r["door_clearance_blocked"] == [[0, "wardrobe_1"]]
    assert not r["reachable"]
    assert r["reachable_object_ratio"] == 0.0 and r["door_connected_ratio"] == 0.0
    assert r["unreachable_objects"] == ["wardrobe_1"] and r["blockers"] == ["wardrobe_1"]


def test_bed_and_wardrobe_split_the_room():
    r = m("split")
    assert r["num_regions"] == 2 and not r["reachable"]
    assert r["unreachable_objects"] == ["nightstand_1", "wardrobe_1"]
    assert r["reachable_object_ratio"] == pytest.approx(1 / 3)
    assert 0.3 < r["door_connected_ratio"] < 0.6
    assert set(r["blockers"]) >= {"queen_bed_1", "wardrobe_1"}
    assert r["collision_pairs"] == []


def test_gap_040_passes_and_025_blocks():
    wide, narrow = m("gap_040"), m("gap_025")
    assert wide["num_regions"] == 1 and wide["reachable"]
    assert narrow["num_regions"] == 2 and not narrow["reachable"]
    assert narrow["door_connected_ratio"] == pytest.approx(22 / 36, abs=0.01)  # 22 free rows below, 14 above


@pytest.mark.parametrize("name", ["rug", "shelf"])
def test_rug_and_high_shelf_block_nothing(name):
    r, empty = m(name), m("empty")
    for key in ("walkable_ratio", "num_regions", "reachable", "door_connected_ratio", "reachable_object_ratio"):
        assert r[key] == empty[key], key
    assert r["collision_pairs"] == [] and r["unreachable_objects"] == []


@pytest.mark.parametrize("y", [1.5, 1.525, 1.545, 1.55])
def test_a_mirror_thinner_than_the_cell_pitch_is_reachable_wherever_it_stands(y):
    """A 3 cm mirror whose box holds no cell centre is the cell holding its centre: it is reached
    and blocks that cell's agent disk (29 cells) wherever it stands, not only where a row of
    centres crosses it (y = 1.525: 8 cells, 78 blocked)."""
    r = measure(thin_mirror(2.3, y))
    assert r["unreachable_objects"] == [] and r["reachable_object_ratio"] == 1.0 and r["reachable"]
    blocked = 78 if y == 1.525 else 29
    assert r["walkable_ratio"] == pytest.approx((74 * 54 - blocked) / (80 * 60), abs=1e-6)


def test_a_thin_mirror_across_the_door_start_blocks_the_door():
    r = measure(thin_mirror(2.0, 0.25), blockers=True)   # door start (2.0, 0.2); box y 0.235..0.265 m
    assert r["door_walk_blocked"] == [0] and r["door_connected_ratio"] == 0.0
    assert r["unreachable_objects"] == ["standing_mirror_1"] and r["blockers"] == ["standing_mirror_1"]


def test_wardrobe_facing_the_wall_is_unreachable():
    wall, room = m("wardrobe_wall"), m("wardrobe_room")
    assert wall["unreachable_objects"] == ["wardrobe_1"] and wall["front_to_wall_objects"] == ["wardrobe_1"]
    assert room["unreachable_objects"] == [] and room["reachable"] and room["front_to_wall_objects"] == []
    grades = rule_grades(KNOWN["wardrobe_wall"](), [], wall, load_catalogue())
    assert grades["functionality"] <= 3


@pytest.mark.parametrize("gap,faces", [(0.26, True), (0.29, True), (0.31, False)])
def test_a_front_faces_a_wall_until_the_agent_fits_in_front(gap, faces):
    """The probe is 2 x agent_radius_m (0.30 m): at a 0.26 m gap the wardrobe's front ring still
    reaches free cells beside it, so only this flag says its front faces the wall."""
    s = scene([obj("wardrobe_1", "wardrobe", 2.0, 3.0 - gap - 0.3, 1.2, 0.6, 2.0)])
    r = measure(s)
    assert r["front_to_wall_objects"] == r["storage_front_to_wall_objects"] == (["wardrobe_1"] if faces else [])
    assert rule_grades(s, [], r, load_catalogue())["functionality"] == (3 if faces else 10)


@pytest.mark.parametrize("yaw", [0, 90, 180, 270])
def test_a_front_exactly_two_agent_radii_from_any_wall_does_not_face_it(yaw):
    """The probe lands on the wall line: floor, whichever wall (the crossing test counted only
    two walls' lines as inside)."""
    front = {0: (2.0, 3.0 - 0.3 - 0.3), 90: (0.3 + 0.3, 1.5), 180: (2.0, 0.3 + 0.3), 270: (4.0 - 0.3 - 0.3, 1.5)}
    x, y = front[yaw]     # a 0.6 m deep wardrobe whose front is 0.30 m from the wall it faces
    r = measure(scene([obj("wardrobe_1", "wardrobe", x, y, 1.2, 0.6, 2.0, yaw=yaw)]))
    assert r["front_to_wall_objects"] == []


def test_the_functionality_cap_is_for_storage_fronts_only():
    """A desk facing a wall costs 3 functionality points; the cap at 3 is a storage front's."""
    s = scene([obj("desk_1", "desk", 2.0, 2.5, 1.2, 0.6, 0.75)])   # front 0.2 m from the top wall
    r = measure(s)
    assert r["front_to_wall_objects"] == ["desk_1"] and r["storage_front_to_wall_objects"] == []
    assert rule_grades(s, [], r, load_catalogue())["functionality"] == 7


@pytest.mark.parametrize("mount,elevation,blocked", [("wall", 1.2, False), ("floor", 0.0, True)])
def test_only_floor_objects_block_a_door_clearance_box(mount, elevation, blocked):
    """A shelf hung at 1.2 m beside the door (0.15 m into its 0.8 m box) blocks walking under
    it, but the door's clearance box is kept free of floor objects only."""
    s = scene([obj("wall_shelf_1", "wall_shelf", 2.7, 0.15, 0.8, 0.3, 0.3, mount=mount, elevation=elevation)])
    r = measure(s)
    assert r["door_clearance_blocked"] == ([[0, "wall_shelf_1"]] if blocked else [])
    assert r["door_blocked"] is blocked and r["door_walk_blocked"] == []


def test_collisions_need_vertical_overlap_and_skip_parents_and_rugs():
    s = scene([
        obj("nightstand_1", "nightstand", 1.0, 1.0, 0.45, 0.4, 0.55),
        obj("table_lamp_1", "table_lamp", 1.0, 1.0, 0.3, 0.3, 0.45, mount="on", elevation=0.55, parent="nightstand_1"),
        obj("rug_1", "rug", 1.0, 1.0, 2.0, 1.4, 0.01),
        obj("dresser_1", "dresser", 1.3, 1.0, 1.2, 0.5, 0.8),  # overlaps the nightstand by 0.225 m
        obj("wall_shelf_1", "wall_shelf", 1.0, 1.0, 0.8, 0.25, 0.3, mount="wall", elevation=1.6),
        obj("chair_1", "chair", 3.0, 2.0, 0.5, 0.5, 0.9),
        obj("chair_2", "chair", 3.495, 2.0, 0.5, 0.5, 0.9),  # 5 mm penetration: below the 1 cm threshold
    ])
    r = measure(s)
    # the lamp sits on the nightstand (parent: excluded) but reaches into the dresser's height
    assert r["collision_pairs"] == [["dresser_1", "nightstand_1"], ["dresser_1", "table_lamp_1"]]
    # the lamp stands on its nightstand's top; the shelf hangs in mid-room, off every wall
    assert r["unsupported_objects"] == ["wall_shelf_1"]


def test_a_thin_object_inside_another_footprint_collides():
    """Spec section 4, penetration >= 1 cm: the depth along an axis is the distance one box must
    move to separate (min(a1 - b0, b1 - a0)), not the projections' overlap, so a 5 mm thick
    board standing inside a bed's footprint (overlap 5 mm on y) is 0.5 m deep and collides."""
    from jscenegen.scene.geometry import box_corners, penetration

    bed = box_corners(2.0, 1.5, 1.0, 1.0, 0.0)            # x in [1.5, 2.5], y in [1.0, 2.0]
    board = box_corners(2.0, 1.5, 0.5, 0.005, 0.0)         # x in [1.75, 2.25], y in [1.4975, 1.5025]
    assert penetration(bed, board) == pytest.approx(0.5025)  # y: min(2.5 - 1.4975, 1.5025 - 1.5)
    s = scene([
        obj("double_bed_1", "double_bed", 2.0, 1.5, 1.0, 1.0, 0.6),
        obj("standing_mirror_1", "standing_mirror", 2.0, 1.5, 0.5, 0.005, 0.5),
    ])
    assert measure(s)["collision_pairs"] == [["double_bed_1", "standing_mirror_1"]]


@pytest.mark.parametrize("dx, dy, yaw, expected", [
    (0.49, 0.0, 0.0, 0.01),       # 1 cm overlap on x: a partial overlap is its projections' overlap
    (0.491, 0.0, 0.0, 0.009),
    (0.3, 0.2, 0.0, 0.2),         # overlap 0.2 on x, 0.3 on y
    (0.5, 0.0, 0.0, 0.0),         # touching
    (0.6, 0.0, 0.0, -0.1),        # separated: minus the gap
    (0.58, 0.0, 45.0, 0.02355339059327373),  # a corner 45 degrees into the box
])
def test_partial_overlap_depth_is_the_projections_overlap(dx, dy, yaw, expected):
    from jscenegen.scene.geometry import box_corners, penetration

    a = box_corners(2.0, 2.0, 0.5, 0.5, 0.0)
    b = box_corners(2.0 + dx, 2.0 + dy, 0.5, 0.5, yaw)
    assert penetration(a, b) == pytest.approx(expected, abs=1e-12)
    assert penetration(b, a) == pytest.approx(expected, abs=1e-12)


def test_supported_objects_sit_on_their_parent():
    s = scene([
        obj("nightstand_1", "nightstand", 1.0, 1.0, 0.45, 0.4, 0.55),
        obj("table_lamp_1", "table_lamp", 1.0, 1.0, 0.3, 0.3, 0.45, mount="on", elevation=0.55, parent="nightstand_1"),
        obj("table_lamp_2", "table_lamp", 1.5, 1.0, 0.3, 0.3, 0.45, mount="on", elevation=0.55, parent="nightstand_1"),
        obj("table_lamp_3", "table_lamp", 1.0, 1.0, 0.3, 0.3, 0.45, mount="on", elevation=0.60, parent="nightstand_1"),
    ])
    assert measure(s)["unsupported_objects"] == ["table_lamp_2", "table_lamp_3"]


def _art(oid, x, y, yaw=0.0, elevation=1.2):
    return obj(oid, "wall_art", x, y, 0.8, 0.03, 0.6, yaw=yaw, mount="wall", elevation=elevation)


@pytest.mark.parametrize("x, y, yaw, unsupported", [
    (1.0, 0.015, 0.0, False),     # back face (local -y) on wall 0 (y = 0)
    (1.0, 0.065, 0.0, False),     # back face 5 cm off the wall: mount_gap_m, still held
    (1.0, 0.075, 0.0, True),      # 6 cm off
    (2.0, 1.5, 0.0, True),        # in mid-room at 1.2 m (audit F1)
    (3.985, 1.5, 90.0, False),    # facing -x, back face on wall 1 (x = 4)
    (3.5, 1.5, 90.0, True),
    (2.0, 0.4, 90.0, True),       # 0.8 m wide, sticking straight out of wall 0: one corner on it
    (2.0, 0.42, 90.0, True),      # ... its near corner 2 cm off the wall
    (0.015, 1.5, 270.0, False),   # facing +x, back face on wall 3 (x = 0)
    (0.4, 0.015, 0.0, False),     # on wall 0 in the corner: its left corner on wall 3 too
])
def test_a_wall_mount_is_unsupported_off_every_wall(x, y, yaw, unsupported):
    """Spec section 1 (front = local +y): a wall-mounted object whose back face does not lie
    along one wall (both its corners within metrics.mount_gap_m, 0.05 m, of the same wall of
    the floor polygon) hangs in the air; only `on` objects were checked. A back face at right
    angles to a wall, touching it with one corner, is not held by it."""
    r = measure(scene([_art("wall_art_1", x, y, yaw)]))
    assert r["unsupported_objects"] == (["wall_art_1"] if unsupported else [])


def test_point_to_segment_distances_known_values():
    """geometry.py has one point-to-segment distance (`point_segment_distance`), which
    `segment_distance`, `point_on_polygon` and `segment_off_walls` call; these values held
    before the three copies were merged and hold after."""
    from jscenegen.scene.geometry import point_on_polygon, point_segment_distance, segment_distance

    a, b = np.array([0.0, 0.0]), np.array([4.0, 0.0])
    assert point_segment_distance([1.0, 0.5], a, b) == 0.5          # projects inside
    assert point_segment_distance([7.0, 4.0], a, b) == 5.0          # beyond the end b: 3-4-5
    assert point_segment_distance([3.0, 4.0], a, a) == 5.0          # a zero-length segment
    assert segment_distance(np.array([1.0, -1.0]), np.array([1.0, 1.0]), a, b) == 0.0   # crossing
    assert segment_distance(np.array([5.0, 3.0]), np.array([5.0, 1.0]), a, b) == pytest.approx(2 ** 0.5)
    poly = [[0, 0], [4, 0], [4, 3], [0, 3]]
    assert point_on_polygon(4.0000005, 1.0, poly) and point_on_polygon(2.0, 3.0, poly)
    assert not point_on_polygon(4.000002, 1.0, poly)


def _shelf(x, y, yaw=0.0):
    return obj("wall_shelf_1", "wall_shelf", x, y, 1.0, 0.25, 0.3, yaw=yaw, mount="wall", elevation=1.6)


def _room_scene(polygon, objects, door_wall=0):
    return scene_from_json({"room": {
        "type": "bedroom", "floor_polygon": polygon, "wall_height": 2.6,
        "doors": [{"wall": door_wall, "offset": 1.0, "width": 0.9, "height": 2.1}], "windows": []},
        "objects": list(objects)})


def test_a_wall_mount_across_a_vertex_of_a_straight_wall_is_supported():
    """Rules revision 8: collinear consecutive floor edges are one wall for a wall mount's
    support (geometry.straight_walls). A 4 m x 3 m room whose bottom wall has an extra vertex
    at (2, 0): a 1 m shelf flush along y = 0 (back face at y = 0.01) across x = 2 lies along
    that wall; revision 7 measured each edge alone, saw the far corner 0.5 m past its end and
    listed the shelf unsupported. The stored polygon keeps its five edges (a door on edge 1
    stays on the right half of the wall)."""
    from jscenegen.scene.geometry import opening_centre, segment_off_walls

    split = [[0, 0], [2, 0], [4, 0], [4, 3], [0, 3]]
    assert segment_off_walls(np.array([1.5, 0.01]), np.array([2.5, 0.01]), split) == pytest.approx(0.01)
    s = _room_scene(split, [_shelf(2.0, 0.135)], door_wall=1)
    assert measure(s)["unsupported_objects"] == []
    assert len(s.room.floor_polygon) == 5
    assert opening_centre(s.room, s.room.doors[0])[0].tolist() == [3.0, 0.0]
    assert measure(_room_scene(split, [_shelf(2.0, 0.2)]))["unsupported_objects"] == ["wall_shelf_1"]  # 7.5 cm off


@pytest.mark.parametrize("x, y, yaw, unsupported", [
    (0.135, 2.0, 270.0, False),   # facing +x on the left wall, across its extra vertex at (0, 2)
    (3.0, 1.865, 180.0, False),   # facing -y under the inner wall y = 2 (x 2..4)
    (1.9, 1.865, 180.0, True),    # ... 0.6 m of its back face past the reflex corner (2, 2), over the floor
    (2.135, 3.0, 270.0, False),   # facing +x on the inner wall x = 2 (y 2..4)
    (2.135, 1.9, 270.0, True),    # ... 0.6 m of its back face below that wall's end (2, 2)
])
def test_a_wall_mount_in_an_l_shaped_room(x, y, yaw, unsupported):
    """An L-shaped floor (a reflex corner at (2, 2); the left wall split at (0, 2)): a back face
    along one wall is held, across a straight wall's vertex too; one reaching past a wall's end
    at the reflex corner is not."""
    ell = [[0, 0], [4, 0], [4, 2], [2, 2], [2, 4], [0, 4], [0, 2]]
    r = measure(_room_scene(ell, [_shelf(x, y, yaw)]))
    assert r["unsupported_objects"] == (["wall_shelf_1"] if unsupported else [])


def test_the_mount_gap_is_a_setting():
    from jscenegen.scene.config import SceneRuntimeConfig

    s = scene([_art("wall_art_1", 1.0, 0.075)])                     # 6 cm off wall 0
    assert measure(s)["unsupported_objects"] == ["wall_art_1"]
    assert measure(s, SceneRuntimeConfig(metrics={"mount_gap_m": 0.1}))["unsupported_objects"] == []


def test_an_object_on_a_parent_without_a_top_is_unsupported():
    """A plant stood on a picture frame was measured as supported: only its centre over the
    frame's footprint and its base at the frame's top were checked. The catalogue's
    `top_surfaces` names the categories that carry what stands on them."""
    s = scene([
        _art("wall_art_1", 1.0, 0.015),
        obj("plant_1", "plant", 1.0, 0.015, 0.4, 0.4, 0.5, mount="on", elevation=1.8, parent="wall_art_1"),
        obj("nightstand_1", "nightstand", 3.0, 2.0, 0.45, 0.4, 0.55),
        obj("plant_2", "plant", 3.0, 2.0, 0.3, 0.3, 0.5, mount="on", elevation=0.55, parent="nightstand_1"),
        obj("rug_1", "rug", 2.0, 2.0, 2.0, 1.4, 0.01),
        obj("plant_3", "plant", 1.5, 2.0, 0.3, 0.3, 0.5, mount="on", elevation=0.01, parent="rug_1"),
    ])
    assert measure(s)["unsupported_objects"] == ["plant_1"]


def test_a_catalogue_without_top_surfaces_checks_no_parent_category(tmp_path):
    import json
    from importlib import resources

    doc = json.loads(resources.files("jscenegen.scene").joinpath("data/catalogue.json").read_text())
    del doc["top_surfaces"]
    path = tmp_path / "catalogue.json"
    path.write_text(json.dumps(doc))
    s = scene([
        _art("wall_art_1", 1.0, 0.015),
        obj("plant_1", "plant", 1.0, 0.015, 0.4, 0.4, 0.5, mount="on", elevation=1.8, parent="wall_art_1"),
    ])
    assert load_catalogue(str(path)).top_surfaces is None
    assert measure(s, catalogue=load_catalogue(str(path)))["unsupported_objects"] == []
    assert measure(s)["unsupported_objects"] == ["plant_1"]


def test_a_ceiling_mount_is_unsupported_below_the_ceiling():
    """A scene file cannot hold one (schema: its top is at wall_height within 1e-5 m), so the
    scene is built around validation here: 10 cm below the ceiling is more than mount_gap_m."""
    s = scene([obj("ceiling_light_1", "ceiling_light", 2.0, 1.5, 0.5, 0.5, 0.2, mount="ceiling", elevation=2.4)])
    assert measure(s)["unsupported_objects"] == []
    low = s.objects[0].model_copy(update={"elevation": 2.3})
    assert measure(s.model_copy(update={"objects": (low,)}))["unsupported_objects"] == ["ceiling_light_1"]


def test_unsupported_objects_are_read_by_no_rule_grade_and_add_no_metric():
    """The rule judge's grades are the spec's (section 5) and read no unsupported object: the
    picture in mid-room and the plant on it grade as the same scene with nothing listed; the
    metrics keep their keys (the policy's metrics text keeps its lines)."""
    s = scene([
        obj("double_bed_1", "double_bed", 1.0, 1.5, 1.37, 1.91, 1.0),
        _art("wall_art_1", 2.6, 1.7),
        obj("plant_1", "plant", 2.6, 1.7, 0.4, 0.4, 0.5, mount="on", elevation=1.8, parent="wall_art_1"),
    ])
    r = measure(s)
    assert r["unsupported_objects"] == ["plant_1", "wall_art_1"]
    cat = load_catalogue()
    assert rule_grades(s, [], r, cat) == rule_grades(s, [], {**r, "unsupported_objects": []}, cat)
    assert list(r) == [
        "object_count", "collision_pairs", "oob_objects", "oob_cap_objects", "door_blocked",
        "door_clearance_blocked", "window_warnings", "unsupported_objects", "reachable_object_ratio",
        "door_connected_ratio", "num_regions", "largest_region_ratio", "walkable_ratio",
        "unreachable_objects", "door_walk_blocked", "front_to_wall_objects",
        "storage_front_to_wall_objects", "storage_off_wall_objects", "size_out_of_range_objects",
        "chairs_not_at_desk", "unknown_categories", "missing_required", "reachable"]


def test_out_of_bounds_and_wall_height():
    s = scene([
        obj("dresser_1", "dresser", 0.5, 1.5, 1.2, 0.5, 0.8),  # 0.1 of 1.2 m width outside: 8.3 %
        obj("bookshelf_1", "bookshelf", 2.0, 2.8, 0.8, 0.3, 2.7),  # taller than the 2.6 m wall
        obj("nightstand_1", "nightstand", 3.79, 1.0, 0.45, 0.4, 0.55),  # 3.3 % outside: OOB, under the 5 % cap
    ])
    r = measure(s)
    assert r["oob_objects"] == ["bookshelf_1", "dresser_1", "nightstand_1"]
    assert r["oob_cap_objects"] == ["bookshelf_1", "dresser_1"]


def test_window_box_warns_only_for_tall_objects():
    win = {"wall": 2, "offset": 2.0, "width": 1.2, "height": 1.2, "sill": 0.9}
    s = scene([
        obj("bookshelf_1", "bookshelf", 2.0, 2.84, 0.8, 0.3, 1.8, yaw=180),
        obj("nightstand_1", "nightstand", 1.6, 2.79, 0.45, 0.4, 0.55),
    ], windows=[win])
    r = measure(s)
    assert r["window_warnings"] == [{"window": 0, "object": "bookshelf_1"}]


@pytest.mark.parametrize("name", sorted(KNOWN))
@pytest.mark.parametrize("angle,shift", [(90, (0, 0)), (180, (0.35, -1.2)), (270, (5.0, 0.05)), (0, (-2.5, 1.15))])
def test_quarter_turns_and_cell_shifts_change_no_metric(name, angle, shift):
    base = m(name)
    moved = measure(transform(KNOWN[name](), angle, shift), blockers=True)
    assert moved == base


@pytest.mark.parametrize("name", ["empty", "wardrobe_door", "split", "rug", "shelf", "wardrobe_room"])
@pytest.mark.parametrize("angle", [17.0, 37.0, 128.0])
def test_arbitrary_rotation_keeps_booleans_and_counts(name, angle):
    base = m(name)
    rot = measure(transform(KNOWN[name](), angle, (0.3, 0.2)), blockers=True)
    for key in ("reachable", "door_blocked", "num_regions", "unreachable_objects", "collision_pairs", "oob_objects"):
        assert rot[key] == base[key], key


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10**6), kx=st.integers(-40, 40), ky=st.integers(-40, 40))
def test_whole_cell_shifts_of_random_scenes_change_no_metric(seed, kx, ky):
    s = random_scene(seed)
    assert measure(transform(s, 0.0, (kx * 0.05, ky * 0.05))) == measure(s)


def test_out_of_bounds_against_a_concave_floor():
    from jscenegen.scene.geometry import box_corners, outside_fraction

    ell = np.array([[0, 0], [4, 0], [4, 2], [3, 2], [3, 3], [0, 3]], dtype=float)  # notch at the top right
    # a 1 m square centred on the concave corner (3, 2): one quadrant lies in the notch
    assert outside_fraction(box_corners(3.0, 2.0, 1.0, 1.0, 0.0), ell) == pytest.approx(0.25)
    assert outside_fraction(box_corners(3.0, 2.0, 1.0, 1.0, 45.0), ell) == pytest.approx(0.25)
    assert outside_fraction(box_corners(1.0, 1.0, 1.0, 1.0, 30.0), ell) == pytest.approx(0.0)
    assert outside_fraction(box_corners(3.6, 2.6, 0.4, 0.4, 0.0), ell) == pytest.approx(1.0)
    s = scene_from_json({"room": {"floor_polygon": ell.tolist(), "wall_height": 2.6,
                                  "doors": [{"wall": 0, "offset": 1.0, "width": 0.9, "height": 2.1}]},
                         "objects": [obj("dresser_1", "dresser", 3.0, 2.0, 1.0, 0.5, 0.8)]})
    assert measure(s)["oob_cap_objects"] == ["dresser_1"]


def test_measuring_refuses_more_objects_than_the_cap_before_any_geometry():
    from jscenegen.scene.reach_inputs import ReachabilityError
    from jscenegen.scene.schema import MAX_SCENE_OBJECTS

    shelves = [obj(f"wall_shelf_{k}", "wall_shelf", 0.2 + 0.028 * k, 2.85, 0.3, 0.25, 0.3, mount="wall",
                   elevation=1.6) for k in range(MAX_SCENE_OBJECTS - 1)]
    at_cap = scene([obj("wardrobe_1", "wardrobe", 2.0, 0.31, 1.2, 0.6, 2.0), *shelves])
    m = measure(at_cap, blockers=True)
    assert m["object_count"] == MAX_SCENE_OBJECTS == 128
    assert m["door_walk_blocked"] == [0] and m["blockers"] == ["wardrobe_1"]  # as without the shelves
    # model_copy skips validation, as the editor's operations do: measure must count for itself
    for n in (MAX_SCENE_OBJECTS + 1, 200_000):
        big = at_cap.model_copy(update={"objects": at_cap.objects[:1] * n})
        with pytest.raises(ReachabilityError, match=rf"^the scene has {n} objects; measuring allows at most 128 "):
            measure(big, blockers=True)


def test_a_room_without_a_door_is_not_measured():
    """Reachability is anchored at doors: a doorless room used to measure 0 and score 0.66
    silently. The schema refuses it when read; measure refuses one built without validation."""
    from jscenegen.scene.reach_inputs import ReachabilityError

    s = KNOWN["split"]()
    doorless = s.model_copy(update={"room": s.room.model_copy(update={"doors": ()})})
    with pytest.raises(ReachabilityError, match="the room has no door"):
        measure(doorless)


def test_a_grid_too_large_for_the_int32_geometry_is_named_not_blamed_on_an_object():
    """grid_size 512 x cell_m 1.0 (a 512 m grid; 4.0 was, before cell_m's bound) refused every object of every scene as lying too
    far from the grid origin, the grid never named. The room is checked first now; a large grid
    that the room's far corners stay within still measures (512 x 5 cm and a 6 m room)."""
    from jscenegen.scene.config import MetricsConfig, SceneRuntimeConfig
    from jscenegen.scene.reach_inputs import MAX_ANY_ROOM_GRID_MM, ReachabilityError

    assert MAX_ANY_ROOM_GRID_MM == 16_383
    assert 8 * MAX_ANY_ROOM_GRID_MM ** 2 < 2**31 <= 8 * (MAX_ANY_ROOM_GRID_MM + 1) ** 2
    s = KNOWN["split"]()
    huge = SceneRuntimeConfig(metrics=MetricsConfig(grid_size=512, cell_m=1.0))
    with pytest.raises(ReachabilityError, match=r"^room bounding box .* with the 512 x 512 cell "
                                                r"grid \(512.00 m, scene.metrics.grid_size x "
                                                r"cell_m\) its far corners lie beyond .* lower "
                                                r"grid_size or cell_m"):
        measure(s, huge)
    wide = SceneRuntimeConfig(metrics=MetricsConfig(grid_size=512))   # 25.6 m: a 6 m room measures
    assert measure(s, wide) == measure(s)


def _plant_by_the_door(mount: str):
    """The audit's scene, built by the operations: a queen bed, a rug at the door and a
    0.6 x 0.6 x 1.8 m plant in the door's clearance box, standing on the floor or `on` the rug."""
    from jscenegen.scene.config import SceneRuntimeConfig
    from jscenegen.scene.ops import SceneEditor, parse_op
    ops = [{"op": "add_object", "category": "queen_bed", "position": [2.0, 1.95], "yaw": 180},
           {"op": "add_object", "category": "rug", "position": [2.0, 0.75], "size": [1.2, 1.4, 0.01]},
           {"op": "add_object", "category": "plant", "position": [2.0, 0.35], "size": [0.6, 0.6, 1.8],
            "mount": mount, **({"parent": "rug_1"} if mount == "on" else {})}]
    ed = SceneEditor(scene(), SceneRuntimeConfig(), load_catalogue())
    lines, _ = ed.apply_batch([parse_op(o) for o in ops])
    assert all(": ok" in line for line in lines), lines
    return ed.scene


REACH_KEYS = ("door_blocked", "door_clearance_blocked", "door_walk_blocked", "walkable_ratio", "num_regions",
              "door_connected_ratio", "reachable", "reachable_object_ratio", "unreachable_objects", "blockers")


def test_a_plant_on_a_rug_blocks_the_door_as_on_the_floor():
    """Only thin coverings and objects whose bottom is >= 1.5 m never block (rules revision 6):
    a plant `on` a rug stands on the floor in effect (it blocked nothing before)."""
    on, floor = _plant_by_the_door("on"), _plant_by_the_door("floor")
    r_on, r_floor = measure(on, blockers=True), measure(floor, blockers=True)
    assert r_on["door_blocked"] is True and r_on["door_clearance_blocked"] == [[0, "plant_1"]]
    assert r_on["reachable"] is False
    for key in REACH_KEYS:
        assert r_on[key] == r_floor[key], key
    cat = load_catalogue()
    g_on, g_floor = (rule_grades(s, [{"category": "plant", "count": 1}], r, cat)
                     for s, r in ((on, r_on), (floor, r_floor)))
    assert (g_on["reachability"], g_on["physical_plausibility"]) == (0, 4)
    assert g_on == g_floor


def test_an_object_on_a_rug_blocks_walking_and_must_be_reached():
    """Away from the door, a plant on a rug takes the same walkable floor as one on the floor and
    counts among the objects to reach; the rug itself still blocks nothing."""
    rug = obj("rug_1", "rug", 2.0, 1.5, 2.0, 1.4, 0.01)
    on = scene([rug, obj("plant_1", "plant", 2.0, 1.5, 0.6, 0.6, 1.2, mount="on", elevation=0.01, parent="rug_1")])
    floor = scene([rug, obj("plant_1", "plant", 2.0, 1.5, 0.6, 0.6, 1.2)])
    r_on, r_floor = measure(on), measure(floor)
    assert r_on["walkable_ratio"] < EMPTY_WALKABLE
    for key in REACH_KEYS[:-1]:
        assert r_on[key] == r_floor[key], key


def test_a_lamp_on_a_nightstand_is_reached_through_its_nightstand():
    """A child standing on a blocking parent blocks too (bottom under 1.5 m) but is not an object
    to reach by itself: a lamp inside its nightstand's footprint changes no reachability metric.
    A lamp on a wall shelf by the door is not a floor object: the clearance box stays free."""
    stand = obj("nightstand_1", "nightstand", 1.0, 1.0, 0.45, 0.4, 0.55)
    lamp = obj("table_lamp_1", "table_lamp", 1.0, 1.0, 0.3, 0.3, 0.45, mount="on", elevation=0.55,
               parent="nightstand_1")
    alone, with_lamp = measure(scene([stand])), measure(scene([stand, lamp]))
    for key in REACH_KEYS[:-1]:
        assert with_lamp[key] == alone[key], key
    shelf = obj("wall_shelf_1", "wall_shelf", 2.7, 0.15, 0.8, 0.3, 0.3, mount="wall", elevation=1.0)
    vase = obj("plant_1", "plant", 2.7, 0.15, 0.2, 0.2, 0.25, mount="on", elevation=1.3, parent="wall_shelf_1")
    r = measure(scene([shelf, vase]))
    assert r["door_clearance_blocked"] == [] and r["door_blocked"] is False
