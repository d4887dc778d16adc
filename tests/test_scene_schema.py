"""Reading scenes is bounded: file size, nesting depth and list lengths are refused up front,
with a SceneError naming the file; a room needs a door."""
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from jscenegen.scene.catalogue import load_catalogue
from jscenegen.scene.sceneset import read_scene_set
from jscenegen.scene.schema import (
    MAX_FLOOR_VERTICES,
    MAX_JSON_FILE_BYTES,
    MAX_OPENINGS,
    MAX_SCENE_OBJECTS,
    Room,
    SceneError,
    load_scene,
    read_json_file,
    scene_from_json,
)

from scene_fixtures import obj, room

DEEP = "[" * 100_000 + "]" * 100_000
NESTED = {  # 100k levels: far beyond the parser's recursion limit
    "array": DEEP,
    "room": '{"room": ' + DEEP + "}",
    "prompt": '{"prompt": ' + '{"a": ' * 100_000 + "1" + "}" * 100_001,
}
DEV = Path(__file__).resolve().parents[1] / "data" / "scenes" / "dev.jsonl"


@pytest.mark.parametrize("name", sorted(NESTED))
def test_deeply_nested_json_is_a_scene_error_naming_the_file(tmp_path, name):
    path = tmp_path / "deep.json"
    path.write_text(NESTED[name])
    for read in (read_json_file, load_scene):
        with pytest.raises(SceneError, match=rf"^{path}: not valid JSON: nested too deeply"):
            read(path)
    first = DEV.read_text().splitlines()[0]
    (tmp_path / "deep.jsonl").write_text(first + "\n" + NESTED[name] + "\n")
    with pytest.raises(SceneError, match=r"deep.jsonl:2: not valid JSON: nested too deeply"):
        read_scene_set(tmp_path / "deep.jsonl")


def test_a_file_over_the_size_bound_is_refused_before_reading(tmp_path):
    path = tmp_path / "huge.json"
    with open(path, "wb") as f:  # sparse: the size without the bytes
        f.truncate(MAX_JSON_FILE_BYTES + 1)
    with pytest.raises(SceneError, match=rf"^{path}: {MAX_JSON_FILE_BYTES + 1} bytes; .* at most {MAX_JSON_FILE_BYTES}"):
        load_scene(path)
    path.write_text(json.dumps({"room": room(), "objects": []}))
    assert load_scene(path).room.doors[0].offset == 2.0
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())   # a UTF-8 byte-order mark is not JSON
    assert load_scene(path).room.doors[0].offset == 2.0
    with pytest.raises(SceneError, match="at most 10 bytes"):
        read_json_file(path, max_bytes=10)


