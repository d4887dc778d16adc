"""Designer operations: unit charging on request, budget refusal, validation without change, snaps."""
import pytest

from jscenegen.scene.catalogue import load_catalogue
from jscenegen.scene.config import OpCosts, SceneRuntimeConfig
from jscenegen.scene.geometry import footprint
from jscenegen.scene.ops import OpSchemaError, SceneEditor, parse_op
from jscenegen.scene.schema import Budget, Scene

from scene_fixtures import empty_room


def editor(total=512, **cfg):
    s = empty_room()
    s = s.model_copy(update={"budget": Budget(total_units=total, used_units=0)})
    return SceneEditor(s, SceneRuntimeConfig(**cfg), load_catalogue())


def run(ed, *raw):
    return ed.apply_batch([parse_op(r) for r in raw])


def test_units_are_charged_on_request_including_failed_ops():
    ed = editor()
    lines, refused = run(
        ed,
        {"op": "add_object", "category": "queen_bed", "position": [2.0, 1.5]},  # 8, ok
        {"op": "move_object", "id": "nope_1", "position": [1, 1]},  # 2, unknown id
        {"op": "add_object", "category": "rug", "position": [1, 1], "size": [9, 9, 0.01]},  # 8, bad size
        {"op": "rotate_object", "id": "queen_bed_1", "yaw": 90},  # 1, ok
        {"op": "get_scene"},  # 0
    )
    assert not refused
    assert ed.scene.budget.used_units == 8 + 2 + 8 + 1 + 0
    assert ["ok" in line.split(":")[1] for line in lines] == [True, False, False, True, True]
    assert [o.id for o in ed.scene.objects] == ["queen_bed_1"]
    assert ed.scene.objects[0].yaw == 90


def test_budget_refusal_is_not_charged_and_ends_the_batch():
    ed = editor(total=20)
    lines, refused = run(
        ed,
        {"op": "add_object", "category": "nightstand", "position": [1.0, 1.0]},  # 8 -> 8
        {"op": "add_object", "category": "nightstand", "position": [2.0, 1.0]},  # 8 -> 16
        {"op": "add_object", "category": "nightstand", "position": [3.0, 1.0]},  # would be 24: refused
        {"op": "rotate_object", "id": "nightstand_1", "yaw": 90},  # never run
    )
    assert refused and len(lines) == 3 and "refused" in lines[2]
    assert ed.scene.budget.used_units == 16
    assert len(ed.scene.objects) == 2 and ed.scene.objects[0].yaw == 0


def test_costs_come_from_config():
    ed = editor(op_costs=OpCosts(add_object=5, rotate_object=4))
    run(ed, {"op": "add_object", "category": "chair", "position": [1, 1]}, {"op": "rotate_object", "id": "chair_1", "yaw": 5})
    assert ed.scene.budget.used_units == 9


def test_validation_errors_change_nothing():
    ed = editor(max_objects=1)
    run(ed, {"op": "add_object", "category": "dresser", "position": [2.0, 1.5]})
    before = ed.scene.objects
    lines, _ = run(
        ed,
        {"op": "add_object", "category": "chair", "position": [1, 1]},  # too many objects
        {"op": "move_object", "id": "dresser_1", "position": [5.0, 1.0]},  # centre outside the floor
        {"op": "resize_object", "id": "dresser_1", "scale": 3.0},  # out of range
        {"op": "add_object", "category": "spaceship", "position": [1, 1]},  # unknown category
        {"op": "add_object", "category": "table_lamp", "position": [1, 1]},  # lamps need mount on
        {"op": "resize_object", "id": "dresser_1"},  # neither size nor scale
    )
    assert all(": error:" in line for line in lines), lines
    assert ed.scene.objects == before
    assert "maximum of 1 objects" in lines[0] and "outside the floor" in lines[1]


