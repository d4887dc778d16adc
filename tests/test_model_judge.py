"""The model judge (`judge.backend: model`): the project's own model graded with in the process.

A tiny random Qwen3 with the protocol tokenizer (chat_fixtures) is the judge: it writes no
valid JSON, so its real answers are masked failures; the valid-answer path is driven with chosen
completion texts and, through the whole `grade`, with chosen tokens at the sampler's decode."""
import copy
import dataclasses
import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from jscenegen.config import ConfigError
from jscenegen.generate.sampler import STOP_LENGTH, STOP_TOKEN
from jscenegen.grpo.rollout.judges import build_judge, load_judge
from jscenegen.grpo.rollout.model_judge import ModelJudge, prompt_seed
from jscenegen.run_config import RunConfig, load_run_config
from jscenegen.scene.config import GRADE_KEYS, JudgeConfig
from jscenegen.scene.expert import run_scripted_episode
from jscenegen.scene.judge import ModelJudgeUnavailable, judge_messages, make_judge
from jscenegen.scene.judge_answer import CUT_DETAIL

from chat_fixtures import chat_model_dir, dev_records

BUCKETS = (128, 1024)   # the ~1,300-token judge prompts: one 1024 chunk and 128s


def model_cfg(path, **judge) -> RunConfig:
    cfg = RunConfig(judge=JudgeConfig(backend="model", model_path=str(path),
                                      **{"max_tokens": 16, **judge}))
    return cfg.model_copy(update={"sampling": cfg.sampling.model_copy(update={"buckets": BUCKETS})})


@pytest.fixture(scope="module")
def judge() -> ModelJudge:
    return build_judge(model_cfg(chat_model_dir()), load=True)   # one device


def unjudged_episodes():
    """Two finished, unjudged scripted episodes of two dev scenes."""
    return [run_scripted_episode(r, judged=False)[0] for r in dev_records()[:2]]


@pytest.fixture(scope="module")
def requests():
    return [ep.judge_request() for ep in unjudged_episodes()]


def seen(results):
    """What a result says, without its latency."""
    return [(r.grades, r.failure, {k: v for k, v in r.info.items() if k != "latency_s"})
            for r in results]


def test_a_random_model_judge_masks_its_episodes_alike_on_every_call(judge, requests):
    """End to end: two requests graded in one batch by the real sampler; a random model writes
    no grade object, so each is `judge_unparseable` (cut at max_tokens: every one of its 16
    tokens is used), the same on a second call (greedy), and the episodes' rewards are masked
    (0, never the policy's -1) through the path a rollout's judge failures take."""
    from jscenegen.grpo.rollout.primary_judge import judge_on_primary

    first = judge.grade(requests)
    assert [r.failure for r in first] == ["judge_unparseable"] * 2
    assert all(r.grades is None for r in first)
    assert {r.info["detail"] for r in first} == {CUT_DETAIL}
    assert [r.info["answer_tokens"] for r in first] == [16, 16]
    assert all(r.info["attempts"] == 1 and r.info["latency_s"] >= 0 for r in first)
    assert seen(judge.grade(requests)) == seen(first)
    prompts = [judge.prompt_ids(r) for r in requests]
    tokens = judge._generate(prompts)
    assert judge._generate(prompts) == tokens   # the same 16 token ids on a second call (greedy)
    assert [len(ids) for ids, _ in tokens] == [16, 16]
    episodes = unjudged_episodes()
    judge_on_primary(episodes, judge)
    for ep in episodes:
        o = ep.outcome
        assert (o.failure_cause, o.masked, o.reward, o.grades) == ("judge_unparseable", True, 0.0, None)
        assert o.judge_info["detail"] == CUT_DETAIL


def test_the_judge_reads_its_chat_template_applied_to_the_judge_messages(judge, requests, monkeypatch):
    """The ids appended to the sampler's cache are the judge model's chat template applied to
    `judge_messages` with the generation prompt (transformers' own rendering and tokenising),
    each row padded only by empty rows."""
    from jscenegen.scene.prompts import load_templates

    fed = []
    real = judge.sampler.append
    monkeypatch.setattr(judge.sampler, "append",
                        lambda cache, last, rows, *a: fed.append([list(r) for r in rows]) or real(cache, last, rows, *a))
    judge.grade(requests)
    templates = load_templates(None)
    want = []
    for req in requests:
        messages = judge_messages(req, judge.cfg, templates, RunConfig().scene.metrics)
        ids = judge.chat.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        want.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    assert fed == [want]          # 2 rows: a power of two, no padding row
    assert len(want[0]) > 1000 and want[0] != want[1]
    assert judge.chat.decode(want[0]).endswith("<|im_end|>\n<|im_start|>assistant\n")


def _grades(**changed):
    return {**{k: 8 for k in GRADE_KEYS}, **changed}


def test_a_valid_answer_is_graded_and_capped(judge, requests):
    """The text -> result step with real completions: strict JSON grades (after a reasoning
    trace), comments kept, the metric caps clamping them as the HTTP judge's; a wrong answer
    is judge_unparseable naming why, and the cut detail only for an answer cut at max_tokens."""
    req = dataclasses.replace(requests[0], metrics={**requests[0].metrics, "collision_pairs": [["a", "b"]],
                                                    "reachable": True, "door_blocked": False})
    answer = json.dumps({"grades": _grades(realism=9, reachability=3), "comments": {"realism": "ok"}})
    got = judge.result(answer, req, info={"latency_s": 0.5})
    assert got.failure is None and got.info == {"latency_s": 0.5, "comments": {"realism": "ok"}}
    # a collision caps realism at 4; a fully reachable scene gets reachability at least 7
    assert got.grades == _grades(realism=4, reachability=7)
    thought = judge.result("<think>\nthe bed blocks nothing\n</think>\n\n" + answer, req)
    assert thought.grades == got.grades
    uncapped_judge = copy.copy(judge)
    uncapped_judge.cfg = judge.cfg.model_copy(update={"enforce_caps": False})
    uncapped = uncapped_judge.result(answer, req)
    assert uncapped.grades == _grades(realism=9, reachability=3)
    bad = judge.result(json.dumps({"grades": _grades(realism=11)}), req)
    assert (bad.grades, bad.failure) == (None, "judge_unparseable")
    assert bad.info["detail"] == "grade 'realism' = 11 is not an integer 0..10"
    missing = judge.result(json.dumps({"grades": {"realism": 5}}), req)
    assert missing.failure == "judge_unparseable" and "missing ['completeness'" in missing.info["detail"]
    assert judge.result('{"grades": {"realism"', req, cut=True).info["detail"] == CUT_DETAIL
    assert judge.result(answer, req, cut=True).grades == got.grades   # whole though at the cap


