"""Text as jscenegen shows it: cut to a length (`clip_text`), escaped for a terminal
(`terminal_text`, `terminal_line`), both (`clip_line`: cut first, so the escaping costs what
the shown part does), and checked to be Unicode (`not_unicode`). A leaf: it
imports nothing of jscenegen."""
from __future__ import annotations

import unicodedata


def not_unicode(text: str) -> str | None:
    """Why `text` is not Unicode text (a lone surrogate: what Python makes of bytes that are not
    UTF-8 in a command line or of a JSON `\\udcff` escape), or None when it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"character {err.start} is a lone surrogate {text[err.start]!r}, not Unicode text"
    return None


def clip_text(text: str, limit: int = 200) -> str:
    """`text` cut to `limit` characters, its full length said: an error line echoes what it
    refuses, not a megabyte of it."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


# Unicode's bidirectional embeddings, overrides, isolates and marks: printed raw, one reorders
# how the rest of the line (and the lines after it) display ("Trojan Source", CVE-2021-42574)
BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e"
                          "\u2066\u2067\u2068\u2069")


def terminal_text(text: str, keep: str = "\n\t") -> str:
    """`text` safe to print: control characters (Unicode category Cc) other than those in
    `keep` (newline and tab), the bidirectional controls (`BIDI_CONTROLS`) and lone surrogates
    (argv bytes that are not UTF-8), written as escapes (`\\x1b`, `\\u202e`, `\\udcff`), so an
    escape sequence in a prompt, a sampled token or a refused input cannot drive the terminal
    or reorder what it shows, and any stream can encode the line; files keep the text itself."""
    return "".join(repr(c)[1:-1] if (unicodedata.category(c) in ("Cc", "Cs") and c not in keep)
                   or c in BIDI_CONTROLS else c for c in text)


def one_line(text: str, limit: int | None = None) -> str:
    """A message's lines joined by '; ' (each stripped, blank ones dropped), then
    `terminal_line` (tabs escaped too): one line a script reads, which cannot drive the
    terminal; "" for a blank message. With `limit`, cut to `limit` characters (`clip_line`)."""
    joined = "; ".join(part.strip() for part in text.splitlines() if part.strip())
    return terminal_line(joined) if limit is None else clip_line(joined, limit)


def clip_line(text: str, limit: int = 200) -> str:
    """`terminal_line(text)` cut to `limit` characters, its full length said (`clip_text`'s
    form), escaping no more of `text` than is shown: the escape is a Python loop over each
    character, so a message that echoes a 400 MiB value took a minute to escape before the
    cut threw nearly all of it away. The length said is that of the escaped text when `text`
    has at most `limit` characters, else that of `text`."""
    if len(text) <= limit:
        return clip_text(terminal_line(text), limit)
    return f"{terminal_line(text[:limit])[:limit]}... ({len(text):,} characters)"


def terminal_line(text: str) -> str:
    """`terminal_text` for a one-line message: newlines and tabs escaped too (`\\n`), so a
    path or name holding them cannot break the line a script reads."""
    return terminal_text(text, keep="")
