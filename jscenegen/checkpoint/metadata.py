"""`training_metadata.json`: what produced a checkpoint (code, protocol, schedule, config, versions).

Fields (../shared/DESIGN.md, "Checkpoints"; ../shared/specs/seed.md lists the first four for the
published GRPO100 checkpoint):

- `git_commit`: commit of the jscenegen source tree, `"<sha>-dirty"` with uncommitted changes,
  `null` outside a git checkout.
- `protocol_hash`, `schedule_hash`: identities of the scene protocol and the role/scene order.
- `optimizer_step`: AdamW steps actually taken (= torch AdamW `step`, optax `count`).
- `effective_updates`: updates that counted towards the schedule (zero-spread policy).
- `judge`: the judge's identity (kind, model name, endpoint without credentials, ...).
- `config`: the resolved run config with credentials redacted (see `redact`).
- `versions`: Python and the packages that determine the numbers.
- `created_utc`: ISO-8601 time of writing.

Credentials never reach the file: keys that name a credential are replaced by `"<redacted>"`,
and so is any string containing the value of a credential-named environment variable or a URL
with a credential in it (`https://user:KEY@host`, `?api_key=...`). `redact_argv` does the same
for a command line, `mask_credentials` for files a third party wrote (swanlab).
"""
from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import re
import subprocess
import urllib.parse
from pathlib import Path
from typing import Any, Mapping, Sequence

from jscenegen.config import REDACTED, dotted_items, override_value
from jscenegen.paths import atomic_file

# Words that make a key name a credential, matched on the `_`/`-`/`.`/camelCase parts of the
# name (so `api_key`, `hf_token`, `clientSecret` are redacted but `max_new_tokens` and
# `tokenizer` are not), plus substrings that are credentials wherever they appear.
_CREDENTIAL_WORDS = {"key", "apikey", "token", "secret", "password", "passwd",
                     "credential", "credentials", "auth", "authorization", "cookie"}
_CREDENTIAL_SUBSTRINGS = ("secret", "password", "passwd", "apikey", "api_key")
_MIN_ENV_SECRET_CHARS = 8
VERSION_PACKAGES = ("jscenegen", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint",
                    "numpy", "transformers", "tokenizers")


