"""Action parser causes, the episode state machine (caps, critique, revert, fail hook), reward, judging."""
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jscenegen.scene.actions import parse_action
from jscenegen.scene.config import GRADE_KEYS, JudgeConfig, RewardConfig, SceneRuntimeConfig
from jscenegen.scene.episode import Episode, judge_episodes
from jscenegen.scene.expert import run_scripted_episode
from jscenegen.scene.generator import make_scene_set
from jscenegen.scene.judge import JudgeResult, make_judge
from jscenegen.scene.protocol import protocol_hash
from jscenegen.scene.reward import failed_outcome, reward_from_grades
from jscenegen.scene.sceneset import SceneRecord

from scene_fixtures import empty_room

GRADES = {k: 7 for k in GRADE_KEYS}


def A(obj) -> str:
    return "thinking...\n<action>" + json.dumps(obj) + "</action>"


@pytest.mark.parametrize(
    "text,role,cause",
    [
        ("I will design now.", "planner", "no_action_block"),
        (A({"action": "critique"}) + A({"action": "finish", "summary": ""}), "planner", "multiple_action_blocks"),
        ("<action>{\"action\": \"critique\"}", "planner", "truncated_action"),
        ("<action>{\"action\": \"desi", "planner", "truncated_action"),
        (A({"action": "critique"}) + " and more", "planner", "text_after_action"),
        ("<action>{action: critique}</action>", "planner", "bad_json"),
        ("<action>[1, 2]</action>", "planner", "bad_json"),
        (A({"action": "dance"}), "planner", "unknown_action"),
        (A({"action": "design", "instruction": 5}), "planner", "schema_violation"),
        (A({"action": "finish"}), "planner", "schema_violation"),
        (A({"ops": []}), "planner", "role_violation"),
        (A({"action": "finish", "summary": "x"}), "designer", "role_violation"),
        (A({"critique": "ok", "grades": GRADES}), "designer", "role_violation"),
        (A({"ops": [{"op": "fly"}]}), "designer", "unknown_op"),
        (A({"ops": [{"op": "rotate_object", "id": "a", "yaw": "x"}]}), "designer", "schema_violation"),
        (A({"ops": {"op": "get_scene"}}), "designer", "schema_violation"),
        (A({"critique": "ok", "grades": {**GRADES, "realism": 11}}), "critic", "schema_violation"),
        (A({"critique": "ok", "grades": {**GRADES, "realism": 7.5}}), "critic", "schema_violation"),
        (A({"critique": "ok", "grades": {"realism": 7}}), "critic", "schema_violation"),
        (A({"action": "critique"}), "critic", "role_violation"),
        # JSON that Python parses but no scene text can hold: a lone surrogate escape, a
        # number past the digit limit (json.loads raises ValueError), a key given twice
        ('<action>{"action": "design", "instruction": "a \\ud800 b"}</action>', "planner", "bad_json"),
        ('<action>{"critique": "\\udfff", "grades": {}}</action>', "critic", "bad_json"),
        ('<action>{"ops": [{"op": "add_object", "category": "bed", "description": "\\ud83d",'
         ' "position": [1, 1]}]}</action>', "designer", "bad_json"),
        ('<action>{"action": "finish", "summary": "s", "n": ' + "1" * 5000 + "}</action>", "planner", "bad_json"),
        ('<action>{"action": "design", "action": "finish", "summary": "s"}</action>', "planner", "bad_json"),
        # Python's parser takes these constants; JSON has none
        ('<action>{"ops": [{"op": "rotate_object", "id": "a", "yaw": NaN}]}</action>', "designer", "bad_json"),
        ('<action>{"ops": [{"op": "move_object", "id": "a", "position": [-Infinity, 1]}]}</action>',
         "designer", "bad_json"),
        # numbers that are infinite as a float: the same constants written in digits
        ('<action>{"ops": [{"op": "rotate_object", "id": "a", "yaw": 1e400}]}</action>', "designer", "bad_json"),
        ('<action>{"ops": [{"op": "move_object", "id": "a", "position": [-' + "9" * 401 + ', 1]}]}</action>',
         "designer", "bad_json"),
    ],
)
def test_malformed_actions_give_the_right_cause(text, role, cause):
    parsed = parse_action(text, role, GRADE_KEYS)
    assert parsed.failure_cause == cause and parsed.message


@pytest.mark.parametrize("text, found", [
    ('<action>{"action": "critique"}</action></action>', "1 <action> and 2 </action>"),
    ('I mention </action> first, then <action>{"action": "critique"}</action>', "1 <action> and 2 </action>"),
    (A({"action": "critique"}) + A({"action": "finish", "summary": ""}), "2 <action> and 2 </action>"),
    ('<action>{"action": "critique"} <action>{"action": "finish"}</action>', "2 <action> and 1 </action>"),
])
def test_multiple_blocks_name_both_tag_counts(text, found):
    """A repeated closing tag alone was reported as "1 <action> tags; exactly one block is
    allowed": the count named the opening tags only."""
    parsed = parse_action(text, "planner", GRADE_KEYS)
    assert parsed.failure_cause == "multiple_action_blocks"
    assert parsed.message == f"found {found} tags; exactly one block (one of each) is allowed"