def test_bad_text_is_one_scene_error(tmp_path):
    for name, data, why in (("digits.json", b"1" * 5000, "not valid JSON: an integer of more than 4,300 digits"), ("latin.json", b'{"a": "\xe9"}', "not UTF-8")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(SceneError, match=f"{name}: {why}"):
            read_json_file(tmp_path / name)
    with pytest.raises(SceneError, match="is a directory"):
        read_json_file(tmp_path)


def test_a_jsonl_file_given_for_one_document_is_named_as_such(tmp_path):
    """`scene check data/scenes/dev.jsonl` or `design --room` a whole set said only "Extra data:
    line 2 column 1"; trailing junk on the first line keeps the plain message."""
    lines = DEV.read_text().splitlines()
    (tmp_path / "set.jsonl").write_text("\n".join(lines[:3]) + "\n")
    with pytest.raises(SceneError, match=r"set.jsonl: not valid JSON: Extra data: line 2 column 1 "
                                         r".*\(a second JSON document starts on line 2: a JSONL "
                                         r"file such as a scene set\? this input is one JSON "
                                         r"document, e.g. one line of a set\)$"):
        read_json_file(tmp_path / "set.jsonl")
    (tmp_path / "junk.json").write_text(lines[0] + " x")
    with pytest.raises(SceneError, match=r"junk.json: not valid JSON: Extra data: line 1 column \d+ "
                                         r"\(char \d+\)$"):
        read_json_file(tmp_path / "junk.json")


@pytest.mark.parametrize(
    "key,bound,build",
    [
        ("objects", MAX_SCENE_OBJECTS, lambda d, n: d.update(objects=[{}] * n)),
        ("room.floor_polygon", MAX_FLOOR_VERTICES, lambda d, n: d["room"].update(floor_polygon=[[0, 0]] * n)),
        ("room.doors", MAX_OPENINGS, lambda d, n: d["room"].update(doors=[{}] * n)),
        ("room.windows", MAX_OPENINGS, lambda d, n: d["room"].update(windows=[{}] * n)),
    ],
)
def test_lists_beyond_the_bounds_are_refused_before_validation(key, bound, build):
    # the entries are invalid: the count, not a validation error, must be what refuses them
    for n in (bound + 1, 200_000):
        data = {"room": room(), "objects": []}
        build(data, n)
        with pytest.raises(SceneError, match=rf"^x.json: {key} has {n} entries; a scene holds at most {bound} "):
            scene_from_json(data, "x.json")


def test_a_scene_at_the_object_bound_is_read():
    objs = [obj(f"plant_{k}", "plant", 0.2 + 0.03 * k, 1.0, 0.02, 0.02, 0.5) for k in range(MAX_SCENE_OBJECTS)]
    s = scene_from_json({"room": room(), "objects": objs})
    assert len(s.objects) == MAX_SCENE_OBJECTS
    with pytest.raises(SceneError, match=r"duplicate object ids \['plant_0'\]"):
        scene_from_json({"room": room(), "objects": objs[:-1] + objs[:1]})


@pytest.mark.parametrize("doors", [None, []])
def test_a_room_without_a_door_is_refused(doors):
    r = room()
    if doors is None:
        del r["doors"]
    else:
        r["doors"] = doors
    with pytest.raises(SceneError, match=r"^s.json: room.doors: a room needs at least one door"):
        scene_from_json({"room": r}, "s.json")
    with pytest.raises(ValidationError, match="at least one door"):
        Room.model_validate(r)  # a bare room (`jscenegen design --room`)


DOOR = {"wall": 0, "offset": 2.0, "width": 0.9, "height": 2.1}


@pytest.mark.parametrize("extra,message", [
    ({"doors": [DOOR]}, r"doors\[1\] overlaps doors\[0\] on wall 0 \(0.900 m"),
    ({"doors": [dict(DOOR, offset=2.5)]}, r"doors\[1\] overlaps doors\[0\] on wall 0 \(0.400 m"),
    ({"windows": [dict(DOOR, offset=1.8, height=1.0, sill=1.5)]}, r"windows\[0\] overlaps doors\[0\]"),
])
def test_openings_sharing_wall_area_are_refused(extra, message):
    r = room()
    r["doors"] += extra.get("doors", [])
    r["windows"] += extra.get("windows", [])
    with pytest.raises(SceneError, match=rf"^s.json: room: .*{message}"):
        scene_from_json({"room": r}, "s.json")


@pytest.mark.parametrize("extra", [
    {"doors": [dict(DOOR, offset=2.9)]},                       # touching edge to edge
    {"doors": [dict(DOOR, wall=1, offset=1.5)]},               # another wall
    {"windows": [dict(DOOR, height=0.4, sill=2.1)]},           # above the door
])
def test_openings_apart_are_accepted(extra):
    r = room()
    r["doors"] += extra.get("doors", [])
    r["windows"] += extra.get("windows", [])
    assert scene_from_json({"room": r}, "s.json").room.doors[0].offset == 2.0


@pytest.mark.parametrize("field,value", [("position", [1e30, 1e30]), ("size", [1e30, 1.0, 1.0]),
                                         ("elevation", -1e30), ("yaw", 1e30)])
def test_coordinates_beyond_the_bound_are_refused_naming_object_and_field(field, value):
    o = dict(obj("bed_1", "bed", 1.0, 1.0, 1.0, 1.0, 0.5), **{field: value})
    with pytest.raises(SceneError, match=rf"^s.json: objects.0: .*object bed_1: {field} .* is beyond"):
        scene_from_json({"room": room(), "objects": [o]}, "s.json")
    far = dict(room(), floor_polygon=[[0, 0], [1e30, 0], [1e30, 1e30], [0, 1e30]])
    with pytest.raises(SceneError, match=r"^s.json: room.floor_polygon: .*vertex 1 .* is beyond"):
        scene_from_json({"room": far}, "s.json")


@pytest.mark.parametrize("where,edit", [
    ("objects.0.yaw", lambda s: s["objects"][0].update(yaw="90")),
    ("objects.0.position", lambda s: s["objects"][0].update(position=["1.0", 1.0])),
    ("room.wall_height", lambda s: s["room"].update(wall_height="2.7")),
])
def test_a_number_written_as_a_string_is_refused_naming_the_field(where, edit):
    scene = {"room": room(), "objects": [obj("bed_1", "bed", 1.0, 1.0, 1.0, 1.0, 0.5)]}
    assert scene_from_json(json.loads(json.dumps(scene))).objects[0].yaw == 0.0
    edit(scene)
    with pytest.raises(SceneError, match=rf"^s.json: {where}: expected a number, not a string"):
        scene_from_json(scene, "s.json")


@pytest.mark.parametrize("where,edit", [
    ("room.doors.0.wall", lambda s: s["room"]["doors"][0].update(wall=0.0)),
    ("budget.total_units", lambda s: s.update(budget={"total_units": 512.0, "used_units": 0})),
])
def test_an_integer_field_written_as_a_float_is_refused_naming_the_field(where, edit):
    """An edge index or a unit count is an integer literal: pydantic reads 0.0 as 0."""
    scene = {"room": room(), "objects": [], "budget": {"total_units": 512, "used_units": 0}}
    assert scene_from_json(json.loads(json.dumps(scene))).budget.total_units == 512
    edit(scene)
    with pytest.raises(SceneError, match=rf"^s.json: {where}: expected an integer, not "):
        scene_from_json(scene, "s.json")


def test_a_key_repeated_in_one_object_is_refused(tmp_path):
    """Python's json keeps the last value: an appended `"objects": []` would empty the room."""
    text = json.dumps({"room": room(), "objects": [obj("bed_1", "bed", 1.0, 1.0, 1.0, 1.0, 0.5)]})
    path = tmp_path / "s.json"
    path.write_text(text[:-1] + ', "objects": []}')
    with pytest.raises(SceneError, match=r"s.json: not valid JSON: the key 'objects' appears twice"):
        load_scene(path)


def test_parents_that_are_the_object_itself_or_form_a_cycle_are_refused():
    def on(oid, parent):
        return obj(oid, "plant", 1.0, 1.0, 0.2, 0.2, 0.2, mount="on", elevation=0.5, parent=parent)

    with pytest.raises(SceneError, match=r"^s.json: objects.0: .*object a: parent is the object itself"):
        scene_from_json({"room": room(), "objects": [on("a", "a")]}, "s.json")
    with pytest.raises(SceneError, match=r"^s.json: .*objects b -> c -> d -> b: parents form a cycle"):
        scene_from_json({"room": room(), "objects": [on("a", "b"), on("b", "c"), on("c", "d"), on("d", "b")]},
                        "s.json")
    assert len(scene_from_json({"room": room(), "objects": [on("a", "b"), obj("b", "desk", 1, 1, 1, 1, 0.5)]}).objects) == 2


def test_an_empty_scene_set_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n  \n")
    with pytest.raises(SceneError, match=rf"^{path}: no scenes \(an empty scene set"):
        read_scene_set(path)
    path.write_text(DEV.read_text().splitlines()[0] + "\n")
    assert len(read_scene_set(path)) == 1


def test_a_named_pipe_given_as_input_is_refused_without_blocking(tmp_path):
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)          # opening it for reading would wait for a writer forever
    with pytest.raises(SceneError, match=rf"^{fifo}: is a named pipe$"):
        read_json_file(fifo)
    with pytest.raises(SceneError, match=rf"^scene set {fifo}: is a named pipe$"):
        read_scene_set(fifo)
    with pytest.raises(SceneError, match=rf"^scene.catalogue_path {fifo}: is a named pipe$"):
        load_catalogue(str(fifo))


