"""The model's tokenizer and chat template, used token-in/token-out for multi-turn episodes.

An episode is one conversation (scene-protocol.md section 2). Its token sequence is built by
appending, never by re-tokenising history: the prompt is the template's rendering of the system
and first user message plus the generation prompt; each assistant turn is the exact sampled
tokens; each environment segment is the text the template adds when the next user message
(and the next generation prompt) is rendered after the conversation so far, tokenised alone.

That only reproduces what the template would render for the whole conversation when the
template is *prefix-preserving*: rendering one more turn must not change the text of earlier
turns. Qwen3's template is not: it drops the `<think>` blocks of assistant turns that precede
the last user message, so the history the model saw during the rollout would differ from the
template's view of the same conversation. `ChatTokenizer` probes the template for that at load
time and refuses it (ChatTemplateError naming the directory and what changed), and every
appended segment re-checks the prefix. A prefix-preserving template can be supplied instead
(`chat_template_path`, e.g. jscenegen/model/tokenizer/templates/chatml.jinja).

Message contents are text, never chat structure: a content that spells out a special token
(a plan the Planner wrote with `<|im_end|>` in it, echoed to the Designer) is encoded with that
token's text split into ordinary tokens, while the template's own text keeps its special tokens
(`encode_turns`), so no message can open or close a turn.

Message contents are also normalised with the tokenizer's own normaliser before they are
rendered (`ChatTokenizer.normalize`: tokenizer.json's `normalizer`, NFC for Qwen2/2.5/3, and
the one transformers' Qwen3_5Tokenizer installs for Qwen3.5). Tokenising normalises anyway, so
the ids of a content that is not in normal form (`e` + COMBINING ACUTE U+0301, which an ASCII
JSON escape in a policy's action spells; KELVIN SIGN U+212A) decode to other text and `encode`'s
round-trip check refuses them; normalised first, the conversation's text and its messages are
the text the tokens stand for.

Qwen3.5: the official template is not prefix-preserving (docs/qwen35.md section 5: it
rewrites assistant turns in thinking mode, trims them, and drops the empty think block of
earlier turns). For a Qwen3.5 directory (`model_type` qwen3_5 / qwen3_5_text) whose own
template fails the check and no `chat_template_path` is given, `from_dir` uses the bundled
variant templates/qwen3_5_protocol.jinja (the official non-thinking format, made
prefix-preserving) and logs a warning naming both; `template_source` records which template
is in use. Other directories are refused as before.
"""
from __future__ import annotations

import functools
import logging
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from jscenegen.model.assets import MAX_ASSET_FILE_BYTES, TOKENIZER_FILES, refuse_irregular_assets
from jscenegen.paths import loads_json, not_a_file, read_json_object

log = logging.getLogger(__name__)
TEMPLATES_DIR = Path(__file__).with_name("templates")
QWEN35_PROTOCOL_TEMPLATE = TEMPLATES_DIR / "qwen3_5_protocol.jinja"
TEMPLATE_OPTION = "sampling.chat_template_path"
"""How a replacement chat template is passed: the run config's key (`sft` takes --chat-template)."""
MAX_TEMPLATE_BYTES = 1 << 20   # chat templates are a few KB (Qwen3.5's ~7 KB)
QWEN35_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")


class ChatTemplateError(ValueError):
    """A chat template that cannot be used token-in/token-out; the message says why and where."""


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The inverse of byte-level BPE's byte -> printable-character table (GPT-2's layout: the
    188 printable Latin-1 bytes map to themselves, the other 68 to U+0100 onwards in order)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = {}
    extra = 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


_PROBE_THINK = "<think>\nprobe reasoning\n</think>\n\nprobe answer <action>{}</action>"


