"""SFT warm start (grpo/sft.py): demo scenes, token streams identical to rollouts, loss masks on
real episodes, the NLL against a direct computation, micro-batching, the overfit check on the
3 x 2 mesh, and the HF directory it writes."""
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jscenegen
from jscenegen.config import ConfigError, validate_config
from jscenegen.grpo.algo.accumulate import check_padded_micro_batches
from jscenegen.grpo.algo.config import OptimConfig
from jscenegen.grpo.algo.logprobs import selection_capacity
from jscenegen.grpo.algo.optimizer import init_train_state
from jscenegen.grpo.algo.roles import CRITIC, DESIGNER, ENVIRONMENT, PLANNER
from jscenegen.grpo.rollout.config import DEFAULT_STOP_STRINGS, SamplingConfig
from jscenegen.grpo.rollout.engine import RolloutEngine
from jscenegen.model.functional import hidden_fn
from jscenegen.model.hf_io import load_hf
from jscenegen.model.tokenizer.chat import ChatTokenizer
from jscenegen.paths import json_line
from jscenegen.scene.config import JudgeConfig, SceneRuntimeConfig
from jscenegen.scene.corpus import COMPACT_PROMPTS
from jscenegen.scene.expert import expert_ops, run_scripted_episode, scripted_answers
from jscenegen.scene.judge import make_judge
from jscenegen.scene.sceneset import read_scene_set
from jscenegen.sft.config import SFTRunConfig
from jscenegen.sft.demos import (
    SFT_SEED_BASE,
    Demo,
    answer_lengths,
    batch_indices,
    build_demos,
    demo_batch,
    drop_failed_episodes,
    drop_over_answer_cap,
    sft_records,
    tokenize_transcript,
)
from jscenegen.sft.run import run_sft
from jscenegen.sft.step import SFTStep
from jscenegen.sharding.layout import pad_batch, shard_batch
from jscenegen.sharding.mesh import make_mesh

from chat_fixtures import chat_model_dir, dev_records, nfc_chat_model_dir

# The compact prompt set the CPU default plays (0.6k-token prompt; the packaged one is 2.2k), rows
# truncated after the first planner turns: a third of the tokens, a ninth of the attention.
SCENE = {"prompts_dir": COMPACT_PROMPTS}
SEQ = 768


@pytest.fixture(scope="module")
def chat():
    return ChatTokenizer.from_dir(chat_model_dir())


@pytest.fixture(scope="module")
def demos(chat):
    return build_demos(chat, sft_records(3), SceneRuntimeConfig(**SCENE), stop_strings=DEFAULT_STOP_STRINGS)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(3, 2)


def test_sft_scenes_are_their_own_split():
    recs = sft_records(4, offset=2)
    assert [r.seed for r in recs] == [SFT_SEED_BASE * 1000 + 2 + i for i in range(4)]
    assert [r.scene.scene_id for r in recs] == ["sft_0002", "sft_0003", "sft_0004", "sft_0005"]
    shipped = read_scene_set("data/scenes/train.jsonl") + list(dev_records())
    prompts = {r.scene.prompt + json.dumps(r.scene.room.model_dump()) for r in shipped}
    assert not {r.seed for r in recs} & {r.seed for r in shipped}
    assert not {r.scene.prompt + json.dumps(r.scene.room.model_dump()) for r in recs} & prompts
    assert sft_records(4, offset=2)[1].scene == recs[1].scene  # deterministic


@pytest.mark.parametrize("stop_strings", [("</action>",), ()])
def test_demo_stream_is_the_rollout_stream(chat, stop_strings):
    """The scripted expert forced through RolloutEngine (the GRPO path) gives the same tokens,
    roles and policy mask as the SFT demo of the same episode: with the default stop string
    the end-of-turn token after each </action> is environment in both (the sampler stops at
    the string), without one it is the acting role's."""
    record = dev_records()[0]
    ops = expert_ops(record)
    cfg = SamplingConfig(max_new_tokens=512, max_episode_tokens=8192,
                         buckets=(256, 512, 1024, 2048, 4096), stop_strings=stop_strings)
    tr = RolloutEngine(load_hf(chat_model_dir()), chat, cfg).run_group(
        record, group_id=0, seeds=[0], judge=make_judge(JudgeConfig()),
        forced=lambda ep: scripted_answers(ep, ops)).trajectories[0]
    tokens, roles, policy = tokenize_transcript(chat, run_scripted_episode(record)[1], stop_strings=stop_strings)
    assert tr.failure_cause is None
    eots = tokens == chat.eot_id
    assert policy[eots].sum() == (0 if stop_strings else 5)   # the five answers' end-of-turn tokens
    np.testing.assert_array_equal(tokens, tr.tokens)
    np.testing.assert_array_equal(roles, tr.roles)
    np.testing.assert_array_equal(policy, tr.policy_mask)