def test_a_relative_catalogue_path_is_found_in_the_checkout_as_prompts_dir_is(tmp_path, monkeypatch):
    """scene.catalogue_path was read only against the working directory, unlike
    scene.prompts_dir (and config_inputs, which found it in the checkout)."""
    monkeypatch.chdir(tmp_path)
    given = "jscenegen/scene/data/catalogue.json"   # the packaged one, by its checkout path
    assert load_catalogue(given).categories == load_catalogue().categories
    (tmp_path / "jscenegen/scene/data").mkdir(parents=True)   # the working directory's first
    (tmp_path / given).write_text("{}")
    with pytest.raises(ValueError, match=f"^{given}: expected a JSON object with a 'categories'"):
        load_catalogue(given)   # the working directory's file now, not the checkout's cached


def _packaged_catalogue() -> dict:
    from importlib import resources

    return json.loads(resources.files("jscenegen.scene").joinpath("data/catalogue.json").read_text())


@pytest.mark.parametrize("change,message", [
    # every bed category gone while the bed group still names them: the expert crashed
    (lambda d: [d["categories"].pop(k) for k in ("single_bed", "double_bed", "queen_bed", "king_bed")],
     r"groups\.bed names 'single_bed', which is not a category"),
    (lambda d: d["categories"]["chair"].__setitem__("width_range", ["a", "b"]),
     r"categories\.chair: width_range must be a list of 2 numbers, got \[\"a\", \"b\"\]"),
    (lambda d: d["categories"]["chair"].update(default_size=[-0.5, -0.5, -0.9], width_range=[-3, -1]),
     r"categories\.chair: width_range \[-3, -1\] must lie in \[0, 1000\] metres"),
    # an integer no float holds: math.isfinite raised OverflowError (a traceback)
    (lambda d: d["categories"]["chair"].update(default_size=[int("9" * 400), 1, 1]),
     r"categories\.chair: default_size must be a list of 3 numbers, got \[9999"),
    (lambda d: d["categories"]["chair"].update(default_size=[0, 0, 0]),
     r"categories\.chair: default_size \[0, 0, 0\] must lie in \(0, 1000\]"),
    (lambda d: d["categories"]["chair"].update(height_range=[1.2, 0.4]),
     r"categories\.chair: height_range \[1\.2, 0\.4\] runs backwards"),
    (lambda d: d["categories"]["wall_art"].update(default_elevation="high"),
     r"categories\.wall_art: default_elevation must be a number of metres >= 0, got \"high\""),
    (lambda d: d["categories"]["chair"].update(mounts=["floor", "sky"]),
     r"categories\.chair: mounts must be a non-empty list of floor, on, wall, ceiling"),
    (lambda d: d["categories"]["chair"].update(storage="yes"), r"categories\.chair: storage must be true or false"),
    (lambda d: d["room_types"]["bedroom"].update(required_group="beds"),
     r"room_types\.bedroom\.required_group 'beds' is not a group"),
    # a list or a number here raised a bare TypeError (unhashable / not iterable)
    (lambda d: d["room_types"]["bedroom"].update(required_group=["bed"]),
     r"room_types\.bedroom\.required_group must be a group name, got \[\"bed\"\]"),
    (lambda d: d["room_types"]["bedroom"].update(expected=5),
     r"room_types\.bedroom\.expected must be a list of lists of names, got 5"),
    (lambda d: d["top_surfaces"].append("table"), r"top_surfaces names 'table', which is not a category"),
    (lambda d: d.update(top_surfaces="desk"), r"top_surfaces must be a list of names, got \"desk\""),
])
def test_a_catalogue_file_is_checked_key_by_key(tmp_path, change, message):
    doc = _packaged_catalogue()
    change(doc)
    path = tmp_path / "catalogue.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=rf"^{path}: {message}"):
        load_catalogue(str(path))