@pytest.mark.parametrize("text, inside", [
    ("thinking... <acti", True),                                   # cut in the opening tag
    ("thinking... <", True),
    ("thinking... <action", True),
    ('<action>{"action": "desi', True),                            # one block, not closed
    ('<action>{"action": "critique"}</action> <action>{"op', True),   # a second block opened
    ('<action>{"action": "critique"}</action> and <acti', True),
    ('I mention </action> first, then <action>{"action": "cri', True),
    ("thinking about the room, very very", False),
    ("thinking... <b", False),
    ('<action>{"action": "critique"}</action> and more words', False),
    ('<action>{"action": "critique"}</action>', False),
    ("", False),
])
def test_cut_inside_action(text, inside):
    from jscenegen.scene.actions import cut_inside_action

    assert cut_inside_action(text) is inside


def test_a_number_infinite_as_a_float_is_named_in_the_message():
    yaw = parse_action('<action>{"ops": [{"op": "rotate_object", "id": "a", "yaw": 1e400}]}</action>',
                       "designer", GRADE_KEYS)
    assert yaw.message == ("action block is not valid JSON: the number 1e400 is too large for a float "
                           "(beyond 1.8e308)")
    big = parse_action('<action>{"action": "finish", "summary": "s", "n": ' + "9" * 401 + "}</action>",
                       "planner", GRADE_KEYS)
    assert big.failure_cause == "bad_json" and big.message == (
        f"action block is not valid JSON: the integer {'9' * 20}... (401 digits) is too large for a "
        "float (beyond 1.8e308)")
    fits = '<action>{"ops": [{"op": "rotate_object", "id": "a", "yaw": 1e308}]}</action>'
    assert parse_action(fits, "designer", GRADE_KEYS).failure_cause is None


def test_well_formed_actions_parse():
    assert parse_action(A({"action": "critique"}) + "\n  ", "planner", GRADE_KEYS).payload == {"action": "critique"}
    ops = parse_action(A({"ops": [{"op": "get_scene"}]}), "designer", GRADE_KEYS).payload
    assert [o.op for o in ops] == ["get_scene"]
    assert parse_action(A({"critique": "c", "grades": GRADES}), "critic", GRADE_KEYS).payload["grades"] == GRADES
    paired = '<action>{"action": "design", "instruction": "\\ud83d\\ude00 a sofa"}</action>'
    assert parse_action(paired, "planner", GRADE_KEYS).payload["instruction"] == "\U0001F600 a sofa"


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list('<>/actionps{}[]":,0123456789 \n')), max_size=80),
       role=st.sampled_from(["planner", "designer", "critic"]))
def test_parser_never_raises(text, role):
    parsed = parse_action(text, role, GRADE_KEYS)
    assert parsed.ok or parsed.failure_cause


def record():
    return SceneRecord(empty_room(), seed=7, requested=({"category": "bed", "count": 1},))


def test_episode_flow_critique_cap_revert_and_finish():
    cfg = SceneRuntimeConfig(max_critique_rounds=1)
    ep = Episode(record(), cfg)
    assert "Planner" in ep.system_prompt() and "add_object (8 units)" in ep.system_prompt()
    assert "Next role: planner" in ep.first_user_message()
    assert ep.next_role == "planner"
    r = ep.step(A({"action": "design", "instruction": "add a bed"}))
    assert ep.next_role == "designer" and "Next role: designer" in r.env_message
    r = ep.step(A({"ops": [{"op": "add_object", "category": "queen_bed", "position": [2.0, 1.8]}]}))
    assert ep.next_role == "planner" and "queen_bed_1" in r.env_message and ep.units == 8
    ep.step(A({"action": "critique"}))
    assert ep.next_role == "critic"
    r = ep.step(A({"critique": "fine", "grades": GRADES}))
    assert "Critic: fine" in r.env_message and ep.next_role == "planner"
    r = ep.step(A({"action": "critique"}))  # second round is refused, not failed
    assert "refused" in r.env_message and ep.next_role == "planner" and not r.done
    ep.step(A({"action": "design", "instruction": "remove the bed"}))
    ep.step(A({"ops": [{"op": "remove_object", "id": "queen_bed_1"}]}))
    assert ep.scene.objects == () and ep.units == 10
    r = ep.step(A({"action": "revert", "reason": "the bed was better"}))
    assert [o.id for o in ep.scene.objects] == ["queen_bed_1"] and ep.units == 10  # units not refunded
    r = ep.step(A({"action": "finish", "summary": "done"}))
    assert r.done and r.failure_cause is None and ep.judge_request() is not None
    (out,) = judge_episodes([ep], make_judge(JudgeConfig()))
    assert not out.masked and out.failure_cause is None
    expect = sum(out.grades.values()) / 7 / 10 - 0.8 * 10 / 512
    assert out.reward == pytest.approx(expect)


