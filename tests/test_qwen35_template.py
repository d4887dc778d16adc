"""The Qwen3.5 chat template and the rollout's prefix-preserving check (jscenegen/model/tokenizer/chat.py).

The official template (Qwen/Qwen3.5-*/chat_template.jinja, kept byte-exact in
jscenegen/model/tokenizer/templates/qwen3_5_official.jinja) is refused by `ChatTokenizer`; these tests
record why, and show that templates/qwen3_5_protocol.jinja passes the check, renders what the
official template renders in non-thinking mode wherever that one is prefix-preserving, and
differs only in keeping the empty think block of earlier assistant turns.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from jscenegen.model.tokenizer.chat import ChatTemplateError, ChatTokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "jscenegen" / "model" / "tokenizer" / "templates"
OFFICIAL = (TEMPLATES / "qwen3_5_official.jinja").read_text()
PROTOCOL = (TEMPLATES / "qwen3_5_protocol.jinja").read_text()
# sha256 of chat_template.jinja in Qwen/Qwen3.5-4B@851bf6e8 (also the 9B and 35B-A3B releases).
OFFICIAL_SHA256 = "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715"
EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def tok():
    from qwen35_fixtures import build_tokenizer

    return build_tokenizer()


def render(tok, template, messages, gen, **kwargs):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen,
                                   chat_template=template, **kwargs)


def test_official_template_is_the_released_file():
    assert hashlib.sha256(OFFICIAL.encode()).hexdigest() == OFFICIAL_SHA256


def test_official_template_is_refused_default_mode(tok):
    # Thinking mode (the default): the generation prompt ends in "<think>\n" and the template
    # re-renders an assistant turn as "<think>\n" + reasoning + "\n</think>\n\n" + content, so
    # sampled text is not reproduced verbatim after the generation prompt.
    with pytest.raises(ChatTemplateError, match="rewrites assistant content"):
        ChatTokenizer(tok, OFFICIAL, "official")
    prompt = render(tok, OFFICIAL, [{"role": "user", "content": "u"}], True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")


def test_official_template_nonthinking_rewrites_history(tok):
    # enable_thinking=false, the mode our protocol needs: the last turn is written as the model
    # saw it (empty think block), but once a later user message exists the same turn loses the
    # block (the template special-cases turns after the last user query), and assistant content
    # is trimmed. Either breaks token-in/token-out appending.
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"}]
    closed = render(tok, OFFICIAL, msgs, False, enable_thinking=False)
    assert closed.endswith("<|im_start|>assistant\n" + EMPTY_THINK + "a1<|im_end|>\n")
    longer = render(tok, OFFICIAL, msgs + [{"role": "user", "content": "u2"}], True, enable_thinking=False)
    assert not longer.startswith(closed)
    assert "<|im_start|>assistant\na1<|im_end|>" in longer
    trimmed = render(tok, OFFICIAL, msgs[:2] + [{"role": "assistant", "content": " a1\n"}], False,
                     enable_thinking=False)
    assert trimmed.endswith(EMPTY_THINK + "a1<|im_end|>\n")
    with pytest.raises(ChatTemplateError):
        ChatTokenizer(tok, "{%- set enable_thinking = false %}" + OFFICIAL, "official, no thinking")


def test_protocol_template_passes_the_check(tok):
    chat = ChatTokenizer(tok, PROTOCOL, "qwen3_5_protocol")
    assert chat.eot_token == "<|im_end|>"


def test_protocol_conversation_is_token_in_token_out(tok):
    chat = ChatTokenizer(tok, PROTOCOL, "qwen3_5_protocol")
    conv, ids = chat.start("You are the Designer.", "Place a sofa.")
    turns = [' <action>{"op": "place"}</action>\n', "</think> not parsed <think>", "done"]
    for i, answer in enumerate(turns):
        ids += chat.encode(answer) + [chat.eot_id]
        conv.add_assistant(answer, ended_with_eot=True)
        if i < len(turns) - 1:
            ids += conv.user_segment(f"Observation {i}: ok.")
    assert chat.decode(ids) == conv.text
    assert chat.render(conv.messages, add_generation_prompt=False) == conv.text + "\n"


def test_protocol_template_is_the_official_nonthinking_format(tok):
    first = [{"role": "system", "content": " s \n"}, {"role": "user", "content": "u1"}]
    for gen in (True, False):
        assert render(tok, PROTOCOL, first, gen) == render(tok, OFFICIAL, first, gen, enable_thinking=False)
    last = first + [{"role": "assistant", "content": "a1"}]
    assert render(tok, PROTOCOL, last, False) == render(tok, OFFICIAL, last, False, enable_thinking=False)
    # Multi-turn: identical except that earlier assistant turns keep the empty think block.
    multi = last + [{"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}]
    official = render(tok, OFFICIAL, multi, False, enable_thinking=False)
    ours = render(tok, PROTOCOL, multi, False)
    assert ours == official.replace("<|im_start|>assistant\na1", "<|im_start|>assistant\n" + EMPTY_THINK + "a1")


@pytest.mark.parametrize("message", [
    {"role": "tool", "content": "x"},
    {"role": "user", "content": [{"type": "text", "text": "x"}]},
])
def test_protocol_template_refuses_what_the_protocol_does_not_use(tok, message):
    with pytest.raises(Exception, match="supported"):
        render(tok, PROTOCOL, [{"role": "user", "content": "u"}, message], False)


def test_a_template_jinja_refuses_is_a_chat_template_error_naming_the_line(tok, tmp_path):
    with pytest.raises(ChatTemplateError, match=r"^bad\.jinja: the chat template fails in jinja at "
                                                r"line 2: unexpected end of template"):
        ChatTokenizer(tok, "{% for m in messages %}\n{{ garbage\n", "bad.jinja")
    with pytest.raises(ChatTemplateError, match=r"^raises: the chat template fails in jinja: no"):
        ChatTokenizer(tok, "{{ raise_exception('no') }}", "raises")
    # errors of the template's own expressions were a bare traceback
    with pytest.raises(ChatTemplateError, match=r"^zd\.jinja: the chat template fails while "
                                                r"rendering \(ZeroDivisionError: "):
        ChatTokenizer(tok, "{{ 1 // 0 }}", "zd.jinja")
    with pytest.raises(ChatTemplateError, match=r"^add\.jinja: the chat template fails while "
                                                r"rendering \(TypeError: "):
        ChatTokenizer(tok, "{{ messages + 1 }}", "add.jinja")
    with pytest.raises(ChatTemplateError, match=rf"^sampling.chat_template_path {tmp_path}: is a directory"):
        ChatTokenizer.from_dir(tmp_path, chat_template_path=tmp_path)
    empty = tmp_path / "empty.jinja"
    empty.write_text("\n")             # was "the tokenizer has no chat template; pass chat_template_path"
    with pytest.raises(ChatTemplateError, match=rf"^--chat-template {empty}: the file is empty"):
        ChatTokenizer.from_dir(tmp_path, chat_template_path=empty, option="--chat-template")


def test_a_path_that_is_no_directory_is_refused_without_going_online(tmp_path):
    """transformers took `Qwen/Qwen3-0.6B` for a Hub id and tried the network for ~50 s."""
    with pytest.raises(ChatTemplateError, match=r"^Qwen/Qwen3-0\.6B: not a directory"):
        ChatTokenizer.from_dir("Qwen/Qwen3-0.6B")


def test_a_template_or_tokenizer_file_beyond_its_size_is_refused_before_it_is_read(tmp_path):
    """A chat template or tokenizer.json of gigabytes was read whole into memory."""
    with open(tmp_path / "big.jinja", "wb") as f:       # sparse: no disk used
        f.truncate((1 << 20) + 1)
    with pytest.raises(ChatTemplateError, match=r"big\.jinja: 1,048,577 bytes, more than a chat "
                                                r"template's 1,048,576"):
        ChatTokenizer.from_dir(tmp_path, chat_template_path=tmp_path / "big.jinja")
    with open(tmp_path / "tokenizer.json", "wb") as f:
        f.truncate((1 << 28) + 1)
    with pytest.raises(ChatTemplateError, match=r"tokenizer\.json: 268,435,457 bytes, more than a "
                                                r"tokenizer file holds"):
        ChatTokenizer.from_dir(tmp_path)