def _model_type(path: str | Path) -> str | None:
    """config.json's model_type of a model directory, or None when it has no readable one."""
    try:
        return loads_json((Path(path) / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def generation_end_ids(path: str | Path, tokenizer, eot_id: int) -> tuple[int, ...]:
    """The ids that end a sampled turn in the model directory `path`, as vLLM (and so VERL's
    rollout) stops on them: `eot_id` (the template's end of turn), the tokenizer's eos token and
    generation_config.json's `eos_token_id` (an id or a list: Qwen releases list `<|im_end|>`
    and `<|endoftext|>`), or without that file config.json's (of its `text_config` for a
    composite model: transformers' `GenerationConfig.from_model_config`, which vLLM falls back
    to), each once, `eot_id` first.

    Raises ChatTemplateError naming the file when it is not a JSON object or its
    `eos_token_id` is not an id or a list of ids of the tokenizer."""
    ids = [eot_id]
    if isinstance(tokenizer.eos_token_id, int):
        ids.append(tokenizer.eos_token_id)
    f = Path(path) / "generation_config.json"
    if not os.path.lexists(f):
        f = Path(path) / "config.json"
    if os.path.lexists(f):
        doc = read_json_object(f, ChatTemplateError)
        text = doc.get("text_config")
        eos = doc.get("eos_token_id", text.get("eos_token_id") if isinstance(text, dict) else None)
        listed = eos if isinstance(eos, list) else [] if eos is None else [eos]
        if not all(type(i) is int and 0 <= i < len(tokenizer) for i in listed):
            raise ChatTemplateError(f"{f}: eos_token_id must be a token id or a list of token ids "
                                    f"below the tokenizer's {len(tokenizer)}, got "
                                    f"{str(eos)[:200]}")
        ids += listed
    return tuple(dict.fromkeys(ids))


@dataclass
class Conversation:
    """One episode's conversation: the messages and the text its tokens stand for.

    `text` is always the template's rendering of `messages` as far as tokens exist: after
    `start`/`user_segment` it ends with the generation prompt, after `add_assistant` with the
    assistant content (and the end-of-turn text when the policy sampled it).
    """

    chat: "ChatTokenizer"
    messages: list[dict] = field(default_factory=list)
    text: str = ""

    def add_assistant(self, content: str, ended_with_eot: bool) -> None:
        """Record the assistant turn whose tokens decode to `content` (+ the end-of-turn token)."""
        self.messages.append({"role": "assistant", "content": content})
        self.text += content + (self.chat.eot_token if ended_with_eot else "")

    def user_segment(self, content: str) -> list[int]:
        """Tokens of the environment segment that follows the last assistant turn: the rest of
        that turn's template text (the end-of-turn token when it was not sampled, the glue),
        the user message `content` (normalised: `ChatTokenizer.normalize`; the message
        appended to `messages` holds that text) and the next generation prompt.

        Raises ChatTemplateError when rendering the longer conversation changes earlier text.
        """
        messages, self.text, ids = self.chat.encode_turns(
            self.text, self.messages + [{"role": "user", "content": content}], new=1)
        self.messages = messages
        return ids

    def closing_segment(self) -> list[int]:
        """Tokens that close a last assistant turn that stopped before its end-of-turn token
        (stopped on a stop string): the end-of-turn token, or [] when it was sampled."""
        if self.text.endswith(self.chat.eot_token):
            return []
        self.text += self.chat.eot_token
        return [self.chat.eot_id]


def read_template(chat_template_path: str | Path | None, option: str = TEMPLATE_OPTION) -> str | None:
    """The text of the replacement chat template file `chat_template_path` (None: None), read
    before any tokenizer: what `ChatTokenizer.from_dir` refuses of the file itself, so a
    command can refuse it before expensive work. `option`: how the command's user passes it
    (named in the errors). Raises ChatTemplateError for a path that is no regular file, a file
    over MAX_TEMPLATE_BYTES, one that cannot be read as UTF-8, or one holding only whitespace."""
    if not chat_template_path:
        return None
    if why := not_a_file(chat_template_path):
        raise ChatTemplateError(f"{option} {chat_template_path}: {why}")
    if (size := Path(chat_template_path).stat().st_size) > MAX_TEMPLATE_BYTES:
        raise ChatTemplateError(f"{option} {chat_template_path}: {size:,} bytes, more than a "
                                f"chat template's {MAX_TEMPLATE_BYTES:,} (MAX_TEMPLATE_BYTES)")
    try:
        template = Path(chat_template_path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ChatTemplateError(f"{option} {chat_template_path}: cannot be read "
                                f"({getattr(err, 'strerror', None) or err})") from None
    if not template.strip():
        raise ChatTemplateError(f"{option} {chat_template_path}: the file is empty "
                                "(a jinja chat template, e.g. jscenegen/model/tokenizer/"
                                "templates/chatml.jinja)")
    return template


class ChatTokenizer:
    """An HF tokenizer plus its chat template, checked for token-in/token-out use.

    Args:
      tokenizer: a transformers tokenizer with a chat template.
      chat_template: a replacement template (jinja text); None keeps the tokenizer's own.
      source: where it came from (for error messages).
      option: how the command's user passes a replacement template (named in the errors).

    Attributes: eot_token / eot_id (the template's end of assistant turn, e.g. `<|im_end|>`),
    end_ids (the ids a sampled turn ends at: eot_id, and from `from_dir` also the model's
    end-of-generation ids, `generation_end_ids`), vocab_size (len(tokenizer)).
    Raises ChatTemplateError: no template, a template jinja refuses (syntax, or an error while
    rendering), an assistant turn without an end-of-turn special token, or a template that is
    not prefix-preserving (see the module docstring).
    """

    def __init__(self, tokenizer, chat_template: str | None = None, source: str = "<tokenizer>",
                 option: str = TEMPLATE_OPTION):
        self.tokenizer = tokenizer
        self.source = source
        self.option = option
        self.template_source = "replacement" if chat_template is not None else "tokenizer"
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(f"{source}: the tokenizer has no chat template; pass one with "
                                    f"{option} (e.g. jscenegen/model/tokenizer/templates/chatml.jinja)")
        self.eot_token = self._find_eot()
        self.eot_id = tokenizer.convert_tokens_to_ids(self.eot_token)
        self.end_ids: tuple[int, ...] = (self.eot_id,)
        self.check_prefix_preserving()

    @classmethod
    def from_dir(cls, path: str | Path, chat_template_path: str | Path | None = None,
                 option: str = TEMPLATE_OPTION) -> "ChatTokenizer":
        """Load the tokenizer of an HF model directory (never with remote code).

        With no `chat_template_path`, a Qwen3.5 directory whose own template is refused gets
        the bundled protocol template (module docstring). `option`: how the command's user
        passes `chat_template_path` (the config key, or `--chat-template` of `sft`), named in
        the errors. Raises ChatTemplateError as the constructor does for any other directory,
        for a refused replacement template, or for a path that is no directory (never looked
        up online) or a directory without tokenizer files.
        """
        from transformers import AutoTokenizer

        template = read_template(chat_template_path, option)
        if not Path(path).is_dir():   # transformers would take it for a Hub id and go online
            raise ChatTemplateError(f"{path}: not a directory (a local HF model directory with "
                                    "the model's tokenizer files)")
        refuse_irregular_assets(path, ChatTemplateError)   # the loader would wait on a named pipe
        for f in (Path(path) / name for name in TOKENIZER_FILES):
            if f.is_file() and (size := f.stat().st_size) > MAX_ASSET_FILE_BYTES:
                raise ChatTemplateError(f"{f}: {size:,} bytes, more than a tokenizer file holds "
                                        f"(at most {MAX_ASSET_FILE_BYTES:,}: "
                                        "jscenegen.model.assets.MAX_ASSET_FILE_BYTES)")
        if not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
            raise ChatTemplateError(f"{path}: no tokenizer file ({', '.join(TOKENIZER_FILES)}); "
                                    "copy the model's tokenizer files into it")
        try:
            tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False,
                                                local_files_only=True)
        except Exception as err:  # transformers' parsers raise anything on a malformed file
            raise ChatTemplateError(f"{path}: the tokenizer cannot be loaded ({type(err).__name__}: "
                                    f"{err}); tokenizer.json and tokenizer_config.json must be "
                                    "those of the model") from None
        src = str(path) + (f" (template {chat_template_path})" if chat_template_path else "")
        try:
            chat = cls(tok, template, src, option)
        except ChatTemplateError as err:
            if chat_template_path or _model_type(path) not in QWEN35_MODEL_TYPES:
                raise
            log.warning("%s; using the Qwen3.5 protocol template %s instead (set %s to choose "
                        "another)", err, QWEN35_PROTOCOL_TEMPLATE, option)
            chat = cls(tok, QWEN35_PROTOCOL_TEMPLATE.read_text(encoding="utf-8"),
                       f"{path} (template {QWEN35_PROTOCOL_TEMPLATE}: its own is not prefix-preserving)",
                       option)
            chat.template_source = str(QWEN35_PROTOCOL_TEMPLATE)
        else:
            if chat_template_path:
                chat.template_source = str(chat_template_path)
        chat.end_ids = generation_end_ids(path, tok, chat.eot_id)
        return chat

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def check_fits(self, model_vocab_size: int, source: str) -> None:
        """Raise ChatTemplateError naming `source` (the model) when the tokenizer has more
        tokens than the model's embedding rows: its ids past them have no embedding (a gather
        out of range reads garbage, a loss over them is NaN). Fewer is normal (Qwen pads its
        vocabulary to a multiple of 128)."""
        if self.vocab_size > model_vocab_size:
            raise ChatTemplateError(f"{source}: the tokenizer has {self.vocab_size} tokens, more "
                                    f"than the model's vocab_size {model_vocab_size}; "
                                    "tokenizer and weights must come from the same model")

    # ---- text <-> tokens ----------------------------------------------------------------
    def render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        """The chat template applied to `messages` as text. Raises ChatTemplateError (the
        source, jinja's line) when the template fails: a syntax error, `raise_exception`, or
        anything its expressions raise (`{{ 1 // 0 }}`)."""
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
        except TemplateError as err:
            line = getattr(err, "lineno", None)
            raise ChatTemplateError(f"{self.source}: the chat template fails in jinja"
                                    f"{f' at line {line}' if line else ''}: {err}") from None
        except Exception as err:   # the template's own expressions: ZeroDivisionError, TypeError
            raise ChatTemplateError(f"{self.source}: the chat template fails while rendering "
                                    f"({type(err).__name__}: {err})") from None

    def normalize(self, text: str) -> str:
        """`text` as the tokenizer's normaliser writes it (the backend's `normalizer`: NFC for
        Qwen's tokenizers), or `text` itself for a tokenizer without one. The normaliser runs
        before the tokens are made, so the ids of `text` decode to this text: message contents
        are normalised before they are encoded (module docstring). Idempotent for NFC."""
        normalizer = getattr(getattr(self.tokenizer, "backend_tokenizer", None), "normalizer", None)
        return text if normalizer is None else normalizer.normalize_str(text)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (special tokens in the text recognised, none added).

        Raises ChatTemplateError when the ids do not decode back to `text`.
        """
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if self.decode(ids) != text:
            raise ChatTemplateError(f"{self.source}: tokenising {text[:60]!r}... does not round-trip")
        return ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` with every special token it spells out read as ordinary text
        (tokenizers' `split_special_tokens`); raises ChatTemplateError when they do not decode
        back to `text`."""
        ids = list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
        if self.decode(ids) != text:
            raise ChatTemplateError(f"{self.source}: tokenising {text[:60]!r}... as plain text "
                                    "does not round-trip")
        return ids

    def encode_content(self, text: str) -> tuple[str, list[int]]:
        """A message content as a turn holds it: the normalised text (`normalize`) and its
        ids read as plain text (`encode_plain`), which decode back to that text. The one rule
        for a turn's text outside `encode_turns` (which normalises the environment's
        messages the same way): a forced rollout turn, an SFT demonstration's answer, the
        prompt a too-long episode names."""
        text = self.normalize(text)
        return text, self.encode_plain(text)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens included, no clean-up."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def token_bytes(self) -> list[bytes]:
        """The bytes every id decodes to (for byte-level stop-string matching in the sampler).

        Byte-level BPE entries are mapped through the byte table; added/special tokens give
        their text; other tokenizers fall back to decoding the id alone.
        """
        tok = self.tokenizer
        added = {i: t.content for i, t in tok.added_tokens_decoder.items()}
        decoder = getattr(getattr(tok, "backend_tokenizer", None), "decoder", None)
        byte_level = type(decoder).__name__ == "ByteLevel" or "ByteLevel" in repr(decoder)
        table = _byte_decoder()
        pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
        out = []
        for i, piece in enumerate(pieces):
            if i in added:
                out.append(added[i].encode("utf-8"))
            elif piece is None:
                out.append(b"")
            elif byte_level and all(c in table for c in piece):
                out.append(bytes(table[c] for c in piece))
            else:
                out.append(self.decode([i]).encode("utf-8"))
        return out

    # ---- conversations ------------------------------------------------------------------
    def start(self, system: str, user: str) -> tuple[Conversation, list[int]]:
        """A new conversation and its prompt tokens (system, user, generation prompt); the
        conversation's messages hold the contents normalised (`normalize`)."""
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        messages, text, ids = self.encode_turns("", messages, new=2)
        return Conversation(self, messages, text), ids

    def encode_turns(self, before: str, messages: Sequence[dict],
                     new: int) -> tuple[list[dict], str, list[int]]:
        """`messages` with the last `new` contents normalised (`normalize`), their rendering with
        the generation prompt, and the ids of its text after `before` (the rendering so far), in
        which those `new` messages are written.

        The template's own text is encoded with its special tokens; the contents of the `new`
        messages never are: text a model wrote (a plan echoed to the next role, an action
        quoted back) that spells out `<|im_end|>` stays ordinary text instead of becoming a turn
        boundary (`encode_plain`). Contents without special-token text are encoded with the
        template's text in one piece, exactly as tokenising the whole rendering would.
        Raises ChatTemplateError when `before` is not a prefix of the rendering, or when the
        template writes a content in a way that depends on the other contents.
        """
        first = len(messages) - new
        messages = [*messages[:first],
                    *(dict(m, content=self.normalize(m["content"])) for m in messages[first:])]
        full = self.render(messages, add_generation_prompt=True)
        delta = self.delta(before, full)
        contents = [m["content"] for m in messages[first:]]
        if not any(self.special_tokens_in(c) for c in contents):
            return messages, full, self.encode(delta)
        ids = []
        for piece, is_content in self._content_spans(before, messages, new, delta):
            ids += self.encode_plain(piece) if is_content else self.encode(piece)
        return messages, full, ids

    def _content_spans(self, before: str, messages: Sequence[dict], new: int,
                       delta: str) -> list[tuple[str, bool]]:
        """`delta` cut into (text, is_content) pieces: the template's text and, in order, the
        last `new` messages' contents as rendered (a template may trim them). Each content is
        found by rendering it alone among unique markers standing for the others."""
        first = len(messages) - new
        marks = [f"\u2063content-{uuid.uuid4().hex}\u2063" for _ in range(new)]

        def render_with(real: int | None) -> str:
            shown = [dict(m, content=m["content"] if i - first == real else marks[i - first])
                     if i >= first else m for i, m in enumerate(messages)]
            return self.delta(before, self.render(shown, add_generation_prompt=True))

        marked = render_with(None)
        refused = ChatTemplateError(f"{self.source}: the chat template does not write each "
                                    "message's content once and on its own, so contents that "
                                    "spell out special tokens cannot be kept as text")
        structure, rest = [], marked       # the template's text around the marks, in order
        for mark in marks:
            head, found, rest = rest.partition(mark)
            if not found or mark in rest:   # once each; one out of order is not found
                raise refused
            structure.append(head)
        structure.append(rest)
        pieces = [(structure[0], False)]
        for k, mark in enumerate(marks):
            alone = render_with(k)
            prefix, _, suffix = marked.partition(mark)
            if not (alone.startswith(prefix) and alone.endswith(suffix)
                    and len(alone) >= len(prefix) + len(suffix)):
                raise refused
            pieces += [(alone[len(prefix):len(alone) - len(suffix)], True), (structure[k + 1], False)]
        if "".join(p for p, _ in pieces) != delta:
            raise refused
        return [(p, c) for p, c in pieces if p]

    def delta(self, before: str, after: str) -> str:
        """`after` minus its prefix `before`; raises ChatTemplateError when `before` is not one."""
        if after.startswith(before):
            return after[len(before):]
        at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
        raise ChatTemplateError(
            f"{self.source}: the chat template is not prefix-preserving: rendering one more turn "
            f"changes earlier text at character {at} ({before[max(0, at - 30):at + 30]!r} became "
            f"{after[max(0, at - 30):at + 30]!r}). Templates that drop earlier <think> blocks "
            "(Qwen3's default) do this; use a prefix-preserving template "
            f"({self.option}, e.g. jscenegen/model/tokenizer/templates/chatml.jinja)")

    def special_tokens_in(self, text: str) -> list[str]:
        """The tokenizer's special (added) tokens written out in `text`: `encode` would read
        them as the tokens themselves (`<|im_end|>` in a prompt would end the user's turn)."""
        return sorted({t.content for t in self.tokenizer.added_tokens_decoder.values()
                       if t.special and t.content in text})

    def _find_eot(self) -> str:
        """The special token the template writes right after an assistant message's content."""
        marker = "\u2063probe-content\u2063"
        text = self.render([{"role": "user", "content": "u"}, {"role": "assistant", "content": marker}],
                           add_generation_prompt=False)
        if marker not in text:
            raise ChatTemplateError(f"{self.source}: the chat template does not write assistant content verbatim")
        after = text[text.index(marker) + len(marker):]
        specials = sorted((t.content for t in self.tokenizer.added_tokens_decoder.values()), key=len,
                          reverse=True)
        for s in specials:
            if after.startswith(s):
                return s
        raise ChatTemplateError(f"{self.source}: no special end-of-turn token follows the assistant "
                                f"content in the chat template (found {after[:20]!r})")

    def check_prefix_preserving(self) -> None:
        """Probe the template with our turn structure (system, user, assistant with a <think>
        block and an action, user, ...): every rendering must extend the previous one, and the
        assistant content must follow the generation prompt verbatim. Raises ChatTemplateError."""
        msgs = [{"role": "system", "content": "probe system"}, {"role": "user", "content": "probe user 1"}]
        for turn in range(2):
            prompt = self.render(msgs, add_generation_prompt=True)
            answer = _PROBE_THINK if turn == 0 else " plain answer <action>{}</action>\n"
            msgs = msgs + [{"role": "assistant", "content": answer}]
            closed = self.render(msgs, add_generation_prompt=False)
            if not closed.startswith(prompt + answer + self.eot_token):
                at = self.delta(prompt, closed) if closed.startswith(prompt) else None
                raise ChatTemplateError(
                    f"{self.source}: the chat template rewrites assistant content "
                    f"(expected the sampled text right after the generation prompt, got "
                    f"{(at or closed)[:80]!r}); use a prefix-preserving template "
                    f"({self.option}, e.g. jscenegen/model/tokenizer/templates/chatml.jinja)")
            msgs = msgs + [{"role": "user", "content": f"probe user {turn + 2}"}]
            self.delta(closed, self.render(msgs, add_generation_prompt=True))
