"""Group rollouts: token accounting of multi-turn episodes (scripted expert forced through the
model's cache path), failure causes, masking of judge/runtime failures, seeds, and sampled
log-probs against the trainer's recompute."""
from types import SimpleNamespace

import numpy as np
import pytest
from test_sampler import trainer_logprobs

from jscenegen.generate.sampler import Sampler
from jscenegen.generate.sampling import SamplingParams
from jscenegen.grpo.algo.roles import CRITIC, DESIGNER, ENVIRONMENT, PLANNER, ROLE_CODES, role_loss_mask
from jscenegen.grpo.rollout.config import SamplingConfig
from jscenegen.grpo.rollout.engine import RolloutEngine, _Row, trajectory_batch
from jscenegen.grpo.rollout.seeds import episode_seed
from jscenegen.model.hf_io import load_hf
from jscenegen.model.tokenizer.chat import ChatTokenizer
from jscenegen.scene.actions import format_action
from jscenegen.scene.config import JudgeConfig
from jscenegen.scene.expert import expert_ops, run_scripted_episode, scripted_answers
from jscenegen.scene.judge import JudgeResult, make_judge

from chat_fixtures import chat_model_dir, dev_records, nfc_chat_model_dir

BUCKETS = (128, 1024)          # few compiled shapes; long appends run as several chunks
SLOTS = 6144 + 512 + 128       # one cache shape for every engine here
FORCED = SamplingConfig(max_new_tokens=512, max_episode_tokens=6144, buckets=BUCKETS, temperature=0.9,
                        cache_tokens=SLOTS)
SAMPLED = SamplingConfig(max_new_tokens=16, max_episode_tokens=2560, buckets=BUCKETS, temperature=1.0,
                         cache_tokens=2816)


@pytest.fixture(scope="module")
def chat():
    return ChatTokenizer.from_dir(chat_model_dir())


@pytest.fixture(scope="module")
def model():
    return load_hf(chat_model_dir())


@pytest.fixture(scope="module")
def record():
    return dev_records()[0]


@pytest.fixture(scope="module")
def rule_judge():
    return make_judge(JudgeConfig())


@pytest.fixture(scope="module")
def expert(record):
    ops = expert_ops(record)
    return lambda ep: scripted_answers(ep, ops)


class MaskingJudge:
    """The rule judge, except member 1's request times out (judge failure -> masked)."""

    def __init__(self, inner):
        self.inner = inner

    def identity(self):
        return self.inner.identity()

    def grade(self, requests):
        out = self.inner.grade(requests)
        return [out[0], JudgeResult(None, "judge_timeout", {"detail": "test"})] + out[2:]


class RaisingJudge(MaskingJudge):
    def grade(self, requests):
        raise ConnectionError("judge server down")


@pytest.fixture(scope="module")
def expert_group(model, chat, record, expert, rule_judge):
    engine = RolloutEngine(model, chat, FORCED)
    return engine.run_group(record, group_id=7, seeds=[episode_seed(record.seed, m, 0) for m in range(2)],
                            judge=MaskingJudge(rule_judge), forced=expert)


def test_expert_episode_reward_matches_the_scripted_runner(expert_group, record):
    ep, _ = run_scripted_episode(record)
    a, b = expert_group.trajectories
    assert a.failure_cause is None and not a.masked
    assert a.reward == pytest.approx(ep.outcome.reward) and a.units == ep.outcome.units > 0
    assert a.group_id == b.group_id == 7 and (a.member, b.member) == (0, 1)
    assert a.seed == episode_seed(record.seed, 0, 0) != b.seed
    # judge failure: masked, reward 0 (never -1, never NaN)
    assert b.masked and b.failure_cause == "judge_timeout" and b.reward == 0.0
    np.testing.assert_array_equal(a.tokens, b.tokens)


def test_token_accounting_reproduces_the_transcript(expert_group, chat):
    tr = expert_group.trajectories[0]
    messages = [{"role": m["role"], "content": m["content"]} for m in tr.transcript]
    rendered = chat.render(messages, add_generation_prompt=False)
    assert chat.decode(tr.tokens.tolist()) + "\n" == rendered
    # every environment token has mask 0, every policy token its role
    assert not tr.policy_mask[tr.roles == ENVIRONMENT].any()
    assert (tr.roles[tr.policy_mask] != ENVIRONMENT).all()
    policy_turns = [t for t in tr.turns if t["role"] != "environment"]
    actors = [m["actor"] for m in tr.transcript if m["role"] == "assistant"]
    assert [t["role"] for t in policy_turns] == actors == ["planner", "designer", "planner", "critic", "planner"]
    codes = {"planner": PLANNER, "designer": DESIGNER, "critic": CRITIC}
    contents = [m["content"] for m in tr.transcript if m["role"] == "assistant"]
    for t, content in zip(policy_turns, contents):
        seg = slice(t["start"], t["end"])
        assert (tr.roles[seg] == codes[t["role"]]).all() and tr.policy_mask[seg].all()
        # each answer ends at the stop string </action>: the sampler stops there and the
        # environment segment after it starts with the end-of-turn token
        assert chat.decode(tr.tokens[seg].tolist()) == content and content.endswith("</action>")
        after = next(x for x in tr.turns if x["start"] == t["end"])
        assert after["role"] == "environment" and tr.tokens[t["end"]] == chat.eot_id
        # the template glue before the turn belongs to the environment segment before it
        before = next(x for x in tr.turns if x["end"] == t["start"])
        assert before["role"] == "environment"
        assert chat.decode(tr.tokens[before["start"]:before["end"]].tolist()).endswith("<|im_start|>assistant\n")
    # segments tile the sequence
    assert tr.turns[0]["start"] == 0 and tr.turns[-1]["end"] == tr.num_tokens
    assert all(x["end"] == y["start"] for x, y in zip(tr.turns, tr.turns[1:]))
    batch = trajectory_batch(expert_group.trajectories, rows=3)
    assert batch["input_ids"].shape == (3, tr.num_tokens) and batch["masked"].tolist() == [False, True, True]
    mask = np.asarray(role_loss_mask(batch["roles"], batch["policy_mask"], DESIGNER))
    assert mask[0].sum() == policy_turns[1]["end"] - policy_turns[1]["start"]
    with pytest.raises(ValueError, match="2 trajectories do not fit 1 rows"):
        trajectory_batch(expert_group.trajectories, rows=1)