def test_grade_returns_the_grades_the_sampler_decodes(judge, requests, monkeypatch):
    """The whole `grade` path with chosen tokens at the sampler's decode: a valid answer ended
    by the end-of-turn token is graded (and capped), one cut at the budget is unparseable with
    the cut detail, and an exception in the judge's own generate masks its rows as judge_error
    naming it."""
    chat = judge.chat
    answers = [json.dumps({"grades": _grades(functionality=6)}), '{"grades": {"realism": 5, "lay']
    ids = [chat.encode_plain(answers[0]) + [chat.eot_id], chat.encode_plain(answers[1])]
    width = max(map(len, ids))
    tokens = np.zeros((2, width), np.int32)
    for i, row in enumerate(ids):
        tokens[i, :len(row)] = row
    real = judge.sampler.decode
    calls = []

    def decode(cache, last, max_new, keys, max_steps, **kw):
        calls.append((list(max_new), max_steps, np.asarray(keys).tolist()))
        return SimpleNamespace(tokens=tokens, lengths=np.array([len(r) for r in ids]),
                               reason=np.array([STOP_TOKEN, STOP_LENGTH]))

    monkeypatch.setattr(judge.sampler, "decode", decode)
    graded, cut = judge.grade(requests)
    want = _grades(functionality=6)
    from jscenegen.scene.caps import apply_caps

    assert graded.failure is None and graded.grades == apply_caps(want, requests[0].metrics)
    assert graded.info["answer_tokens"] == len(ids[0]) and graded.info["comments"] == {}
    assert (cut.grades, cut.failure, cut.info["detail"]) == (None, "judge_unparseable", CUT_DETAIL)
    # greedy by default; each row's key still derives from its own prompt
    assert calls == [([16, 16], 16, [[0, prompt_seed(judge.prompt_ids(r))] for r in requests])]
    assert judge.params.greedy

    def broken(*a, **kw):
        raise RuntimeError("out of memory while decoding")

    monkeypatch.setattr(judge.sampler, "decode", broken)
    failed = judge.grade(requests)
    assert [(r.failure, r.info["detail"], r.info["attempts"]) for r in failed] == [
        ("judge_error", "RuntimeError: out of memory while decoding", 1)] * 2
    monkeypatch.setattr(judge.sampler, "decode", real)


def test_the_failure_warning_shows_the_start_of_the_judges_raw_answer(judge, requests, monkeypatch, caplog):
    """A model judge's failure warning named the cause ("cut at judge.max_tokens") but not what
    the judge wrote, so the cause could not be checked: the one warning line of a grading now
    ends with the first failed answer's first 200 characters, escaped to one line and clipped
    as clip_text clips (its length said)."""
    chat = judge.chat
    rambling = "Sure!\nLet me think " + "a" * 300
    assert chat.decode(chat.encode_plain(rambling)) == rambling
    ids = [chat.encode_plain(json.dumps({"grades": _grades()})) + [chat.eot_id],
           chat.encode_plain(rambling)]
    monkeypatch.setattr(judge, "_generate", lambda prompts: [(ids[0], STOP_TOKEN), (ids[1], STOP_LENGTH)])
    with caplog.at_level("WARNING", logger="jscenegen.grpo.rollout.model_judge"):
        graded, cut = judge.grade(requests)
    assert graded.grades and cut.failure == "judge_unparseable"
    shown = "Sure!\\nLet me think " + "a" * (200 - len("Sure!\\nLet me think "))
    assert [r.getMessage() for r in caplog.records] == [
        f"model judge {judge.identity()['model']}: 1 of 2 answers not graded (first: "
        f'judge_unparseable: {CUT_DETAIL}; its answer: "{shown}... (319 characters)")']
    caplog.clear()
    # the real random judge: its 16 tokens, whole (under 200 characters), escaped
    from jscenegen.text import terminal_line

    monkeypatch.undo()
    with caplog.at_level("WARNING", logger="jscenegen.grpo.rollout.model_judge"):
        judge.grade(requests[:1])
    (answer, reason), = judge._generate([judge.prompt_ids(requests[0])])
    text = judge.answer_text(answer, reason)
    assert 0 < len(text) < 200 and caplog.records[-1].getMessage().endswith(
        f'its answer: "{terminal_line(text)}")')


def test_a_sampling_judge_answers_a_request_alike_whatever_its_batch(requests):
    """Above temperature 1e-5 each row samples with a key from its own prompt: the tokens a
    request's answer is made of are the same generated alone or beside another, and on every
    call; another key draws other tokens (so the sameness is the key's, not a cut answer's);
    rows beyond judge.concurrency go in further batches."""
    from jscenegen.grpo.rollout import model_judge

    judge = build_judge(model_cfg(chat_model_dir(), temperature=1.0, concurrency=1))
    assert not judge.params.greedy and judge.params.temperature == 1.0
    generated = []   # each _generate call's (token ids, stop reason) per row
    real = ModelJudge._generate

    def spy(self, prompts):
        out = real(self, prompts)
        generated.append(out)
        return out

    judge2 = build_judge(model_cfg(chat_model_dir(), temperature=1.0))   # both in one batch
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ModelJudge, "_generate", spy)
        judge.grade(requests)               # concurrency 1: one row per batch
        judge2.grade(requests)
        judge2.grade(requests)
    assert [len(g) for g in generated] == [1, 1, 2, 2]
    alone = [generated[0][0], generated[1][0]]
    assert all(len(ids) == 16 for ids, _ in alone)
    assert generated[2] == alone            # each row alone, and beside the other
    assert generated[3] == alone            # a second call
    assert alone[0][0] != alone[1][0]       # two prompts, two keys, two answers
    prompts = [judge2.prompt_ids(r) for r in requests]
    seed = model_judge.prompt_seed
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_judge, "prompt_seed", lambda ids: seed(ids) ^ 1)
        other = judge2._generate(prompts)
    assert [ids != alone[i][0] for i, (ids, _) in enumerate(other)] == [True, True]