def test_planner_turn_cap_is_a_policy_failure():
    ep = Episode(record(), SceneRuntimeConfig(max_planner_turns=2))
    ep.step(A({"action": "design", "instruction": "x"}))
    ep.step(A({"ops": []}))
    r = ep.step(A({"action": "design", "instruction": "more"}))
    assert r.done and r.failure_cause == "planner_turn_cap"
    assert ep.outcome.reward == -1.0 and not ep.outcome.masked


def test_malformed_answer_fails_the_episode_and_empty_finish_is_invalid():
    ep = Episode(record())
    r = ep.step("no block here")
    assert r.done and r.failure_cause == "no_action_block" and ep.outcome.reward == -1.0
    with pytest.raises(RuntimeError):
        ep.step(A({"action": "critique"}))
    ep2 = Episode(record())
    r = ep2.step(A({"action": "finish", "summary": "nothing"}))
    assert r.failure_cause == "invalid_terminal_scene" and ep2.outcome.reward == -1.0


def test_driver_fail_hook_policy_and_masked():
    ep = Episode(record())
    ep.step(A({"action": "design", "instruction": "x"}))
    r = ep.fail("truncated_generation")
    assert r.done and ep.outcome.reward == -1.0 and not ep.outcome.masked
    ep2 = Episode(record())
    ep2.fail("rollout_error")
    assert ep2.outcome.masked and ep2.outcome.reward == 0.0
    with pytest.raises(ValueError):
        Episode(record()).fail("bored")


def finished_episodes(n: int) -> list[Episode]:
    """`n` episodes that placed a bed and finished, waiting for the judge."""
    eps = []
    for _ in range(n):
        ep = Episode(record())
        ep.step(A({"action": "design", "instruction": "x"}))
        ep.step(A({"ops": [{"op": "add_object", "category": "queen_bed", "position": [2.0, 1.8]}]}))
        ep.step(A({"action": "finish", "summary": "x"}))
        eps.append(ep)
    return eps


class _BrokenJudge:
    def identity(self):
        return {"backend": "test", "model": None, "rubric_hash": "0"}

    def grade(self, requests):
        return [JudgeResult(None, "judge_timeout", {"attempts": 3}) for _ in requests]


def test_judge_failures_are_masked_never_minus_one():
    eps = finished_episodes(3)
    failed = Episode(record())
    failed.step("garbage")
    outs = judge_episodes(eps + [failed], _BrokenJudge())
    assert [o.masked for o in outs] == [True, True, True, False]
    assert [o.reward for o in outs] == [0.0, 0.0, 0.0, -1.0]
    assert outs[0].failure_cause == "judge_timeout" and all(math.isfinite(o.reward) for o in outs)


class _ShortJudge(_BrokenJudge):
    def grade(self, requests):   # answers the first request only
        return [JudgeResult({k: 7 for k in GRADE_KEYS}, None, {})]


def test_a_judge_answering_fewer_results_than_requests_masks_them_all(caplog):
    """Episode 2 kept outcome None, and the trainer crashed on it later."""
    eps = finished_episodes(2)
    with caplog.at_level("WARNING"):
        outs = judge_episodes(eps, _ShortJudge())
    assert [(o.masked, o.failure_cause, o.reward) for o in outs] == [(True, "judge_error", 0.0)] * 2
    assert "the judge answered 1 results for 2 episodes" in caplog.text


class _RaisingJudge(_BrokenJudge):
    def grade(self, requests):
        raise RuntimeError("device OOM\nwhile grading " + "x" * 400)


def test_a_judge_exception_keeps_its_text_in_the_warning_and_detail(caplog):
    """scene/episode.py judge_episodes: "judge_error: RuntimeError" alone sent a reader to a
    log that lacked the cause; the exception's type and text are kept, on one line (one_line:
    lines joined by '; ') and clipped to JUDGE_ERROR_CHARS as clip_text clips."""
    eps = finished_episodes(2)
    with caplog.at_level("WARNING"):
        outs = judge_episodes(eps, _RaisingJudge())
    text = "RuntimeError: device OOM; while grading " + "x" * 400
    want = f"{text[:300]}... (440 characters)"
    assert [(o.masked, o.failure_cause) for o in outs] == [(True, "judge_error")] * 2
    assert [o.judge_info["detail"] for o in outs] == [want] * 2
    assert f"judge raised {want}; masking 2 episodes" in caplog.text


