"""The D-D-D-P-C schedule, zero_spread policies, episode seeds and the schedule hash."""
import pytest

from jscenegen.grpo.algo.roles import CRITIC, DESIGNER, PLANNER
from jscenegen.grpo.rollout.seeds import episode_seed
from jscenegen.grpo.train.schedule import (
    Schedule,
    ScheduleConfig,
    SchedulePosition,
    check_extension,
    check_scene_content,
)

SCENES = [(f"train-{i:04d}", 100 + i) for i in range(4)]


def _run(policy, signals, max_redraws=2):
    s = Schedule(SCENES, ScheduleConfig(zero_spread=policy, max_redraws=max_redraws, group_size=2))
    pos, trace = SchedulePosition(), []
    for sig in signals:
        trace.append((pos.scene_index, pos.redraw, s.role_letter(pos)))
        pos, stepped = s.advance(pos, sig)
        trace[-1] += (stepped,)
    return pos, trace


def test_roles_cycle_dddpc_over_effective_updates_only():
    pos, trace = _run("redraw", [True] * 6)
    assert [t[2] for t in trace] == list("DDDPCD")
    s = Schedule(SCENES, ScheduleConfig())
    assert [s.role(SchedulePosition(effective_updates=k)) for k in range(5)] == [
        DESIGNER, DESIGNER, DESIGNER, PLANNER, CRITIC]


def test_redraw_reuses_the_scene_with_new_seeds_then_moves_on_without_a_step():
    pos, trace = _run("redraw", [False, False, False, True])
    assert trace == [(0, 0, "D", False), (0, 1, "D", False), (0, 2, "D", False), (1, 0, "D", True)]
    assert pos.effective_updates == 1 and pos.attempts == 4
    s = Schedule(SCENES, ScheduleConfig(group_size=3))
    a = s.seeds(SchedulePosition(redraw=0))
    b = s.seeds(SchedulePosition(redraw=1))
    assert len(set(a)) == 3 and not set(a) & set(b)


def test_skip_and_count_policies():
    pos, trace = _run("skip", [False, True])
    assert trace == [(0, 0, "D", False), (1, 0, "D", True)]
    pos, trace = _run("count", [False, False])
    assert [t[3] for t in trace] == [True, True] and pos.effective_updates == 2


def test_scene_order_wraps_into_a_new_epoch_with_new_seeds():
    s = Schedule(SCENES[:1], ScheduleConfig(group_size=2))
    pos, _ = s.advance(SchedulePosition(), True)
    assert (pos.scene_index, pos.epoch) == (0, 1)
    assert s.seeds(pos) != s.seeds(SchedulePosition())


def test_episode_seed_is_a_stable_hash():
    # the values of earlier releases: a change of the key format changes every run's seeds
    assert episode_seed(7, 0, 0) == 1919956695
    assert episode_seed(7, 3, 1, 2) == 1684128694 and episode_seed(7, 3, 1, 2, 5) == 573143225
    assert len({episode_seed(7, m, r) for m in range(8) for r in range(3)}) == 24
    assert Schedule(SCENES[:2], ScheduleConfig()).hash() == (
        "532647a2bbafde696e3dd92a867142c2bc8f038ed89d4d424450f64142d8a0be")


def test_extension_keeps_the_prefix_hash_and_refuses_a_changed_prefix():
    short = Schedule(SCENES[:2], ScheduleConfig())
    saved = {"num_scenes": 2, "schedule_hash": short.hash()}
    longer = Schedule(SCENES, ScheduleConfig())
    check_extension(saved, longer)  # 2 -> 4 scenes: same prefix
    assert longer.hash(2) == short.hash() != longer.hash()
    changed = Schedule([SCENES[0], ("train-0001", 999)] + SCENES[2:], ScheduleConfig())
    with pytest.raises(ValueError, match=short.hash()):
        check_extension(saved, changed)
    with pytest.raises(ValueError, match="schedule.roles, schedule.group_size or schedule.seed changed"):
        check_extension(saved, Schedule(SCENES, ScheduleConfig(group_size=4)))