def test_results_no_scene_file_could_hold_are_op_errors():
    """A yaw or offset far out of range, or a rotation whose carried child would leave the yaw
    range, is a per-op error (charged, nothing changed); every object stays valid."""
    ed = editor()
    run(ed, {"op": "add_object", "category": "queen_bed", "position": [2.0, 1.5]},
        {"op": "add_object", "category": "nightstand", "position": [0.5, 0.5], "yaw": 35999},
        {"op": "add_object", "category": "table_lamp", "position": [0.5, 0.5], "mount": "on",
         "parent": "nightstand_1", "yaw": -35999})
    before = ed.scene.objects
    lines, _ = run(
        ed,
        {"op": "add_object", "category": "chair", "position": [1, 1], "yaw": 1e9},
        {"op": "rotate_object", "id": "queen_bed_1", "yaw": 1.7e308},
        {"op": "move_object", "id": "queen_bed_1", "position": [2, 1.5], "yaw": -1e200},
        {"op": "rotate_object", "id": "nightstand_1", "yaw": -35999},   # the lamp: -35999 - 71998
        {"op": "snap_to_object", "id": "nightstand_1", "target": "queen_bed_1", "side": "left",
         "offset": 1e308},
        {"op": "snap_to_wall", "id": "nightstand_1", "wall": int("9" * 400)},
    )
    assert all(": error:" in line for line in lines), lines
    assert ed.scene.objects == before
    assert "yaw 1000000000.0 is beyond +-36000 degrees" in lines[0]
    assert "yaw 1.7e+308 is beyond" in lines[1] and "yaw -1e+200 is beyond" in lines[2]
    assert "object table_lamp_1: yaw -107997.0 is beyond" in lines[3]
    assert "centre [1.00154, 1e+308] is outside the floor" in lines[4]
    assert "... (427 characters) [2 units charged]" in lines[5] and len(lines[5]) < 500
    assert Scene.model_validate(ed.scene.model_dump())


def test_resize_and_replace_keep_wall_and_ceiling_objects_in_the_room():
    ed = editor()
    wall = ed.scene.room.wall_height
    run(ed, {"op": "add_object", "category": "ceiling_light", "position": [2, 1.5], "mount": "ceiling"},
        {"op": "add_object", "category": "wall_art", "position": [0.3, 1.5], "mount": "wall",
         "elevation": wall - 0.6, "size": [0.5, 0.05, 0.5]})
    lines, _ = run(ed, {"op": "resize_object", "id": "ceiling_light_1", "size": [0.5, 0.5, 0.45]},
                   {"op": "resize_object", "id": "wall_art_1", "size": [0.5, 0.05, 0.9]},
                   {"op": "replace_object", "id": "wall_art_1", "size": [0.6, 0.05, 0.95]},
                   {"op": "replace_object", "id": "wall_art_1", "size": [0.6, 0.05, 0.55]})
    assert [": ok" in line for line in lines] == [True, False, False, True], lines
    light, art = ed.scene.objects
    assert light.elevation == pytest.approx(wall - 0.45)          # still hangs from the ceiling
    assert art.elevation + art.size[2] <= wall
    assert "outside 0..wall_height" in lines[1] and "outside 0..wall_height" in lines[2]


def test_ids_with_a_non_ascii_digit_suffix_do_not_count():
    """'chair_²' is a valid id; `str.isdigit` accepts '²' but int() does not."""
    from scene_fixtures import obj, scene

    s = scene([obj("chair_\u00b2", "chair", 1, 1, 0.5, 0.5, 0.9), obj("chair_4", "chair", 2, 1, 0.5, 0.5, 0.9)])
    ed = SceneEditor(s, SceneRuntimeConfig(), load_catalogue())
    lines, _ = run(ed, {"op": "add_object", "category": "chair", "position": [3, 1]})
    assert lines == ["1. add_object: ok -> chair_5 [8 units]"]


def test_remove_takes_children_and_ids_are_not_reused():
    ed = editor()
    run(
        ed,
        {"op": "add_object", "category": "nightstand", "position": [1.0, 1.0]},
        {"op": "add_object", "category": "table_lamp", "position": [1.0, 1.0], "mount": "on", "parent": "nightstand_1"},
        {"op": "remove_object", "id": "nightstand_1"},
        {"op": "add_object", "category": "nightstand", "position": [1.0, 1.0]},
    )
    assert [o.id for o in ed.scene.objects] == ["nightstand_2"]