def test_forced_logprobs_equal_trainer_recompute(expert_group, model):
    tr = expert_group.trajectories[0]
    want = trainer_logprobs(model, [tr.tokens.tolist()], FORCED.temperature)[0, :tr.num_tokens]
    np.testing.assert_allclose(tr.logprobs[tr.policy_mask], want[tr.policy_mask], atol=1e-5, rtol=0)
    assert (tr.logprobs[~tr.policy_mask] == 0).all()


def test_a_growing_cache_gives_the_fixed_caches_episodes(expert_group, model, chat, record, expert,
                                                        rule_judge):
    """Without `cache_tokens` the cache starts at the prompt plus one turn and grows (doubling,
    contents kept) as the episode lengthens: same tokens and log-probs, fewer slots attended."""
    engine = RolloutEngine(model, chat, FORCED.model_copy(update={"cache_tokens": None,
                                                                  "buckets": (128, 256, 1024)}))
    group = engine.run_group(record, group_id=7, seeds=[episode_seed(record.seed, m, 0) for m in range(2)],
                             judge=MaskingJudge(rule_judge), forced=expert)
    assert group.stats["cache_grows"] >= 1 and group.stats["cache_rebuilds"] == 0
    assert group.stats["cache_slots"] < engine.slots
    for tr, ref in zip(group.trajectories, expert_group.trajectories):
        np.testing.assert_array_equal(tr.tokens, ref.tokens)
        np.testing.assert_allclose(tr.logprobs, ref.logprobs, atol=1e-5, rtol=0)


def test_a_rebuild_that_outgrows_the_cache_grows_it_and_replays_every_history(model, chat):
    """Padded appends can use up a growing cache's maximum while the histories still fit: the
    rebuild then needs more slots than the cache had, and grows to them. Before, it rebuilt at
    the old size and the append wrote past its end (onto earlier slots, no error)."""
    cfg = SamplingConfig(max_new_tokens=16, max_episode_tokens=480, buckets=(16, 64, 256, 512),
                         cache_tokens=None)
    engine = RolloutEngine(model, chat, cfg)
    assert engine.grows and engine.slots == 512
    rng = np.random.default_rng(5)
    rows = [_Row(member=m, seed=m, episode=SimpleNamespace(done=False, outcome=None)) for m in range(2)]
    engine._capacity = 128
    engine._cache, engine._last = engine.sampler.new_cache(2, engine._capacity)
    engine._used = engine._rebuilds = 0
    for grown in (0, 1):                          # each append pads the other row: 112 slots each
        rows[grown].add(rng.integers(3, 1000, 100), ENVIRONMENT, False)
        engine._sync(rows, 0)
    assert (engine._used, engine._capacity) == (224, 256)
    rows[0].add(rng.integers(3, 1000, 300), ENVIRONMENT, False)  # 224 + 304 > 512; histories 400
    engine._sync(rows, 0)
    assert engine._rebuilds == 1 and engine._capacity >= engine._used == 400
    fresh, last = engine.sampler.new_cache(2, 512)
    _, want = engine.sampler.append(fresh, last, [r.tokens for r in rows])
    np.testing.assert_allclose(np.asarray(engine._last), np.asarray(want), atol=1e-5, rtol=0)


def test_an_append_past_the_cache_end_is_refused_before_writing(model):
    sampler = Sampler(model, SamplingParams(greedy=True), buckets=(16, 32))
    cache, last = sampler.new_cache(1, 36)
    with pytest.raises(ValueError, match="need 48; the cache has 36"):
        sampler.append(cache, last, [list(range(3, 43))])
    with pytest.raises(ValueError, match="need 52 cache slots; cache_len is 36"):
        sampler.generate([list(range(3, 43))], 4, [0], cache_len=36)


def test_malformed_and_truncated_outputs_are_policy_failures(model, chat, record, rule_judge):
    seen = {}

    def policy(ep):
        if seen.setdefault(id(ep), len(seen)) == 0:
            return "I think the room is nice."                       # no action block
        return '<action>{"action": "design", "instruction": "' + "very " * 100

    cfg = FORCED.model_copy(update={"max_new_tokens": 64})           # same compiled shapes
    trs = RolloutEngine(model, chat, cfg).run_group(
        record, group_id=1, seeds=[1, 2], judge=rule_judge, forced=policy).trajectories
    assert [(t.failure_cause, t.reward, t.masked) for t in trs] == [
        ("no_action_block", -1.0, False), ("truncated_action", -1.0, False)]
    assert trs[0].turns[-1]["stop"] == "stop_token"
    assert trs[1].turns[-1]["stop"] == "length" and trs[1].policy_mask.sum() == 64
    assert trs[1].roles[-1] == PLANNER and trs[1].tokens[-1] != chat.eot_id


