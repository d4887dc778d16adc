"""Shipped scene sets, the deterministic generator, schema text and the CLI."""
import json
import re
from pathlib import Path

import pytest

from jscenegen.cli import main
from jscenegen.scene.generator import SPLIT_BASE, make_record, make_scene_set
from jscenegen.scene.sceneset import read_scene_record, read_scene_set, record_from_json, write_scene_set
from jscenegen.scene.schema import SceneError, canonical_text, edge_length, scene_from_json

from cli_errors import one_error_line
from scene_fixtures import KNOWN, room, transform

DATA = Path(__file__).resolve().parents[1] / "data" / "scenes"


def test_shipped_sets_match_the_generator():
    train, dev = read_scene_set(DATA / "train.jsonl"), read_scene_set(DATA / "dev.jsonl")
    assert len(train) == 100 and len(dev) == 9
    assert [r.to_json() for r in train] == [r.to_json() for r in make_scene_set("train", 100)]
    assert [r.to_json() for r in dev] == [r.to_json() for r in make_scene_set("dev", 9)]
    assert len({r.seed for r in train + dev}) == 109
    assert all(r.scene.objects == () and r.requested and r.scene.room.doors for r in train + dev)
    assert len({r.scene.room.floor_polygon for r in train}) > 50
    assert any(len(r.scene.room.floor_polygon) > 4 for r in train)


@pytest.mark.parametrize("split, index", [("train", 1736), ("train", 19722), ("dev", 5110)])
def test_an_opening_on_a_wall_exactly_its_width_plus_margins_long_is_placed(split, index):
    """These seeds draw a window or door for a wall whose length equals the opening plus both
    margins: rounding put the upper end of the offset range below the lower (numpy raised)."""
    scene = make_record(SPLIT_BASE[split] * 1000 + index, f"{split}-{index}").scene
    for opening in scene.room.doors + scene.room.windows:
        wall = edge_length(scene.room.floor_polygon, opening.wall)
        assert opening.width / 2 <= opening.offset <= wall - opening.width / 2 + 1e-9


def test_write_is_atomic_and_round_trips(tmp_path):
    recs = make_scene_set("dev", 2)
    write_scene_set(tmp_path / "s.jsonl", recs)
    assert [r.to_json() for r in read_scene_set(tmp_path / "s.jsonl")] == [r.to_json() for r in recs]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.jsonl"]
    bom = tmp_path / "bom.jsonl"   # a UTF-8 byte-order mark (Windows editors) is not JSON
    bom.write_bytes(b"\xef\xbb\xbf" + (tmp_path / "s.jsonl").read_bytes())
    assert [r.to_json() for r in read_scene_set(bom)] == [r.to_json() for r in recs]
    (tmp_path / "bad.jsonl").write_text('{"scene": {"room": {}}, "seed": 1}\n')
    with pytest.raises(SceneError, match=r"bad.jsonl:1: scene: room.floor_polygon"):
        read_scene_set(tmp_path / "bad.jsonl")