def test_an_extended_run_goes_on_into_the_appended_scenes_as_an_uninterrupted_run():
    cfg = ScheduleConfig(group_size=2)
    short, longer = Schedule(SCENES[:2], cfg), Schedule(SCENES, cfg)
    pos = SchedulePosition()
    for _ in range(2):
        pos, _ = short.advance(pos, True)
    assert (pos.scene_index, pos.epoch) == (0, 1)   # the short run wrapped at its own count
    resumed = longer.extended(pos, saved_scenes=2)
    straight = SchedulePosition()
    for _ in range(2):
        straight, _ = longer.advance(straight, True)
    assert resumed == straight and longer.seeds(resumed) == longer.seeds(straight)
    for _ in range(3):   # and on, into the next epoch, alike
        resumed, _ = longer.advance(resumed, True)
        straight, _ = longer.advance(straight, True)
        assert resumed == straight
    # inside a pass (or its redraws), and without appended scenes, the position is kept
    inside = SchedulePosition(scene_index=1, epoch=1, effective_updates=3, attempts=3)
    assert longer.extended(inside, 2) == inside
    redrawing = SchedulePosition(epoch=1, redraw=1, effective_updates=2, attempts=3)
    assert longer.extended(redrawing, 2) == redrawing
    assert short.extended(pos, 2) == pos


def test_a_scene_edited_in_place_is_refused_and_an_extension_is_not():
    """The schedule hash covers each scene's place and seed only: a prompt edited in place
    (same seed) resumed silently (helper-134 #9). Checkpoints without the key pass."""
    import dataclasses

    from jscenegen.paths import resolve_data_path
    from jscenegen.scene.sceneset import read_scene_set, scene_set_hash
    from jscenegen.scene.schema import scene_from_json

    records = read_scene_set(resolve_data_path("data/scenes/train.jsonl"))[:4]
    saved = {"num_scenes": 2, "scenes_hash": scene_set_hash(records[:2])}
    check_scene_content(saved, records, "train.jsonl")          # 2 -> 4 scenes: the prefix holds
    edited = list(records)
    scene = records[1].scene.to_json()
    edited[1] = dataclasses.replace(records[1], scene=scene_from_json(
        {**scene, "prompt": scene["prompt"] + " with a plant"}))
    with pytest.raises(ValueError, match="content of the first 2 scenes of train.jsonl changed"):
        check_scene_content(saved, edited, "train.jsonl")
    check_scene_content({"num_scenes": 2}, edited, "train.jsonl")   # an older checkpoint
    edited[3] = edited[1]                                            # past the prefix: free
    check_scene_content({"num_scenes": 1, "scenes_hash": scene_set_hash(records[:1])}, edited,
                        "train.jsonl")


def test_max_attempts_ends_a_run_without_signal():
    s = Schedule(SCENES, ScheduleConfig(total_updates=5, max_attempts=3))
    pos = SchedulePosition()
    while not s.done(pos):
        pos, _ = s.advance(pos, False)
    assert pos.attempts == 3 and pos.effective_updates == 0


def test_several_groups_per_attempt_take_the_next_scenes_across_the_epoch():
    s = Schedule(SCENES, ScheduleConfig(group_size=2))
    pos = SchedulePosition(scene_index=3, epoch=1, redraw=1)
    assert [s.scene_at(pos, j) for j in range(3)] == [(3, 1), (0, 2), (1, 2)]
    assert s.seeds(pos, 1) == [episode_seed(100, m, 1, 2) for m in range(2)]
    nxt, stepped = s.advance(pos, True, scenes=3)
    assert stepped and (nxt.scene_index, nxt.epoch, nxt.redraw) == (2, 2, 0)
    same, stepped = s.advance(pos, False, scenes=3)       # redraw all three together
    assert not stepped and (same.scene_index, same.epoch, same.redraw) == (3, 1, 2)


