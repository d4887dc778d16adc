"""`checksums.json`: SHA-256 and byte size of every file under a directory, and its check.

Format written: {"files": {relpath: {"sha256": hex, "bytes": int}}} (relpaths with "/",
sorted; symlinks and checksums.json itself are not listed). Verification also accepts the
variants a published checkpoint may use: "size" for "bytes", a list of
{"path", "sha256", "bytes"|"size"} under "files", or the path map at the top level.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from convert.errors import ConvertError

NAME = "checksums.json"
_CHUNK = 8 << 20


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 8 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def list_files(root: Path) -> list[str]:
    """Relative paths of the regular files under `root` (symlinked entries not followed)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not (Path(dirpath) / d).is_symlink())
        for fn in filenames:
            p = Path(dirpath) / fn
            if not p.is_symlink():
                out.append(p.relative_to(root).as_posix())
    return sorted(f for f in out if f != NAME)


def write_checksums(root: str | Path) -> dict[str, dict[str, Any]]:
    """Write `root/checksums.json` for every file under `root`; returns the file map."""
    root = Path(root)
    files = {rel: {"sha256": file_sha256(root / rel), "bytes": (root / rel).stat().st_size}
             for rel in list_files(root)}
    tmp = root / f".{NAME}.tmp"
    tmp.write_text(json.dumps({"files": files}, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, root / NAME)
    return files


def _entries(doc: Any, source: Path) -> dict[str, dict[str, Any]]:
    files = doc.get("files", doc) if isinstance(doc, dict) else None
    if isinstance(files, list):
        files = {e.get("path"): e for e in files if isinstance(e, dict)}
    if not isinstance(files, dict) or not files:
        raise ConvertError(f"{source}: no file entries (expected {{\"files\": {{path: {{sha256, bytes}}}}}})")
    out = {}
    for rel, e in files.items():
        if not isinstance(rel, str) or not isinstance(e, dict) or "sha256" not in e:
            raise ConvertError(f"{source}: entry {rel!r} lacks a sha256")
        size = e.get("bytes", e.get("size"))
        out[rel] = {"sha256": str(e["sha256"]).lower(), "bytes": None if size is None else int(size)}
    return out


def verify(root: str | Path) -> list[str]:
    """Check `root` against its checksums.json; returns the problems (empty when it verifies).

    Each problem names the file: missing, size differs, sha256 differs, or present but not
    listed. Raises ConvertError if checksums.json is missing or unreadable.
    """
    root = Path(root)
    f = root / NAME
    if not f.is_file():
        raise ConvertError(f"{f}: not found")
    try:
        entries = _entries(json.loads(f.read_text()), f)
    except json.JSONDecodeError as err:
        raise ConvertError(f"{f}: not valid JSON: {err}") from None
    problems = []
    for rel, e in sorted(entries.items()):
        p = root / rel
        if not p.is_file():
            problems.append(f"{rel}: missing")
            continue
        size = p.stat().st_size
        if e["bytes"] is not None and size != e["bytes"]:
            problems.append(f"{rel}: {size} bytes, expected {e['bytes']}")
            continue
        if file_sha256(p) != e["sha256"]:
            problems.append(f"{rel}: sha256 differs")
    for rel in list_files(root):
        if rel not in entries and not rel.startswith("."):
            problems.append(f"{rel}: present but not listed in {NAME}")
    return problems