def test_reward_arithmetic():
    cfg = RewardConfig()
    r, q, pen = reward_from_grades({k: 10 for k in GRADE_KEYS}, 0, cfg)
    assert (r, q, pen) == (1.0, 1.0, 0.0)
    r, _, pen = reward_from_grades({k: 5 for k in GRADE_KEYS}, 128, cfg)
    assert pen == pytest.approx(0.2) and r == pytest.approx(0.3)
    r, _, pen = reward_from_grades({k: 0 for k in GRADE_KEYS}, 2000, cfg)  # penalty saturates at 512 units
    assert pen == pytest.approx(0.8) and r == pytest.approx(-0.8)
    assert failed_outcome("bad_json", 40, cfg).reward == -1.0
    assert failed_outcome("judge_unparseable", 40, cfg).masked


def test_scripted_expert_scores_well_on_dev_scenes():
    for rec in make_scene_set("dev", 3):
        ep, chat = run_scripted_episode(rec)
        out = ep.outcome
        assert out.failure_cause is None and out.metrics["reachable"] and not out.metrics["collision_pairs"]
        assert out.reward > 0.8 and out.units == ep.scene.budget.used_units
        assert [m["actor"] for m in chat if m["role"] == "assistant"] == [
            "planner", "designer", "planner", "critic", "planner"]


def test_the_expert_needs_no_category_a_scene_does_not_request(tmp_path):
    """It read the nightstand's size after placing any bed: a catalogue without nightstands
    crashed it on a scene asking only for a bed."""
    from importlib import resources

    doc = json.loads(resources.files("jscenegen.scene").joinpath("data/catalogue.json").read_text())
    del doc["categories"]["nightstand"]
    doc["room_types"]["bedroom"]["expected"] = [g for g in doc["room_types"]["bedroom"]["expected"]
                                                if "nightstand" not in g]
    doc["top_surfaces"].remove("nightstand")   # every name it lists is a category
    path = tmp_path / "catalogue.json"
    path.write_text(json.dumps(doc))
    rec = SceneRecord(empty_room(), seed=3, requested=({"category": "bed", "count": 1},))
    ep, _ = run_scripted_episode(rec, SceneRuntimeConfig(catalogue_path=str(path)))
    assert ep.outcome.failure_cause is None
    assert [o.category for o in ep.scene.objects if o.category.endswith("bed")]


def test_protocol_hash_tracks_every_ingredient():
    base = protocol_hash(SceneRuntimeConfig(), JudgeConfig())
    assert base == protocol_hash(SceneRuntimeConfig(), JudgeConfig())
    changed = [
        protocol_hash(SceneRuntimeConfig(budget_units=500), JudgeConfig()),
        protocol_hash(SceneRuntimeConfig(reward=RewardConfig(unit_penalty=0.5)), JudgeConfig()),
        protocol_hash(SceneRuntimeConfig(metrics={"agent_radius_m": 0.2}), JudgeConfig()),
        protocol_hash(SceneRuntimeConfig(), JudgeConfig(grade_keys=GRADE_KEYS[:6])),
        protocol_hash(SceneRuntimeConfig(), JudgeConfig(backend="http", base_url="http://x", model="m")),
    ]
    assert len(set(changed + [base])) == 6


def test_replaced_prompt_templates_change_the_hash_and_bad_ones_are_named(tmp_path):
    from importlib import resources

    from jscenegen.scene.prompts import TEMPLATE_NAMES, PromptError, load_templates

    src = resources.files("jscenegen.scene").joinpath("prompts")
    for name in TEMPLATE_NAMES:
        (tmp_path / f"{name}.txt").write_text(src.joinpath(f"{name}.txt").read_text())
    changed = SceneRuntimeConfig(prompts_dir=str(tmp_path))
    before = protocol_hash(changed, JudgeConfig())
    assert before == protocol_hash(SceneRuntimeConfig(), JudgeConfig())  # a copy of the packaged templates
    (tmp_path / "system.txt").write_text("Be brief. $op_table\nMystery: $not_provided\n")
    assert protocol_hash(changed, JudgeConfig()) != before
    with pytest.raises(PromptError, match=r"system.txt: placeholder \$not_provided"):
        Episode(record(), changed).system_prompt()
    (tmp_path / "critic.txt").unlink()
    with pytest.raises(PromptError, match=rf"^scene.prompts_dir {tmp_path}: critic.txt is missing \(needed: system"):
        load_templates(str(tmp_path))
    (tmp_path / "critic.txt").write_bytes(b"Grade \xff\xfe it.")
    with pytest.raises(PromptError, match=rf"^scene.prompts_dir {tmp_path}: critic.txt is not UTF-8 "
                                          r"text \(byte 6: invalid start byte\)$"):
        load_templates(str(tmp_path))