def test_advantages_are_normalised_within_each_group_of_a_batch():
    import numpy as np

    from jscenegen.grpo.rollout.engine import Trajectory
    from jscenegen.grpo.train.batch import build_group_batch

    def tr(group, member, reward):
        n = 6
        return Trajectory(group, member, 0, np.arange(n, dtype=np.int32), np.full(n, PLANNER, np.int8),
                          np.ones(n, bool), np.zeros(n, np.float32), [], [], reward, None, False,
                          0, None, None, {})

    trs = [tr(5, 0, 1.0), tr(5, 1, 3.0), tr(9, 0, -1.0), tr(9, 1, -1.0)]
    batch = build_group_batch(trs, PLANNER, row_multiple=3, col_multiple=8)
    # group 5: rewards 1, 3 -> -0.707, +0.707 (std ddof 1); group 9: no spread -> 0
    np.testing.assert_allclose(batch.episode_advantages, [-0.7071063, 0.7071063, 0, 0], atol=1e-5)
    assert batch.arrays["input_ids"].shape == (6, 8) and batch.has_signal
    with pytest.raises(ValueError, match="group size"):
        build_group_batch(trs[:3], PLANNER, row_multiple=3, col_multiple=8)
    # one group that came back short of the configured G (no other group to compare with)
    with pytest.raises(ValueError, match="group size"):
        build_group_batch(trs[:1], PLANNER, row_multiple=3, col_multiple=8, group_size=2)


def test_columns_after_the_last_trained_token_are_dropped():
    """A role that speaks early (the planner's 5 tokens before 15 designer tokens) trains on the
    prefix (rounded up to col_multiple); the designer's update keeps every column; trim=False
    keeps the longest episode's length for both."""
    import numpy as np

    from jscenegen.grpo.rollout.engine import Trajectory
    from jscenegen.grpo.train.batch import build_group_batch

    def tr(member, reward, n=20):
        roles = np.where(np.arange(n) < 5, PLANNER, DESIGNER).astype(np.int8)
        return Trajectory(0, member, 0, np.arange(n, dtype=np.int32) + 3, roles, np.ones(n, bool),
                          np.full(n, -0.5, np.float32), [], [], reward, None, False, 0, None, None, {})

    trs = [tr(0, 1.0), tr(1, 3.0, n=17)]
    planner = build_group_batch(trs, PLANNER, row_multiple=1, col_multiple=4)
    designer = build_group_batch(trs, DESIGNER, row_multiple=1, col_multiple=4)
    whole = build_group_batch(trs, PLANNER, row_multiple=1, col_multiple=4, trim=False)
    tokens = lambda b: {k: a for k, a in b.arrays.items() if k != "episode_mask"}  # noqa: E731
    assert {a.shape for a in tokens(planner).values()} == {(2, 8)}
    assert {a.shape for a in tokens(designer).values()} == {(2, 20)}
    assert {a.shape for a in tokens(whole).values()} == {(2, 20)}
    assert planner.arrays["episode_mask"].tolist() == whole.arrays["episode_mask"].tolist() == [1, 1]
    for key, a in tokens(planner).items():
        np.testing.assert_array_equal(a, whole.arrays[key][:, :8], err_msg=key)
        assert not whole.arrays["loss_mask"][:, 8:].any()
    assert planner.trained_tokens == whole.trained_tokens == 8     # tokens 1-4 of each row