def test_a_model_judge_whose_least_need_does_not_fit_is_refused_before_its_weights_load(monkeypatch):
    """Before any weights are read, `load` counts the judge's least need per device (its
    rollout weights from the abstract model of its config.json, split as finely as the `auto`
    layout could split them: whole on one device; its largest KV cache) and refuses, in one
    line naming judge.model_path, judge.concurrency, judge.max_tokens and the bytes, when even
    that does not fit the free memory: `load_model` is never called. Where it fits, the judge
    loads. On one device the least need is the exact one (the check after the load's)."""
    import jax

    from jscenegen.grpo.rollout import model_judge
    from jscenegen.model.hf_io import iter_hf_tensors

    judge = build_judge(model_cfg(chat_model_dir()))
    prompt = judge.prompt_ids(None)
    weights = sum(a.astype(np.float32).nbytes for _, a in iter_hf_tensors(chat_model_dir()))
    from jscenegen.model.loader import model_class
    shapes = jax.eval_shape(lambda: model_class(judge.model_cfg).create_cache(
        judge.model_cfg, 8, 1024, np.float32))
    cache = 2 * sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))  # no donation on CPU
    need = weights + cache
    assert judge.least_need() == (weights, "float32", 1, 8, 1024, cache)
    loads = []
    real_load = model_judge.load_model

    def load_model(*args, **kwargs):
        loads.append(args[0])
        return real_load(*args, **kwargs)

    monkeypatch.setattr(model_judge, "load_model", load_model)
    monkeypatch.setattr(model_judge, "least_free_device_memory_bytes", lambda: need - 1)
    with pytest.raises(ValueError) as err:
        judge.load()
    assert type(err.value).__name__ == "JudgeMemoryError"
    assert loads == [] and judge.sampler is None
    assert str(err.value) == (
        f"judge.model_path {chat_model_dir()}: the model judge needs at least {need:,} bytes "
        f"({need / 2**30:.2f} GiB) per device in any layout (counted before loading), "
        f"{weights:,} bytes of weights (float32, whole on each device) and {cache:,} for a KV "
        f"cache of 8 rows (judge.concurrency 8) x 1,024 slots (the rubric alone, "
        f"{len(prompt):,} tokens, + judge.max_tokens 16), more than the {need - 1:,} bytes "
        f"({(need - 1) / 2**30:.2f} GiB) a device has free beside the policy: lower "
        "judge.concurrency or judge.max_tokens, or give judge.model_path a smaller model")
    monkeypatch.setattr(model_judge, "least_free_device_memory_bytes", lambda: need)
    judge.load()
    assert loads == [chat_model_dir()] and judge.sampler is not None
    assert judge.sampler.weight_device_bytes() == weights   # the estimate is the rollout copy's


def test_the_least_need_on_the_mesh_is_a_floor_of_what_the_auto_layout_holds():
    """On the 3 x 2 mesh the pre-load estimate splits the weights 1/tp over the largest tensor
    size `auto` could choose (tp 2: the judge has 2 kv heads), pads judge.concurrency to that
    layout's row multiple (6 / tp = 3) and splits the cache over the 6 devices; the layout
    `auto` then picks holds at least that much per device, weights and cache (of its own row
    padding, over the same slots), so a judge refused before loading would not have fit."""
    import jax

    from jscenegen.grpo.rollout.model_judge import padded_rows
    from jscenegen.model.loader import model_class
    from jscenegen.sharding.mesh import make_mesh

    alone = build_judge(model_cfg(chat_model_dir())).least_need()
    judge = build_judge(model_cfg(chat_model_dir()), mesh=make_mesh(3, 2))
    weights, dtype, tp, rows, slots, cache = judge.least_need()
    assert (dtype, tp, rows, slots) == ("float32", 2, padded_rows(8, 3), alone[4]) and rows == 9
    assert weights == -(-alone[0] // 2)                  # the one-device copy, halved
    shapes = jax.eval_shape(lambda: model_class(judge.model_cfg).create_cache(
        judge.model_cfg, 9, slots, np.float32))
    # a 1/6 share of 9 rows' cache, doubled as on one device (no donation on CPU)
    assert cache == 2 * (sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes)) // 6)
    judge.load()
    sampler = judge.sampler
    assert sampler.weight_device_bytes() >= weights
    assert sampler.cache_bytes_needed(padded_rows(8, sampler.row_multiple), slots) >= cache