def _exactly(chat, head: str, filler: str, tail: str, n: int) -> str:
    """head + filler * k + tail for the k whose ids (as a forced turn encodes them) are exactly
    n tokens: with its end-of-turn token the answer is one past max_new_tokens = n, so the
    turn is cut right after `tail`."""
    for k in range(4 * n):
        text = head + filler * k + tail
        got = len(chat.encode_content(text)[1])
        if got == n:
            return text
        if got > n:
            break
    raise AssertionError(f"no filler count gives {n} tokens for {tail!r}")


def test_a_turn_cut_inside_an_action_tag_or_a_second_block_is_truncated_action(model, chat, record,
                                                                                rule_judge):
    """Spec section 5: generation truncated inside an action is its own policy failure. A turn
    cut in the opening tag ("<acti") and one cut in a second, unclosed block after a complete
    one were `truncated_generation`; a cut turn that began no action stays that."""
    n = 64
    texts = [
        _exactly(chat, "I will now act: ", "very ", "<acti", n),
        _exactly(chat, '<action>{"action": "critique"}</action> ', "and ", '<action>{"action": "fin', n),
        _exactly(chat, "I will now act: ", "very ", "nice", n),
    ]
    rows = {}

    def policy(ep):
        return texts[rows.setdefault(id(ep), len(rows))]

    # without the `</action>` stop string, as only then does a turn go on past a closed block
    cfg = FORCED.model_copy(update={"max_new_tokens": n, "stop_strings": ()})
    trs = RolloutEngine(model, chat, cfg).run_group(
        record, group_id=1, seeds=[1, 2, 3], judge=rule_judge, forced=policy).trajectories
    assert [(t.failure_cause, t.reward, t.masked) for t in trs] == [
        ("truncated_action", -1.0, False), ("truncated_action", -1.0, False),
        ("truncated_generation", -1.0, False)]
    for t, text in zip(trs, texts):
        assert t.turns[-1]["stop"] == "length" and t.policy_mask.sum() == n
        assert t.transcript[-1]["content"] == text       # cut right after "<acti", "fin", "nice"
        assert t.failure_message == f"the planner turn reached max_new_tokens={n}"


def test_a_forced_answer_spelling_the_end_of_turn_token_keeps_it_as_text(model, chat, record,
                                                                         rule_judge):
    """A scripted answer holding the text `<|im_end|>` was encoded with that special token
    read as the token itself: an end of turn inside the turn, with policy mask 1, which a
    sampled turn cannot hold (the sampler stops there)."""
    text = "plan: no <|im_end|> here, then nothing"
    cfg = FORCED.model_copy(update={"max_new_tokens": 64})           # same compiled shapes
    tr = RolloutEngine(model, chat, cfg).run_group(
        record, group_id=1, seeds=[1], judge=rule_judge, forced=lambda ep: text).trajectories[0]
    turn = tr.tokens[tr.policy_mask.astype(bool)].tolist()
    assert turn == chat.encode_plain(text) + [chat.eot_id]
    assert turn.count(chat.eot_id) == 1 and chat.decode(turn[:-1]) == text


def test_an_echoed_content_outside_the_tokenizers_normal_form_plays_on(model, record, rule_judge):
    """Qwen's tokenizers normalise to NFC (tokenizer.json's normaliser). A planner answer in
    ASCII whose JSON escape spells a combining mark ("cafe" + U+0301) is echoed in the
    designer's message: its ids decoded to "caf\u00e9", `encode`'s round-trip check refused
    the segment and the row was masked as a rollout_error, though the text is the policy's.
    The message is normalised before it is encoded, so the episode plays to its outcome."""
    chat = ChatTokenizer.from_dir(nfc_chat_model_dir())
    design = '<action>{"action": "design", "instruction": "a cafe\\u0301 corner"}</action>'

    def forced(ep):
        if ep.next_role == "designer":
            return '<action>{"ops": []}</action>'
        return design if ep.planner_turns == 0 else '<action>{"action": "finish", "summary": "x"}</action>'

    tr = RolloutEngine(model, chat, FORCED).run_group(record, group_id=0, seeds=[1], judge=rule_judge,
                                                      forced=forced).trajectories[0]
    assert (tr.failure_cause, tr.reward, tr.masked) == ("invalid_terminal_scene", -1.0, False)
    assert [m["actor"] for m in tr.transcript[2:]] == ["planner", "environment", "designer",
                                                       "environment", "planner"]
    assert "from the planner: a caf\u00e9 corner\n" in tr.transcript[3]["content"]
    messages = [{"role": m["role"], "content": m["content"]} for m in tr.transcript]
    assert chat.decode(tr.tokens.tolist()) + "\n" == chat.render(messages, add_generation_prompt=False)