def test_lamp_rides_on_its_parent():
    ed = editor()
    run(
        ed,
        {"op": "add_object", "category": "nightstand", "position": [1.0, 1.0]},
        {"op": "add_object", "category": "table_lamp", "position": [1.1, 1.0], "mount": "on", "parent": "nightstand_1"},
        {"op": "move_object", "id": "nightstand_1", "position": [2.0, 2.0], "yaw": 90},
        {"op": "resize_object", "id": "nightstand_1", "size": [0.45, 0.4, 0.6]},
    )
    lamp = ed.scene.object("table_lamp_1")
    assert lamp.position == pytest.approx((2.0, 2.1)) and lamp.yaw == 90 and lamp.elevation == pytest.approx(0.6)


def test_snap_to_wall_is_flush_with_a_1cm_gap():
    ed = editor()
    run(
        ed,
        {"op": "add_object", "category": "wardrobe", "position": [1.5, 1.5], "yaw": 33},
        {"op": "snap_to_wall", "id": "wardrobe_1", "wall": 2, "orientation": "away"},
        {"op": "add_object", "category": "single_bed", "position": [3.0, 1.5]},
        {"op": "snap_to_wall", "id": "single_bed_1", "orientation": "along"},  # nearest wall: x = 4
    )
    w, bed = ed.scene.object("wardrobe_1"), ed.scene.object("single_bed_1")
    assert w.yaw == 180 and w.position == pytest.approx((1.5, 3.0 - 0.3 - 0.01))
    assert footprint(bed)[:, 0].max() == pytest.approx(4.0 - 0.01)
    assert bed.yaw in (0, 180)


def test_snap_to_object_sides():
    ed = editor()
    run(
        ed,
        {"op": "add_object", "category": "desk", "position": [2.0, 1.0]},
        {"op": "add_object", "category": "chair", "position": [1.0, 2.0]},
        {"op": "snap_to_object", "id": "chair_1", "target": "desk_1", "side": "front", "orientation": "toward"},
        {"op": "add_object", "category": "nightstand", "position": [1.0, 2.5]},
        {"op": "snap_to_object", "id": "nightstand_1", "target": "desk_1", "side": "right", "orientation": "same"},
    )
    chair, stand = ed.scene.object("chair_1"), ed.scene.object("nightstand_1")
    assert chair.position == pytest.approx((2.0, 1.0 + 0.3 + 0.275 + 0.01)) and chair.yaw == 180
    assert stand.position == pytest.approx((2.0 + 0.6 + 0.225 + 0.01, 1.0)) and stand.yaw == 0


@pytest.mark.parametrize(
    "raw,cause",
    [
        ({"op": "teleport", "id": "a"}, "unknown_op"),
        ({"op": "move_object", "id": "a", "position": "here"}, "schema_violation"),
        ({"op": "move_object", "id": "a", "position": [1, "2"]}, "schema_violation"),
        ({"op": "rotate_object", "id": "a", "yaw": "90"}, "schema_violation"),
        ({"op": "rotate_object", "id": 3, "yaw": 90}, "schema_violation"),
        ({"op": "get_scene", "extra": 1}, "schema_violation"),
        ({"id": "a"}, "schema_violation"),
        (["add_object"], "schema_violation"),
        ({"op": "add_object", "category": "chair", "position": [1.0, float("nan")]}, "schema_violation"),
    ],
)
def test_malformed_ops_raise_schema_errors_with_causes(raw, cause):
    with pytest.raises(OpSchemaError) as err:
        parse_op(raw)
    assert err.value.cause == cause