def test_a_stop_string_inside_an_expert_answer_is_refused_in_sft_and_masked_in_a_rollout(chat):
    """A stop string the answers also hold mid-text ('"' in every JSON action) was accepted:
    SFT trained continuations past where the sampler always stops."""
    record = dev_records()[0]
    ops = expert_ops(record)
    with pytest.raises(ValueError, match=r"transcript message 2 \(planner\): a stop string ends "
                                         r"at character \d+ .*before its last token.*"
                                         r"sft\.stop_strings"):
        tokenize_transcript(chat, run_scripted_episode(record)[1], stop_strings=('"',))
    cfg = SamplingConfig(max_new_tokens=512, max_episode_tokens=8192,
                         buckets=(256, 512, 1024, 2048, 4096), stop_strings=('"',))
    tr = RolloutEngine(load_hf(chat_model_dir()), chat, cfg).run_group(
        record, group_id=0, seeds=[0], judge=make_judge(JudgeConfig()),
        forced=lambda ep: scripted_answers(ep, ops)).trajectories[0]
    assert tr.masked and tr.failure_cause == "rollout_error"


def one_answer_transcript(answer: str) -> list[dict]:
    """system, user, the planner's `answer`, the environment's reply."""
    return [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": answer, "actor": "planner"},
            {"role": "user", "content": "ok"}]


def test_a_demonstration_spelling_the_end_of_turn_token_keeps_it_as_text(chat):
    """An expert answer holding the text `<|im_end|>` became an end-of-turn token with loss
    mask 1 inside the turn: SFT taught ending a turn mid-answer and going on."""
    answer = "plan: copy <|im_end|> then <action>{}</action>"
    transcript = one_answer_transcript(answer)
    tokens, _, policy = tokenize_transcript(chat, transcript, stop_strings=())
    turn = tokens[policy].tolist()
    assert turn == chat.encode_plain(answer) + [chat.eot_id]
    assert turn.count(chat.eot_id) == 1


def test_a_demonstration_outside_the_tokenizers_normal_form_is_normalised():
    """An expert answer not in NFC ("cafe" + U+0301, the Kelvin sign) under Qwen's NFC
    tokenizer: its ids decode to other text and `encode_plain` refused the demo. Normalised
    first, as a rollout's environment messages are, its tokens decode to the NFC text."""
    nfc = ChatTokenizer.from_dir(nfc_chat_model_dir())
    answer = "a cafe\u0301 corner at 300 \u212a <action>{}</action>"
    transcript = one_answer_transcript(answer)
    tokens, _, policy = tokenize_transcript(nfc, transcript, stop_strings=())
    turn = tokens[policy].tolist()
    assert nfc.decode(turn) == "a caf\u00e9 corner at 300 K <action>{}</action><|im_end|>"
    normal = [dict(m, content=nfc.normalize(m["content"])) for m in transcript]
    assert nfc.decode(tokens.tolist()) == nfc.render(normal, add_generation_prompt=True)


def test_an_answer_ends_at_the_token_completing_its_first_stop_string(chat):
    """The sampler stops at the token that completes a stop string, which may carry more
    (`>` and a newline merged): such an answer ends there; text after that token never."""
    from jscenegen.generate.stop import ends_at_stop_string

    def ends(text):
        ids = chat.encode(text)
        return ends_at_stop_string(text, ("</action>",), len(chat.decode(ids[:-1])))

    assert ends('<action>{"a": 1}</action>') is True
    assert ends("no action here") is False
    merged = '<action>{"a": 1}</action>\n'
    # a tokenizer whose last token is ">\n" (Qwen's vocabulary has such merges): it ends there
    assert ends_at_stop_string(merged, ("</action>",), len(merged) - 2) is True
    # ">" and "\n" apart (this fixture's tokenizer): the sampler would never write the "\n"
    with pytest.raises(ValueError, match=r"before its last token.*</action>"):
        ends(merged)
    with pytest.raises(ValueError, match=r"before its last token.*</action>"):
        ends('<action>{"a": 1}</action> and then some more text')


def test_demo_masks_on_real_episodes(demos, chat):
    for d in demos:
        assert d.reward > 0.5  # the expert's episodes are good ones
        env = d.roles == ENVIRONMENT
        assert not d.policy_mask[env].any() and d.policy_mask[~env].all()
        # turns in protocol order, each answer ending at the stop string </action>, the
        # <|im_end|> after it environment, each preceded by environment glue
        starts = np.flatnonzero(np.diff(np.r_[0, d.policy_mask.astype(int)]) == 1)
        ends = np.flatnonzero(np.diff(np.r_[d.policy_mask.astype(int), 0]) == -1) + 1
        assert [int(d.roles[s]) for s in starts] == [PLANNER, DESIGNER, PLANNER, CRITIC, PLANNER]
        for s, e in zip(starts, ends):
            assert chat.decode(d.tokens[:s].tolist()).endswith("<|im_end|>\n<|im_start|>assistant\n")
            text = chat.decode(d.tokens[s:e].tolist())
            assert text.endswith("</action>") and "<|im_start|>" not in text
            assert d.tokens[e] == chat.eot_id and d.roles[e] == ENVIRONMENT
        assert chat.decode(d.tokens[:20].tolist()).startswith("<|im_start|>system\nYou furnish rooms as Planner")
    batch = demo_batch(demos, 6000)
    for i, d in enumerate(demos):
        n = len(d.tokens)
        np.testing.assert_array_equal(batch["loss_mask"][i, :n], d.policy_mask.astype(np.float32))
        assert not batch["loss_mask"][i, n:].any() and batch["attention_mask"][i].sum() == n
    short = demo_batch(demos, 100)
    assert short["input_ids"].shape == (3, 100) and not short["loss_mask"].any()  # prompt only
    # rows padded beyond sft.max_seq_len hold max_seq_len real tokens at most
    capped = demo_batch(demos, 128, max_tokens=100)
    assert capped["input_ids"].shape == (3, 128) and (capped["attention_mask"].sum(1) == 100).all()
    np.testing.assert_array_equal(capped["input_ids"][:, :100], short["input_ids"])