def test_a_forced_answer_outside_the_tokenizers_normal_form_plays_on(model, record, rule_judge):
    """A scripted answer not in NFC (a raw combining mark in its text) under Qwen's NFC
    tokenizer: `encode_plain`'s round-trip check refused it and the row was masked as a
    rollout_error. It is normalised first, as a sampled turn's decoded text is."""
    chat = ChatTokenizer.from_dir(nfc_chat_model_dir())
    text = "plan: a cafe\u0301 corner, then nothing"
    cfg = FORCED.model_copy(update={"max_new_tokens": 64})           # same compiled shapes
    tr = RolloutEngine(model, chat, cfg).run_group(
        record, group_id=1, seeds=[1], judge=rule_judge, forced=lambda ep: text).trajectories[0]
    assert (tr.failure_cause, tr.masked) == ("no_action_block", False)
    turn = tr.tokens[tr.policy_mask.astype(bool)].tolist()
    assert chat.decode(turn) == "plan: a caf\u00e9 corner, then nothing<|im_end|>"
    assert tr.transcript[2]["content"] == "plan: a caf\u00e9 corner, then nothing"


def test_runtime_and_judge_exceptions_are_masked_not_raised(model, chat, record, rule_judge):
    seen = {}
    bed = {"op": "add_object", "category": "double_bed", "description": "bed", "position": [1.8, 1.6],
           "yaw": 0}

    def policy(ep):
        if seen.setdefault(id(ep), len(seen)) == 0:
            raise KeyError("driver bug")                             # our side: masked
        if ep.next_role == "designer":
            return format_action({"ops": [bed]})
        return format_action({"action": "design", "instruction": "a bed"} if ep.planner_turns == 0
                             else {"action": "finish", "summary": "done"})

    trs = RolloutEngine(model, chat, FORCED).run_group(
        record, group_id=2, seeds=[3, 4], judge=RaisingJudge(rule_judge), forced=policy).trajectories
    assert [(t.failure_cause, t.reward, t.masked) for t in trs] == [
        ("rollout_error", 0.0, True), ("judge_error", 0.0, True)]
    assert [t["role"] for t in trs[1].turns if t["role"] != "environment"] == ["planner", "designer", "planner"]
    assert trs[1].units == 8


def test_an_engine_error_masks_the_running_episodes_not_the_finished_ones(model, chat, record,
                                                                          rule_judge):
    """Member 0 finishes (planner `finish`) while member 1 still plays; then the sampler fails:
    member 1 is masked, member 0's whole episode is judged (it was masked too, helper-134)."""
    bed = {"op": "add_object", "category": "double_bed", "description": "bed",
           "position": [1.8, 1.6], "yaw": 0}
    member = {}

    def policy(ep):
        m = member.setdefault(id(ep), len(member))
        if ep.next_role == "designer":
            return format_action({"ops": [bed]})
        return format_action({"action": "design", "instruction": "a bed"}
                             if ep.planner_turns < (1 if m == 0 else 3)
                             else {"action": "finish", "summary": "done"})

    engine = RolloutEngine(model, chat, FORCED)
    append, consume = engine.sampler.append, engine._consume
    broken = {"now": False}

    def failing_append(*args, **kwargs):
        if broken["now"]:
            raise RuntimeError("sampler failure")
        return append(*args, **kwargs)

    def watching_consume(r, *args):
        consume(r, *args)
        broken["now"] = broken["now"] or (r.member == 0 and r.episode.done)

    engine.sampler.append, engine._consume = failing_append, watching_consume
    first, second = engine.run_group(record, group_id=0, seeds=[1, 2], judge=rule_judge,
                                     forced=policy).trajectories
    assert broken["now"]
    assert first.failure_cause is None and not first.masked and first.reward != 0.0
    assert [t["role"] for t in first.turns if t["role"] != "environment"] == [
        "planner", "designer", "planner"]
    assert second.failure_cause == "rollout_error" and second.masked



def test_a_failure_on_one_process_only_stops_every_process(model, chat, record, expert,
                                                           rule_judge, monkeypatch):
    """Each process of a multi-process run plays the same rows; a row masked for an error of
    one host only (its memory, a file) left the processes' episodes, and their next
    collectives, apart: a hang. After the episodes' start and each round the rows' state
    (running, length, failure cause) is compared across processes (`processes_apart`, here
    standing in for a second process that failed nothing)."""
    import jscenegen.grpo.rollout.engine as engine_mod
    from jscenegen.grpo.rollout.engine import RolloutDivergedError, _cause_code

    seen = []

    def other_process_failed_nothing(state):
        seen.append([list(row) for row in state])
        return [1] if any(cause == _cause_code("rollout_error") for _, _, cause in state) else []

    monkeypatch.setattr(engine_mod, "processes_apart", other_process_failed_nothing)
    engine = RolloutEngine(model, chat, FORCED)
    consume = engine._consume
    turns = {1: 0}

    def failing_consume(r, *args):
        turns[r.member] = turns.get(r.member, 0) + 1
        if r.member == 1 and turns[1] == 3:      # the third round, one row
            raise OSError(28, "No space left on device")
        return consume(r, *args)

    engine._consume = failing_consume
    with pytest.raises(RolloutDivergedError, match=r"process\(es\) \[1\] and process 0 disagree "
                                                   r".*\(this one masks 1, first: rollout_error: "
                                                   r"OSError: \[Errno 28\]"):
        engine.run_group(record, group_id=0, seeds=[1, 2], judge=rule_judge, forced=expert)
    assert len(seen) == 4                                    # the start, then each round
    assert [[active for active, _, _ in state] for state in seen] == [[1, 1]] * 3 + [[1, 0]]
    assert [state[0][1] for state in seen] == sorted({state[0][1] for state in seen})  # growing