def test_a_model_judge_that_does_not_fit_beside_the_policy_is_refused_at_load(judge, requests, monkeypatch):
    """`load` measures the free device memory before the judge's weights arrive (the policy's
    are in place) and refuses, in one line naming judge.model_path, judge.concurrency and
    judge.max_tokens and the bytes, when the judge's rollout weights and its largest KV cache
    (judge.concurrency rows x the rubric-alone prompt + max_tokens) do not fit it; a grading
    whose longer prompts need a larger cache than is free is refused naming them too."""
    import jax

    from jscenegen.generate.sampler import bucket_length
    from jscenegen.grpo.rollout import model_judge
    from jscenegen.model.hf_io import iter_hf_tensors

    s = judge.sampler
    prompt = judge.prompt_ids(None)   # the rubric alone: the shortest prompt
    assert 600 < len(prompt) < min(len(judge.prompt_ids(r)) for r in requests)
    rows, slots = 8, bucket_length(s.appended_slots([prompt]) + 16, BUCKETS)   # concurrency 8
    assert (rows, slots) == (8, 1024)
    weights = sum(a.astype(np.float32).nbytes for _, a in iter_hf_tensors(chat_model_dir()))
    shapes = jax.eval_shape(lambda: s.create_cache(s.cfg, rows, slots, s.cache_dtype))
    cache = 2 * sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))  # no donation on CPU
    need = weights + cache
    monkeypatch.setattr(model_judge, "least_free_device_memory_bytes", lambda: need - 1, raising=False)
    # the pre-load estimate passes (`least_need`: tested on its own below), so the exact check
    # after the load speaks
    monkeypatch.setattr(ModelJudge, "least_need", lambda self: (0, "float32", 1, 8, 1024, 0))
    with pytest.raises(ValueError) as err:
        build_judge(model_cfg(chat_model_dir()), load=True)
    assert type(err.value).__name__ == "JudgeMemoryError"
    assert str(err.value) == (
        f"judge.model_path {chat_model_dir()}: the model judge needs {need:,} bytes "
        f"({need / 2**30:.2f} GiB) per device, {weights:,} bytes of weights (float32) and "
        f"{cache:,} for a KV cache of 8 rows (judge.concurrency 8) x 1,024 slots (the rubric "
        f"alone, {len(prompt):,} tokens, + judge.max_tokens 16), more than the {need - 1:,} bytes "
        f"({(need - 1) / 2**30:.2f} GiB) a device has free beside the policy: lower "
        "judge.concurrency or judge.max_tokens, or give judge.model_path a smaller model")
    monkeypatch.setattr(model_judge, "least_free_device_memory_bytes", lambda: need)
    assert build_judge(model_cfg(chat_model_dir()), load=True).sampler is not None
    monkeypatch.setattr(model_judge, "least_free_device_memory_bytes", lambda: None)   # unknown
    assert build_judge(model_cfg(chat_model_dir()), load=True).sampler is not None

    # the batch's own prompts (1,269 and 1,518 tokens: 2,048 slots for 2 rows), checked before
    # its cache is made
    monkeypatch.setattr(model_judge, "least_free_device_memory_bytes", lambda: 1000)
    results = judge.grade(requests)
    assert [r.failure for r in results] == ["judge_error"] * 2
    grown = s.cache_bytes_needed(2, 2048)
    why = judge._does_not_fit(s, 2, 2048, 1000, weights=False,
                              prompt="this batch's longest prompt, 1,518 tokens")
    assert results[0].info["detail"] == f"JudgeMemoryError: {why}"[:300] + f"... ({len(why) + 18:,} characters)"
    assert why == (
        f"judge.model_path {chat_model_dir()}: the model judge's KV cache of "
        "2 rows (judge.concurrency 8) x 2,048 slots (this batch's longest prompt, 1,518 tokens, "
        f"+ judge.max_tokens 16) needs {grown:,} bytes ({grown / 2**30:.2f} GiB) per device, "
        "more than the 1,000 bytes (0.00 GiB) a device has free beside the policy and the "
        "judge's weights: lower judge.concurrency or judge.max_tokens, or give "
        "judge.model_path a smaller model")


@pytest.mark.parametrize("overrides,message", [
    (["judge.backend=model"], "judge.backend 'model' needs judge.model_path (the judge's HF model "
                              "directory or checkpoint step)"),
    (["judge.backend=model", "judge.model_path={tmp}/absent"],
     "judge.model_path {tmp}/absent: no such directory"),
    (["judge.backend=model", "judge.model_path={tmp}/file"],
     "judge.model_path {tmp}/file: not a directory (give the judge's HF model directory or "
     "checkpoint step)"),
    (["judge.model_path={model}"], "judge.model_path is read by judge.backend 'model' only, not "
                                   "'rule': set judge.backend=model, or leave judge.model_path out"),
    (["judge.backend=http", "judge.base_url=http://127.0.0.1:8000/v1", "judge.model=m",
      "judge.model_path={model}"],
     "judge.model_path is read by judge.backend 'model' only, not 'http': set "
     "judge.backend=model, or leave judge.model_path out"),
    (["judge.chat_template_path=x.jinja"],
     "judge.chat_template_path is read by judge.backend 'model' only, not 'rule': set "
     "judge.backend=model, or leave judge.chat_template_path out"),
])
def test_the_model_judge_keys_are_checked_when_the_config_loads(tmp_path, overrides, message):
    (tmp_path / "file").write_text("x")
    given = [o.format(tmp=tmp_path, model=chat_model_dir()) for o in overrides]
    with pytest.raises(ConfigError) as err:
        load_run_config(None, given)
    text = str(err.value)
    assert len(text.splitlines()) == 1 and text.startswith("override") and \
        f": {message.format(tmp=tmp_path)}" in text, text
    cfg = load_run_config(None, ["judge.backend=model", f"judge.model_path={chat_model_dir()}"])
    assert cfg.judge.model_path == str(chat_model_dir())


@pytest.mark.parametrize("layout", ["empty", "hf_only", "run"])
def test_a_judge_directory_that_is_no_model_is_refused_with_the_model_flags_message(tmp_path, layout):
    """The config checks only that judge.model_path is a directory; whether it is a model is the
    rule `--model` is refused by (`checkpoint.store.not_a_model`, one copy), applied when the
    judge is built: a directory with only hf/config.json (no params/) is no checkpoint step,
    and a run directory points at its newest step."""
    from jscenegen.checkpoint.store import not_a_model

    d = tmp_path / "judge"
    d.mkdir()
    if layout == "hf_only":
        shutil.copytree(chat_model_dir(), d / "hf")
    if layout == "run":
        (d / "checkpoints" / "3" / "params").mkdir(parents=True)
        shutil.copytree(chat_model_dir(), d / "checkpoints" / "3" / "hf")
    cfg = load_run_config(None, ["judge.backend=model", f"judge.model_path={d}"])   # accepted here
    with pytest.raises(FileNotFoundError) as err:
        build_judge(cfg)
    hint = f"; its newest checkpoint step is {d}/checkpoints/3" if layout == "run" else ""
    assert str(err.value) == str(not_a_model(d, "judge.model_path")) == (
        f"judge.model_path {d}: neither an HF model directory (config.json) nor a checkpoint "
        f"step directory (params/ and hf/){hint}")


def test_the_scene_runtime_refuses_to_build_the_model_judge_and_build_judge_does():
    cfg = model_cfg(chat_model_dir())
    with pytest.raises(ModelJudgeUnavailable) as err:
        make_judge(cfg.judge, cfg.scene)
    assert str(err.value) == ("judge.backend 'model' runs a JAX model, which the scene runtime "
                              "cannot load: build the judge with "
                              "jscenegen.grpo.rollout.judges.build_judge")
    import importlib
    module, name = str(err.value).rsplit(" ", 1)[1].rsplit(".", 1)
    assert getattr(importlib.import_module(module), name) is build_judge   # the name is real
    assert type(build_judge(cfg)).__name__ == "ModelJudge"
    assert type(build_judge(RunConfig())).__name__ == "RuleJudge"
    http = RunConfig(judge=JudgeConfig(backend="http", base_url="http://127.0.0.1:9/v1", model="m"))
    assert type(build_judge(http)).__name__ == "HttpJudge"