def test_batch_indices_cycle_epochs_deterministically():
    from itertools import islice

    def order(seed, steps=4):
        return np.stack(list(islice(batch_indices(5, 3, seed=seed), steps)))

    got = order(1)
    assert got.shape == (4, 3)
    flat = got.ravel()
    assert sorted(flat[:5]) == list(range(5)) and sorted(flat[5:10]) == list(range(5))
    np.testing.assert_array_equal(got, order(1))
    assert not np.array_equal(got, order(2))
    np.testing.assert_array_equal(order(1, 10**5)[:4], got)   # many steps: made as taken


def _direct_nll(model, batch):
    forward = nnx.jit(lambda m, ids, mask: m(ids, mask))   # eager: each op dispatched alone
    logits = forward(model, jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"]))
    logp = jax.nn.log_softmax(np.asarray(logits, np.float64)[:, :-1], axis=-1)
    tok = np.take_along_axis(np.asarray(logp), batch["input_ids"][:, 1:, None], -1)[..., 0]
    m = batch["loss_mask"][:, 1:]
    return -(tok * m).sum() / m.sum()


OPTIM = OptimConfig(lr=1e-2, warmup_steps=2, weight_decay=0.0)


@pytest.fixture(scope="module")
def sharded(mesh):
    model = load_hf(chat_model_dir(), mesh=mesh)
    graphdef, params, *rest = nnx.split(model, nnx.Param, ...)
    whole = SFTStep(hidden_fn(graphdef, *rest), OPTIM, donate=False)
    return params, rest, graphdef, whole


@pytest.fixture(scope="module")
def batch(demos, mesh):
    arrays = demo_batch(demos, SEQ)
    return arrays, shard_batch(pad_batch(arrays, mesh), mesh)


def test_loss_matches_direct_nll_and_micro_batches(sharded, batch, mesh):
    params, rest, graphdef, whole = sharded
    arrays, placed = batch
    assert arrays["loss_mask"].sum() > 50  # the first planner turns (~20 tokens each)
    micro = SFTStep(hidden_fn(graphdef, *rest), OPTIM, micro_batch_size=3, donate=False)
    # steps of one model structure and options share their compiled function (a resume)
    assert SFTStep(hidden_fn(graphdef, *rest), OPTIM, donate=False).step is whole.step
    assert micro.step is not whole.step
    capacity = selection_capacity(arrays["loss_mask"])   # run_sft's: the policy tokens' logits only
    assert capacity < arrays["loss_mask"].shape[1]
    with jax.set_mesh(mesh):
        s1, m1 = whole.step(init_train_state(params, OPTIM), placed)
        s2, m2 = micro.step(init_train_state(params, OPTIM), placed)
        s3, m3 = whole.step(init_train_state(params, OPTIM), placed, capacity=capacity)
    assert float(m1["tokens"]) == float(m2["tokens"]) == arrays["loss_mask"][:, 1:].sum()
    assert float(m1["loss"]) == pytest.approx(_direct_nll(load_hf(chat_model_dir()), arrays), rel=1e-5)
    assert float(m2["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-5)
    assert float(m3["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-5)
    assert float(m1["lr"]) == 0.0 and int(s1.lr_step) == 1  # warmup starts at 0, as LambdaLR
    # lr is 0 in this first step, so the Adam moments carry the gradients: equal either way
    for other in (s2, s3):
        for i, (a, b) in enumerate(zip(jax.tree.leaves(s1.opt_state), jax.tree.leaves(other.opt_state))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-10,
                                       err_msg=str(i))
    assert float(np.abs(np.asarray(jax.tree.leaves(s1.opt_state)[-1])).max()) > 0


@pytest.mark.slow  # ~150 s on 2 cores; the pipeline test runs SFT in the default run
def test_sft_overfits_a_handful_of_demos(sharded, batch, mesh):
    params, _, _, whole = sharded
    _, placed = batch
    losses = []
    with jax.set_mesh(mesh):
        state = init_train_state(params, OPTIM)
        for _ in range(13):  # the 13th step's loss is the NLL after 12 updates
            state, metrics = whole.step(state, placed)
            losses.append(float(metrics["loss"]))
    assert float(metrics["skipped"]) == 0.0 and int(state.lr_step) == 13
    assert losses[-1] < 0.5 * losses[0], losses
    assert losses[0] == pytest.approx(np.log(ChatTokenizer.from_dir(chat_model_dir()).vocab_size), rel=0.05)
    for p in jax.tree.leaves(state.params):  # parameters stay FSDP2-sharded
        assert p.sharding.spec == jax.sharding.PartitionSpec(("fsdp", "sp"))


def test_the_log_says_which_roles_answers_truncation_cut():
    """The demos event counted truncated demos only: 16% of the CPU default's were cut, every
    one losing the planner's closing `finish` (helper-170)."""
    from jscenegen.sft.demos import Demo, truncation_losses

    roles = np.array([0, 0, 1, 1, 1, 0, 2, 2, 0, 3], np.int8)
    demo = Demo("s", np.arange(10, dtype=np.int32), roles, roles != 0, 0.5)
    short = Demo("t", np.arange(4, dtype=np.int32), roles[:4], roles[:4] != 0, 0.5)
    assert truncation_losses([demo, short], 4) == {
        "truncated": 1, "policy_tokens_cut": {"planner": 1, "designer": 2, "critic": 1},
        "cut_mid_answer": 1}
    assert truncation_losses([demo, short], 6) == {
        "truncated": 1, "policy_tokens_cut": {"planner": 0, "designer": 2, "critic": 1},
        "cut_mid_answer": 0}
    assert truncation_losses([demo], 10)["truncated"] == 0


def test_run_sft_writes_a_loadable_hf_dir(tmp_path):
    cfg = validate_config({"sft": {"num_demos": 2, "steps": 2, "batch_size": 3, "max_seq_len": SEQ,
                                   "log_every": 1, "seed": 3}, "scene": SCENE,
                           "optim": {"lr": 5e-3, "weight_decay": 0.0}}, "sft.yaml", SFTRunConfig)
    rows = []
    # the template it trains with (here ChatML marked by a comment) is the one it writes
    variant = tmp_path / "variant.jinja"
    variant.write_text("{# variant #}" + (Path(jscenegen.__file__).parent / "model/tokenizer/templates/chatml.jinja").read_text())
    summary = run_sft(cfg, chat_model_dir(), tmp_path / "out", log=rows.append, chat_template_path=variant)
    out = tmp_path / "out"
    for f in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", "sft_summary.json"):
        assert (out / f).is_file(), f
    assert (out / "chat_template.jinja").read_text() == variant.read_text()
    assert ChatTokenizer.from_dir(out).tokenizer.chat_template == variant.read_text()
    assert rows[0]["event"] == "demos" and rows[0]["truncated"] == 2 and rows[0]["row_length"] == SEQ
    assert set(rows[0]["policy_tokens_cut"]) == {"planner", "designer", "critic"}
    assert rows[0]["policy_tokens_cut"]["designer"] > 0   # cut after the first planner turns
    assert [r["step"] for r in rows[1:]] == [0, 1]
    vocab = ChatTokenizer.from_dir(chat_model_dir()).vocab_size
    assert all(abs(r["loss"] - np.log(vocab)) < 0.5 and r["tokens"] > 30 for r in rows[1:])  # 2 planner turns
    saved = json.loads((out / "sft_summary.json").read_text())
    assert saved["final_loss"] == summary["final_loss"] == rows[-1]["loss"]
    assert saved["config"]["sft"]["seed"] == 3 and saved["chat_template_path"] == str(variant)
    # weights changed, shapes and config kept; the tokenizer travels with them
    before, after = load_hf(chat_model_dir()), load_hf(out)
    assert before.cfg == after.cfg
    w0 = np.asarray(before.model.embed_tokens.weight[...])
    w1 = np.asarray(after.model.embed_tokens.weight[...])
    assert w0.shape == w1.shape and not np.allclose(w0, w1)
    assert ChatTokenizer.from_dir(out).encode("<action>") == ChatTokenizer.from_dir(chat_model_dir()).encode("<action>")


def test_answer_lengths_are_the_policy_turns_as_a_rollout_generates_them(chat, demos):
    """What must fit sampling.max_new_tokens: each policy turn, its end-of-turn token included
    unless the answer ends at a stop string (the environment adds it then)."""
    E = ENVIRONMENT
    roles = np.array([E, PLANNER, PLANNER, E, DESIGNER, DESIGNER, DESIGNER, CRITIC, CRITIC, E], np.int8)
    demo = Demo("s", np.arange(10, dtype=np.int32), roles, roles != E, 0.0)
    assert answer_lengths(demo) == [("planner", 2), ("designer", 3), ("critic", 2)]
    for d, record in zip(demos, sft_records(3)):
        _, transcript = run_scripted_episode(record, SceneRuntimeConfig(**SCENE))
        answers = [m for m in transcript if m["role"] == "assistant"]
        turns = answer_lengths(d)
        assert [role for role, _ in turns] == [m["actor"] for m in answers]
        assert all(n - len(chat.encode_plain(m["content"])) in (0, 1) for (_, n), m in zip(turns, answers))
        assert sum(n for _, n in turns) == d.policy_mask.sum()
    # the three demos' designer answers: 301, 289 and 245 tokens; every other answer is shorter
    assert [max(n for _, n in answer_lengths(d)) for d in demos] == [301, 289, 245]
    kept, stats = drop_over_answer_cap(demos, 289)
    assert kept == demos[1:] and stats == {
        "max_answer_tokens": 289, "demos_over_answer_cap": 1,
        "answers_over_cap": {"planner": 0, "designer": 1, "critic": 0},
        "longest_answer": {"planner": 19, "designer": 301, "critic": 68}}
    kept, stats = drop_over_answer_cap(demos, None)   # `jscenegen sft`'s default: no cap
    assert kept == demos and stats["demos_over_answer_cap"] == 0
    assert drop_over_answer_cap(demos, 18)[0] == []   # the planner's 19-token turns


def test_run_sft_drops_the_demos_whose_answers_pass_max_answer_tokens(tmp_path, caplog):
    """The CPU default's warm start trained designer answers longer than the rollouts'
    per-turn cap (30 of 300 demos): answers no rollout can finish. They are dropped, counted
    per role, with one warning line; none left is refused."""
    def cfg(cap):
        return validate_config({"sft": {"num_demos": 2, "steps": 1, "batch_size": 3,
                                         "max_seq_len": SEQ, "max_answer_tokens": cap},
                                "scene": SCENE, "optim": {"warmup_steps": 0}}, "sft.yaml", SFTRunConfig)

    with pytest.raises(ValueError, match=r"^sft.max_answer_tokens=18 \(a train warm start: the "
                       r"run's sampling.max_new_tokens\): every one of the 2 demonstrations holds "
                       r"a longer answer \(longest answers in tokens: planner 19, designer 301, "
                       r"critic 67\); raise it to train on them$"):
        run_sft(cfg(18), chat_model_dir(), tmp_path / "none")
    assert not (tmp_path / "none").exists()
    rows = []
    with caplog.at_level("WARNING", logger="jscenegen.sft.run"):
        summary = run_sft(cfg(300), chat_model_dir(), tmp_path / "out", log=rows.append)
    assert caplog.messages == [
        "sft: 1 of 2 demonstrations dropped: they hold answers longer than "
        "sft.max_answer_tokens=300, the rollouts' per-turn cap, which no rollout could finish "
        "(answers over it: designer 1; longest answers in tokens: planner 19, designer 301, "
        "critic 67)"]
    saved = json.loads((tmp_path / "out" / "sft_summary.json").read_text())
    for stats in (rows[0], summary, saved):
        assert stats["demos"] == 1 and stats["demos_over_answer_cap"] == 1
        assert stats["answers_over_cap"] == {"planner": 0, "designer": 1, "critic": 0}
        assert stats["max_answer_tokens"] == 300 and stats["longest_answer"]["designer"] == 301


def test_demos_play_the_rollouts_grade_keys(chat):
    """The demonstrations were played with the default seven grade keys whatever the rollouts'
    judge grades: their system prompt was not the rollouts', and the expert's critiques held
    keys the rollouts' critic schema refuses."""
    from jscenegen.scene.actions import parse_action
    from jscenegen.scene.episode import Episode

    keys = ("layout", "functionality")
    scene = SceneRuntimeConfig(**SCENE)
    record = sft_records(1)[0]
    demo = build_demos(chat, [record], scene, stop_strings=DEFAULT_STOP_STRINGS, grade_keys=keys)[0]
    rollout = Episode(record, scene, JudgeConfig(grade_keys=keys))
    _, prompt = chat.start(rollout.system_prompt(), rollout.first_user_message())
    np.testing.assert_array_equal(demo.tokens[:len(prompt)], prompt)
    critic = chat.decode(demo.tokens[demo.policy_mask & (demo.roles == CRITIC)].tolist())
    assert parse_action(critic, "critic", keys).failure_cause is None
    assert demo.failure_cause is None
    with pytest.raises(ConfigError, match=r"sft.grade_keys \['layout', 'style'\]: the scripted "
                       r"expert's critic grades as the rule judge does, which knows only "
                       r"realism, .*, not style"):
        validate_config({"sft": {"grade_keys": ["layout", "style"]}}, "sft.yaml", SFTRunConfig)
    with pytest.raises(ConfigError, match=r"sft.grade_keys \['layout', 'layout'\]: must be "
                       r"distinct and non-empty"):
        validate_config({"sft": {"grade_keys": ["layout", "layout"]}}, "sft.yaml", SFTRunConfig)


def test_sft_scenes_the_catalogue_or_grid_cannot_hold_are_refused_before_any_model(tmp_path):
    """A replacement catalogue without a category the SFT scenes request (desk) crashed the
    expert with an AttributeError traceback, and a room wider than scene.metrics' grid raised
    an error naming no scene; both only once the model was made (a train warm start: its
    base model). Refused by check_sft_inputs now, naming the SFT scene."""
    from importlib import resources

    from jscenegen.sft.run import check_sft_inputs

    doc = json.loads(resources.files("jscenegen.scene").joinpath("data/catalogue.json").read_text())
    del doc["categories"]["desk"]
    for key in ("desk_like", "top_surfaces"):
        doc[key].remove("desk")
    cat = tmp_path / "cat.json"
    cat.write_text(json.dumps(doc))
    cases = [({"catalogue_path": str(cat)}, r"scene sft_0000 requests 'desk': neither a category "
                                             r"nor a group of the catalogue$"),
             ({"metrics": {"grid_size": 96}}, r"scene sft_0002: room bounding box 4.90 x 3.15 m "
                                               r"exceeds the 96 x 96 cell grid \(4.80 m\)")]
    for scene, error in cases:
        cfg = validate_config({"sft": {"num_demos": 4}, "mesh": {"fsdp": 3, "sp": 2},
                               "scene": {**SCENE, **scene}}, "sft.yaml", SFTRunConfig)
        with pytest.raises(ValueError, match=r"^the SFT scenes \(sft.num_demos=4, "
                           r"sft.scene_offset=0\): record \d: " + error):
            check_sft_inputs(cfg)
    check_sft_inputs(validate_config({"sft": {"num_demos": 4}, "mesh": {"fsdp": 3, "sp": 2},
                                      "scene": SCENE}, "sft.yaml", SFTRunConfig))


def test_run_sft_drops_the_demos_the_expert_failed(tmp_path, caplog, monkeypatch):
    """Under scene.max_critique_rounds=0 the scripted planner asks for a critique until the
    planner turn cap fails the episode: a warm start trained every demonstration on an
    episode with reward -1 (the planner taught to loop on refused critiques), saying nothing.
    Failed episodes are dropped with one warning line and counted per cause; none left is
    refused before any training."""
    import dataclasses

    import jscenegen.sft.run as sft_run

    def cfg(**scene):
        return validate_config({"sft": {"num_demos": 2, "steps": 1, "batch_size": 3,
                                         "max_seq_len": SEQ},
                                "scene": {**SCENE, **scene}, "optim": {"warmup_steps": 0}},
                               "sft.yaml", SFTRunConfig)

    chat = ChatTokenizer.from_dir(chat_model_dir())
    failed = build_demos(chat, sft_records(1), SceneRuntimeConfig(**SCENE, max_critique_rounds=0),
                         stop_strings=DEFAULT_STOP_STRINGS)[0]
    assert (failed.failure_cause, failed.reward) == ("planner_turn_cap", -1.0)
    assert drop_failed_episodes([failed, dataclasses.replace(failed, failure_cause=None)]) == (
        [dataclasses.replace(failed, failure_cause=None)], {"expert_failures": {"planner_turn_cap": 1}})
    with pytest.raises(ValueError, match=r"^sft: the scripted expert failed every one of the 2 "
                       r"demonstrations under the scene settings \(planner_turn_cap 2\); "):
        run_sft(cfg(max_critique_rounds=0), chat_model_dir(), tmp_path / "none")
    assert not (tmp_path / "none").exists()

    real = sft_run.build_demos

    def first_failed(*args, **kwargs):   # one of two episodes failed by the expert
        demos = real(*args, **kwargs)
        return [dataclasses.replace(demos[0], failure_cause="planner_turn_cap"), *demos[1:]]

    monkeypatch.setattr(sft_run, "build_demos", first_failed)
    rows = []
    with caplog.at_level("WARNING", logger="jscenegen.sft.run"):
        summary = run_sft(cfg(), chat_model_dir(), tmp_path / "out", log=rows.append)
    assert caplog.messages == [
        "sft: 1 of 2 demonstrations dropped: the scripted expert failed them under the scene "
        "settings (planner_turn_cap 1), and they would teach what earns reward -1"]
    saved = json.loads((tmp_path / "out" / "sft_summary.json").read_text())
    for stats in (rows[0], summary, saved):
        assert stats["demos"] == 1 and stats["expert_failures"] == {"planner_turn_cap": 1}


def test_an_sft_stopped_leaves_no_directory_it_made(tmp_path, monkeypatch):
    """`sft --out NEW/model` without --model, stopped during the SFT: the fresh model beside
    the output was removed, NEW itself stayed; an empty `model-init` given for it stays."""
    import jscenegen.sft.run
    from jscenegen.cli import main

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(jscenegen.sft.run, "run_sft", stopped)
    assert main(["sft", "--config", "configs/sft-cpu.yaml", "--out",
                 str(tmp_path / "new" / "model")]) == 130
    assert list(tmp_path.iterdir()) == []
    # an empty directory that was there for the fresh model stays (it was removed)
    (tmp_path / "model-init").mkdir()
    assert main(["sft", "--config", "configs/sft-cpu.yaml", "--out", str(tmp_path / "model")]) == 130
    assert [(p.name, list(p.iterdir())) for p in tmp_path.iterdir()] == [("model-init", [])]


def test_run_sft_never_replaces_an_existing_directory(tmp_path):
    cfg = validate_config({"sft": {"num_demos": 2, "steps": 1, "batch_size": 3, "max_seq_len": SEQ},
                           "scene": SCENE}, "sft.yaml", SFTRunConfig)
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "keep.txt").write_text("precious")
    rows = []
    with pytest.raises(FileExistsError, match=f"{out}: already exists and is not empty"):
        run_sft(cfg, chat_model_dir(), out, log=rows.append)
    assert rows == [] and (out / "keep.txt").read_text() == "precious" and (out / "sub").is_dir()
    # an --out above the model directory is not empty either: the model is never touched
    with pytest.raises(FileExistsError):
        run_sft(cfg, chat_model_dir(), Path(chat_model_dir()).parent, log=rows.append)
    assert (Path(chat_model_dir()) / "config.json").is_file()


def test_run_sft_refuses_what_would_not_train_and_warns_when_nothing_moved(tmp_path, caplog):
    """Exit 0 with a "trained" model that is not: rows too short for any policy token, weights
    that diverged (lr 1e30, past the config's bound, set after validation as a stand-in for a
    run that diverges: the first update blows them up, every later step is skipped), a single
    step inside the warmup (lr 0)."""
    def cfg(sft=None, optim=None):
        optim = dict(optim or {})
        huge = optim.pop("huge_lr", None)
        c = validate_config({"sft": {"num_demos": 2, "steps": 2, "batch_size": 3, "max_seq_len": SEQ,
                                     "log_every": 1, **(sft or {})}, "scene": SCENE,
                             "optim": {"lr": 5e-3, "weight_decay": 0.0, **optim}},
                            "sft.yaml", SFTRunConfig)
        return c if huge is None else c.model_copy(update={"optim": c.optim.model_copy(update={"lr": huge})})
    with pytest.raises(ValueError, match=r"^sft.micro_batch_size=4: sft.batch_size = 4 rows, padded "
                                         r"to 6 \(a multiple of mesh.fsdp=3\), do not split"):
        run_sft(cfg({"batch_size": 4, "micro_batch_size": 4}), "/nonexistent", tmp_path / "padded")
    with pytest.raises(ValueError, match=r"sft.max_seq_len=16: no demonstration has a policy token"):
        run_sft(cfg({"max_seq_len": 16, "seq_multiple": 16}), chat_model_dir(), tmp_path / "short")
    rows = []
    with pytest.raises(ValueError, match=r"the last step's gradient is not finite: training diverged "
                                         r"\(1 of 2 steps skipped.*optim.lr=1e\+30\); nothing written"):
        run_sft(cfg(optim={"huge_lr": 1e30, "warmup_steps": 0}), chat_model_dir(), tmp_path / "diverged",
                log=rows.append)
    assert json.loads(json_line(rows[-1]))["grad_norm"] is None      # strict JSON: NaN is null
    # one step: its logged loss (before the update) is finite, the weights written are not
    with pytest.raises(ValueError, match=r"at the weights after the last step its batch has loss "
                                         r"\S+ and gradient norm (nan|inf): the last update diverged"):
        run_sft(cfg({"steps": 1}, optim={"huge_lr": 1e30, "warmup_steps": 0}), chat_model_dir(),
                tmp_path / "one", log=rows.append)
    assert not (tmp_path / "one").exists()
    with caplog.at_level("WARNING"):
        run_sft(cfg({"steps": 1}), chat_model_dir(), tmp_path / "still", log=rows.append)
    assert "every step ran at learning rate 0 (sft.steps=1, optim.warmup_steps=4" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["still"]


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="sft.batch_size"):
        validate_config({"sft": {"batch_size": 0}}, "sft.yaml", SFTRunConfig)
    # an AdamW learning rate past 1 is a typo (1e308 went on into a full warm start)
    with pytest.raises(ConfigError, match=r"optim.lr: Input should be less than or equal to 1"):
        validate_config({"optim": {"lr": 1e308}}, "sft.yaml", SFTRunConfig)
    with pytest.raises(ConfigError, match="sft.nmu_demos"):
        validate_config({"sft": {"nmu_demos": 3}}, "sft.yaml", SFTRunConfig)
    # the rule is the padded batch's, as GRPO's (run_sft checks it against mesh.fsdp before any
    # work): 4 rows on fsdp=3 pad to 6, two micro-batches of 3; the config refused it
    assert validate_config({"sft": {"batch_size": 4, "micro_batch_size": 3}}, "sft.yaml",
                           SFTRunConfig).sft.micro_batch_size == 3
    assert check_padded_micro_batches(4, 3, 3, "sft.batch_size", "sft.micro_batch_size") == 2
    with pytest.raises(ConfigError, match="batch_size 100000 x max_seq_len 3072 = 307,200,000 tokens"):
        validate_config({"sft": {"batch_size": 100000, "micro_batch_size": 1}}, "sft.yaml", SFTRunConfig)
    with pytest.raises(ConfigError, match=r"batch_size 5600 x max_seq_len 3000 = 16,800,000 tokens"):
        validate_config({"sft": {"batch_size": 5600, "max_seq_len": 3000}}, "sft.yaml", SFTRunConfig)
    # rows are padded to the multiple but never past max_seq_len: a multiple of 2^20 (rows of
    # 2^20 tokens ran out of memory) is harmless, as is the default 128 beside a short max_seq_len
    assert validate_config({"sft": {"batch_size": 17, "seq_multiple": 2**20}}, "sft.yaml",
                           SFTRunConfig).sft.seq_multiple == 2**20
    assert validate_config({"sft": {"max_seq_len": 64}}, "sft.yaml", SFTRunConfig).sft.seq_multiple == 128
    with pytest.raises(ConfigError, match="scene_offset 999999 \\+ num_demos 2 passes"):
        validate_config({"sft": {"num_demos": 2, "scene_offset": 999999}}, "sft.yaml", SFTRunConfig)
    with pytest.raises(ConfigError, match="sft.stop_strings.*must not contain an empty string"):
        validate_config({"sft": {"stop_strings": ["</action>", ""]}}, "sft.yaml", SFTRunConfig)
    # a jitter of 1e308 m ended in an OverflowError traceback while the demos were played
    with pytest.raises(ConfigError, match=r"sft.noise_m: Input should be less than or equal to 10"):
        validate_config({"sft": {"noise_m": 1e308}}, "sft.yaml", SFTRunConfig)
    assert validate_config({"sft": {"noise_m": 10}}, "sft.yaml", SFTRunConfig).sft.noise_m == 10


def test_json_files_are_strict_json():
    """`sft_summary.json`'s history held a skipped step's NaN grad_norm as Python's `NaN`, which
    JSON has not and strict parsers refuse: written files hold null, as JSON lines do."""
    from jscenegen.paths import json_document, loads_json

    summary = {"history": [{"step": 0, "grad_norm": float("nan"), "loss": 1.5}],
               "inf": (float("inf"), -float("inf")), "final_loss": np.float64("nan")}
    text = json_document(summary)
    assert loads_json(text, allow_nan=False) == {
        "final_loss": None, "history": [{"grad_norm": None, "loss": 1.5, "step": 0}],
        "inf": [None, None]}
    assert text.endswith("}\n") and '\n  "final_loss": null' in text   # indented, sorted
    assert loads_json(json_line(summary), allow_nan=False) == loads_json(text, allow_nan=False)


def test_a_cosine_schedule_shorter_than_the_sft_steps_is_warned_before_any_work(tmp_path, caplog):
    """Past optim.total_steps the cosine climbs back towards optim.lr (`train` warned; `sft`
    ran on silently: sft.steps=600 with configs/sft-cpu.yaml's total_steps=300)."""
    from jscenegen.sharding.mesh import MeshError

    cfg = validate_config({"sft": {"steps": 600}, "mesh": {"fsdp": 5, "sp": 1},
                           "optim": {"lr_schedule": "cosine", "total_steps": 300}},
                          "sft.yaml", SFTRunConfig)
    with pytest.raises(MeshError):        # the mesh is checked after the warning: no model loads
        run_sft(cfg, tmp_path / "no-model", tmp_path / "out")
    assert "optim.total_steps=300 is below sft.steps=600: past it the cosine LR climbs back" \
        in caplog.text
    caplog.clear()
    fits = validate_config({"sft": {"steps": 300}, "mesh": {"fsdp": 5, "sp": 1},
                            "optim": {"lr_schedule": "cosine", "total_steps": 300}},
                           "sft.yaml", SFTRunConfig)
    with pytest.raises(MeshError):
        run_sft(fits, tmp_path / "no-model", tmp_path / "out2")
    assert "total_steps" not in caplog.text


def test_a_warmup_longer_than_the_run_is_warned_before_any_work(tmp_path, caplog):
    """sft.steps=300 with optim.warmup_steps=1000 trained at 30% of optim.lr at most, silently."""
    from jscenegen.sharding.mesh import MeshError

    cfg = validate_config({"sft": {"steps": 300}, "mesh": {"fsdp": 5, "sp": 1},
                           "optim": {"warmup_steps": 1000}}, "sft.yaml", SFTRunConfig)
    with pytest.raises(MeshError):        # the mesh is checked after the warning: no model loads
        run_sft(cfg, tmp_path / "no-model", tmp_path / "out")
    assert ("optim.warmup_steps=1000 is at or over sft.steps=300: the run ends inside its "
            "warmup, its last step at 30% of optim.lr") in caplog.text
    caplog.clear()
    fits = validate_config({"sft": {"steps": 300}, "mesh": {"fsdp": 5, "sp": 1},
                            "optim": {"warmup_steps": 299}}, "sft.yaml", SFTRunConfig)
    with pytest.raises(MeshError):
        run_sft(fits, tmp_path / "no-model", tmp_path / "out2")
    assert "warmup" not in caplog.text
