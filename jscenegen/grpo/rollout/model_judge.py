"""The project's own model as a frozen judge (`judge.backend: model`), run in the process.

`ModelJudge` grades as the HTTP judge does, with a model of ours in place of the server: each
request's chat messages are `scene.judge.judge_messages` (the same rubric, caps and scene
text), rendered with the judge model's chat template by its `ChatTokenizer` (`start`: the
contents read as plain text, so a scene's prompt cannot spell out a special token), generated
with the project's `Sampler` and read by the same strict parser (`scene.judge_answer`).

Weights and devices: the weights of `judge.model_path` (an HF directory or a checkpoint step,
what `--model` of eval and design takes: `checkpoint.model_dir.load_model`) are loaded once per
process, by `load` (the commands call it once the policy is loaded) or the first `grade`,
in the rollout dtype (`rollout.dtype`, else `model.compute_dtype`), and placed by the sampler's
`auto` layout on the run's mesh (whole on every device when they fit
`rollout.memory_fraction` of one, else tensor-parallel): they sit beside the policy's
training and rollout weights for the whole process and are never trained. `load` refuses a
judge whose weights and largest KV cache do not fit the device memory free beside the policy's
(JudgeMemoryError, naming judge.concurrency, judge.max_tokens and judge.model_path): first,
before any weights are read, when even their least need does not fit (`least_need`: the
rollout weights from the abstract model, split as finely as `auto` could, and the cache split
over every device), then exactly, once the sampler holds the rollout copy. A
judge.max_tokens that, with the rubric-alone prompt, passes the positions the judge model is
made for (max_position_embeddings, times a RoPE scaling factor) is refused sooner, when the
judge is made (JudgePositionsError, naming judge.max_tokens, judge.model_path and
max_position_embeddings: a judge that never ends its turn would decode that many tokens); a
request whose own prompt passes them with judge.max_tokens is a judge_error naming the same,
never decoded.

Batches: the requests of one `grade` call are generated together, at most `judge.concurrency`
rows per call of the sampler (the GRPO recipe's group of 8 is one call), rows padded with
empty ones to a power of two and to the layout's `row_multiple` and prompts appended in the
sampling buckets, so the compiled shapes are few. Each row decodes up to `judge.max_tokens`
tokens and stops at the template's end of turn (or the model's end-of-generation ids).

Determinism: below a temperature of 1e-5 (`judge.temperature`, 0 by default) decoding is
greedy; above it each row samples with a key derived from its prompt's tokens alone, so the
same request gets the same answer in every call, and whatever else is in the batch (a row's
samples depend on its key and its own tokens: `generate.sampling`; up to the float rounding
of another padding, which could flip a draw at a near tie). In a multi-process run every
process grades (the decode is a collective over the mesh) and gets the same answers.

Failures are results, as the HTTP judge's: an answer that does not parse (bad JSON, other
keys, a grade outside 0..10) is `judge_unparseable`, with CUT_DETAIL when the answer reached
max_tokens; an exception in the judge's own generate masks its rows as `judge_error` with the
exception's type and text in `info["detail"]`, except a failure of the joined run (a peer
process gone: `sharding.mesh.fails_the_joined_run`), which is raised and ends the run on every
process (`run_broken`, read by `primary_judge.judge_on_primary`). A grading with ungraded
answers logs one warning: their count, the first one's cause and detail, and the first
ANSWER_CHARS characters of its raw answer (`failure_warning`).
"""
from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from jscenegen.checkpoint.model_dir import load_chat_and_config, load_model, model_digest
from jscenegen.checkpoint.store import is_checkpoint_dir
from jscenegen.generate.sampler import (
    DEFAULT_BUCKETS,
    STOP_LENGTH,
    STOP_TOKEN,
    Sampler,
    bucket_length,
    split_into_buckets,
)
from jscenegen.generate.sampling import MIN_TEMPERATURE, SamplingParams, row_keys
from jscenegen.scene.caps import apply_caps
from jscenegen.scene.config import MIN_JUDGE_MAX_TOKENS, JudgeConfig, MetricsConfig
from jscenegen.scene.judge import (
    JudgeIdentity,
    JudgeRequest,
    JudgeResult,
    judge_error_detail,
    judge_messages,
    rubric_hash,
)
from jscenegen.scene.judge_answer import CUT_DETAIL, JudgeAnswerError, parse_judge_content
from jscenegen.scene.prompts import PromptTemplates
from jscenegen.sharding.mesh import fails_the_joined_run, host_array
from jscenegen.sharding.rollout import least_free_device_memory_bytes
from jscenegen.sharding.rules import round_up
from jscenegen.text import clip_line, clip_text

