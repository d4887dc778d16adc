"""`checksums.json`: SHA-256 and byte size of every file under a directory.

The format is the one the published GRPO100 checkpoint uses and ../shared/DESIGN.md fixes::

    {"files": {"<relative/posix/path>": {"sha256": "<64 hex digits>", "bytes": <int>}, ...}}

Paths are relative to the directory that holds `checksums.json`, with `/` separators, sorted.
The checksum file itself is never listed. Directory symlinks are not followed (an export's
`huggingface -> ../..` link would otherwise loop); file symlinks are hashed by content.
Written atomically (temporary file + rename), so a reader sees either no file or a whole one.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Mapping

from jscenegen.paths import fsync_path, not_a_file, read_json_object, write_json

CHECKSUMS_NAME = "checksums.json"


class ChecksumError(ValueError):
    """A directory that does not match its `checksums.json`; the message names every bad file."""


def failure_message(root: Path, problems: list[tuple[str, str]], shown: int = 10) -> str:
    """One line: each failing file as `root/rel: what is wrong` (the first `shown`), then the
    manifest and the count, e.g. `d/a.pt: 20 bytes, expected 40 (d/checksums.json; 1 file
    fails)`."""
    n = len(problems)
    more = f"; ... {n - shown} more" if n > shown else ""
    return ("; ".join(f"{root / rel}: {why}" for rel, why in problems[:shown]) + more
            + f" ({root / CHECKSUMS_NAME}; {n} file{' fails' if n == 1 else 's fail'})")


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of the file at `path`, streamed (memory does not grow with size)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sampled_file_digest(path: str | Path, samples: int = 16, block: int = 4096) -> str:
    """Hex SHA-256 of the file at `path`'s size and of `samples` blocks of `block` bytes at
    evenly spaced offsets, first and last included (the whole file when it is no larger): a
    fingerprint that tells two copies of a large weight file apart without reading them whole.
    Equal files always agree; two fine-tunes of one model disagree though their headers and
    sizes match wherever a sampled block falls in a tensor the fine-tune changed (a full
    fine-tune changes them all; one that froze most of the model may go unseen). Not every
    byte is read: `file_sha256` is the checksum. Raises OSError naming the file when it cannot be read."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(str(size).encode())
        last = max(size - block, 0)
        for offset in sorted({last * i // max(samples - 1, 1) for i in range(samples)}):
            f.seek(offset)
            digest.update(f.read(block))
    return digest.hexdigest()


def list_files(root: str | Path, exclude: tuple[str, ...] = (CHECKSUMS_NAME,)) -> list[str]:
    """Sorted relative POSIX paths of every regular file under `root` (not following dir links).

    `exclude` names relative paths to leave out (by default the checksum file itself).
    """
    root = Path(root)
    out = []
    for dirpath, _dirnames, filenames in os.walk(root, followlinks=False):
        for name in filenames:
            full = Path(dirpath) / name
            if not full.is_file():  # dangling link, socket, ...
                continue
            rel = full.relative_to(root).as_posix()
            if rel not in exclude:
                out.append(rel)
    return sorted(out)


def compute_checksums(root: str | Path, exclude: tuple[str, ...] = (CHECKSUMS_NAME,)) -> dict:
    """`{"files": {relpath: {"sha256": hex, "bytes": int}}}` for every file under `root`."""
    root = Path(root)
    files = {}
    for rel in list_files(root, exclude):
        path = root / rel
        files[rel] = {"sha256": file_sha256(path), "bytes": path.stat().st_size}
    return {"files": files}


def write_checksums(root: str | Path) -> dict:
    """Hash every file under `root`, flush those files and their directories to the device
    (`fsync_path`), then write `root/checksums.json` atomically; returns the written dict. So a
    power cut after it leaves either no checksums.json (an unfinished save, replaced by the
    next) or the files it describes: what makes a step complete is durable before the older
    steps are deleted. Raises OSError (DiskFullError for a full disk) naming the file."""
    root = Path(root)
    table = compute_checksums(root, exclude=(CHECKSUMS_NAME,))
    for rel in table["files"]:
        fsync_path(root / rel)
    for directory in sorted({(root / rel).parent for rel in table["files"]} | {root},
                            key=lambda d: len(d.parts), reverse=True):
        fsync_path(directory)
    write_json(root / CHECKSUMS_NAME, table)
    fsync_path(root.parent)   # `root`'s own entry (a step renamed into place)
    return table


def read_checksums(root: str | Path) -> dict[str, dict]:
    """The `files` table of `root/checksums.json`.

    Raises ChecksumError if the file is missing, not JSON, or not of the documented format
    (the message names the file and the offending entry).
    """
    path = Path(root) / CHECKSUMS_NAME
    if not os.path.lexists(path):
        raise ChecksumError(f"{path}: missing (no checksums were written, or the write was cut off)")
    files = read_json_object(path, ChecksumError).get("files")
    if not isinstance(files, dict):
        raise ChecksumError(f"{path}: expected an object with key 'files' mapping path -> entry")
    for rel, entry in files.items():
        parts = rel.split("/")
        if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ChecksumError(f"{path}: entry {rel[:200]!r} is not a relative POSIX path inside "
                                f"{Path(root)} (no '..', '.', empty or absolute parts)")
        if (not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str)
                or not isinstance(entry.get("bytes"), int)):
            raise ChecksumError(f"{path}: entry {rel!r} must be {{'sha256': str, 'bytes': int}}")
    return files


def verify_checksums(root: str | Path, *, hash_files: bool = True, under: str | None = None,
                     flat: bool = False, known: Mapping[str, str] | None = None) -> int:
    """Check every file listed in `root/checksums.json` (size, then SHA-256); return the number
    checked.

    With `hash_files=False` only presence and byte sizes are checked (cheap). Files present on
    disk but not listed are errors. `under` (a relative POSIX path)
    limits both checks to the files below that sub-directory; with `flat`, to the files
    directly in it ("" or None: `root` itself). `known` ({relative path: SHA-256}) gives the
    digests of files another manifest verified just before (an orbax step's own): those are
    compared, not hashed again (their sizes are still read). Raises ChecksumError naming each
    missing, resized, altered or unlisted file (`failure_message`: one line, each file under
    `root` as given, then the manifest and how many files fail). A listed file under a
    directory that is a symbolic link fails too: `list_files` does not follow directory links,
    so that directory's unlisted files would go unseen.
    """
    root = Path(root)
    if not root.is_dir():
        raise ChecksumError(f"{root}: not a directory" if root.exists() else f"{root}: no such directory")
    files = read_checksums(root)
    where = (under or "").rstrip("/")
    if flat:
        files = {rel: e for rel, e in files.items() if rel.rpartition("/")[0] == where}
    elif where:
        files = {rel: e for rel, e in files.items() if rel.startswith(where + "/")}
    problems: list[tuple[str, str]] = []
    for rel, entry in sorted(files.items()):
        path = root / rel
        if (link := _linked_directory(root, rel)) is not None:
            problems.append((rel, f"lies under the symbolic link {link} (its directory's unlisted "
                                  "files would go unseen)"))
            continue
        if not os.path.lexists(path):
            problems.append((rel, "missing"))
            continue
        if (why := not_a_file(path)) is not None:
            problems.append((rel, why))
            continue
        size = path.stat().st_size
        if size != entry["bytes"]:
            problems.append((rel, f"{size} bytes, expected {entry['bytes']}"))
        elif hash_files and (known[rel] if known and rel in known
                             else file_sha256(path)) != entry["sha256"]:
            problems.append((rel, "SHA-256 differs"))
    listed = set(files)
    prefix = where + "/" if where else ""
    if flat:
        on_disk = [prefix + entry for entry in sorted(os.listdir(root / where))
                   if (root / where / entry).is_file() and prefix + entry != CHECKSUMS_NAME]
    else:
        on_disk = list_files(root, (CHECKSUMS_NAME,)) if not where else [
            prefix + rel for rel in list_files(root / where, ())]
    problems += [(rel, "not listed") for rel in on_disk if rel not in listed]
    if problems:
        raise ChecksumError(failure_message(root, problems))
    return len(files)


def _linked_directory(root: Path, rel: str) -> str | None:
    """The first directory of `rel`'s path below `root` that is a symbolic link (relative
    POSIX path), or None."""
    parts = rel.split("/")[:-1]
    for i in range(1, len(parts) + 1):
        if os.path.islink(root.joinpath(*parts[:i])):
            return "/".join(parts[:i])
    return None


def covering_checksums(path: str | Path, levels: int = 3, *,
                       above: bool = False) -> tuple[Path, str] | None:
    """(directory holding a `checksums.json` that lists files under `path`, `path` relative to
    it) for `path` itself or one of its `levels` parents, the nearest first; None if none does
    (e.g. a VERL rank directory inside an exported or converted checkpoint). With `above`,
    `path`'s own is passed over (an orbax step's, which the step's check verifies). One that
    cannot be read covers `path` (`verify_checksums` names the file and entry)."""
    path = Path(path).resolve()
    for root in [path, *path.parents][int(above): levels + 1]:
        if not root.is_dir() or not os.path.lexists(root / CHECKSUMS_NAME):
            continue  # one that is there but not a file: verify_checksums names it
        rel = path.relative_to(root).as_posix()
        rel = "" if rel == "." else rel
        try:
            listed = read_checksums(root)
        except ChecksumError:
            return root, rel  # unreadable: verify_checksums will say so
        if not rel or any(f.startswith(rel + "/") for f in listed):
            return root, rel
    return None
