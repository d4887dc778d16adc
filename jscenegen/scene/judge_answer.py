"""What a language-model judge answers, read by one strict rule for every backend that asks one
(`judge_http.HttpJudge`, the model judge of `grpo.rollout.model_judge`): the text must be
one JSON object {"grades": {key: int 0..10 for exactly the configured keys}, "comments": {...}?}
after an optional leading reasoning trace, nesting at most MAX_ANSWER_DEPTH lists and objects.
"""
from __future__ import annotations

from typing import Any

from jscenegen.paths import loads_json
from jscenegen.text import clip_text

from .config import GRADE_MAX, GRADE_MIN, is_grade

MAX_ANSWER_DEPTH = 32       # a chat completion nests 4 deep, a grade object 2 or 3


class JudgeAnswerError(ValueError):
    """The judge's answer is not the strict JSON grade object."""


def check_depth(value: Any, what: str) -> None:
    """Raise JudgeAnswerError naming `what` when the parsed JSON `value` nests lists and objects
    more than MAX_ANSWER_DEPTH deep. Iterative: what reads an answer afterwards (masking, repr,
    writing the comments into trajectories) recurses once per level, and a few hundred levels
    (JSON the parser still reads) would raise RecursionError out of `grade`."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > MAX_ANSWER_DEPTH:
                raise JudgeAnswerError(f"{what} nests lists and objects more than "
                                       f"{MAX_ANSWER_DEPTH} deep")
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))


class AnswerCut(JudgeAnswerError):
    """The judge stopped at judge.max_tokens (the HTTP judge's `finish_reason: "length"`, the
    model judge's sampler at its budget) before an answer that parses: a `judge_unparseable`
    failure whose detail is CUT_DETAIL."""


CUT_DETAIL = ("the judge's answer was cut at judge.max_tokens (a reasoning trace can take them "
              "all): raise judge.max_tokens")


THINK_END = "</think>"


def without_reasoning(content: str) -> str:
    """`content` without a leading reasoning trace: the text after the first `</think>` when
    the content opens with `<think>`, or does not open with `{` and holds `</think>` (Qwen3's
    chat template opens the trace in the prompt, so a server without a reasoning parser sends
    "...</think>" then the answer); else `content` itself."""
    head = content.lstrip()
    if THINK_END in head and (head.startswith("<think>") or not head.startswith("{")):
        return head.split(THINK_END, 1)[1]
    return content


def parse_judge_content(content: str, grade_keys, mask=None) -> tuple[dict[str, int], dict]:
    """(grades, comments) from a judge's message content (strict JSON, after a leading
    reasoning trace: `without_reasoning`), the parsed answer passed through `mask` (parsed
    object -> object) before anything in it is checked or quoted. Raises JudgeAnswerError."""
    try:
        obj = loads_json(without_reasoning(content).strip())
    except ValueError as err:
        raise JudgeAnswerError(f"not JSON: {err}") from None
    check_depth(obj, "the message content")
    if mask is not None:
        obj = mask(obj)
    if not isinstance(obj, dict) or not isinstance(obj.get("grades"), dict):
        raise JudgeAnswerError("answer must be an object with a 'grades' object")
    grades = obj["grades"]
    if set(grades) != set(grade_keys):
        missing = sorted(set(grade_keys) - set(grades))
        extra = sorted(map(str, set(grades) - set(grade_keys)))
        raise JudgeAnswerError(f"grade keys differ: missing {missing}, not asked for "
                               f"{clip_text(repr(extra), 100)}")
    for k, v in grades.items():
        if not is_grade(v):
            raise JudgeAnswerError(f"grade {k!r} = {v!r} is not an integer {GRADE_MIN}..{GRADE_MAX}")
    comments = obj.get("comments", {})
    return {k: grades[k] for k in grade_keys}, comments if isinstance(comments, dict) else {}