def test_processes_apart_is_free_in_one_process():
    from jscenegen.sharding.mesh import processes_apart

    assert processes_apart([True, False]) == []


def test_a_forced_turn_whose_append_fails_leaves_the_row_whole(model, chat, record, expert,
                                                               rule_judge):
    """The forced turn's tokens were put on the row before the append that computes their
    log-probs; when that append raised, the row was masked but kept the tokens without roles,
    policy mask or log-probs, and `trajectory_batch` failed to broadcast them. The row now ends
    at the environment text before the failed turn, every per-token array as long."""
    engine = RolloutEngine(model, chat, FORCED)
    append = engine.sampler.append
    calls = {"turns": 0}

    def failing_turn_append(cache, last, seqs, with_logprobs=False):
        if with_logprobs:                        # a forced turn's append: the second one fails
            calls["turns"] += 1
            if calls["turns"] == 2:
                raise RuntimeError("sampler failure")
        return append(cache, last, seqs, with_logprobs)

    engine.sampler.append = failing_turn_append
    (tr,) = engine.run_group(record, group_id=0, seeds=[1], judge=rule_judge,
                             forced=expert).trajectories
    assert calls["turns"] == 2
    assert tr.failure_cause == "rollout_error" and tr.masked
    n = tr.num_tokens
    assert len(tr.roles) == len(tr.policy_mask) == len(tr.logprobs) == n
    assert [t["role"] for t in tr.turns if t["role"] != "environment"] == ["planner"]
    assert tr.roles[-1] == ENVIRONMENT and tr.turns[-1]["end"] == n
    batch = trajectory_batch([tr])
    np.testing.assert_array_equal(batch["input_ids"][0], tr.tokens)
    assert batch["masked"][0] and batch["policy_mask"][0].sum() == tr.policy_mask.sum() > 0