def test_canonical_text_is_deterministic_and_rounded():
    s = transform(KNOWN["split"](), 0, (0.001, 0.0))
    text = canonical_text(s)
    assert text == canonical_text(scene_from_json(json.loads(json.dumps(s.to_json()))))
    assert "pos [2.00, 1.01]" in text or "pos [2.00, 1.02]" in text
    assert text.index("nightstand_1") < text.index("queen_bed_1") < text.index("wardrobe_1")
    assert "yaw 270 mount floor" in text


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda d: d["room"].update(floor_polygon=[[0, 0], [0, 3], [4, 3], [4, 0]]), "counter-clockwise"),
        (lambda d: d["room"].update(floor_polygon=[[0, 0], [4, 3], [4, 0], [0, 3]]), "not simple"),
        (lambda d: d["room"]["doors"][0].update(wall=9), r"doors\[0\]\.wall 9"),
        (lambda d: d["room"]["doors"][0].update(offset=3.9), "leaves wall 0"),
        (lambda d: d["room"]["doors"][0].update(height=200), r"doors\[0\]: its top at 200 m is above wall_height"),
        (lambda d: d["room"].update(windows=[{"wall": 1, "offset": 1, "width": 1, "height": 1, "sill": 9}]),
         r"windows\[0\]: its top at 10 m is above wall_height"),
        (lambda d: d["objects"].append({"id": "a_1", "category": "x", "position": [1, 1], "size": [1, -1, 1]}), "size"),
        (lambda d: d["objects"].append({"id": "a_1", "category": "x", "position": [1, 1], "size": [1, 1, 1],
                                        "mount": "on"}), "parent"),
        (lambda d: d.update(schema="scenegen.scene/0"), "schema"),
        # a boolean is not a number (pydantic would read true as 1), alone or in a list
        (lambda d: d["objects"].append({"id": "a_1", "category": "x", "position": [1, 1], "size": [1, 1, 1],
                                        "yaw": True}), "objects.0.yaw: .*not a boolean"),
        (lambda d: d["objects"].append({"id": "a_1", "category": "x", "position": [True, 1], "size": [1, 1, 1]}),
         "objects.0.position: .*not a boolean"),
        (lambda d: d["room"]["doors"][0].update(width=True), r"room.doors.0.width: .*not a boolean"),
        # a JSON "\udcff" escape: text that is not Unicode (the tokenizer cannot encode it)
        (lambda d: d["objects"].append({"id": "a_1", "category": "x", "position": [1, 1], "size": [1, 1, 1],
                                        "description": "\udcff bed"}), "objects.0.description: .*lone surrogate"),
        (lambda d: d.update(prompt="a \udcff bedroom"), "prompt: .*lone surrogate"),
        (lambda d: d.update(budget={"total_units": 512, "used_units": 10**30}),
         "budget: .*used_units 1000000000000000000000000000000 exceeds total_units 512"),
        # what the add operation refuses, a file may not hold either
        (lambda d: d["objects"].append({"id": "a_1", "category": "x", "position": [1, 1], "size": [1, 1, 1],
                                        "mount": "wall", "elevation": -3.0}), "a_1: elevation -3.0 puts its bottom below"),
        (lambda d: d["objects"].extend([{"id": "a_1", "category": "x", "position": [1, 1], "size": [1, 1, 1]},
                                        {"id": "b_1", "category": "x", "position": [2, 2], "size": [1, 1, 1],
                                         "parent": "a_1"}]), "b_1: a parent is only for mount 'on', not 'floor'"),
    ],
)
def test_schema_errors_name_the_field(mutate, field):
    data = {"room": room(), "objects": []}
    mutate(data)
    with pytest.raises(SceneError, match=field):
        scene_from_json(data)