log = logging.getLogger(__name__)

OPTION = "judge.model_path"
TEMPLATE_OPTION = "judge.chat_template_path"
DIGEST_CHARS = 16   # hex digits of `model_digest` in the identity's model string
ANSWER_CHARS = 200   # of an ungraded answer's raw text in the failure warning


def judge_model_name(path: str | Path, digest: str) -> str:
    """The identity's `model` of the judge at `path`: its directory's name (a checkpoint
    step's `RUN/checkpoints/N`, the run's name with it) and the first DIGEST_CHARS hex digits
    of `model_digest` (config, tokenizer and chat template files, weights, and the template
    used in place of the directory's own), never the path
    above it: "Qwen3-8B@3f2a...". The same model copied to another machine or directory of
    the same name has the same identity; a renamed copy or other weights, another."""
    p = Path(path).resolve()
    name = "/".join(p.parts[-3:]) if is_checkpoint_dir(p) else p.name
    return f"{name}@{digest[:DIGEST_CHARS]}"


def padded_rows(n: int, multiple: int) -> int:
    """Rows a batch of `n` requests decodes in: `n` padded with empty rows to a power of two,
    then to `multiple` (the layout's `row_multiple`), so the compiled shapes are few."""
    return round_up(1 << (max(1, n) - 1).bit_length(), multiple)


def prompt_seed(ids: Sequence[int]) -> int:
    """The sampling seed of a judge prompt: 32 bits of the SHA-256 of its token ids, so a
    request is answered alike whatever else is graded with it."""
    raw = np.asarray(ids, np.int64).tobytes()
    return int.from_bytes(hashlib.sha256(raw).digest()[:4], "little")


def sampling_params(temperature: float) -> SamplingParams:
    """How the judge draws: greedy (argmax) below MIN_TEMPERATURE (as vLLM reads a temperature
    near 0), else sampling at `temperature` with no top-k or top-p."""
    if temperature < MIN_TEMPERATURE:
        return SamplingParams(greedy=True)
    return SamplingParams(temperature=temperature)