def test_a_long_object_id_is_refused_by_its_length_not_clipped_away():
    """A 10,000-character id filled the clipped error line, so its cause (a parent that is no
    object id) was cut off; ids and categories now have a length bound named by field."""
    o = obj("x" * 10_000, "bed", 1.0, 1.0, 1.0, 1.0, 0.5)
    with pytest.raises(SceneError, match=r"^s.json: objects.0.id: String should have at most 144 "
                                         r"characters"):
        scene_from_json({"room": room(), "objects": [o]}, "s.json")
    o = obj("bed_1", "b" * 129, 1.0, 1.0, 1.0, 1.0, 0.5)
    with pytest.raises(SceneError, match=r"^s.json: objects.0.category: String should have at most"):
        scene_from_json({"room": room(), "objects": [o]}, "s.json")


def test_a_long_scene_id_is_refused_by_its_length():
    """A 100,000-character scene_id passed: `scene render` drew it as the title, a PNG 900,241
    pixels wide (2.4 GB of memory; 400,000 characters ended in matplotlib's MemoryError)."""
    with pytest.raises(SceneError, match=r"^s.json: scene_id: String should have at most 144 "):
        scene_from_json({"scene_id": "x" * 145, "room": room()}, "s.json")
    assert scene_from_json({"scene_id": "x" * 144, "room": room()}, "s.json").scene_id == "x" * 144


def test_floor_and_ceiling_objects_away_from_their_mount_are_refused():
    """A bed `mount: ceiling` at elevation 0 was measured and graded like any floor bed (full
    marks), and a floor object could float; the operations never make either (helper-77)."""
    with pytest.raises(SceneError, match=r"^s.json: .*object b: mount 'ceiling' has its top at the "
                       r"ceiling \(elevation \+ height = wall_height 2\.6\), not at 0\.5$"):
        scene_from_json({"room": room(), "objects": [obj("b", "bed", 2, 1.5, 1, 2, 0.5, mount="ceiling")]},
                        "s.json")
    with pytest.raises(SceneError, match=r"^s.json: .*object d: mount 'floor' stands on the floor "
                       r"\(elevation 0\), not at elevation 1\.2$"):
        scene_from_json({"room": room(), "objects": [obj("d", "desk", 1, 1, 1, 1, 0.5, elevation=1.2)]},
                        "s.json")
    light = obj("l", "ceiling_light", 2, 1.5, 0.4, 0.4, 0.2, mount="ceiling", elevation=2.4)
    assert scene_from_json({"room": room(), "objects": [light]}).objects[0].elevation == 2.4