def test_cli_check_and_render_on_dev_scenes(tmp_path, capsys):
    line = (DATA / "dev.jsonl").read_text().splitlines()[0]
    (tmp_path / "rec.json").write_text(line)
    assert main(["scene", "check", str(tmp_path / "rec.json")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"metrics", "judge", "grades", "reward", "failure_cause", "warnings"}
    assert out["judge"] == {"backend": "rule", "model": None}  # no --config: the rule judge
    assert out["metrics"]["reachable"] and out["metrics"]["object_count"] == 0
    # an empty room is no scene an episode may end with: not judged, the episode's -1 (it was
    # graded 0.857 here while the same terminal scene scored -1 in training)
    assert (out["grades"], out["reward"], out["failure_cause"]) == (None, -1.0, "invalid_terminal_scene")
    assert out["warnings"] == ["the final scene is empty"]
    assert main(["scene", "render", str(tmp_path / "rec.json"), "-o", str(tmp_path / "r.png")]) == 0
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_check_furnished_scene_with_overrides(tmp_path, capsys, caplog):
    s = KNOWN["split"]().to_json()
    s["objects"].append({"id": "ufo_1", "category": "ufo", "position": [0.5, 2.5], "size": [0.3, 0.3, 0.3]})
    (tmp_path / "s.json").write_text(json.dumps(s))
    with caplog.at_level("WARNING"):
        assert main(["scene", "check", str(tmp_path / "s.json"), "--requested-units", "256",
                     "--requested", "bed:1,nightstand:2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert caplog.messages == ["unknown category 'ufo' (ufo_1)"]   # logged (stderr), as every warning
    m = out["metrics"]
    assert m["num_regions"] == 2 and not m["reachable"] and m["unreachable_objects"] == ["nightstand_1", "wardrobe_1"]
    assert m["collision_pairs"] == [] and isinstance(m["collision_pairs"], list)
    assert out["grades"]["prompt_following"] == 7  # 2 of 3 requested objects (round half up of 6.67)
    assert out["grades"]["reachability"] <= 6
    assert out["reward"] == pytest.approx(sum(out["grades"].values()) / 70 - 0.4)
    assert out["warnings"] == ["unknown category 'ufo' (ufo_1)"]
    # without requested items (a furnished scene file holds none) an empty room scored full
    # prompt_following without a word
    s["objects"] = []
    (tmp_path / "s.json").write_text(json.dumps(s))
    assert main(["scene", "check", str(tmp_path / "s.json")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["grades"] is None and out["reward"] == -1.0 and out["warnings"] == [
        "the final scene is empty", "no requested items (a scene file holds none; give --requested, or check a scene-set "
        "record): prompt_following counts nothing asked as met"]


def test_cli_invalid_input_exits_non_zero_with_one_line(tmp_path, capsys):
    (tmp_path / "bad.json").write_text('{"room": {"floor_polygon": [[0, 0], [1, 0]], "wall_height": 2}}')
    assert main(["scene", "check", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "floor_polygon" in err
    assert main(["scene", "check", str(tmp_path / "missing.json")]) == 2
    capsys.readouterr()
    s = KNOWN["split"]().to_json()
    (tmp_path / "s.json").write_text(json.dumps(s))
    (tmp_path / "typo.yaml").write_text("modle: {}\nscene: {}\n")   # a misspelt section
    assert main(["scene", "check", str(tmp_path / "s.json"), "--config",
                 str(tmp_path / "typo.yaml")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'typo.yaml'}: unknown key 'modle'"


@pytest.mark.parametrize(
    "name,text,why",
    [
        ("deep.json", "[" * 100_000 + "]" * 100_000, "not valid JSON: nested too deeply"),
        ("doorless.json", json.dumps({"room": {**room(), "doors": []}}), "room.doors: .*at least one door"),
        ("crowded.json", json.dumps({"room": room(), "objects": [{"id": "x"}] * 5000}),
         "objects has 5000 entries; a scene holds at most 128"),
    ],
    ids=["nested", "doorless", "crowded"],
)
def test_cli_check_refuses_unmeasurable_scenes_in_one_line(tmp_path, capsys, name, text, why):
    (tmp_path / name).write_text(text)
    assert main(["scene", "check", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{tmp_path / name}: " in err
    assert re.search(why, err), err


def test_scene_runtime_imports_no_models_flax_grpo_or_jax():
    import subprocess
    import sys

    code = (
        "import sys, jscenegen.scene.episode, jscenegen.scene.expert, jscenegen.scene.judge_http, "
        "jscenegen.scene.protocol, jscenegen.scene.render, jscenegen.commands.scene; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('flax', 'jax', 'torch') "
        "or m.startswith(('jscenegen.grpo', 'jscenegen.model'))]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_cli_refuses_far_objects_in_check_and_render(tmp_path, capsys):
    s = KNOWN["split"]().to_json()
    s["objects"][0]["position"] = [1e30, 1e30]
    (tmp_path / "far.json").write_text(json.dumps(s))
    assert main(["scene", "check", str(tmp_path / "far.json")]) == 2
    assert re.search(r"far.json: objects.0: .*position .* is beyond", one_error_line(capsys))
    assert main(["scene", "render", str(tmp_path / "far.json"), "-o", str(tmp_path / "far.png")]) == 2
    assert "position" in one_error_line(capsys) and not (tmp_path / "far.png").exists()


def test_cli_refuses_empty_sets(tmp_path, capsys):
    assert main(["scene", "generate", "--split", "dev", "--n", "-1", "-o", str(tmp_path / "g.jsonl")]) == 2
    assert "--n" in one_error_line(capsys) and not (tmp_path / "g.jsonl").exists()


def test_cli_never_writes_over_its_input(tmp_path, capsys):
    dev = tmp_path / "dev.jsonl"
    dev.write_text((DATA / "dev.jsonl").read_text())
    for out in (dev, tmp_path / "." / "dev.jsonl"):
        assert main(["scene", "furnish", str(dev), "--index", "0", "-o", str(out)]) == 2
        err = one_error_line(capsys)
        assert f"-o {out} is the same file as the scene set {dev}" in err
    assert dev.read_text() == (DATA / "dev.jsonl").read_text()
    record = tmp_path / "record.png"           # a scene file whose name a render could take
    record.write_text(dev.read_text().splitlines()[0])
    assert main(["scene", "render", str(record), "-o", str(record)]) == 2
    assert "same file" in one_error_line(capsys) and record.read_text() == dev.read_text().splitlines()[0]


def test_cli_furnish_names_a_binary_file_and_finds_shipped_sets_from_anywhere(tmp_path, capsys, monkeypatch):
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00\x81 not text")
    assert main(["scene", "furnish", str(tmp_path / "bin.json"), "-o", str(tmp_path / "o.json")]) == 2
    assert f"{tmp_path / 'bin.json'}:1: not UTF-8 text" in one_error_line(capsys)
    monkeypatch.chdir(tmp_path)  # outside the checkout: data/... resolves under it
    assert main(["scene", "furnish", "data/scenes/dev.jsonl", "--index", "1", "-o", "f.json"]) == 0
    assert json.loads(capsys.readouterr().out)["output"] == "f.json"
    assert scene_from_json(json.loads((tmp_path / "f.json").read_text())).objects


@pytest.mark.parametrize("fails", ["judge", "runtime"])
def test_cli_furnish_of_a_masked_episode_prints_no_reward_and_exits_1(tmp_path, capsys, monkeypatch, fails):
    """A masked episode (the rule judge raised, or the scene runtime did) has no reward: furnish
    printed the masked 0.0 and exited 0, where `scene check` prints null and exits 1. The
    scene is written all the same; one error line says what failed."""
    from jscenegen.scene.episode import Episode
    from jscenegen.scene.judge_rule import RuleJudge

    def boom(*a, **kw):
        raise RuntimeError("boom")

    monkeypatch.setattr(RuleJudge if fails == "judge" else Episode,
                        "grade" if fails == "judge" else "_critic", boom)
    out = tmp_path / "f.json"
    assert main(["scene", "furnish", str(DATA / "dev.jsonl"), "--index", "2", "-o", str(out)]) == 1
    cap = capsys.readouterr()
    got = json.loads(cap.out)
    assert got["reward"] is None and got["grades"] is None and out.is_file()
    if fails == "judge":
        assert got["failure_cause"] == "judge_error"
        assert cap.err.splitlines()[-1] == (
            f"error: the judge did not grade the scene (judge_error: RuntimeError: boom); {out} holds it "
            "(the rule judge's error is in the log above)")
    else:
        assert got["failure_cause"] == "runtime_error"
        assert cap.err.splitlines()[-1] == (
            "error: the episode was masked (runtime_error: RuntimeError: boom): jscenegen's "
            "sampler or scene runtime failed, not the policy (the log line above names the error; "
            f"JSCENEGEN_DEBUG=1 adds its traceback); {out} holds the scene as it stood")


def test_cli_furnish_reads_only_the_scene_it_plays(tmp_path, capsys):
    """It validated every record of the set first: ~0.2 ms each, minutes for a set of a
    million scenes, to play one."""
    first = (DATA / "dev.jsonl").read_text().splitlines()[0]
    (tmp_path / "set.jsonl").write_text(first + "\n\n{not json\n")
    out = tmp_path / "o.json"
    assert main(["scene", "furnish", str(tmp_path / "set.jsonl"), "--index", "0", "-o", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["output"] == str(out) and out.is_file()
    assert main(["scene", "furnish", str(tmp_path / "set.jsonl"), "--index", "1", "-o", str(out)]) == 2
    assert f"error: {tmp_path / 'set.jsonl'}:3: not valid JSON" in one_error_line(capsys)
    assert main(["scene", "furnish", str(tmp_path / "set.jsonl"), "--index", "2", "-o", str(out)]) == 2
    assert one_error_line(capsys) == f"error: --index 2 is outside {tmp_path / 'set.jsonl'} (2 scenes)"
    # the library names no command-line flag (it said --index to every caller)
    with pytest.raises(IndexError, match=r"^-1 is outside .*set\.jsonl \(records are numbered from 0\)$"):
        read_scene_record(tmp_path / "set.jsonl", -1)   # refused before the file is read


def test_cli_furnish_refuses_a_request_the_catalogue_cannot_satisfy(tmp_path, capsys):
    """It played the episode and exited 0 with failure_cause invalid_terminal_scene; eval
    refused the same file."""
    record = json.loads((Path(__file__).resolve().parents[1] / "data/scenes/dev.jsonl").read_text().splitlines()[0])
    record["requested"] = [{"category": "spaceship", "count": 1}]
    (tmp_path / "set.jsonl").write_text(json.dumps(record) + "\n")
    assert main(["scene", "furnish", str(tmp_path / "set.jsonl"), "-o", str(tmp_path / "x.json")]) == 2
    assert one_error_line(capsys).endswith(
        "requests 'spaceship': neither a category nor a group of the catalogue")
    assert not (tmp_path / "x.json").exists()


def test_a_record_requesting_more_objects_than_an_episode_may_add_is_refused(tmp_path, capsys):
    """chair x41 with at most 40 objects per episode could never get prompt_following 10; the
    shipped sets request at most scene.max_objects each."""
    from jscenegen.scene.catalogue import load_catalogue
    from jscenegen.scene.config import SceneRuntimeConfig
    from jscenegen.scene.sceneset import check_records_usable

    cfg, cat = SceneRuntimeConfig(), load_catalogue()
    assert cfg.max_objects == 40
    for name in ("train.jsonl", "dev.jsonl"):
        check_records_usable(read_scene_set(DATA / name), cat, cfg.metrics, name, max_objects=cfg.max_objects)
    record = json.loads((DATA / "dev.jsonl").read_text().splitlines()[0])
    record["requested"] = [{"category": "chair", "count": 39}, {"category": "bed", "count": 1}]
    (tmp_path / "set.jsonl").write_text("\n" + json.dumps(record) + "\n")   # 40: accepted
    check_records_usable(read_scene_set(tmp_path / "set.jsonl"), cat, cfg.metrics, "set.jsonl", max_objects=40)
    record["requested"][0]["count"] = 40
    (tmp_path / "set.jsonl").write_text("\n" + json.dumps(record) + "\n")
    why = (f"scene {record['scene']['scene_id']} requests 41 objects in all, more than an episode may add "
           "(scene.max_objects 40): prompt_following could never reach 10; lower the counts or raise "
           "scene.max_objects")
    with pytest.raises(SceneError, match=re.escape(f"set.jsonl:2: {why}")):
        check_records_usable(read_scene_set(tmp_path / "set.jsonl"), cat, cfg.metrics, "set.jsonl", max_objects=40)
    assert main(["scene", "furnish", str(tmp_path / "set.jsonl"), "-o", str(tmp_path / "x.json")]) == 2
    assert one_error_line(capsys) == f"error: {tmp_path / 'set.jsonl'}:2: {why}"
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("requested, why", [
    ([{"category": "bed", "count": 1}, {"category": "bed", "count": 2}],
     r"requested\[1\]: category 'bed' is requested twice"),
    ([{"category": "bed", "count": 0}], r"requested\[0\] must be .*1\.\.128"),
    ([{"category": "bed", "count": 10**23}], r"requested\[0\] must be .*1\.\.128"),
    ([{"category": "", "count": 1}], r"requested\[0\] must be"),
    ([{"category": "b\udcffed", "count": 1}], r"requested\[0\]\.category: .*lone surrogate"),
])
def test_a_records_requested_items_are_checked(requested, why):
    data = {"scene": {"room": room(), "objects": []}, "seed": 1, "requested": requested}
    with pytest.raises(SceneError, match=why):
        record_from_json(data, "set.jsonl:3")


@pytest.mark.parametrize("prompt", ["", "  \n\t"])
def test_a_records_prompt_is_not_blank(prompt):
    """eval ran a set whose record had `"prompt": ""` (the planner given no request) while
    `design --prompt ""` is refused."""
    data = {"scene": {"room": room(), "prompt": prompt}, "seed": 1, "requested": []}
    with pytest.raises(SceneError, match=r"^set.jsonl:3: scene.prompt: empty; a record's prompt "):
        record_from_json(data, "set.jsonl:3")
    data["scene"]["prompt"] = "a bed"
    assert record_from_json(data, "set.jsonl:3").scene.prompt == "a bed"


def test_requests_the_catalogue_does_not_know_are_refused_or_flagged(tmp_path, capsys):
    """A typo in a request can never be satisfied: prompt_following dropped silently."""
    record = json.loads((DATA / "dev.jsonl").read_text().splitlines()[1])
    (tmp_path / "rec.json").write_text(json.dumps(record))
    assert main(["scene", "check", str(tmp_path / "rec.json"), "--requested", "queen_bed:1,nightstnd:2"]) == 2
    assert one_error_line(capsys) == (
        "error: --requested item 'nightstnd:2': 'nightstnd' is neither a category nor a group of "
        "the catalogue (groups: bed, lamp, seating)")
    assert main(["scene", "check", str(tmp_path / "rec.json"), "--requested", "nightstand:-2"]) == 2
    assert one_error_line(capsys) == (   # said "a count of at most 9 digits"
        "error: --requested item 'nightstand:-2' is not category:count (a count in 1..128)")
    record["requested"].append({"category": "spaceship", "count": 1})
    (tmp_path / "rec.json").write_text(json.dumps(record))
    assert main(["scene", "check", str(tmp_path / "rec.json")]) == 0
    assert "requested 'spaceship' is neither a category nor a group" in json.loads(capsys.readouterr().out)["warnings"]
    (tmp_path / "set.jsonl").write_text("\n" + json.dumps(record) + "\n")   # named by its line, 2
    assert main(["train", "--run-dir", str(tmp_path / "run"), f"schedule.train_set={tmp_path / 'set.jsonl'}"]) == 2
    assert one_error_line(capsys) == (
        f"error: {tmp_path / 'set.jsonl'}:2: scene {record['scene']['scene_id']} requests 'spaceship': "
        "neither a category nor a group of the catalogue")
    assert not (tmp_path / "run").exists()


def test_requested_counts_are_capped_at_what_a_scene_holds(tmp_path, capsys):
    """`scene check --requested` capped each count (1..128) but not their sum: 'bed:100,
    nightstand:29', or a thousand items, were taken whole, though no scene holds more than
    MAX_SCENE_OBJECTS objects. Refused at the item that passes the cap, naming it and the cap,
    whatever the text's length; a record's `requested` likewise."""
    from jscenegen.scene.sceneset import record_from_json
    from jscenegen.scene.schema import MAX_SCENE_OBJECTS, SceneError

    record = json.loads((DATA / "dev.jsonl").read_text().splitlines()[1])
    (tmp_path / "rec.json").write_text(json.dumps(record))
    cap = MAX_SCENE_OBJECTS
    for requested, item, total in (("bed:999999999", "bed:999999999", 999999999),
                                   (f"bed:100,nightstand:{cap - 99}", f"nightstand:{cap - 99}", cap + 1),
                                   (",".join(["bed:1"] * 20000), "bed:1", cap + 1)):
        assert main(["scene", "check", str(tmp_path / "rec.json"), "--requested", requested]) == 2
        assert one_error_line(capsys) == (
            f"error: --requested item '{item}': the requested counts reach {total}, more than a "
            f"scene holds ({cap} objects)")
    assert main(["scene", "check", str(tmp_path / "rec.json"), "--requested",
                 f"bed:100,nightstand:{cap - 100}"]) == 0   # at the cap: checked
    capsys.readouterr()
    record["requested"] = [{"category": "bed", "count": 100}, {"category": "nightstand", "count": 29}]
    with pytest.raises(SceneError, match=r"^set.jsonl:3: requested\[1\] \('nightstand' x29\): the "
                       r"requested counts reach 129, more than a scene holds \(128 objects\)$"):
        record_from_json(record, "set.jsonl:3")


def test_a_requested_count_of_0_is_refused_at_once_in_the_loops_own_words():
    """Counts of 0 added nothing to the sum, so `bed:0` repeated 200,000 times was read whole
    (each name looked up in the catalogue) before requested_items refused item 0 in another
    format: refused at the first, naming it, with nothing looked up."""
    from jscenegen.commands.scene import _requested

    class Catalogue:
        asked = 0

        def knows(self, name):
            Catalogue.asked += 1
            return True

    for text in (",".join(["bed:0"] * 200_000), "nightstand:1,bed:00,chair:1"):
        item = "bed:0" if text.startswith("bed") else "bed:00"
        with pytest.raises(ValueError) as err:
            _requested(text, Catalogue())
        assert str(err.value) == (f"--requested item '{item}' is not category:count (a count "
                                  "in 1..128)")
    assert Catalogue.asked == 1   # nightstand only
    assert _requested("bed:1,nightstand:2", Catalogue()) == [
        {"category": "bed", "count": 1}, {"category": "nightstand", "count": 2}]


def test_a_room_the_measuring_grid_cannot_hold_is_refused_before_the_run(tmp_path, capsys):
    """Every episode of such a scene failed at its first measurement (masked rollout errors,
    the scene redrawn and skipped each epoch) while the set itself was accepted."""
    record = json.loads((DATA / "dev.jsonl").read_text().splitlines()[0])
    record["scene"]["room"] = room(w=7.0, d=4.0)
    (tmp_path / "set.jsonl").write_text(json.dumps(record) + "\n")
    why = (f"{tmp_path / 'set.jsonl'}:1: scene {record['scene']['scene_id']}: room bounding box "
           "7.00 x 4.00 m exceeds the 128 x 128 cell grid (6.40 m)")
    assert main(["train", "--run-dir", str(tmp_path / "run"),
                 f"schedule.train_set={tmp_path / 'set.jsonl'}"]) == 2
    assert one_error_line(capsys).startswith(f"error: {why}")
    assert not (tmp_path / "run").exists()
    assert main(["scene", "furnish", str(tmp_path / "set.jsonl"), "-o", str(tmp_path / "x.json")]) == 2
    assert one_error_line(capsys).startswith(f"error: {why}")
    record["scene"]["room"] = room(w=6.0, d=4.0)   # fits
    (tmp_path / "set.jsonl").write_text(json.dumps(record) + "\n")
    assert main(["scene", "furnish", str(tmp_path / "set.jsonl"), "-o", str(tmp_path / "x.json")]) == 0


def test_a_scene_set_holds_each_scene_id_once(tmp_path):
    """Reports name scenes by id: two scenes of one id would be one row of `eval --compare`."""
    lines = (DATA / "dev.jsonl").read_text().splitlines()
    (tmp_path / "set.jsonl").write_text("\n".join([lines[0], lines[1], lines[0]]) + "\n")
    scene_id = json.loads(lines[0])["scene"]["scene_id"]
    with pytest.raises(SceneError, match=rf"set.jsonl:3: scene_id '{scene_id}' is already the id of line 1$"):
        read_scene_set(tmp_path / "set.jsonl")


def test_render_names_its_format_and_measuring_errors_name_the_file(tmp_path, capsys):
    s = KNOWN["split"]().to_json()
    (tmp_path / "s.json").write_text(json.dumps(s))
    assert main(["scene", "render", str(tmp_path / "s.json"), "-o", str(tmp_path / "s.jpg")]) == 2
    assert one_error_line(capsys) == (f"error: -o {tmp_path / 's.jpg'}: the file is written as PNG; "
                                      "give a name ending in .png")
    s["objects"][0]["position"] = [600.0, 600.0]      # inside the schema's bound, beyond the grid's
    (tmp_path / "far.json").write_text(json.dumps(s))
    for argv in (["check", str(tmp_path / "far.json")],
                 ["render", str(tmp_path / "far.json"), "-o", str(tmp_path / "far.png")]):
        assert main(["scene", *argv]) == 2
        err = one_error_line(capsys)
        assert err.startswith(f"error: {tmp_path / 'far.json'}: ") and "the measuring grid's 32-bit arithmetic reaches" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["far.json", "s.json"]


@pytest.mark.parametrize("seed", [-1, 2**40, True, 1.5])
def test_a_records_seed_is_32_bits(seed):
    data = {"scene": {"room": room(), "objects": []}, "seed": seed, "requested": []}
    with pytest.raises(SceneError, match=r"^set.jsonl:3: seed must be an integer in 0..4294967295"):
        record_from_json(data, "set.jsonl:3")


def test_a_record_whose_scene_holds_objects_is_refused_naming_file_and_line(tmp_path):
    """Section 6: a record's scene has an empty objects list (the episode furnishes it); one with
    objects was read and its episode started furnished."""
    empty = {"scene": {"room": room(), "objects": [], "prompt": "a bed"}, "seed": 1, "requested": []}
    bed = {"id": "single_bed_1", "category": "single_bed", "position": [2.0, 1.5], "size": [0.9, 2.0, 0.5]}
    furnished = {**empty, "scene": {**empty["scene"], "objects": [bed]}}
    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps(empty) + "\n" + json.dumps(furnished) + "\n")
    with pytest.raises(SceneError, match=rf"^{re.escape(str(path))}:2: scene\.objects: 1 object; a "
                                         r"record's scene is the empty room the episode furnishes "
                                         r"\(objects: \[\]\)$"):
        read_scene_set(path)
    assert record_from_json(empty).scene.objects == ()


def test_a_pretty_printed_scene_given_as_a_scene_set_is_told_the_format(tmp_path):
    record = {"scene": {"room": room(), "objects": []}, "seed": 1, "requested": []}
    path = tmp_path / "set.json"
    path.write_text(json.dumps(record, indent=2))
    with pytest.raises(SceneError, match=r"set.json:1: not valid JSON: .*\(a scene set holds one "
                                         r"JSON record per line: JSONL\)$"):
        read_scene_set(path)


def test_scene_set_lines_split_at_newlines_only(tmp_path):
    """A record whose prompt holds a raw U+2028 (json.dumps(ensure_ascii=False) writes one) was
    cut in two by str.splitlines and refused; CRLF endings still read, and line numbers are an
    editor's (a lone CR or a form feed does not start a line)."""
    rec = make_record(0, "a").to_json()
    rec["scene"]["prompt"] = "A room\u2028with\u0085odd\x0cbreaks"
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps(rec, ensure_ascii=False) + "\r\n", encoding="utf-8", newline="")
    (record,) = read_scene_set(path)
    assert record.scene.prompt == "A room\u2028with\u0085odd\x0cbreaks"
    other = make_record(1, "b").to_json()
    path.write_text(json.dumps(rec) + "\r" + json.dumps(other) + "\n\x0c\n{", newline="")
    with pytest.raises(SceneError, match=rf"^{re.escape(str(path))}:1: not valid JSON"):
        read_scene_set(path)
    path.write_text(json.dumps(rec) + "\n\x0c\n" + json.dumps(other) + "\n{", newline="")
    with pytest.raises(SceneError, match=rf"^{re.escape(str(path))}:4: not valid JSON"):
        read_scene_set(path)


def test_render_draws_any_id_as_text_under_any_legal_file_name(tmp_path, capsys):
    """matplotlib parsed `$...$` in an object id as math (`\\sqrt$` ended the render with a
    ParseSyntaxException) and warned of missing glyphs for control characters; the atomic
    writer's hidden temporary, `.NAME.XXXXXXXX.png`, made a legal 251-byte name fail with
    "File name too long"; `-o .png` was refused as "not ending in .png"."""
    s = KNOWN["split"]().to_json()
    s["scene_id"] = "id\x1bwith\x00control$\\sqrt$"
    s["objects"][0]["id"] = "odd$\\frac{$x"
    (tmp_path / "s.json").write_text(json.dumps(s))
    for name in ("a" * 251 + ".png", ".png"):
        assert main(["scene", "render", str(tmp_path / "s.json"), "-o", str(tmp_path / name)]) == 0
        captured = capsys.readouterr()
        assert captured.err == "" and json.loads(captured.out)["output"] == str(tmp_path / name)
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".png", "a" * 251 + ".png", "s.json"]


def test_a_scene_set_is_read_a_line_at_a_time_and_bounded(tmp_path, monkeypatch):
    """The whole file was read and decoded at once: one 300 MB line took 843 MB, and `scene
    furnish --index 0` of its first record read all of it (helper-172)."""
    import tracemalloc

    from jscenegen.scene import sceneset

    first = json.dumps(make_record(0, "s0").to_json())
    big = tmp_path / "big.jsonl"
    with open(big, "w") as f:
        f.write(first + "\n" + "x" * (sceneset.MAX_RECORD_BYTES + 1) + "\n")
    tracemalloc.start()
    assert read_scene_record(big, 0).scene.scene_id == "s0"
    assert tracemalloc.get_traced_memory()[1] < 2**20   # the first line only
    tracemalloc.stop()
    with pytest.raises(SceneError, match=rf"^{re.escape(str(big))}:2: a record of more than "
                                         r"4,194,304 bytes \(a scene set holds one scene per line"):
        read_scene_set(big)
    joined = tmp_path / "joined.jsonl"   # a byte-order mark starts the file, not a line in it
    joined.write_bytes(b"\xef\xbb\xbf" + first.encode() + b"\n\xef\xbb\xbf" + first.encode() + b"\n")
    with pytest.raises(SceneError, match=rf"^{re.escape(str(joined))}:2: not valid JSON"):
        read_scene_set(joined)
    exact = tmp_path / "exact.jsonl"   # a record of exactly the limit, CRLF-ended, is a record
    exact.write_text(first + " " * (sceneset.MAX_RECORD_BYTES - len(first)) + "\r\n")
    assert len(read_scene_set(exact)) == 1
    monkeypatch.setattr(sceneset, "MAX_SCENE_SET_RECORDS", 2)
    many = tmp_path / "many.jsonl"
    write_scene_set(many, [make_record(i, f"s{i}") for i in range(3)])
    assert len([read_scene_record(many, i) for i in range(2)]) == 2
    with pytest.raises(SceneError, match=r"many.jsonl: more than 2 scenes \(line 3\); split the set$"):
        read_scene_set(many)