def test_every_process_grades_with_the_model_judge(judge, monkeypatch):
    """In a multi-process run process 0 alone grades (PrimaryJudge), except with the model
    judge, whose decode is a collective over the mesh of every process."""
    from jscenegen.grpo.rollout import primary_judge

    monkeypatch.setattr(primary_judge.jax, "process_count", lambda: 2)
    assert primary_judge.for_processes(judge) is judge
    assert isinstance(primary_judge.for_processes(make_judge(JudgeConfig())), primary_judge.PrimaryJudge)


@pytest.mark.parametrize("where", ["load", "generate"])
def test_a_joined_run_failure_in_the_model_judge_stops_the_run(judge, monkeypatch, where):
    """A failure of the joined run itself (a peer process gone) raised by the model judge's
    load or generate is not masked as judge_error by `judge_episodes`: `judge_on_primary`
    raises it on every process (through `run_broken`, as PrimaryJudge's), so the processes
    cannot go on out of step; any other exception there stays a judge_error."""
    from jscenegen.grpo.rollout import model_judge, primary_judge

    class PeerGone(Exception):
        pass

    monkeypatch.setattr(model_judge, "fails_the_joined_run", lambda e: isinstance(e, PeerGone))
    monkeypatch.setattr(primary_judge, "fails_the_joined_run", lambda e: isinstance(e, PeerGone))
    monkeypatch.setattr(primary_judge.jax, "process_count", lambda: 2)
    monkeypatch.setattr(judge, "run_broken", None, raising=False)   # restored after: a shared fixture

    def gone(*a, **kw):
        raise PeerGone("peer gone")

    if where == "load":
        monkeypatch.setattr(judge, "sampler", None)
        # process_count is faked: no collective of the load's memory check in one process
        monkeypatch.setattr(model_judge, "least_free_device_memory_bytes", lambda: None, raising=False)
        monkeypatch.setattr(model_judge, "load_model", gone)
    else:
        monkeypatch.setattr(judge, "_generate", gone)
    episodes = unjudged_episodes()
    with pytest.raises(PeerGone, match="peer gone"):
        primary_judge.judge_on_primary(episodes, judge)
    assert isinstance(judge.run_broken, PeerGone)
    assert [ep.outcome.failure_cause for ep in episodes] == ["judge_error"] * 2   # masked, then raised

    monkeypatch.setattr(judge, "run_broken", None)
    monkeypatch.setattr(model_judge, "fails_the_joined_run", lambda e: False)
    episodes = unjudged_episodes()
    primary_judge.judge_on_primary(episodes, judge)   # another failure: masked, the run goes on
    assert judge.run_broken is None
    assert [(ep.outcome.failure_cause, ep.outcome.judge_info["detail"]) for ep in episodes] == [
        ("judge_error", ("loading judge.model_path " f"{judge.path}: PeerGone: peer gone")
         if where == "load" else "PeerGone: peer gone")] * 2


