"""Parser of the single `<action>{json}</action>` block that ends every role's answer.

Each malformed answer maps to one precise policy-failure cause (reward.POLICY_FAILURES); the parser
never raises on model text. Roles: planner {"action": design|critique|revert|finish, ...},
designer {"ops": [...]}, critic {"critique": str, "grades": {key: int 0..10}}.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jscenegen.paths import loads_json
from jscenegen.text import clip_text

from .config import GRADE_MAX, GRADE_MIN, is_grade
from .ops import OpSchemaError, parse_op

OPEN, CLOSE = "<action>", "</action>"
ROLES = ("planner", "designer", "critic")
PLANNER_ACTIONS = {"design": {"instruction"}, "critique": set(), "revert": {"reason"}, "finish": {"summary"}}
ACTION_GRAMMAR = (
    "answer := free_text '<action>' json_object '</action>' whitespace; exactly one block; "
    "planner: {action: design(instruction: str) | critique | revert(reason: str) | finish(summary: str)}; "
    f"designer: {{ops: [op, ...]}}; critic: {{critique: str, grades: {{key: int {GRADE_MIN}..{GRADE_MAX}}}}}"
)


@dataclass(frozen=True)
class ParsedAction:
    """A parsed answer: `payload` (validated; designer ops are parsed op models) or a failure."""

    role: str
    payload: Any = None
    failure_cause: str | None = None
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.failure_cause is None


def _fail(role: str, cause: str, message: str) -> ParsedAction:
    return ParsedAction(role, None, cause, message)


def extract_block(text: str) -> tuple[str | None, str | None, str]:
    """(json_text, failure_cause, message) for the one action block in `text` (spec section 2:
    every answer ends with exactly one block). More than one opening or closing tag is
    `multiple_action_blocks`, its message counting both kinds."""
    n_open, n_close = text.count(OPEN), text.count(CLOSE)
    if n_open == 0:
        return None, "no_action_block", "no <action>...</action> block"
    if n_open > 1 or n_close > 1:
        return None, "multiple_action_blocks", (f"found {n_open} <action> and {n_close} </action> tags; "
                                                "exactly one block (one of each) is allowed")
    start = text.index(OPEN)
    if n_close == 0 or text.index(CLOSE) < start:
        return None, "truncated_action", "the <action> block is not closed"
    end = text.index(CLOSE)
    if text[end + len(CLOSE):].strip():
        return None, "text_after_action", "text follows </action>; the block must end the answer"
    return text[start + len(OPEN): end], None, ""


def cut_inside_action(text: str) -> bool:
    """Whether an answer cut short (the sampler's max_new_tokens) was cut inside an action
    (spec section 5: "generation truncated inside an action", cause `truncated_action`; any
    other cut turn is `truncated_generation`; both score -1).

    Looks at the text after the last `</action>` (all of it when there is none): inside an
    action when it holds an opened `<action>` (a first block, or a second one after a complete
    block) or ends with the start of one (a non-empty prefix of `<action>`, such as "<acti").
    A `</action>` written inside a JSON string counts as a close, as `extract_block` reads it.
    """
    tail = text[text.rfind(CLOSE) + len(CLOSE):] if CLOSE in text else text
    return OPEN in tail or any(tail.endswith(OPEN[:k]) for k in range(1, len(OPEN)))


def _lone_surrogate(obj) -> str | None:
    """Where in parsed JSON a string (value or key) holds a lone surrogate, which JSON's
    \\uXXXX escapes can make but no UTF-8 text (a prompt, a tokenizer input) can carry; None
    when there is none. Walks without recursion (the parser already bounded the depth)."""
    todo = [("the object", obj)]
    while todo:
        where, x = todo.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return where
        elif isinstance(x, dict):
            for k, v in x.items():
                todo.append((f"key {k[:40]!r}", k))
                todo.append((f"field {k[:40]!r}", v))
        elif isinstance(x, list):
            todo.extend((where, v) for v in x)
    return None


def _role_of(obj: dict) -> str | None:
    if "action" in obj:
        return "planner"
    if "ops" in obj:
        return "designer"
    if "critique" in obj or "grades" in obj:
        return "critic"
    return None


def parse_action(text: str, role: str, grade_keys: tuple[str, ...]) -> ParsedAction:
    """Parse `role`'s answer `text`. Never raises; failures carry a cause and a message."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    body, cause, msg = extract_block(text)
    if cause:
        return _fail(role, cause, msg)
    try:
        obj = loads_json(body, allow_nan=False)
    except ValueError as err:
        return _fail(role, "bad_json", f"action block is not valid JSON: {err}")
    if (where := _lone_surrogate(obj)) is not None:
        return _fail(role, "bad_json", f"action block: {where} holds a lone UTF-16 surrogate "
                                       "escape (\\ud800-\\udfff not part of a pair), which is no text")
    if not isinstance(obj, dict):
        return _fail(role, "bad_json", f"action block must be a JSON object, got {type(obj).__name__}")
    other = _role_of(obj)
    if other is not None and other != role:
        return _fail(role, "role_violation", f"the {role} answered with a {other} action")
    if role == "planner":
        return _planner(obj)
    if role == "designer":
        return _designer(obj)
    return _critic(obj, grade_keys)


def _planner(obj: dict) -> ParsedAction:
    act = obj.get("action")
    if not isinstance(act, str):
        return _fail("planner", "schema_violation", "planner field 'action' must be a string")
    if act not in PLANNER_ACTIONS:
        return _fail("planner", "unknown_action", f"unknown planner action {clip_text(repr(act))}; "
                                                  f"known: {', '.join(PLANNER_ACTIONS)}")
    need = PLANNER_ACTIONS[act]
    extra = set(obj) - need - {"action"}
    if extra:
        return _fail("planner", "schema_violation",
                     f"{act}: unexpected fields {clip_text(repr(sorted(extra)))}")
    for k in need:
        if not isinstance(obj.get(k), str):
            return _fail("planner", "schema_violation", f"{act}: field {k!r} must be a string")
    return ParsedAction("planner", dict(obj))


def _designer(obj: dict) -> ParsedAction:
    if set(obj) != {"ops"}:
        return _fail("designer", "schema_violation",
                     f"designer object must have only 'ops', got {clip_text(repr(sorted(obj)))}")
    if not isinstance(obj["ops"], list):
        return _fail("designer", "schema_violation", "'ops' must be a list")
    ops = []
    for i, raw in enumerate(obj["ops"]):
        try:
            ops.append(parse_op(raw))
        except OpSchemaError as err:
            return _fail("designer", err.cause, f"ops[{i}]: {err}")
    return ParsedAction("designer", ops)


def _critic(obj: dict, grade_keys) -> ParsedAction:
    if set(obj) != {"critique", "grades"}:
        return _fail("critic", "schema_violation", f"critic object needs exactly 'critique' and 'grades', got "
                     f"{clip_text(repr(sorted(obj)))}")
    if not isinstance(obj["critique"], str) or not isinstance(obj["grades"], dict):
        return _fail("critic", "schema_violation", "'critique' must be a string and 'grades' an object")
    grades = obj["grades"]
    if set(grades) != set(grade_keys):
        return _fail("critic", "schema_violation", f"grades must have exactly the keys {list(grade_keys)}")
    for k, v in grades.items():
        if not is_grade(v):
            return _fail("critic", "schema_violation",
                         f"grade {k!r} must be an integer {GRADE_MIN}..{GRADE_MAX}, got {clip_text(repr(v))}")
    return ParsedAction("critic", {"critique": obj["critique"], "grades": dict(grades)})




def format_action(obj: dict, reasoning: str = "") -> str:
    """The canonical answer text for an action object (used by scripted drivers)."""
    body = json.dumps(obj, ensure_ascii=False, separators=(", ", ": "))
    return (reasoning.strip() + "\n" if reasoning.strip() else "") + f"{OPEN}{body}{CLOSE}"