def _nightstand_lamp_plant(ed):
    lines, _ = run(
        ed,
        {"op": "add_object", "category": "nightstand", "position": [1.0, 1.0], "size": [0.45, 0.4, 0.55]},
        {"op": "add_object", "category": "table_lamp", "position": [1.0, 1.0], "mount": "on", "parent": "nightstand_1"},
        {"op": "add_object", "category": "plant", "position": [1.0, 1.0], "mount": "on", "parent": "table_lamp_1"},
    )
    assert all(": ok" in line for line in lines), lines
    return {o.id: o for o in ed.scene.objects}


@pytest.mark.parametrize("op", [
    {"op": "resize_object", "id": "nightstand_1", "size": [0.45, 0.4, 0.7]},
    {"op": "replace_object", "id": "nightstand_1", "category": "nightstand", "size": [0.45, 0.4, 0.7]},
    {"op": "replace_object", "id": "nightstand_1", "category": "dresser", "size": [1.0, 0.45, 0.7]},
])
def test_resize_and_replace_lift_every_level_on_top(op):
    ed = editor()
    before = _nightstand_lamp_plant(ed)
    lines, _ = run(ed, op)
    assert ": ok" in lines[0], lines
    objs = {o.id: o for o in ed.scene.objects}
    base = objs.get("nightstand_1") or objs["dresser_1"]
    lamp, plant = objs["table_lamp_1"], objs["plant_1"]
    assert lamp.parent == base.id and plant.parent == "table_lamp_1"
    assert lamp.elevation == pytest.approx(0.7)
    assert plant.elevation == pytest.approx(0.7 + lamp.size[2])
    assert plant.elevation - before["plant_1"].elevation == pytest.approx(0.15)


def test_a_move_that_would_carry_a_child_off_the_floor_changes_nothing():
    ed = editor()
    run(ed, {"op": "add_object", "category": "dresser", "position": [0.3, 1.5], "size": [1.8, 0.5, 0.8]},
        {"op": "add_object", "category": "table_lamp", "position": [1.1, 1.5], "mount": "on", "parent": "dresser_1"})
    before = ed.scene
    lines, _ = run(ed, {"op": "rotate_object", "id": "dresser_1", "yaw": 180})
    assert "error: it would carry table_lamp_1 to centre [-0.5, 1.5] is outside the floor" in lines[0]
    assert ed.scene.objects == before.objects


def test_a_centre_on_any_wall_line_is_on_the_floor():
    ed = editor()
    lines, _ = run(ed, *({"op": "add_object", "category": "wall_art", "position": p, "mount": "wall"}
                         for p in ([0.0, 1.5], [4.0, 1.5], [2.0, 0.0], [2.0, 3.0])))
    assert all(": ok" in line for line in lines), lines


def test_a_refused_add_takes_no_id():
    ed = editor()
    lines, _ = run(ed, {"op": "add_object", "category": "chair", "position": [1, 1], "yaw": 1e9},
                   {"op": "add_object", "category": "chair", "position": [1, 1]})
    assert "error" in lines[0] and lines[1].endswith("ok -> chair_1 [8 units]")


def test_a_description_no_scene_file_holds_is_a_validation_error():
    ed = editor()
    lines, _ = run(ed, {"op": "add_object", "category": "chair", "position": [1, 1], "description": "x" * 1001},
                   {"op": "add_object", "category": "chair", "position": [1, 1], "description": "x" * 1000})
    assert "error" in lines[0] and "description" in lines[0] and "1000" in lines[0]
    assert [len(o.description) for o in ed.scene.objects] == [1000]


def test_a_catalogue_default_elevation_of_zero_is_kept():
    import dataclasses

    ed = editor()
    art = ed.catalogue.categories["wall_art"]
    ed.catalogue.categories["wall_art"] = dataclasses.replace(art, default_elevation=0.0)
    try:
        run(ed, {"op": "add_object", "category": "wall_art", "position": [0.05, 1.5], "mount": "wall"})
    finally:
        ed.catalogue.categories["wall_art"] = art
    assert ed.scene.objects[0].elevation == 0.0