def test_masked_episodes_are_padding_rows_of_the_update():
    """A judge failure or a non-finite reward trains nothing: no token of its row is attended or
    in the loss mask (so none counts in the token-mean normaliser), A = 0; its row is still an
    episode (episode_mask 1: the sequence modes' G counts it), the padding rows are not."""
    import numpy as np

    from jscenegen.grpo.rollout.engine import Trajectory
    from jscenegen.grpo.train.batch import build_group_batch

    def tr(member, reward, masked=False):
        n = 6
        return Trajectory(0, member, 0, np.arange(n, dtype=np.int32) + 7, np.full(n, PLANNER, np.int8),
                          np.ones(n, bool), np.full(n, -0.5, np.float32), [], [], reward,
                          "judge_timeout" if masked else None, masked, 0, None, None, {})

    trs = [tr(0, 1.0), tr(1, 3.0), tr(2, 0.0, masked=True), tr(3, float("nan"))]
    batch = build_group_batch(trs, PLANNER, row_multiple=3, col_multiple=8)
    a = batch.arrays
    assert batch.trained_tokens == a["loss_mask"][:2].sum() == 10   # 5 per row: nothing predicts token 0
    for row in (2, 3):
        for key in ("input_ids", "attention_mask", "loss_mask", "advantages", "rollout_logp"):
            assert not a[key][row].any(), (row, key)
    assert a["episode_mask"].tolist() == [1, 1, 1, 1, 0, 0] and a["episode_mask"].dtype == np.float32
    np.testing.assert_allclose(batch.episode_advantages, [-0.7071063, 0.7071063, 0, 0], atol=1e-5)


def test_run_seed_changes_every_episode_seed_and_the_hash_but_not_seed_zero():
    base = Schedule(SCENES, ScheduleConfig(group_size=4))
    other = Schedule(SCENES, ScheduleConfig(group_size=4, seed=1))
    pos = SchedulePosition()
    assert base.seeds(pos) == [episode_seed(100, m, 0) for m in range(4)]  # seed 0: as before
    assert not set(base.seeds(pos)) & set(other.seeds(pos))
    assert other.seeds(pos) == [episode_seed(100, m, 0, 0, 1) for m in range(4)]
    assert base.hash() != other.hash()
    assert base.hash() == Schedule(SCENES, ScheduleConfig(group_size=4, seed=0)).hash()


def test_the_saved_position_is_what_a_resume_validates():
    """convert checks a train state's `schedule` against SCHEDULE_POSITION_KEYS (it may not
    import training code): the two lists are one."""
    import dataclasses

    from jscenegen.checkpoint.resume import SCHEDULE_POSITION_KEYS, check_run_identity

    pos = SchedulePosition(scene_index=1, epoch=2, redraw=0, effective_updates=7, attempts=9)
    assert tuple(f.name for f in dataclasses.fields(SchedulePosition)) == SCHEDULE_POSITION_KEYS
    state = {"schedule": pos.to_json(), "lr_step": 9, "skipped_steps": 2, "num_scenes": 4,
             "schedule_hash": "s", "protocol_hash": "p", "reward": {"unit_penalty": 0.8}}
    check_run_identity(state)
    with pytest.raises(ValueError, match=r"^schedule\.attempts: Input should be greater than or "
                                         r"equal to 0 \(got -1\)$"):
        check_run_identity({**state, "schedule": {**pos.to_json(), "attempts": -1}})
    # the trainer holds them as int32: past that they failed in the restore, after its I/O,
    # as a bare OverflowError (helper-157)
    with pytest.raises(ValueError, match=r"^lr_step: Input should be less than 2147483648 "
                                         r"\(got 1099511627776\)$"):
        check_run_identity({**state, "lr_step": 2 ** 40})


def test_a_position_after_converted_steps_counts_every_scene_of_a_batch():
    """A VERL step counts updates only; with groups_per_batch k each took k scenes."""
    pos = SchedulePosition.after_steps(3, num_scenes=4)
    assert (pos.scene_index, pos.epoch, pos.effective_updates, pos.attempts) == (3, 0, 3, 3)
    pos = SchedulePosition.after_steps(3, num_scenes=4, groups_per_batch=2)
    assert (pos.scene_index, pos.epoch, pos.effective_updates, pos.attempts) == (2, 1, 3, 3)