def is_credential_name(name: str) -> bool:
    """True if a key or environment-variable name denotes a credential (see module docstring).

    A name ending in `_env` (e.g. `api_key_env`) names the variable that holds a credential,
    not the credential, and `grade_keys` lists dictionary keys: neither is redacted.
    """
    lower = name.lower()
    if lower.endswith("_env"):
        return False
    if any(s in lower for s in _CREDENTIAL_SUBSTRINGS):
        return True
    words = re.split(r"[_\-.\s]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name))
    return any(w.lower() in _CREDENTIAL_WORDS for w in words if w)


def environment_secrets() -> list[str]:
    """The values (8 characters or more) of this process's credential-named environment
    variables (`is_credential_name`: JSCENEGEN_JUDGE_API_KEY, SWANLAB_API_KEY, HF_TOKEN)."""
    return [v for k, v in os.environ.items()
            if is_credential_name(k) and len(v) >= _MIN_ENV_SECRET_CHARS]


def url_has_credential(text: str) -> bool:
    """True for a URL carrying a credential: user info (`https://user:KEY@host`,
    `https://TOKEN@host`) or a credential-named query parameter (`?api_key=...`, `&token=...`)."""
    if "://" not in text:
        return False
    try:
        url = urllib.parse.urlsplit(text.strip())
        query = urllib.parse.parse_qsl(url.query, keep_blank_values=True)
    except ValueError:
        return False
    return bool(url.username or url.password) or any(is_credential_name(k) for k, _ in query)


def _is_secret_string(text: str, secrets: list[str]) -> bool:
    return any(s in text for s in secrets) or url_has_credential(text)


def redact(obj: Any, _secrets: list[str] | None = None) -> Any:
    """Copy of a JSON-like `obj` with credentials replaced by "<redacted>".

    A mapping value whose key `is_credential_name` is replaced whatever its type; a string
    that contains the value of a credential-named environment variable (e.g. a URL with the
    `OPENAI_API_KEY` inside) or is a URL with a credential in it (`url_has_credential`) is
    replaced as a whole. Tuples become lists.
    """
    secrets = environment_secrets() if _secrets is None else _secrets
    if isinstance(obj, Mapping):
        return {str(k): REDACTED if is_credential_name(str(k)) else redact(v, secrets)
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact(v, secrets) for v in obj]
    if isinstance(obj, str) and _is_secret_string(obj, secrets):
        return REDACTED
    return obj


def config_changes(saved: Mapping[str, Any], now: Mapping[str, Any], *,
                   only_saved_keys: bool = False, ignored: tuple[str, ...] = ()) -> list[str]:
    """`"key old -> new"` for every dotted key whose value differs between two resolved configs
    (`saved`, as a run's config.yaml or a checkpoint's metadata records it, and `now`), values
    shown redacted; only `saved`'s own keys with `only_saved_keys`; none starting with an
    `ignored` prefix; none whose saved value is a redacted credential (it cannot be compared)."""
    before, after = dotted_items(dict(saved)), dotted_items(dict(now))
    shown_before, shown_after = dotted_items(redact(dict(saved))), redact(after)
    return [f"{k} {shown_before.get(k)!r} -> {shown_after[k]!r}" for k, v in after.items()
            if before.get(k) != v and (k in before or not only_saved_keys)
            and not k.startswith(ignored) and before.get(k) != REDACTED]


def _credential_strings(obj: Any, secrets: list[str], named: bool = False) -> list[str]:
    """The scalars of a JSON-like `obj` that `redact` replaces (under a credential-named key,
    or a secret string), as text."""
    if isinstance(obj, Mapping):
        return [s for k, v in obj.items()
                for s in _credential_strings(v, secrets, named or is_credential_name(str(k)))]
    if isinstance(obj, (list, tuple)):
        return [s for v in obj for s in _credential_strings(v, secrets, named)]
    if obj is None:
        return []
    text = str(obj)
    return [text] if named or (isinstance(obj, str) and _is_secret_string(text, secrets)) else []


def _names_a_credential(text: str) -> bool:
    """Whether a word of `text` (a list or mapping YAML could not read) names a credential."""
    return any(is_credential_name(w) for w in re.findall(r"[A-Za-z][\w-]*", text))


def redact_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(argv with credentials replaced, the credential strings it held).

    `key=value` and `--option=value` items keep their key: the value is replaced when the key
    names a credential or the value holds one, read as the override's YAML value
    (`config.override_value`: `judge={api_key: X}`, a quoted URL with a password), as
    `redact` decides, or, when the value opens a list or mapping YAML cannot read (a key given
    twice: its error line quotes the item), when a word of it names a credential; any other
    item that is a credential is replaced whole. The second list is
    what was removed, longest first (to mask copies that were written before redaction, see
    `mask_credentials`).
    """
    secrets = environment_secrets()
    out, removed = [], []
    for item in argv:
        key, eq, value = item.partition("=")
        parsed = override_value(item)
        unread = parsed == value and value.lstrip().startswith(("[", "{"))
        if eq and key and (is_credential_name(key.lstrip("-").split(".")[-1])
                           or _is_secret_string(value, secrets)
                           or redact(parsed, secrets) != parsed
                           or (unread and _names_a_credential(value))):
            out.append(f"{key}={REDACTED}")
            # a value inside it is masked elsewhere only when it is long enough to be one
            # (`judge={token: 1}` would mask every "1" of an error line)
            removed += [value, *(c for c in _credential_strings(parsed, secrets)
                                 if len(c) >= _MIN_ENV_SECRET_CHARS)]
        elif _is_secret_string(item, secrets):
            out.append(REDACTED)
            removed.append(item)
        else:
            out.append(item)
    removed += [s for s in secrets if any(s in r for r in argv)]
    return out, sorted({r for r in removed if r}, key=len, reverse=True)


def mask_text(text: str, credentials: Sequence[str]) -> str:
    """`text` with every occurrence of each of `credentials` (longest first) replaced by
    `<redacted>`: for messages that quote what a credential reached (an argument, an answer)."""
    for secret in sorted(filter(None, credentials), key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return text


def mask_credentials(root: str | Path, credentials: Sequence[str]) -> list[Path]:
    """Overwrite every occurrence of each credential in every file under `root` with as many
    `*` (the length is kept, so binary records stay readable); return the files changed.

    For copies written by code that cannot be given a redacted value (swanlab records the
    process's command line from /proc/self/cmdline)."""
    needles = [c.encode() for c in credentials if c]
    changed = []
    for path in sorted(Path(root).rglob("*")) if needles else []:
        if not path.is_file() or path.is_symlink():
            continue
        data = path.read_bytes()
        masked = data
        for n in needles:
            masked = masked.replace(n, b"*" * len(n))
        if masked != data:
            with atomic_file(path) as tmp:
                tmp.write_bytes(masked)
            changed.append(path)
    return changed


def git_commit(path: str | Path | None = None) -> str | None:
    """Commit of the git checkout holding `path` (default: this package), `-dirty` if modified.

    Returns None when `path` is not in a git checkout or git is not installed.
    """
    cwd = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=cwd, capture_output=True, text=True, timeout=10,
                                check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{sha}-dirty" if status else sha


def package_versions(packages: tuple[str, ...] = VERSION_PACKAGES) -> dict[str, str | None]:
    """{"python": ..., package: installed version or None} for the packages that set the numbers."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def training_metadata(*, config: Mapping[str, Any], protocol_hash: str, schedule_hash: str,
                      optimizer_step: int, effective_updates: int,
                      judge: Mapping[str, Any] | None, extra: Mapping[str, Any] | None = None,
                      ) -> dict[str, Any]:
    """The `training_metadata.json` dict for one checkpoint (fields in the module docstring).

    `config` is the resolved run config as plain data (e.g. `RunConfig.model_dump(mode="json")`);
    it and `judge` and `extra` are passed through `redact`. `extra` keys are added at the top
    level (e.g. `source` for a converted VERL checkpoint) and may not shadow the fixed fields.
    Raises ValueError for a negative step count or an `extra` key that shadows a field.
    """
    if optimizer_step < 0 or effective_updates < 0:
        raise ValueError(f"optimizer_step ({optimizer_step}) and effective_updates "
                         f"({effective_updates}) must be >= 0")
    meta: dict[str, Any] = {
        "git_commit": git_commit(),
        "protocol_hash": protocol_hash,
        "schedule_hash": schedule_hash,
        "optimizer_step": int(optimizer_step),
        "effective_updates": int(effective_updates),
        "judge": dict(judge) if judge is not None else None,
        "config": dict(config),
        "versions": package_versions(),
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    for k, v in (extra or {}).items():
        if k in meta:
            raise ValueError(f"extra metadata key {k!r} would overwrite the field of that name")
        meta[k] = v
    return redact(meta)