@pytest.mark.parametrize("dx,dy", [(0.225, 0.0), (-0.225, 0.0), (0.0, 0.2), (0.0, -0.2)])
def test_a_child_centred_on_its_parents_edge_is_on_top(dx, dy):
    """add_object takes a centre on any edge of the parent's footprint, and measuring calls
    the child supported: one boundary rule for both."""
    from jscenegen.scene.metrics import measure

    ed = editor()
    lines, _ = run(ed, {"op": "add_object", "category": "nightstand", "position": [1.0, 1.0], "size": [0.45, 0.4, 0.55]},
                   {"op": "add_object", "category": "table_lamp", "position": [1.0 + dx, 1.0 + dy], "mount": "on",
                    "parent": "nightstand_1"})
    assert all(": ok" in line for line in lines), lines
    assert measure(ed.scene)["unsupported_objects"] == []


@pytest.mark.parametrize("op", [
    {"op": "move_object", "id": "table_lamp_1", "position": [2.0, 2.0]},
    {"op": "snap_to_wall", "id": "table_lamp_1", "wall": 0, "orientation": "away"},
    {"op": "resize_object", "id": "nightstand_1", "size": [0.36, 0.45, 0.55]},
    {"op": "replace_object", "id": "nightstand_1", "category": "nightstand", "size": [0.36, 0.45, 0.55]},
])
def test_an_object_on_another_cannot_be_left_beside_it(op):
    """Only add_object checked that an `on` object's centre lies on its parent's top: a move
    took a lamp off its nightstand to hang in the air, measured and graded as if nothing were
    wrong. Now every operation that would leave it there is refused (charged, nothing changed)."""
    ed = editor()
    lines, _ = run(ed, {"op": "add_object", "category": "nightstand", "position": [1.0, 1.0],
                        "size": [0.6, 0.45, 0.55]},
                   {"op": "add_object", "category": "table_lamp", "position": [1.25, 1.0], "mount": "on",
                    "parent": "nightstand_1"})
    assert all(": ok" in line for line in lines), lines
    before, used = ed.scene, ed.scene.budget.used_units
    lines, _ = run(ed, op)
    assert "the centre of table_lamp_1 would not be on top of its parent" in lines[0], lines
    assert ed.scene.objects == before.objects and ed.scene.budget.used_units > used
    lines, _ = run(ed, {"op": "rotate_object", "id": "nightstand_1", "yaw": 45},   # rides along
                   {"op": "move_object", "id": "table_lamp_1", "position": [0.95, 1.0]})
    assert all(": ok" in line for line in lines), lines
    lines, _ = run(ed, {"op": "add_object", "category": "table_lamp", "position": [2.0, 2.0],
                        "mount": "on", "parent": "nightstand_1"})   # the same rule when added
    assert "the centre of table_lamp_2 would not be on top of its parent nightstand_1" in lines[0]
    assert [o.id for o in ed.scene.objects] == ["nightstand_1", "table_lamp_1"]


def test_a_replace_without_anything_to_replace_is_an_error_not_a_charged_no_op():
    ed = editor()
    run(ed, {"op": "add_object", "category": "nightstand", "position": [0.3, 0.3]})
    before = ed.scene.objects
    lines, _ = run(ed, {"op": "replace_object", "id": "nightstand_1"})
    assert "error: give category, description or size (what to replace)" in lines[0]
    assert ed.scene.objects == before


def test_an_unknown_op_or_action_name_is_clipped_in_the_failure_message():
    """A 100,000-character op name came back whole in failure_message (trajectories, logs)."""
    from jscenegen.scene.actions import parse_action
    from jscenegen.scene.config import GRADE_KEYS
    from jscenegen.scene.ops import OpSchemaError, parse_op

    with pytest.raises(OpSchemaError, match=r"unknown operation 'xxx.*\(100,002 characters\); known: ") as err:
        parse_op({"op": "x" * 100_000})
    assert len(str(err.value)) < 500
    action = parse_action('<action>{"action": "' + "y" * 100_000 + '"}</action>', "planner", GRADE_KEYS)
    assert action.failure_cause == "unknown_action" and len(action.message) < 500
    for role, fields in (("critic", '"critique": "c", "grades": {}'), ("designer", '"ops": []')):
        parsed = parse_action('<action>{' + fields + ', "' + "z" * 100_000 + '": 1}</action>',
                              role, GRADE_KEYS)
        assert parsed.failure_cause == "schema_violation" and len(parsed.message) < 500, role