class ModelJudge:
    """The `scene.judge.Judge` of `judge.backend: model`; see the module docstring.

    Args:
      cfg: the judge section (backend "model", model_path, chat_template_path, grade_keys,
        enforce_caps, temperature, max_tokens, concurrency).
      templates, metrics_cfg: the run's prompt templates and `scene.metrics` (the judge's
        messages and rubric hash, as the HTTP judge's).
      mesh: the run's ("fsdp", "sp") mesh, or None for one device.
      model_options: `loader.build_model` keywords for the judge's weights (`build_judge`
        passes the rollout dtype and the run's compute dtype and attention).
      buckets: the sampler's append chunk lengths (`sampling.buckets`).
      memory_fraction: `rollout.memory_fraction`, which the `auto` layout reads.
      weight_dtype: the sampler's rollout weight dtype (None: the compute dtype).

    Reads the judge's config.json, tokenizer and chat template (`judge.chat_template_path`
    in place of the directory's own) and digests the model (`identity`) when made; loads no
    weights (`load`). Raises what `load_chat` raises for a directory that is no model or a
    tokenizer it cannot use, naming `judge.model_path`, or a template it cannot use, naming
    `judge.chat_template_path`; JudgePositionsError when judge.max_tokens and the rubric-alone
    prompt pass the model's positions (`past_positions`).
    """

    # `primary_judge.for_processes`: every process of a multi-process run grades (the decode
    # is a collective over the mesh), instead of process 0 alone
    grades_on_every_process = True

    def __init__(self, cfg: JudgeConfig, templates: PromptTemplates, metrics_cfg: MetricsConfig, *,
                 mesh=None, model_options: dict | None = None,
                 buckets: Sequence[int] = DEFAULT_BUCKETS, memory_fraction: float = 0.25,
                 weight_dtype: str | None = None):
        if cfg.backend != "model" or not cfg.model_path:
            raise ValueError("ModelJudge needs judge.backend 'model' and judge.model_path")
        self.cfg, self.templates, self.metrics_cfg = cfg, templates, metrics_cfg
        self.path = Path(cfg.model_path)
        self.mesh = mesh
        self.model_options = dict(model_options or {})
        self.buckets = tuple(buckets)
        self.memory_fraction = memory_fraction
        self.weight_dtype = weight_dtype
        self.params = sampling_params(cfg.temperature)
        # the tokenizer and config.json's QwenConfig, read and checked once
        self.chat, self.model_cfg = load_chat_and_config(
            self.path, cfg.chat_template_path, option=OPTION, template_option=TEMPLATE_OPTION)
        # an answer budget the model has no positions for: refused now, before any weights
        # (a judge that never ends its turn would decode judge.max_tokens tokens per request)
        if why := self.past_positions(len(self.prompt_ids(None)), "the rubric-alone prompt"):
            raise JudgePositionsError(why)
        # a template used in place of the directory's own (judge.chat_template_path, or the
        # bundled Qwen3.5 protocol template) is part of what the judge is
        replaced = None if self.chat.template_source == "tokenizer" else self.chat.tokenizer.chat_template
        self._identity = JudgeIdentity(
            backend="model",
            model=judge_model_name(self.path, model_digest(self.path, chat_template=replaced)),
            rubric_hash=rubric_hash(cfg, templates, metrics_cfg, caps_enforced=cfg.enforce_caps))
        self.sampler: Sampler | None = None
        # a failure of the joined run (a peer gone) raised by `grade`: the caller's per-episode
        # masking (`scene.episode.judge_episodes`) would catch it, so `primary_judge.
        # judge_on_primary` re-raises it from here, as it does PrimaryJudge's
        self.run_broken: BaseException | None = None

    def __repr__(self) -> str:
        return f"ModelJudge(model={self._identity['model']!r})"

    def identity(self) -> JudgeIdentity:
        return self._identity

    def check_reachable(self) -> None:
        """Nothing: an in-process judge is reachable whenever it could be made."""

    # ---- weights ------------------------------------------------------------------------
    def load(self) -> None:
        """Load the judge's weights and build its sampler, once (later calls return at once).
        Raises what loading raises (a missing or corrupt weight file, too little memory for
        the layout), and JudgeMemoryError when its weights and its largest KV cache
        (`largest_cache`) do not fit the device memory that was free before it loaded (beside
        the policy's weights, loaded first): refused now, not a judge_error at every grading.
        Where the free memory is unknown, no check (as the sampler's `_check_cache_fits`).
        A judge whose least need (`least_need`) already exceeds it is refused before
        `load_model` reads any weights."""
        if self.sampler is not None:
            return
        free = least_free_device_memory_bytes()   # a collective: every process loads here
        # before any weights: a judge whose best case (`least_need`) does not fit is refused
        # here, not by an out-of-memory inside the load
        if free is not None and (why := self._least_does_not_fit(free)):
            raise JudgeMemoryError(why)
        model = load_model(self.path, self.mesh, option=OPTION, **self.model_options)
        sampler = Sampler(model, self.params, stop_token_ids=list(self.chat.end_ids),
                          buckets=self.buckets, mesh=self.mesh, layout="auto",
                          memory_fraction=self.memory_fraction, dtype=self.weight_dtype)
        del model   # the training-layout copy: the sampler holds the rollout weights
        rows, slots = self.largest_cache(sampler)
        prompt = len(self.prompt_ids(None))
        if why := self._does_not_fit(sampler, rows, slots, free, weights=True,
                                     prompt=f"the rubric alone, {prompt:,} tokens"):
            raise JudgeMemoryError(why)
        self.sampler = sampler
        log.info("model judge %s loaded (%s layout)", self._identity["model"],
                 self.sampler.layout.name)

    def least_need(self) -> tuple[int, str, int, int, int, int]:
        """What the judge needs per device at the least, known before its weights are read:
        (weight bytes, their dtype's name, tp, cache rows, cache slots, cache bytes). The weights: the
        rollout copy the sampler will hold (`rollout_weight_bytes` of the parameters decoding
        reads, `decode_params`, of the abstract model of the judge's config.json: a carried
        vision tower or mtp.* is not in it), split 1/tp over the largest tensor size the `auto`
        layout could choose on the mesh (`tp_candidates`; 1: whole on every device). The
        cache: `largest_cache`'s judge.concurrency rows (padded to that layout's row
        multiple) x its slots, in the compute dtype, its bytes split over every device of the
        mesh and doubled where buffers are not donated (CPU), as `Sampler.cache_bytes_needed`
        counts them. Every share is one no layout can go below, so a judge this refuses would
        not fit under any; `load` keeps the exact check once the sampler exists."""
        import jax

        from jscenegen.generate.sampler import donates_buffers, rollout_weight_bytes, tp_divides
        from jscenegen.model.dtypes import np_dtype
        from jscenegen.model.functional import split_params
        from jscenegen.model.loader import abstract_model, model_class
        from jscenegen.sharding.rollout import tp_candidates

        cfg = self.model_cfg
        model = abstract_model(cfg, mesh=self.mesh, **self.model_options)
        state = split_params(model, model.decode_params())[1]
        dtype = np_dtype(self.weight_dtype or model.compute_dtype)
        weights = rollout_weight_bytes(state, dtype)
        n = 1 if self.mesh is None else self.mesh.size
        tp = max(tp_candidates(n, tp_divides(cfg)))   # 1 always divides
        rows = padded_rows(self.cfg.concurrency, n // tp)
        slots = bucket_length(sum(split_into_buckets(len(self.prompt_ids(None)), self.buckets))
                              + self.cfg.max_tokens, self.buckets)
        shapes = jax.eval_shape(lambda: model_class(cfg).create_cache(
            cfg, rows, slots, np_dtype(model.compute_dtype)))
        cache = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes)) // n
        cache *= 1 if donates_buffers() else 2   # `Sampler._cache_need`'s rule
        return -(-weights // tp), dtype.name, tp, rows, slots, cache

    def _least_does_not_fit(self, free: int) -> str | None:
        """Why even the judge's least need (`least_need`) does not fit `free` bytes per device
        (read before its weights, beside the policy), one line in `_does_not_fit`'s style
        naming the keys; None when it may fit (the exact check follows the load)."""
        weights, dtype, tp, rows, slots, cache = self.least_need()
        need = weights + cache
        if need <= free:
            return None
        share = "whole on each device" if tp == 1 else f"a 1/{tp} share: rollout.layout auto's largest tensor split"
        return (f"{OPTION} {self.path}: the model judge needs at least {need:,} bytes "
                f"({need / 2**30:.2f} GiB) per device in any layout (counted before loading), "
                f"{weights:,} bytes of weights ({dtype}, {share}) and {cache:,} for a KV cache of "
                f"{rows} rows (judge.concurrency {self.cfg.concurrency}) x {slots:,} slots (the rubric "
                f"alone, {len(self.prompt_ids(None)):,} tokens, + judge.max_tokens {self.cfg.max_tokens}), "
                f"more than the {free:,} bytes ({free / 2**30:.2f} GiB) a device has free beside the "
                "policy: lower judge.concurrency or judge.max_tokens, or give judge.model_path a "
                "smaller model")

    def largest_cache(self, sampler: Sampler) -> tuple[int, int]:
        """(rows, slots) of the largest KV cache a grading makes, as far as it is known before
        any request: judge.concurrency rows (padded as `_generate` pads them) x the slots of
        the shortest prompt the judge reads (`prompt_ids(None)`, the rubric alone: a scene's
        text adds to it) plus judge.max_tokens."""
        rows = padded_rows(self.cfg.concurrency, sampler.row_multiple)
        slots = bucket_length(sampler.appended_slots([self.prompt_ids(None)]) + self.cfg.max_tokens,
                              sampler.buckets)
        return rows, slots

    def _does_not_fit(self, sampler: Sampler, rows: int, slots: int, free: int | None, *,
                      weights: bool, prompt: str) -> str | None:
        """Why a KV cache of `rows` x `slots` (and, with `weights`, the judge's rollout weights
        beside it) does not fit `free` bytes per device, one line naming the keys; None when it
        fits or `free` is unknown. `prompt`: how the slots' prompt was taken. `free` is
        `least_free_device_memory_bytes` read before the judge loaded (`weights`: beside the
        policy) or at grading (the judge's weights loaded: beside the policy and them)."""
        if free is None:
            return None
        cache = sampler.cache_bytes_needed(rows, slots)
        held = sampler.weight_device_bytes() if weights else 0
        if held + cache <= free:
            return None
        kv = (f"KV cache of {rows} rows (judge.concurrency {self.cfg.concurrency}) x {slots:,} "
              f"slots ({prompt}, + judge.max_tokens {self.cfg.max_tokens})")
        if weights:
            need = (f"the model judge needs {held + cache:,} bytes ({(held + cache) / 2**30:.2f} GiB) "
                    f"per device, {held:,} bytes of weights ({np.dtype(sampler.weight_dtype).name}) "
                    f"and {cache:,} for a {kv}")
            beside = "beside the policy"
        else:
            need = f"the model judge's {kv} needs {cache:,} bytes ({cache / 2**30:.2f} GiB) per device"
            beside = "beside the policy and the judge's weights"
        return (f"{OPTION} {self.path}: {need}, more than the {free:,} bytes ({free / 2**30:.2f} "
                f"GiB) a device has free {beside}: lower judge.concurrency or judge.max_tokens, "
                "or give judge.model_path a smaller model")

    def past_positions(self, prompt_tokens: int, prompt: str) -> str | None:
        """Why a prompt of `prompt_tokens` tokens (`prompt`: which) and an answer of
        judge.max_tokens do not fit the positions the judge model's RoPE is made for
        (`QwenConfig.context_positions`: max_position_embeddings, times a scaling factor; for
        YaRN its original_max_position_embeddings, which the message then names), one line
        naming judge.max_tokens, judge.model_path and the limit's source; None when they fit.
        The fix it gives is a lower judge.max_tokens when one of at least its least value
        (MIN_JUDGE_MAX_TOKENS) fits, else a model with more positions or a shorter rubric."""
        mc = self.model_cfg
        positions, mpe = mc.context_positions, mc.max_position_embeddings
        need = prompt_tokens + self.cfg.max_tokens
        if need <= positions:
            return None
        base = mc.rope_params.get("original_max_position_embeddings") if mc.rope_type == "yarn" else None
        if positions == mpe:
            made = f"max_position_embeddings {mpe:,}"
        elif base is not None and base != mpe:   # YaRN scales the original, not max_position_embeddings
            made = (f"rope_scaling original_max_position_embeddings {base:,} (times its RoPE "
                    f"scaling factor: {positions:,} positions)")
        else:
            made = f"max_position_embeddings {mpe:,} (times its RoPE scaling factor: {positions:,} positions)"
        room = positions - prompt_tokens
        fix = (f"lower judge.max_tokens to {room:,} or less" if room >= MIN_JUDGE_MAX_TOKENS else
               f"give {OPTION} a model with more positions, or shorten the judge's rubric "
               "(judge_system.txt, judge_user.txt in scene.prompts_dir)")
        return (f"judge.max_tokens {self.cfg.max_tokens:,} and {prompt} ({prompt_tokens:,} tokens) "
                f"reach {need:,} positions, more than the judge's {made} ({OPTION} {self.path}): "
                f"positions past them were never trained; {fix}")

    # ---- grading ------------------------------------------------------------------------
    def prompt_ids(self, req: JudgeRequest | None) -> list[int]:
        """The tokens the judge reads for `req`: `judge_messages` (system, user) in the judge
        model's chat template with the generation prompt (`ChatTokenizer.start`); None: those
        of the rubric alone (the shortest prompt)."""
        system, user = judge_messages(req, self.cfg, self.templates, self.metrics_cfg)
        return self.chat.start(system["content"], user["content"])[1]

    def answer_text(self, ids: Sequence[int], reason: int) -> str:
        """The text of a generated answer `ids`, without the end-of-turn (or end-of-generation)
        token that stopped it."""
        ids = list(ids)
        if reason == STOP_TOKEN and ids and ids[-1] in self.chat.end_ids:
            ids = ids[:-1]
        return self.chat.decode(ids)

    def result(self, text: str, req: JudgeRequest, *, cut: bool = False,
               info: dict | None = None) -> JudgeResult:
        """The JudgeResult of the answer `text` to `req`: its grades (capped by the request's
        metrics with `enforce_caps`) and comments, or `judge_unparseable` with the parser's
        reason in `info["detail"]` (CUT_DETAIL when the answer was `cut` at max_tokens).
        Never raises for a bad answer."""
        info = dict(info or {})
        try:
            grades, comments = parse_judge_content(text, self.cfg.grade_keys)
        except (JudgeAnswerError, ValueError, TypeError) as err:
            detail = CUT_DETAIL if cut else clip_text(str(err), 300)
            return JudgeResult(None, "judge_unparseable", {**info, "detail": detail})
        if self.cfg.enforce_caps:
            grades = apply_caps(grades, req.metrics)
        return JudgeResult(grades, None, {**info, "comments": comments})

    def grade(self, requests: Sequence[JudgeRequest]) -> list[JudgeResult]:
        """One JudgeResult per request, in order; never raises for a bad answer (see the module
        docstring). Loads the weights first when `load` has not (a load that fails masks every
        request as `judge_error` naming it; the next call tries again). A failure of the
        joined run itself (a peer process gone) is raised and kept in `run_broken`, which
        `primary_judge.judge_on_primary` raises again once `judge_episodes` has masked it."""
        if not requests:
            return []
        t0 = time.monotonic()
        try:
            self.load()
        except Exception as err:
            if fails_the_joined_run(err):
                self.run_broken = err
                raise
            log.exception("model judge: loading %s failed", self.path)
            info = {"latency_s": round(time.monotonic() - t0, 4), "attempts": 1,
                    "detail": f"loading {OPTION} {self.path}: {judge_error_detail(err)}"}
            return [JudgeResult(None, "judge_error", dict(info)) for _ in requests]
        results: list[JudgeResult | None] = [None] * len(requests)
        prompts: dict[int, list[int]] = {}
        texts: dict[int, str] = {}   # each decoded answer's text, for the failure warning
        for i, req in enumerate(requests):
            try:
                ids = self.prompt_ids(req)
            except Exception as err:   # the template or tokenizer: this request only
                results[i] = JudgeResult(None, "judge_error", {
                    "latency_s": 0.0, "attempts": 1, "detail": judge_error_detail(err)})
                continue
            # a scene's text makes the prompt longer than the rubric alone `__init__` checked
            if why := self.past_positions(len(ids), "this request's prompt"):
                results[i] = JudgeResult(None, "judge_error", {
                    "latency_s": 0.0, "attempts": 1, "detail": why})
                continue
            prompts[i] = ids
        todo = list(prompts)
        step = max(1, self.cfg.concurrency)
        for start in range(0, len(todo), step):
            chunk = todo[start:start + step]
            t0 = time.monotonic()
            try:
                answers = self._generate([prompts[i] for i in chunk])
            except Exception as err:
                if fails_the_joined_run(err):
                    self.run_broken = err
                    raise
                log.exception("model judge %s: generating failed", self._identity["model"])
                info = {"latency_s": round(time.monotonic() - t0, 4), "attempts": 1,
                        "detail": judge_error_detail(err)}
                for i in chunk:
                    results[i] = JudgeResult(None, "judge_error", dict(info))
                continue
            latency = round(time.monotonic() - t0, 4)
            for i, (ids, reason) in zip(chunk, answers):
                info = {"latency_s": latency, "attempts": 1, "answer_tokens": len(ids)}
                texts[i] = self.answer_text(ids, reason)
                results[i] = self.result(texts[i], requests[i], cut=reason == STOP_LENGTH, info=info)
        failed = [i for i, r in enumerate(results) if r is not None and r.grades is None]
        if failed:
            log.warning("%s", self.failure_warning(results, failed[0], texts.get(failed[0]),
                                                   len(failed)))
        return results

    def failure_warning(self, results: Sequence[JudgeResult], first: int, answer: str | None,
                        failed: int) -> str:
        """The one warning line of a grading with `failed` ungraded results: how many, the
        first one's (`results[first]`) cause and detail, and, when the judge answered it, the
        first ANSWER_CHARS characters of its raw `answer` (escaped: one line), so the cause can
        be checked (a random-weights judge writes no JSON; a thinking one may not finish)."""
        r = results[first]
        said = "" if answer is None else f'; its answer: "{clip_line(answer, ANSWER_CHARS)}"'
        return (f"model judge {self._identity['model']}: {failed} of {len(results)} answers not "
                f"graded (first: {r.failure}: {clip_text(str(r.info.get('detail', '')), 200)}{said})")

    def _generate(self, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
        """(answer token ids, stop reason) of each prompt, decoded in one batch: rows padded
        with empty ones (budget 0) to a power of two and the layout's `row_multiple`; a cache
        sized in buckets, grown as the answers go where the model's cache can grow."""
        s = self.sampler
        n, max_new = len(prompts), self.cfg.max_tokens
        rows = padded_rows(n, s.row_multiple)
        seqs = [list(p) for p in prompts] + [[]] * (rows - n)
        prompt_slots = s.appended_slots(seqs)
        max_slots = bucket_length(prompt_slots + max_new, s.buckets)
        # the largest cache of this batch, checked before any of it is made: a longer prompt
        # than `load` budgeted for (the rubric alone) is refused naming the judge's keys
        if why := self._does_not_fit(s, rows, max_slots, least_free_device_memory_bytes(), weights=False,
                                     prompt=f"this batch's longest prompt, {max(map(len, prompts)):,} tokens"):
            raise JudgeMemoryError(why)
        slots = (min(max_slots, bucket_length(prompt_slots + s.segment, s.buckets))
                 if s.can_grow else max_slots)
        cache, last = s.new_cache(rows, slots)
        cache, last = s.append(cache, last, seqs)
        keys = np.concatenate([row_keys([prompt_seed(p) for p in prompts]),
                               np.zeros((rows - n, 2), np.uint32)])
        out = s.decode(cache, last, [max_new] * n + [0] * (rows - n), keys, max_new,
                       max_slots=max_slots if s.can_grow else None)
        tokens, lengths, reasons = (host_array(out.tokens), host_array(out.lengths),
                                    host_array(out.reason))
        return [(tokens[i, :int(lengths[i])].tolist(), int(reasons[i])) for i in range(n)]


class JudgePositionsError(ValueError):
    """judge.max_tokens and the rubric-alone prompt pass the positions the judge model is made
    for (`ModelJudge.past_positions`): the message names judge.max_tokens, judge.model_path and
    its max_position_embeddings."""


class JudgeMemoryError(ValueError):
    """The model judge's weights and KV cache do not fit the free device memory (`ModelJudge.load`,
    `_generate`); the message names judge.concurrency, judge.max_tokens, judge.model_path and
    the bytes."""