def _perturbed_copy(src, dst):
    """A copy of the HF directory `src` whose every weight is changed."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        save_file({k: v + np.ones_like(v) for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    return dst


def test_the_identity_digests_the_judge_model_and_a_resume_with_another_is_refused(tmp_path, judge):
    """identity = backend, `<directory name>@<digest>` and the rubric hash (with caps
    enforced or not); a copy elsewhere is the same judge, other weights at the same name
    another, and the protocol hash a resume compares changes with it: the refusal names the
    judge model even when no setting changed."""
    from jscenegen.checkpoint.resume import ResumeError, check_same_run
    from jscenegen.scene.protocol import judge_model_change, protocol_hash

    ident = judge.identity()
    assert ident["backend"] == "model" and ident["model"].startswith("tiny@")
    assert len(ident["model"].split("@")[1]) == 16 and str(tmp_path) not in ident["model"]
    copy = shutil.copytree(chat_model_dir(), tmp_path / "a" / "tiny")
    assert build_judge(model_cfg(copy)).identity() == ident
    other = build_judge(model_cfg(_perturbed_copy(chat_model_dir(), tmp_path / "b" / "tiny")))
    assert other.identity()["model"] != ident["model"]
    assert other.identity()["model"].startswith("tiny@")
    assert other.identity()["rubric_hash"] == ident["rubric_hash"]
    uncapped = build_judge(model_cfg(chat_model_dir(), enforce_caps=False)).identity()
    assert uncapped["model"] == ident["model"] and uncapped["rubric_hash"] != ident["rubric_hash"]
    cfg = model_cfg(chat_model_dir())
    before = protocol_hash(cfg.scene, cfg.judge, ident)
    after = protocol_hash(cfg.scene, cfg.judge, other.identity())
    assert before != after
    reward = cfg.scene.reward.model_dump()
    check_same_run({"protocol_hash": before, "reward": reward}, protocol_hash=before, reward=reward)
    changed = judge_model_change(ident, other.identity())
    assert changed == [f"judge model {ident['model']!r} -> {other.identity()['model']!r} (the "
                       "model judge's files at judge.model_path)"]
    assert judge_model_change(ident, ident) == [] == judge_model_change(
        {"backend": "rule", "model": None}, ident)
    with pytest.raises(ResumeError, match=r"the scene protocol changed \(judge model 'tiny@"):
        check_same_run({"protocol_hash": before, "reward": reward}, protocol_hash=after,
                       reward=reward, protocol_settings=changed)


def _without_template(src, dst):
    """A copy of the HF directory `src` with no chat template."""
    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_the_judge_template_is_its_key_and_enters_its_identity(tmp_path):
    """A judge directory without a chat template is refused naming the judge's own key,
    judge.chat_template_path (not the policy's sampling.chat_template_path); given one there,
    the judge renders with it and its identity digests the template used (another template,
    another judge), as it does the bundled protocol template a Qwen3.5 judge whose own is
    refused gets."""
    from jscenegen.checkpoint.model_dir import model_digest
    from jscenegen.model.tokenizer.chat import QWEN35_PROTOCOL_TEMPLATE, TEMPLATES_DIR, ChatTemplateError

    from chat_fixtures import qwen35_chat_model_dir

    bare = _without_template(chat_model_dir(), tmp_path / "bare" / "tiny")
    with pytest.raises(ChatTemplateError) as err:
        build_judge(model_cfg(bare))
    assert str(err.value) == (f"{bare}: the tokenizer has no chat template; pass one with "
                              "judge.chat_template_path (e.g. jscenegen/model/tokenizer/templates/"
                              "chatml.jinja)")
    chatml = TEMPLATES_DIR / "chatml.jinja"
    judge = build_judge(model_cfg(bare, chat_template_path=str(chatml)))
    assert judge.chat.template_source == str(chatml)
    digest = model_digest(bare, chat_template=chatml.read_text())
    assert digest != model_digest(bare)
    assert judge.identity()["model"] == f"tiny@{digest[:16]}"
    other = tmp_path / "other.jinja"
    other.write_text(chatml.read_text() + "{#- the same rendering, other text #}")
    assert build_judge(model_cfg(bare, chat_template_path=str(other))).identity()["model"] != \
        judge.identity()["model"]
    missing = tmp_path / "absent.jinja"
    with pytest.raises(ChatTemplateError, match=f"^judge.chat_template_path {missing}: "):
        build_judge(model_cfg(bare, chat_template_path=str(missing)))
    # a Qwen3.5 judge shipping the official template renders with the protocol one: digested
    q35 = shutil.copytree(qwen35_chat_model_dir(), tmp_path / "q35" / "tiny35")
    (q35 / "chat_template.jinja").write_text((TEMPLATES_DIR / "qwen3_5_official.jinja").read_text())
    judge35 = build_judge(model_cfg(q35))
    assert judge35.chat.template_source == str(QWEN35_PROTOCOL_TEMPLATE)
    digest = model_digest(q35, chat_template=QWEN35_PROTOCOL_TEMPLATE.read_text())
    assert digest != model_digest(q35)
    assert judge35.identity()["model"] == f"tiny35@{digest[:16]}"


def test_a_checkpoint_step_is_a_judge_too(tmp_path):
    """judge.model_path takes a checkpoint step, as --model does: verified, its params loaded,
    its identity named by run, `checkpoints` and step, digested from its checksums."""
    from jscenegen.checkpoint.metadata import training_metadata
    from jscenegen.checkpoint.store import CheckpointError, CheckpointStore
    from jscenegen.model.config import QwenConfig
    from jscenegen.model.hf_io import iter_hf_tensors
    from jscenegen.model.weights import param_shapes

    hf = chat_model_dir()
    params = {n: a.astype(np.float32) for n, a in iter_hf_tensors(hf)}
    zeros = {n: np.zeros_like(a) for n, a in params.items()}
    meta = training_metadata(config={}, protocol_hash="p", schedule_hash="s", optimizer_step=0,
                             effective_updates=0, judge=None)
    with CheckpointStore(tmp_path / "run" / "checkpoints") as store:
        step = store.save(3, params=params, adam={"count": np.int32(0), "mu": zeros, "nu": zeros},
                          train_state={}, metadata=meta, hf_assets_dir=hf,
                          shapes=param_shapes(QwenConfig.from_dir(hf)))
    judge = build_judge(model_cfg(step))
    assert judge.identity()["model"].startswith("run/checkpoints/3@")
    load_judge(judge)
    assert judge.sampler is not None   # verified and loaded from params/
    req = run_scripted_episode(dev_records()[0], judged=False)[0].judge_request()
    assert judge.prompt_ids(req) == build_judge(model_cfg(hf)).prompt_ids(req)   # hf/'s tokenizer
    (step / "params" / "extra").write_text("x")   # an unlisted file: the checksums refuse it
    with pytest.raises(CheckpointError) as err:
        build_judge(model_cfg(step))
    assert str(err.value) == (f"judge.model_path {step}: checkpoint step is not usable: "
                              f"{step}/params/extra: not listed "
                              f"({step}/checksums.json; 1 file fails)")


def test_eval_grades_with_the_model_judge_and_records_it(tmp_path, capsys):
    """`jscenegen eval` with judge.backend=model: the judge is built on the run's 3 x 2 mesh,
    the report records its identity with its temperature and max_tokens, and a judge that
    graded nothing fails the command naming what to check."""
    from jscenegen.cli import main

    scenes = tmp_path / "one.jsonl"
    scenes.write_text(json.dumps(dev_records()[0].to_json()) + "\n")
    out = tmp_path / "r.json"
    got = main(["eval", "--model", str(chat_model_dir()), "--scenes", str(scenes), "--greedy",
                "--out", str(out), "sampling.max_new_tokens=8", "sampling.max_episode_tokens=2560",
                "sampling.buckets=[128,1024]", "judge.backend=model",
                f"judge.model_path={chat_model_dir()}", "judge.max_tokens=16"])
    err = capsys.readouterr().err
    assert got == 1, err
    rep = json.loads(out.read_text())
    ident = build_judge(model_cfg(chat_model_dir())).identity()
    assert rep["judge"] == {**ident, "temperature": 0.0, "max_tokens": 16}
    # the random policy's turns are cut (a policy failure, not judged); the expert's scene is
    # sent to the judge, which writes no grades
    assert rep["overall"]["expert"]["failure_causes"] == {"judge_unparseable": 1}
    assert err.splitlines()[-1] == (
        "error: the judge graded none of the episodes it was sent (judge_unparseable x1); the "
        f"report {out} records them (check judge.model_path and judge.max_tokens, and the model "
        "judge's lines in the log)")


def test_scene_furnish_with_a_failing_model_judge_prints_no_reward_and_exits_1(tmp_path, capsys):
    """`scene furnish --config` with a model judge that writes no grades (random weights): the
    episode is masked, so its reward is null (it printed 0.0 and exited 0) and the command
    exits 1 with one error line, as `scene check` and `design` do; the scene is written."""
    from jscenegen.cli import main

    config = tmp_path / "judge.yaml"
    config.write_text(f"judge:\n  backend: model\n  model_path: {chat_model_dir()}\n  max_tokens: 16\n"
                      "sampling:\n  buckets: [128, 1024]\n")
    out = tmp_path / "f.json"
    rc = main(["scene", "furnish", "data/scenes/dev.jsonl", "--index", "2", "-o", str(out),
               "--config", str(config)])
    cap = capsys.readouterr()
    got = json.loads(cap.out)
    assert rc == 1 and json.loads(out.read_text())["objects"]
    assert (got["reward"], got["grades"], got["failure_cause"]) == (None, None, "judge_unparseable")
    assert cap.err.splitlines()[-1] == (
        f"error: the judge did not grade the scene (judge_unparseable: {CUT_DETAIL}); {out} holds "
        "it (check judge.model_path and judge.max_tokens, and the model judge's lines in the log)")


def _with_positions(src, dst, positions: int, **rope):
    """A copy of the HF directory `src` whose config.json says max_position_embeddings
    `positions` (and `rope_scaling` = `rope`, when given)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["max_position_embeddings"] = positions
    if rope:
        config["rope_scaling"] = rope
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_a_judge_max_tokens_past_the_judge_models_positions_is_refused(tmp_path, requests):
    """judge.max_tokens 1048576 decoded for minutes with a judge that never ends its turn,
    with a warning only that positions passed max_position_embeddings: refused when the judge
    is built (before any weights) when it and the rubric-alone prompt pass the model's
    positions (times a RoPE scaling factor), in one line naming judge.max_tokens,
    judge.model_path and max_position_embeddings; a request whose own, longer, prompt passes
    them is a judge_error naming the same, and is never decoded."""
    from jscenegen.grpo.rollout.model_judge import JudgePositionsError

    short = _with_positions(chat_model_dir(), tmp_path / "short" / "tiny", 1024)
    ok = build_judge(model_cfg(short))   # 16 tokens fit beside the rubric (679 tokens)
    rubric = len(ok.prompt_ids(None))
    assert 500 < rubric < 1024 - 16
    with pytest.raises(JudgePositionsError) as err:
        build_judge(model_cfg(short, max_tokens=1024))
    assert str(err.value) == (
        f"judge.max_tokens 1,024 and the rubric-alone prompt ({rubric:,} tokens) reach "
        f"{rubric + 1024:,} positions, more than the judge's max_position_embeddings 1,024 "
        f"(judge.model_path {short}): positions past them were never trained; lower "
        f"judge.max_tokens to {1024 - rubric:,} or less")
    scaled = _with_positions(chat_model_dir(), tmp_path / "scaled" / "tiny", 512,
                             rope_type="linear", factor=2.0)
    with pytest.raises(JudgePositionsError) as err:
        build_judge(model_cfg(scaled, max_tokens=1024))
    assert (f"more than the judge's max_position_embeddings 512 (times its RoPE scaling factor: "
            f"1,024 positions) (judge.model_path {scaled})") in str(err.value)
    assert build_judge(model_cfg(scaled)).model_cfg.context_positions == 1024
    # a scene's prompt is longer than the rubric alone (1,300 tokens or so): past 1,024 itself
    lengths = [len(ok.prompt_ids(r)) for r in requests]
    assert all(n > 1024 for n in lengths) and len(set(lengths)) == 2
    ok._generate = None   # never reached: no row is decoded
    results = ok.grade(requests)
    assert [(r.grades, r.failure) for r in results] == [(None, "judge_error")] * 2
    assert [r.info["detail"] for r in results] == [
        f"judge.max_tokens 16 and this request's prompt ({n:,} tokens) reach {n + 16:,} positions, "
        f"more than the judge's max_position_embeddings 1,024 (judge.model_path {short}): "
        "positions past them were never trained; give judge.model_path a model with more "
        "positions, or shorten the judge's rubric (judge_system.txt, judge_user.txt in "
        "scene.prompts_dir)" for n in lengths]
    # one that fits beside max_tokens is decoded, the other refused
    fits = build_judge(model_cfg(_with_positions(chat_model_dir(), tmp_path / "mid" / "tiny",
                                                 min(lengths) + 16)))
    results = fits.grade(requests)
    assert [r.failure for r in results] == [
        "judge_unparseable" if n == min(lengths) else "judge_error" for n in lengths]


def test_a_yarn_judge_refusal_names_the_original_positions(tmp_path):
    """model_judge.past_positions: a YaRN RoPE scales original_max_position_embeddings (here
    256 x 4 = 1,024), not max_position_embeddings (500): the message printed
    "max_position_embeddings 500 (times its RoPE scaling factor: 1,024 positions)", which no
    product of 500 gives; it names the value the limit used."""
    from jscenegen.grpo.rollout.model_judge import JudgePositionsError

    yarn = _with_positions(chat_model_dir(), tmp_path / "yarn" / "tiny", 500, rope_type="yarn",
                           factor=4.0, original_max_position_embeddings=256)
    rubric = len(build_judge(model_cfg(yarn)).prompt_ids(None))
    with pytest.raises(JudgePositionsError) as err:
        build_judge(model_cfg(yarn, max_tokens=1024))
    assert str(err.value) == (
        f"judge.max_tokens 1,024 and the rubric-alone prompt ({rubric:,} tokens) reach "
        f"{rubric + 1024:,} positions, more than the judge's rope_scaling "
        "original_max_position_embeddings 256 (times its RoPE scaling factor: 1,024 positions) "
        f"(judge.model_path {yarn}): positions past them were never trained; lower "
        f"judge.max_tokens to {1024 - rubric:,} or less")


def test_a_judge_refusal_never_suggests_max_tokens_below_its_minimum(tmp_path):
    """judge.max_tokens is at least 16 (JudgeConfig, ge=16): with room for fewer answer tokens
    beside the rubric the refusal said "lower judge.max_tokens to 5 or less", a value the
    config refuses; it gives the other fixes."""
    from jscenegen.grpo.rollout.model_judge import JudgePositionsError

    rubric = len(build_judge(model_cfg(chat_model_dir())).prompt_ids(None))
    tight = _with_positions(chat_model_dir(), tmp_path / "tight" / "tiny", rubric + 5)
    with pytest.raises(JudgePositionsError) as err:
        build_judge(model_cfg(tight))   # judge.max_tokens 16
    assert str(err.value) == (
        f"judge.max_tokens 16 and the rubric-alone prompt ({rubric:,} tokens) reach "
        f"{rubric + 16:,} positions, more than the judge's max_position_embeddings "
        f"{rubric + 5:,} (judge.model_path {tight}): positions past them were never trained; "
        "give judge.model_path a model with more positions, or shorten the judge's rubric "
        "(judge_system.txt, judge_user.txt in scene.prompts_dir)")
    edge = _with_positions(chat_model_dir(), tmp_path / "edge" / "tiny", rubric + 16)
    with pytest.raises(JudgePositionsError) as err:   # room for 16, the least: that is the fix
        build_judge(model_cfg(edge, max_tokens=17))
    assert str(err.value).endswith("positions past them were never trained; lower "
                                   "judge.max_tokens to 16 or less")


def test_scene_check_with_a_failing_model_judge_says_the_failure_once_on_stderr(tmp_path, capsys, caplog):
    """`scene check` with a model judge that writes no grades printed its cause three times:
    the model judge's warning, "the model judge failed: ..." (the same cause and detail, less
    the judge's answer) and the JSON. The second is no longer logged (still in the JSON's
    warnings, for a caller that reads stdout alone)."""
    from jscenegen.cli import main

    config = tmp_path / "judge.yaml"
    config.write_text(f"judge:\n  backend: model\n  model_path: {chat_model_dir()}\n  max_tokens: 16\n"
                      "sampling:\n  buckets: [128, 1024]\n")
    scene = tmp_path / "s.json"
    scene.write_text(json.dumps(run_scripted_episode(dev_records()[0], judged=False)[0].scene.to_json()))
    rc = main(["scene", "check", str(scene), "--requested", "bed:1", "--config", str(config)])
    cap = capsys.readouterr()
    got = json.loads(cap.out)
    assert rc == 1 and (got["reward"], got["grades"], got["judge_failure"]) == (None, None, "judge_unparseable")
    assert got["warnings"][-1] == f"the model judge failed: judge_unparseable: {CUT_DETAIL}"
    said = [r.getMessage() for r in caplog.records if "judge_unparseable" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(
        f"model judge {got['judge']['model']}: 1 of 1 answers not graded (first: "
        f"judge_unparseable: {CUT_DETAIL}; its answer: \""), said


def test_the_model_judges_keys_where_they_act_and_where_they_do_not():
    """temperature, max_tokens, concurrency and enforce_caps act with the http and model judges
    (named as inert with the rule judge); the HTTP judge's own keys are inert beside the model
    judge; a resume names judge.model_path among the protocol's settings."""
    from jscenegen.run_config import inert_settings
    from jscenegen.scene.protocol import protocol_settings

    model = ["judge.backend=model", f"judge.model_path={chat_model_dir()}"]
    assert inert_settings(load_run_config(None, [*model, "judge.temperature=0.5",
                                                 "judge.max_tokens=64"])) == []
    assert inert_settings(load_run_config(None, [*model, "judge.base_url=http://x/v1"])) == [
        "judge.base_url has no effect without judge.backend: http"]
    assert inert_settings(load_run_config(None, ["judge.temperature=0.5"])) == [
        "judge.temperature has no effect without judge.backend: http or model"]
    saved = load_run_config(None, model).model_dump(mode="json")
    assert protocol_settings(saved)["judge"] == {
        "backend": "model", "grade_keys": list(GRADE_KEYS), "model_path": str(chat_model_dir()),
        "chat_template_path": None, "enforce_caps": True}


def test_a_run_graded_by_the_model_judge_refuses_a_resume_with_other_judge_weights(tmp_path,
                                                                                   monkeypatch):
    """`train` with judge.backend=model: the judge is built and loaded on the run's 3 x 2 mesh
    once the policy's train state exists (its memory check then sees Adam's moments: it was
    loaded before them), its identity recorded in the checkpoint's metadata and protocol
    hash; a resume after its weights were replaced at the same judge.model_path is refused,
    naming the judge model."""
    from test_trainer import _run

    import jscenegen.grpo.train.trainer as trainer_module
    from jscenegen.checkpoint.resume import ResumeError
    from jscenegen.checkpoint.store import read_metadata

    order = []
    for name in ("init_train_state", "load_judge"):
        real = getattr(trainer_module, name)
        monkeypatch.setattr(trainer_module, name,
                            lambda *a, _real=real, _name=name, **kw: order.append(_name) or _real(*a, **kw))
    judge_dir = shutil.copytree(chat_model_dir(), tmp_path / "judge" / "tiny")
    extra = {"judge.backend": "model", "judge.model_path": str(judge_dir), "judge.max_tokens": 16}
    trainer, summary = _run(tmp_path / "run", max_updates=1, **extra)
    assert order[:2] == ["init_train_state", "load_judge"], order
    assert summary.attempts == 1 and trainer.judge.sampler is not None
    assert trainer.judge.sampler.mesh is trainer.mesh
    ident = trainer.judge.identity()
    assert read_metadata(tmp_path / "run" / "checkpoints" / "1")["judge"] == ident
    shutil.rmtree(judge_dir)
    _perturbed_copy(chat_model_dir(), judge_dir)
    with pytest.raises(ResumeError, match=rf"the scene protocol changed \(judge model "
                                          rf"'{ident['model']}' -> 'tiny@"):
        _run(tmp_path / "run", resume=True, **extra)


def test_a_resume_with_the_judge_in_a_renamed_directory_is_refused_saying_so(tmp_path):
    """The identity names the judge's directory (documented), so a resume with the same judge
    files under another directory name is refused, as another judge is: the refusal now says
    that the files are the same and what to do (it named only 'the model judge's files')."""
    from test_trainer import _run

    from jscenegen.checkpoint.resume import ResumeError
    from jscenegen.scene.protocol import judge_model_change

    ja = shutil.copytree(chat_model_dir(), tmp_path / "judges" / "ja")
    extra = {"judge.backend": "model", "judge.model_path": str(ja), "judge.max_tokens": 16}
    trainer, _ = _run(tmp_path / "run", max_updates=1, **extra)
    before = trainer.judge.identity()
    digest = before["model"].split("@")[1]
    jb = ja.rename(tmp_path / "judges" / "jb")
    with pytest.raises(ResumeError) as err:
        _run(tmp_path / "run", resume=True, **{**extra, "judge.model_path": str(jb)})
    assert str(err.value).startswith(
        f"resume refused: the scene protocol changed (judge.model_path '{ja}' -> '{jb}'; judge "
        f"model 'ja@{digest}' -> 'jb@{digest}' (the same judge files under another directory "
        "name (ja -> jb): rename it back, or start a new run); checkpoint protocol hash "), err.value
    # other files under another name: not said to be the same
    other = build_judge(model_cfg(_perturbed_copy(chat_model_dir(), tmp_path / "jc"))).identity()
    assert judge_model_change(before, other) == [
        f"judge model 'ja@{digest}' -> {other['model']!r} (the model judge's files at judge.model_path)"]