def test_the_protocol_hash_reads_the_operations_own_fields_not_pydantics_json_schema(monkeypatch):
    """pydantic renders the same models' JSON schema differently between releases (the
    pyproject allows 2.7-2.x): a run resumed on a machine with another one was refused as a
    changed protocol."""
    from pydantic import BaseModel

    from jscenegen.paths import json_sha256
    from jscenegen.scene.config import JudgeConfig, SceneRuntimeConfig
    from jscenegen.scene.protocol import op_signatures, protocol_hash

    want = protocol_hash(SceneRuntimeConfig(), JudgeConfig())

    def refuse(*args, **kwargs):
        raise AssertionError("the protocol read pydantic's JSON schema")

    monkeypatch.setattr(BaseModel, "model_json_schema", classmethod(refuse))
    assert protocol_hash(SceneRuntimeConfig(), JudgeConfig()) == want
    # an operation's arguments are part of every run's protocol: a change here needs
    # RULES_REVISION raised (jscenegen/scene/protocol.py) and this digest updated
    assert json_sha256(op_signatures()) == "b991cba7891dd6d35d6b5666a568b314e71d6b0c0e2e0d4dcbc559ce4f9c3f8a"


@pytest.mark.parametrize("setting", ["validator", "str_strip_whitespace"])
def test_op_signatures_refuse_a_validator_or_a_model_setting_they_do_not_record(setting):
    """Both change what an operation accepts, and its recorded signature stayed the same
    (helper-171)."""
    from pydantic import BaseModel, ConfigDict, field_validator

    from jscenegen.scene.protocol import op_signatures

    if setting == "validator":
        class Op(BaseModel):
            x: float = 1.0

            @field_validator("x")
            @classmethod
            def positive(cls, v):
                return abs(v)
    else:
        class Op(BaseModel):
            model_config = ConfigDict(str_strip_whitespace=True)
            x: str = ""
    want = "field_validators" if setting == "validator" else setting
    with pytest.raises(TypeError, match=rf"^operation 'odd': {want} is not recorded by op_signatures"):
        op_signatures({"odd": Op})


@pytest.mark.parametrize("extra", ["alias", "factory", "nested", "annotated", "inner"])
def test_op_signatures_refuse_a_field_they_would_not_describe_whole(extra):
    """An alias, a default factory or a nested model's own constraints would change what an
    operation accepts without changing its recorded signature (helper-168)."""
    from typing import Annotated

    from pydantic import AfterValidator, BaseModel, ConfigDict, Field

    from jscenegen.scene.protocol import op_signatures

    class Inner(BaseModel):
        width: float = Field(gt=0)

    doubled = AfterValidator(lambda v: 2 * v)   # its repr holds an address: a new hash per process
    fields = {"alias": (float, Field(1.0, alias="w")),
              "factory": (list[float], Field(default_factory=list)),
              "nested": (tuple[Inner, ...] | None, None),
              "annotated": (Annotated[float, doubled], 1.0),
              "inner": (tuple[Annotated[float, doubled], ...] | None, None)}[extra]
    op = type("Op", (BaseModel,), {"__annotations__": {"x": fields[0]}, "x": fields[1],
                                   "model_config": ConfigDict(extra="forbid")})
    with pytest.raises(TypeError, match=r"^operation 'odd' field 'x': an alias, default factory, "
                                        r"nested model or validator"):
        op_signatures({"odd": op})
    plain = type("Op", (BaseModel,), {"__annotations__": {"x": float}, "x": Field(1.0, gt=0)})
    assert op_signatures({"odd": plain})["odd"]["fields"]["x"] == ["<class 'float'>", "1.0", ["Gt(gt=0)"]]