def test_a_failed_collective_of_a_multi_process_run_is_raised_not_masked(model, chat, record, rule_judge,
                                                                         expert, monkeypatch):
    """A peer that stopped (Ctrl-C on process 1 during the dev evaluation) failed process 0's
    next collective: the engine masked every row as rollout_error, went on, and the run ended
    with two error lines; alone, the same error still masks the rows (helper-71)."""
    import jax

    import jscenegen.sharding.mesh

    engine = RolloutEngine(model, chat, FORCED)

    def lost_peer(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("INTERNAL: Gloo AllGather failed: Connection closed by peer")

    monkeypatch.setattr(engine.sampler, "append", lost_peer)
    (tr,) = engine.run_group(record, group_id=0, seeds=[1], judge=rule_judge,
                             forced=expert).trajectories
    assert tr.failure_cause == "rollout_error" and tr.masked
    monkeypatch.setattr(jscenegen.sharding.mesh, "joined_other_processes", lambda: True)
    with pytest.raises(jax.errors.JaxRuntimeError, match="Connection closed by peer"):
        engine.run_group(record, group_id=0, seeds=[1], judge=rule_judge, forced=expert)


def test_a_failed_collective_while_judging_ends_a_multi_process_run(model, chat, record,
                                                                    rule_judge, expert,
                                                                    monkeypatch):
    """Process 0's grades reach the others by a collective: with a peer gone it raised inside
    `judge_episodes`, which masked every episode as judge_error, and the run went on into its
    next collective (helper-74)."""
    import jax

    import jscenegen.grpo.rollout.primary_judge as primary_judge
    import jscenegen.sharding.mesh

    engine = RolloutEngine(model, chat, FORCED)
    played = engine.play_group(record, group_id=0, seeds=[1], forced=expert)

    def lost_peer(payload):
        raise jax.errors.JaxRuntimeError("INTERNAL: Gloo Broadcast failed: Connection closed by peer")

    monkeypatch.setattr(primary_judge, "bytes_from_primary", lost_peer)
    monkeypatch.setattr(primary_judge, "for_processes", primary_judge.PrimaryJudge)
    monkeypatch.setattr(jscenegen.sharding.mesh, "joined_other_processes", lambda: True)
    with pytest.raises(jax.errors.JaxRuntimeError, match="Connection closed by peer"):
        primary_judge.judge_on_primary(played.episodes, rule_judge)


def test_a_model_with_non_finite_logits_masks_its_episodes(model, chat, record, rule_judge):
    """NaN weights make NaN logits: the sampler still returns tokens (an argmax of noise), so
    the engine must not train on them: a masked rollout_error, not -1 and not NaN."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    engine = RolloutEngine(model, chat, SAMPLED)
    nan_params = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), nnx.state(model, nnx.Param))
    engine.set_weights(nan_params)
    trs = engine.run_group(record, group_id=0, seeds=[1, 2], judge=rule_judge).trajectories
    for tr in trs:
        assert tr.failure_cause == "rollout_error" and tr.masked and tr.reward == 0.0
        assert "not finite" in tr.failure_message and not tr.policy_mask.any()


def test_episode_token_cap_is_a_policy_failure(model, chat, record, expert):
    _, prompt = chat.start(*_prompts(record))
    cfg = FORCED.model_copy(update={"max_episode_tokens": len(prompt) + 20})
    tr = RolloutEngine(model, chat, cfg).run_group(
        record, group_id=0, seeds=[0, 1], judge=make_judge(JudgeConfig()), forced=expert).trajectories[0]
    assert tr.failure_cause == "episode_token_cap" and tr.reward == -1.0 and not tr.masked
    # the first planner answer (19 tokens) ends at </action> within the cap; its reply does not fit
    assert tr.turns[-1]["stop"] == "stop_string" and tr.num_tokens == tr.turns[-1]["end"] == len(prompt) + 19


def test_an_episode_cap_past_the_models_positions_is_named_in_a_warning(model, chat, caplog):
    positions = model.cfg.max_position_embeddings
    cfg = SAMPLED.model_copy(update={"max_episode_tokens": positions + 1})
    with caplog.at_level("WARNING"):
        RolloutEngine(model, chat, SAMPLED)
        assert not caplog.messages
        RolloutEngine(model, chat, cfg)
    assert caplog.messages == [f"sampling.max_episode_tokens={positions + 1} is more than the "
                               f"{positions} positions the model's RoPE is made for "
                               "(max_position_embeddings, times its scaling factor): positions "
                               "past them were never trained (vLLM refuses such a max_model_len)"]


def test_an_episode_whose_prompt_reaches_the_cap_is_masked_not_the_policys_failure(model, chat,
                                                                                  record, expert):
    """The policy never took a turn, yet the episode was a -1 policy failure (episode_token_cap)
    counted in the evaluation's mean and trained on."""
    _, prompt = chat.start(*_prompts(record))
    cfg = FORCED.model_copy(update={"max_episode_tokens": len(prompt)})
    for tr in RolloutEngine(model, chat, cfg).run_group(
            record, group_id=0, seeds=[0, 1], judge=make_judge(JudgeConfig()), forced=expert).trajectories:
        assert tr.failure_cause == "prompt_over_cap" and tr.masked and not tr.policy_mask.any()
        assert f"starts at {len(prompt)} tokens" in tr.failure_message
        assert "sampling.max_episode_tokens=" in tr.failure_message


def _prompts(record):
    from jscenegen.scene.episode import Episode

    ep = Episode(record)
    return ep.system_prompt(), ep.first_user_message()


@pytest.fixture(scope="module")
def sampled_engine(model, chat):
    return RolloutEngine(model, chat, SAMPLED)


def test_sampled_rollout_seeds_and_logprobs(sampled_engine, model, record, rule_judge):
    run = lambda seeds: sampled_engine.run_group(record, group_id=0, seeds=seeds, judge=rule_judge).trajectories
    a, b, c = run([11, 12]), run([11, 12]), run([13, 12])
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_array_equal(x.logprobs, y.logprobs)
    assert not np.array_equal(a[0].tokens, c[0].tokens)
    np.testing.assert_array_equal(a[1].tokens, c[1].tokens)          # row 1 kept its seed
    for tr in a:
        # a random model: one garbage planner turn, a policy failure with reward -1
        assert tr.reward == -1.0 and not tr.masked
        assert tr.failure_cause in ("truncated_generation", "truncated_action", "no_action_block",
                                    "bad_json", "text_after_action", "multiple_action_blocks")
        assert 1 <= tr.policy_mask.sum() <= SAMPLED.max_new_tokens
        want = trainer_logprobs(model, [tr.tokens.tolist()], SAMPLED.temperature)[0, :tr.num_tokens]
        np.testing.assert_allclose(tr.logprobs[tr.policy_mask], want[tr.policy_mask], atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout,rows", [("replicated", 6), ("tp", 3)])
def test_sampled_rollout_on_the_3x2_mesh_pads_rows(sampled_engine, chat, record, rule_judge,
                                                   layout, rows):
    from jscenegen.grpo.rollout.config import RolloutConfig
    from jscenegen.sharding.mesh import make_mesh

    mesh = make_mesh(3, 2)
    engine = RolloutEngine(load_hf(chat_model_dir(), mesh=mesh), chat, SAMPLED, mesh=mesh,
                           rollout=RolloutConfig(layout=layout))
    group = engine.run_group(record, group_id=3, seeds=[11, 12], judge=rule_judge)
    assert group.stats["batch_rows"] == rows and group.stats["layout"] == layout
    unsharded = sampled_engine.run_group(record, group_id=3, seeds=[11, 12], judge=rule_judge)
    for tr, ref in zip(group.trajectories, unsharded.trajectories):
        np.testing.assert_array_equal(tr.tokens, ref.tokens)
        np.testing.assert_allclose(tr.logprobs, ref.logprobs, atol=1e-5, rtol=0)
        assert tr.reward == -1.0 and 1 <= tr.policy_mask.sum() <= SAMPLED.max_new_tokens


def test_a_turn_decoded_in_segments_through_a_growing_cache(sampled_engine, chat, model, record,
                                                            rule_judge):
    """8-step decode segments and a cache that starts at the prompt plus one segment (a bucket
    made to fit it exactly), so the second segment of the first turn grows it: the episodes are
    the fixed cache's, token for token."""
    from jscenegen.scene.episode import Episode

    start = Episode(record)
    first = len(chat.start(start.system_prompt(), start.first_user_message())[1])
    tight = -(-first // 8) * 8 + 8
    cfg = SAMPLED.model_copy(update={"buckets": (8, 128, 1024, tight), "cache_tokens": None})
    engine = RolloutEngine(model, chat, cfg)
    assert engine.sampler.segment == 8
    group = engine.run_group(record, group_id=0, seeds=[11, 12], judge=rule_judge)
    assert group.stats["cache_grows"] >= 1 and group.stats["cache_rebuilds"] == 0
    assert group.stats["cache_slots"] > tight
    ref = sampled_engine.run_group(record, group_id=0, seeds=[11, 12], judge=rule_judge)
    for tr, want in zip(group.trajectories, ref.trajectories):
        assert tr.policy_mask.sum() > 8                 # the turn ran past the first segment
        np.testing.assert_array_equal(tr.tokens, want.tokens)
        np.testing.assert_allclose(tr.logprobs, want.logprobs, atol=1e-5, rtol=0)
        assert tr.failure_cause == want.failure_cause


def test_several_groups_in_one_batch_are_the_groups_run_alone(sampled_engine, record, rule_judge):
    from jscenegen.grpo.rollout.engine import GroupRequest

    other = dev_records()[1]
    both = sampled_engine.run_groups([GroupRequest(record, 7, (11, 12)), GroupRequest(other, 8, (5, 6))],
                                     judge=rule_judge)
    alone = [sampled_engine.run_group(record, group_id=7, seeds=[11, 12], judge=rule_judge),
             sampled_engine.run_group(other, group_id=8, seeds=[5, 6], judge=rule_judge)]
    assert [g.stats["groups"] for g in both] == [2, 2] and both[0].stats["batch_rows"] == 4
    assert both[0].stats["batch_generated_tokens"] == sum(g.stats["generated_tokens"] for g in both)
    for together, single in zip(both, alone):
        assert [t.group_id for t in together.trajectories] == [single.trajectories[0].group_id] * 2
        for tr, ref in zip(together.trajectories, single.trajectories):
            np.testing.assert_array_equal(tr.tokens, ref.tokens)
            np.testing.assert_allclose(tr.logprobs, ref.logprobs, atol=1e-5, rtol=0)
            assert tr.reward == ref.reward and tr.seed == ref.seed


def test_sampled_multi_turn_episodes_keep_every_roles_logprobs(model, chat, record, rule_judge,
                                                                monkeypatch):
    """Sampled episodes were single-turn only (a random model fails its first answer): here the
    runtime accepts the first turns whatever they say and hands the turn to another role, so each
    episode samples planner, designer and critic turns with environment replies between them;
    every sampled token's log-prob equals the trainer's recompute, each turn's role is recorded
    on its tokens, and decoding the tokens gives the template's rendering of the transcript."""
    import jscenegen.grpo.rollout.engine as engine_mod
    from jscenegen.scene.episode import Episode, StepResult

    hand_over = ["designer", "critic", "planner", "designer"]

    class Accepting(Episode):
        def step(self, text):
            self.accepted = getattr(self, "accepted", 0) + 1
            if self.accepted > len(hand_over):
                return super().step(text)
            self.next_role = hand_over[self.accepted - 1]
            return StepResult(f"turn {self.accepted} taken; the {self.next_role} acts", False)

    monkeypatch.setattr(engine_mod, "Episode", Accepting)
    cfg = SAMPLED.model_copy(update={"stop_strings": ("e", "a", "o", " ")})   # short turns
    trs = RolloutEngine(model, chat, cfg).run_group(record, group_id=5, seeds=[21, 22, 23],
                                                   judge=rule_judge).trajectories
    want = trainer_logprobs(model, [tr.tokens.tolist() for tr in trs], cfg.temperature)
    for i, tr in enumerate(trs):
        policy = [t for t in tr.turns if t["role"] != "environment"]
        assert [t["role"] for t in policy] == ["planner", *hand_over]
        for turn in policy:
            span = slice(turn["start"], turn["end"])
            assert tr.policy_mask[span].all() and (tr.roles[span] == ROLE_CODES[turn["role"]]).all()
        assert tr.policy_mask.sum() == sum(t["end"] - t["start"] for t in policy)
        mask = tr.policy_mask
        np.testing.assert_allclose(tr.logprobs[mask], want[i, :tr.num_tokens][mask], atol=1e-5, rtol=0)
        rendered = chat.render([{"role": m["role"], "content": m["content"]} for m in tr.transcript],
                               add_generation_prompt=False)
        assert rendered.startswith(chat.decode(tr.tokens.tolist()).rstrip("\n"))


def test_turn_stopped_by_a_stop_string_gets_its_end_of_turn_as_environment(model, chat, record, rule_judge):
    cfg = SAMPLED.model_copy(update={"stop_strings": ("e", "a", "o", " ")})
    trs = RolloutEngine(model, chat, cfg).run_group(record, group_id=4, seeds=[5, 6], judge=rule_judge).trajectories
    for tr in trs:
        policy, closing = tr.turns[-2], tr.turns[-1]
        assert policy["role"] == "planner" and policy["stop"] == "stop_string"
        text = chat.decode(tr.tokens[policy["start"]:policy["end"]].tolist())
        assert any(s in text for s in cfg.stop_strings)
        # no earlier token of the turn completed a stop string
        prefix = chat.decode(tr.tokens[policy["start"]:policy["end"] - 1].tolist())
        assert not any(s in prefix for s in cfg.stop_strings)
        assert closing == {"role": "environment", "start": policy["end"], "end": policy["end"] + 1, "stop": None}
        assert tr.tokens[-1] == chat.eot_id and tr.roles[-1] == ENVIRONMENT and not tr.policy_mask[-1]
        assert tr.failure_cause == "no_action_block" and tr.reward == -1.0
    # the same last turn ending exactly at the episode cap: no closing token beyond the cap
    at_cap = cfg.model_copy(update={"max_episode_tokens": trs[0].num_tokens - 1})
    tr = RolloutEngine(model, chat, at_cap).run_group(record, group_id=4, seeds=[5], judge=rule_judge).trajectories[0]
    assert tr.num_tokens == at_cap.max_episode_tokens and tr.turns[-1]["stop"] == "stop_string"
    np.testing.assert_array_equal(tr.tokens, trs[0].tokens[:-1])


def test_a_turn_ended_by_another_end_of_generation_id_is_closed_by_the_environment(
        sampled_engine, model, chat, record, rule_judge, monkeypatch):
    """A turn ends at any of the model's end-of-generation ids (`chat.end_ids`, as vLLM stops
    on generation_config.json's eos): that id is the policy's last token, the runtime reads the
    text before it, and the environment closes the turn with the end-of-turn token: at the end
    of the episode, and before the next message when the runtime takes the turn."""
    import copy

    import jscenegen.grpo.rollout.engine as engine_mod
    from jscenegen.scene.episode import Episode, StepResult

    ref = sampled_engine.run_group(record, group_id=4, seeds=[5], judge=rule_judge).trajectories[0]
    start = ref.turns[-1]["start"] if ref.turns[-1]["role"] != "environment" else ref.turns[-2]["start"]
    first_turn = ref.tokens[start:start + 5].tolist()
    end = next(t for t in first_turn[2:] if t != chat.eot_id)
    ending = copy.copy(chat)
    ending.end_ids = (chat.eot_id, end)
    tr = RolloutEngine(model, ending, SAMPLED).run_group(record, group_id=4, seeds=[5],
                                                        judge=rule_judge).trajectories[0]
    policy, closing = tr.turns[-2], tr.turns[-1]
    cut = start + first_turn.index(end) + 1
    assert policy == {"role": "planner", "start": start, "end": cut, "stop": "stop_token"}
    np.testing.assert_array_equal(tr.tokens[:cut], ref.tokens[:cut])
    assert tr.policy_mask[cut - 1] and tr.roles[cut - 1] == PLANNER
    assert closing == {"role": "environment", "start": cut, "end": cut + 1, "stop": None}
    assert tr.tokens[-1] == chat.eot_id and not tr.policy_mask[-1] and tr.num_tokens == cut + 1
    assert tr.transcript[-1]["content"] == chat.decode(tr.tokens[start:cut].tolist())
    assert tr.reward == -1.0
    read = []

    class Taking(Episode):     # takes the first turn (recording what it read), then as ever
        def step(self, text):
            if read:
                return super().step(text)
            read.append(text)
            self.next_role = "designer"
            return StepResult("taken; the designer acts", False)

    monkeypatch.setattr(engine_mod, "Episode", Taking)
    tr = RolloutEngine(model, ending, SAMPLED).run_group(record, group_id=4, seeds=[5],
                                                        judge=rule_judge).trajectories[0]
    assert read == [chat.decode(ref.tokens[start:cut - 1].tolist())]
    assert tr.turns[1]["end"] == cut and tr.turns[2]["role"] == "environment"
    assert tr.tokens[cut] == chat.eot_id and not tr.policy_mask[cut]
    assert [t["role"] for t in tr.turns if t["role"] != "environment"] == ["planner", "designer"]
    rendered = chat.render([{"role": m["role"], "content": m["content"]} for m in tr.transcript],
                           add_generation_prompt=False)
    assert rendered.startswith(chat.decode(tr.tokens.tolist()).rstrip("\n"))
    want = trainer_logprobs(model, [tr.tokens.tolist()], SAMPLED.temperature)[0, :tr.num_tokens]
    np.testing.assert_allclose(tr.logprobs[tr.policy_mask], want[tr.policy_mask], atol=1e-5, rtol=0)


@pytest.mark.slow   # a second model family through whole episodes (~6k tokens): minutes on 2 cores
def test_qwen35_expert_group_through_the_hybrid_cache_with_rebuilds(record, expert, rule_judge, tmp_path):
    """The rollout engine, unchanged, on a Qwen3.5 policy (init-model --arch qwen3_5, the
    protocol template): a cache too small for the bucketed history forces rebuilds (fresh
    HybridCache, history re-appended), and the forced turns' log-probs still equal the
    trainer's full-sequence recompute."""
    from jscenegen.model.init_model import init_model_dir

    from chat_fixtures import scripted_texts

    d = init_model_dir(tmp_path / "q35", arch="qwen3_5", preset="micro", texts=scripted_texts(),
                       vocab_size=2048, seed=0, hidden_size=64, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       linear_key_head_dim=16, linear_value_head_dim=16)
    chat = ChatTokenizer.from_dir(d)
    model = load_hf(d)
    cfg = FORCED.model_copy(update={"cache_tokens": 5120})
    group = RolloutEngine(model, chat, cfg).run_group(
        record, group_id=5, seeds=[1, 2], judge=rule_judge, forced=expert)
    assert group.stats["cache_rebuilds"] >= 1
    tr = group.trajectories[0]
    assert tr.failure_cause is None and tr.policy_mask.sum() > 0
    want = trainer_logprobs(model, [tr.tokens.tolist()], cfg.temperature)[0, :tr.num_tokens]
    np.testing.assert_allclose(tr.logprobs[tr.policy_mask], want[tr.policy_mask], atol=1e-5, rtol=0)
