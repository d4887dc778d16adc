"""Where files are and how they are written.

Relative config/data paths resolve against the working directory first, then the checkout
(the parent of the `jscenegen` package). Every file and directory jscenegen writes goes
through the atomic writers here: a temporary sibling is written and renamed over the target
(atomic on one filesystem) only when complete, with the permissions of the file it replaces
or, for a new one, those a plain open()/mkdir() would give (the umask's); a failure leaves the
target as it was and removes the temporary. A target that is not a regular file (a symbolic
link, a device such as /dev/null, a named pipe) is refused, never replaced.
A full disk (or quota, or file-size limit) is `DiskFullError`: one line naming the directory
and the bytes needed.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import re
import resource
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator, NoReturn

from jscenegen.run_files import RUN_RECORD, run_file_kind

PROJECT_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_FOLDERS = ("configs", "data")   # under PROJECT_ROOT: files no command output may replace


# the errnos of a write stopped by a storage limit -> what the message calls it
STORAGE_LIMITS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large",
}
# how a library error quotes the errno it failed with: tensorstore/orbax "[os_error_code='28']",
# a Python OSError's text inside another message "[Errno 28]"
_QUOTED_ERRNO = re.compile(r"os_error_code=\\?'?(\d+)|\[Errno (\d+)\]")


class DiskFullError(OSError):
    """A write stopped by a storage limit: no space left (ENOSPC), a disk quota (EDQUOT) or a
    file larger than the process's file-size limit or the file system allows (EFBIG); `errno`
    says which. The message names the directory, the bytes the write needs (when known) and
    the bytes free (or the file-size limit)."""

    def __init__(self, directory: str | Path, needed_bytes: int | None, what: str = "the write",
                 code: int = errno.ENOSPC):
        self.directory, self.needed_bytes, self.what = Path(directory), needed_bytes, what
        needs = f"needs {needed_bytes:,} bytes" if needed_bytes is not None else "needs more space"
        reason = STORAGE_LIMITS.get(code, os.strerror(code))
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if code == errno.EFBIG and limit != resource.RLIM_INFINITY:
            reason, have = "file-size limit (ulimit -f) reached", f"the limit is {limit:,} bytes per file"
            advice = "raise the limit or write elsewhere"
        elif code == errno.EFBIG:
            have = "larger than the file system allows"
            advice = "write to a file system that takes larger files"
        else:
            try:
                have = f"{shutil.disk_usage(_existing(self.directory)).free:,} bytes free"
            except OSError:
                have = "free space unknown"
            advice = "free some space or write elsewhere"
        super().__init__(code, f"{reason} in {self.directory}: {what} {needs} ({have}); {advice}")

    def __str__(self) -> str:
        return self.strerror


def write_limit_error(code: int, file: Path, file_bytes: int | None, all_bytes: int | None,
                      all_what: str) -> DiskFullError:
    """The DiskFullError for the write of `file` (`file_bytes`), one of a set of files
    (`all_bytes` together, `all_what` in the message), stopped by the storage limit `code`
    (STORAGE_LIMITS): a file-size limit (EFBIG) is per file, so the file's bytes are named; a
    full disk or quota needs room for the whole set, so its bytes are."""
    if code == errno.EFBIG:
        return DiskFullError(file.parent, file_bytes, f"writing {file.name}", code)
    return DiskFullError(file.parent, all_bytes, all_what, code)


def _existing(path: Path) -> Path:
    """The nearest of `path` and its ancestors that exists (a name too long for the file
    system is one that does not)."""
    while path != path.parent:
        try:
            if path.exists():
                break
        except OSError as err:
            if err.errno != errno.ENAMETOOLONG:
                raise
        path = path.parent
    return path


def _name_max(where: Path) -> int:
    """The longest file name, in bytes, the file system of existing `where` allows."""
    try:
        return os.pathconf(where, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def storage_limit(err: BaseException | None) -> int | None:
    """The STORAGE_LIMITS errno (ENOSPC, EDQUOT, EFBIG) that stopped a write, when `err` or an
    exception it was raised from carries one: an OSError's errno (its text is not read: a path
    may hold any words), or the errno a library error quotes (`quoted_storage_limit`); else
    None."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno is not None:
            if err.errno in STORAGE_LIMITS:
                return err.errno
        elif (code := quoted_storage_limit(str(err))) is not None:
            return code
        err = err.__cause__ or err.__context__
    return None


def quoted_storage_limit(text: str) -> int | None:
    """The STORAGE_LIMITS errno a message quotes as tensorstore/orbax do ("File too large
    [os_error_code='27']") or as an OSError's text does ("[Errno 28] No space left on
    device"); else None."""
    for match in _QUOTED_ERRNO.finditer(text):
        code = int(match.group(1) or match.group(2))
        if code in STORAGE_LIMITS:
            return code
    return None


def resolve_data_path(path: str | Path) -> Path:
    """`path` as given if it exists (or is absolute), else under the project root.

    Raises FileNotFoundError naming both places when neither exists.
    """
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    q = PROJECT_ROOT / p
    if q.exists():
        return q
    places = (f"in {Path.cwd()}" if Path.cwd().resolve() == PROJECT_ROOT.resolve()
              else f"in {Path.cwd()} nor in {PROJECT_ROOT}")
    raise FileNotFoundError(f"{path}: not found {places}")


def data_path_arg(value: str) -> str:
    """argparse `type` of options naming a file that ships with the checkout (`--config
    configs/grpo100.yaml`): `resolve_data_path(value)` where one of its places exists, else
    `value` as given (its reader then says it is missing)."""
    try:
        return str(resolve_data_path(value)) if value.strip() else value
    except FileNotFoundError:
        return value


def refuse_overwriting_input(output: str | Path, output_label: str,
                             inputs: dict[str, str | Path | None]) -> None:
    """Raise ValueError, before anything is written, when writing `output` would change one of
    `inputs` ({label: path}; None entries are skipped): it is the same file (os.path.samefile:
    links and `..` included), or it lies inside an input that is a directory or does not exist
    yet (a model or checkpoint directory: a report written into it would replace or add files
    its loaders and checksums read; the warm-start model cache before its first model; both
    resolved through their nearest existing ancestor's links), or it lies inside a folder the
    checkout ships, configs/ or data/ (`refuse_inside_shipped`: any config's scene sets and
    defaults, whichever config this command read)."""
    out = Path(output)
    for label, path in inputs.items():
        if path is None:
            continue
        src = Path(path)
        if not src.is_dir():
            try:
                same = os.path.samefile(out, src)
            except OSError:  # one of them does not exist (yet): the same path or not
                same = out.resolve() == src.resolve()
            if same:
                raise ValueError(f"{output_label} {output} is the same file as {label} {path}: "
                                 f"writing it would overwrite {label}; write elsewhere")
        if ((src.is_dir() or not os.path.lexists(src))
                and out.resolve().is_relative_to(src.resolve())):
            raise ValueError(f"{output_label} {output} lies inside {label} {path}: writing it "
                             f"would change that input; write elsewhere")
    refuse_inside_shipped(out, f"{output_label} {output}")


def refuse_inside_shipped(path: str | Path, name: str) -> None:
    """Raise ValueError naming `name` when `path` (a file or directory to write, existing or
    not; resolved through its nearest existing ancestor's links) lies inside a folder the
    checkout ships under PROJECT_ROOT (`SHIPPED_FOLDERS`: configs/, data/): what is written
    there would change the files every run reads."""
    p = Path(path).resolve()
    root = PROJECT_ROOT.resolve()
    for folder in SHIPPED_FOLDERS:
        if p.is_relative_to(root / folder):
            raise ValueError(f"{name}: lies inside the checkout's {folder}/ "
                             f"({p.relative_to(root)}): writing there would change the files "
                             f"every run reads; write elsewhere")


def check_output_file(path: str | Path, label: str, suffix: str | None = None) -> None:
    """Raise ValueError, before any work, when a file cannot be written at `path`: it is a
    directory or anything else that is not a regular file (`refuse_non_regular`), its nearest
    existing ancestor is not a directory, no file can be created there (tried with an empty
    temporary file, removed at once, so root on a read-only or pseudo filesystem such as /proc
    is caught too), it lies inside a checkpoint or a folder the checkout ships
    (`refuse_inside_shipped`), it is a file a training run owns in its directory
    (`refuse_run_file`: RUN/eval_before.json, ...), or its name does not end in `suffix` (case ignored; for a writer whose
    format does not follow the name: a PNG named `.jpg` would be PNG bytes), or, for a writer
    of text (no `suffix`), it ends in `.png`, the pictures' name here (`scene furnish -o x.png`
    would be JSON in a file named as the render), or the path is not UTF-8, or it or a directory
    still to be created above it is named longer than the file system allows. Missing parents
    are created by the writers."""
    p = Path(path)
    if not str(path).strip():
        raise ValueError(f"{label}: an empty path; give a file path")
    refuse_non_utf8(path, f"{label} {path}")
    if str(path).endswith(os.sep):
        raise ValueError(f"{label} {path}: ends with {os.sep}, the name of a directory; give a file path")
    _refuse_too_long_names(p, f"{label} {path}", ValueError, 0)
    if p.is_dir() and not p.is_symlink():
        raise ValueError(f"{label} {path}: is a directory; give a file path")
    if suffix and not p.name.lower().endswith(suffix):   # Path(".png").suffix is ""
        raise ValueError(f"{label} {path}: the file is written as {suffix[1:].upper()}; give a "
                         f"name ending in {suffix}")
    if not suffix and p.name.lower().endswith(".png"):
        raise ValueError(f"{label} {path}: this file is written as text (JSON), not a picture; "
                         "give another name (a .png name is for the top views of scene render, "
                         "--render and --plot)")
    refuse_non_regular(p, f"{label} {path}")
    refuse_inside_checkpoint(p, f"{label} {path}")
    refuse_run_file(p, label, path)
    refuse_inside_shipped(p, f"{label} {path}")
    parent = _existing(p.absolute().parent)
    if not parent.is_dir():
        raise ValueError(f"{label} {path}: {parent} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".jscenegen-write-check-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ValueError(f"{label} {path}: cannot create a file in {parent} "
                         f"({err.strerror or err})") from None


def refuse_run_file(path: str | Path, label: str, given: str | Path | None = None) -> None:
    """Raise ValueError (naming `label` and the path `given`, default `path`) when writing at
    `path` (a file or a directory; relative to the working directory, resolved through
    links) would replace or write into what a training run owns (`run_file_kind`) in a run
    directory, one that holds the run's record (`RUN_RECORD`, run.json): `jscenegen eval --out
    RUN/eval_before.json` silently replaced the run's own report, and `init-model
    RUN/hf_assets` made the directory a resume reads as the run's config and tokenizer.
    Other paths in a run directory are written as anywhere."""
    p = Path(path).resolve()
    for run in p.parents:
        if (run / RUN_RECORD).is_file() and (what := run_file_kind(p.relative_to(run).parts)):
            how = "replace" if os.path.lexists(p) else "write into"
            raise ValueError(f"{label} {path if given is None else given}: the training run "
                             f"{run} owns {p.relative_to(run)} (its {what}); writing there "
                             f"would {how} the run's own; choose another {label}")


def refuse_inside_checkpoint(path: str | Path, name: str) -> None:
    """Raise ValueError when writing at `path` would change a checkpoint: it lies inside a
    directory that holds `checksums.json` (a trainer step, an export: its verification would
    fail on the new files), or it would be a numbered step of a run's checkpoint directory
    (the trainer would read it as one of its own steps)."""
    p = Path(path).resolve()
    for ancestor in p.parents:
        if (ancestor / "checksums.json").is_file():
            raise ValueError(f"{name}: lies inside the checkpoint {ancestor}; writing there "
                             "would make its checksums fail; write elsewhere")
    if is_step_name(p.name) and p.parent.is_dir() and any(
            (q / "checksums.json").is_file() for q in p.parent.iterdir() if is_step_name(q.name)):
        raise ValueError(f"{name}: would be a step of the run's checkpoint directory "
                         f"{p.parent}; write elsewhere")


_NOT_REGULAR = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISCHR, "a character device"),
                (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe"),
                (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def not_a_file(path: str | Path) -> str | None:
    """Why `path` cannot be read as a regular file ("no such file", "is a directory", "is a
    broken symbolic link", "is a named pipe", a link loop, ...), following links as a reader
    does; None when it is one."""
    p = Path(path)
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        return "is a broken symbolic link" if p.is_symlink() else "no such file"
    except OSError as err:        # a link loop, a path through a file, no permission
        return err.strerror or str(err)
    if stat.S_ISREG(mode):
        return None
    return next(f"is {kind}" for is_kind, kind in _NOT_REGULAR if is_kind(mode))


def refuse_non_regular(path: str | Path, name: str | None = None) -> None:
    """Raise ValueError when `path` exists and is not a regular file (a symbolic link, device,
    named pipe, socket or directory): an atomic write renames a new file over its target, so it
    would replace the link or the device node itself (`-o /dev/null` as root) instead of
    writing through it."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # nothing there (yet) to replace
        return
    for is_kind, kind in _NOT_REGULAR:
        if is_kind(mode):
            raise ValueError(f"{name or path}: is {kind}, not a regular file; jscenegen writes a "
                             f"new file and renames it over the target, so give a file path")


def cache_dir() -> Path:
    """Models the CPU default creates (tiny model, SFT warm start): $JSCENEGEN_CACHE or
    ~/.cache/jscenegen. An empty JSCENEGEN_CACHE counts as unset (as XDG's variables do), never
    the current directory."""
    return Path(os.environ.get("JSCENEGEN_CACHE") or Path.home() / ".cache" / "jscenegen")


def hidden_name(name: str, tag: str) -> str:
    """`.NAME.TAG`, the name of a temporary written beside `name`, with NAME cut to its first
    100 bytes: a name near the file system's limit (255 bytes) leaves no room for more."""
    return f".{os.fsdecode(os.fsencode(name)[:100])}.{tag}"


@contextlib.contextmanager
def atomic_file(path: str | Path, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temporary path beside `path` to write; on success it gets the permissions of the
    file it replaces (the umask's for a new file) and is renamed to `path` (atomic on one
    filesystem), on error it is deleted and `path` is left as it was. The parent directory is
    created if needed. Raises ValueError, before anything is written, when `path` exists and is
    not a regular file (`refuse_non_regular`)."""
    path = Path(path)
    refuse_non_regular(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=hidden_name(path.name, ""), suffix=suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        if path.is_file():
            os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
        else:
            umask_mode(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)   # the rename itself survives a power cut
    except OSError as err:
        raise_naming(err, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def fsync_tree(root: str | Path) -> None:
    """`fsync_path` every regular file under `root` (links not followed), then each directory
    (its entries): a directory published by a rename after a power cut then holds the bytes
    written, not files of the right size filled with zeros."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            file = os.path.join(dirpath, name)
            if os.path.isfile(file) and not os.path.islink(file):
                fsync_path(file)
        fsync_path(dirpath)


def fsync_path(path: str | Path) -> None:
    """Flush a file's data, or a directory's entries (a rename or an unlink in it), to the
    device: a power cut keeps what was written before, not a renamed-but-empty file. Where the
    filesystem cannot sync a directory (EINVAL), nothing."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if Path(path).is_dir() else 0))
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)


def raise_naming(err: OSError, path: str | Path) -> NoReturn:
    """Raise `err`, as an OSError of its errno naming `path` when it names no file (a write()
    on an open file fails with "[Errno 27] File too large" or "No space left on device" and
    no name). A DiskFullError, which names its directory, is raised as it is."""
    if err.filename is None and err.errno is not None and not isinstance(err, DiskFullError):
        raise OSError(err.errno, err.strerror or os.strerror(err.errno), str(path)) from None
    raise err


@contextlib.contextmanager
def naming_write_errors(path: str | Path) -> Iterator[None]:
    """Within it, an OSError that names no file is raised naming `path` (`raise_naming`)."""
    try:
        yield
    except OSError as err:
        raise_naming(err, path)


def umask_mode(path: str | Path) -> None:
    """Give `path` the permissions a plain open()/mkdir() would (0o666 or 0o777 minus the umask):
    temporary files and directories are created private, so atomic writes call this before the
    rename that publishes them."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~mask)


def write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` atomically (temporary file, fsync, rename).

    Raises DiskFullError (naming the directory and the bytes needed) when a storage limit
    (STORAGE_LIMITS) stops the write; `path` is then left as it was and the temporary removed.
    """
    try:
        with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:   # atomic_file syncs it
            f.write(text)
    except OSError as err:
        if err.errno not in STORAGE_LIMITS or isinstance(err, DiskFullError):
            raise
        raise DiskFullError(Path(path).parent, len(text.encode()), f"writing {Path(path).name}",
                            err.errno) from None


def is_decimal(text: str) -> bool:
    """Whether `text` is a non-empty run of ASCII digits 0-9 (`str.isdigit` also accepts '³'
    and other Unicode digits, which int() refuses)."""
    return text.isascii() and text.isdigit()


def is_step_name(name: str) -> bool:
    """Whether `name` is a checkpoint step directory's name as the store writes it,
    `RUN_DIR/checkpoints/<step>/` (orbax's rule too): decimal digits without leading zeros
    (`09` would read as step 9, whose directory is `9`)."""
    return is_decimal(name) and (name == "0" or not name.startswith("0"))


def finite_number(x: Any) -> bool:
    """Whether `x` is a finite number as JSON reads one: an int or float, not a bool (JSON
    `true`), not NaN or infinite, and not an integer too large for a float."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def json_sha256(value: Any) -> str:
    """Hex SHA-256 of `value` as canonical JSON (sorted keys, no whitespace): a digest two
    processes or two runs compute alike for equal values."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def strict_json(obj: Any, **kwargs) -> str:
    """`obj` as strict JSON text: a float that is not finite (a skipped step's NaN grad_norm)
    becomes null, as JSON has no NaN and strict parsers (`jq`) refuse Python's `NaN`; in dicts,
    lists and tuples at any depth. `kwargs` go to json.dumps (allow_nan is always False)."""
    def finite(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: finite(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [finite(v) for v in value]
        return value
    return json.dumps(finite(obj), allow_nan=False, **kwargs)


def json_line(obj: Any, **kwargs) -> str:
    """`obj` as one line of strict JSON (a JSON Lines row, a command's stdout line):
    `strict_json`, non-finite floats as null. `kwargs` go to json.dumps."""
    return strict_json(obj, **kwargs)


def loads_json(data: str | bytes, *, allow_nan: bool = True) -> Any:
    """`json.loads(data)` refusing a key repeated within one object (`unique_keys`), and with
    `allow_nan=False` the non-JSON constants NaN, Infinity and -Infinity that Python's parser
    (and writer: metrics rows may hold them) accepts, and the numbers that are infinite as a
    float (`1e400`, a 400-digit integer: beyond 1.8e308). Every way JSON text can be bad is a
    ValueError whose text says what in words: empty (or only whitespace), the parser's syntax
    message, bytes that are not UTF-8, a repeated key, such a constant or number, "nested too deeply" (past
    the interpreter's recursion limit) or "an integer of more than N digits" (Python's
    int_max_str_digits, whose own message advises a call only a programmer can make)."""
    finite = {} if allow_nan else {"parse_constant": _refuse_constant, "parse_float": _finite_float,
                                   "parse_int": _float_sized_int}
    if not data.strip():
        raise ValueError("empty: no JSON value" if not data else "only whitespace: no JSON value")
    try:
        return json.loads(data, object_pairs_hook=unique_keys, **finite)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except ValueError as err:
        if "int_max_str_digits" in str(err):
            raise ValueError(f"an integer of more than {sys.get_int_max_str_digits():,} digits") from None
        raise


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON (a number must be written in digits)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:20]}{'...' if len(text) > 20 else ''} is too large "
                         "for a float (beyond 1.8e308)")
    return value


def _float_sized_int(text: str) -> int:
    value = int(text)   # more than int_max_str_digits: the ValueError loads_json words
    try:
        float(value)
    except OverflowError:
        raise ValueError(f"the integer {text[:20]}... ({len(text.lstrip('-'))} digits) is too "
                         "large for a float (beyond 1.8e308)") from None
    return value


MAX_JSON_OBJECT_BYTES = 64 * 2**20   # checksums.json lists ~150 bytes a file: ~400,000 files


def read_json_object(path: str | Path, error: type[Exception] = ValueError,
                     max_bytes: int = MAX_JSON_OBJECT_BYTES) -> dict:
    """The JSON object the file at `path` holds, parsed by `loads_json` (a repeated key is
    refused). Raises `error` naming `path` when it is not a regular file (`not_a_file`: a named
    pipe would block the read), holds more than `max_bytes` (read no further: a config,
    manifest or metadata file of several GB would be parsed whole into memory), is not valid
    JSON, or is valid JSON that is not an object; OSError (which names the file) when it cannot
    be read."""
    if why := not_a_file(path):
        raise error(f"{path}: {why}")
    with open(path, "rb") as f:
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise error(_too_large(path, max_bytes))
    try:
        doc = loads_json(raw)
    except ValueError as err:
        raise error(f"{path}: not valid JSON: {err}") from None
    if not isinstance(doc, dict):
        raise error(f"{path}: expected a JSON object, got {type(doc).__name__}")
    return doc


def refuse_oversized_json(path: str | Path, error: type[Exception] = ValueError,
                          max_bytes: int = MAX_JSON_OBJECT_BYTES) -> None:
    """The bound `read_json_object` reads by, for a JSON file another library parses whole
    (orbax's `train_state/metadata` and `_METADATA`: `json.loads(path.read_text())`): raise
    `error` naming `path` when it is there but is not a regular file (`not_a_file`: a named
    pipe would block the read) or is larger than `max_bytes` on disk. A missing file passes
    (the library names it)."""
    if not os.path.lexists(path):
        return
    if why := not_a_file(path):
        raise error(f"{path}: {why}")
    if os.stat(path).st_size > max_bytes:
        raise error(_too_large(path, max_bytes))


def _too_large(path: str | Path, max_bytes: int) -> str:
    return (f"{path}: more than {max_bytes:,} bytes, more than such a JSON file holds "
            "(jscenegen.paths.MAX_JSON_OBJECT_BYTES)")


def unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """`json.loads` object_pairs_hook refusing a key repeated within one object (JSON readers
    differ on which value wins; Python's keeps the last silently). Raises ValueError naming it."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"the key {key[:200]!r} appears twice in one object")
        seen.add(key)
    return dict(pairs)


def json_document(obj: Any) -> str:
    """`obj` as the indented, key-sorted, strict JSON text of a file (with its final newline):
    a float that is not finite (a skipped SFT step's NaN grad_norm in `sft_summary.json`)
    becomes null (`strict_json`), as in `json_line`."""
    return strict_json(obj, indent=2, sort_keys=True) + "\n"


def write_json(path: str | Path, obj: Any) -> None:
    """Write `obj` as indented, key-sorted strict JSON (`json_document`: non-finite floats as
    null) to `path` atomically."""
    write_text(path, json_document(obj))


def _partial_prefix(name: str) -> str:
    """The name start of `atomic_dir`'s temporary for destination `name`; mkdtemp adds 8
    random characters."""
    return f".{name}.partial-"


TEMPORARY_NAME_EXTRA = len(_partial_prefix("")) + 8   # bytes a temporary's name adds to NAME


def refuse_non_utf8(path: str | Path, name: str, error: type[Exception] = ValueError) -> None:
    """Raise `error` naming `name` when `path` is not UTF-8 text (argv bytes that are not
    UTF-8 arrive surrogate-escaped): the outputs' names are echoed and recorded as text."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError as err:
        raise error(f"{name}: the path is not UTF-8 "
                    f"text (byte {err.object[err.start].encode('utf-8', 'surrogateescape')!r} "
                    f"at {err.start}); give a UTF-8 name") from None


def _refuse_too_long_names(p: Path, name: str, error: type[Exception], room: int) -> Path:
    """Raise `error` naming `name` when a directory of path `p` still to be created is named
    longer than the file system of its nearest existing ancestor allows, or `p`'s own name is
    (after `room` bytes for a temporary named after it); return that ancestor."""
    where = _existing(p.absolute())
    name_max = _name_max(where)
    for part in p.absolute().relative_to(where).parts[:-1]:
        if len(os.fsencode(part)) > name_max:
            raise error(f"{name}: the directory name {part[:40]}... is {len(os.fsencode(part))} "
                        f"bytes, more than the file system allows ({name_max})")
    length = len(os.fsencode(p.name))
    if length + room > name_max:
        extra = f"; the temporary written beside it adds {room}" if room else ""
        raise error(f"{name}: the name is {length} bytes, at most {name_max - room} here (the "
                    f"file system allows {name_max}{extra})")
    return where


def check_output_dir(path: str | Path, error: type[Exception] = ValueError, label: str = "") -> None:
    """Refuse, before any work, a directory `path` that cannot be written: an existing file, or
    (the directory itself when it exists, else its nearest existing ancestor) a place that is
    not a directory or not writable (tried with an empty temporary directory, removed at once,
    so root on a read-only or pseudo filesystem such as /proc is caught too), a name too
    long to leave room for `atomic_dir`'s temporary beside it (or a directory still to be
    created above it named longer than the file system allows), a path that is not UTF-8, one
    inside a checkpoint or a folder the checkout ships (`refuse_inside_shipped`), or one a
    training run owns in its directory (`refuse_run_file`: RUN/hf_assets, RUN/checkpoints,
    RUN/swanlab, or a run file's name). A
    dangling symbolic link is refused too (creating the directory would fail on it).
    Raises `error` naming `path` (after `label`, e.g. the option that gave it)."""
    p = Path(path)
    name = f"{label} {path}" if label else str(path)
    refuse_non_utf8(path, name, error)
    where = _refuse_too_long_names(p, name, error, TEMPORARY_NAME_EXTRA)
    if p.exists() and not p.is_dir():
        raise error(f"{name}: exists and is not a directory")
    if p.is_symlink() and not p.exists():
        raise error(f"{name}: a symbolic link to {os.readlink(p)}, which does not exist; "
                    "create its target or give another path")
    try:
        refuse_inside_checkpoint(p, name)
        refuse_run_file(p, label or "destination", path)
        refuse_inside_shipped(p, name)
    except ValueError as err:
        raise error(str(err)) from None
    if not where.is_dir():
        raise error(f"{name}: cannot create it, {where} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".jscenegen-write-check-", dir=where))
    except OSError as err:
        raise error(f"{name}: cannot create a directory in {where} ({err.strerror or err})") from None


def require_new_dir(path: str | Path, exists_error: type[Exception] = FileExistsError) -> None:
    """Refuse, before any work, a destination directory `path` that must not replace anything
    or cannot be created: a non-empty directory, or what `check_output_dir` refuses. Raises
    `exists_error` naming `path`."""
    p = Path(path)
    if not str(path).strip():
        raise exists_error("an empty destination path; give a directory to create")
    if p.is_symlink():
        raise exists_error(f"{path}: is a symbolic link; give the directory's own path")
    if p.is_dir() and any(p.iterdir()):
        raise exists_error(f"{path}: already exists and is not empty; choose a new destination")
    check_output_dir(p, exists_error)


def _warn_of_leftovers(path: Path) -> None:
    """Warn of the temporaries a killed writer of `path` left beside it (SIGKILL or a power
    cut skip the cleanup); they are not removed: one may belong to a writer still running."""
    with contextlib.suppress(OSError):
        left = sorted(p.name for p in path.parent.iterdir()
                      if p.name.startswith((_partial_prefix(path.name), f".{path.name}.old-")))
        if left:
            logging.getLogger(__name__).warning(
                "%s holds %s, left by an earlier write of %s that was killed (or one still "
                "running): remove %s once no command writes there", path.parent,
                ", ".join(left[:3]) + (f" (+{len(left) - 3} more)" if len(left) > 3 else ""),
                path.name, "it" if len(left) == 1 else "them")


def _publish_new(tmp: Path, path: Path, exists_error: type[Exception]) -> None:
    """Rename the filled `tmp` to `path`, which must still be absent or an empty directory.
    The rename is atomic and fails on a non-empty directory, so nothing that appeared at
    `path` while the output was written (another command's output, a user's files) is ever
    replaced; `exists_error` names `path` then."""
    late = (" (it was empty when this command started: something else wrote there meanwhile; "
            "this command's output was not kept)")
    try:
        require_new_dir(path, exists_error)
    except exists_error as err:
        raise exists_error(f"{err}{late}") from None
    try:
        if path.is_dir():
            path.rmdir()
        os.replace(tmp, path)
    except OSError as err:
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise exists_error(f"{path}: already exists and is not empty{late}") from None
        raise


@contextlib.contextmanager
def atomic_dir(path: str | Path, *, replace: bool = False,
               exists_error: type[Exception] = FileExistsError) -> Iterator[Path]:
    """Yield a temporary directory beside `path` to fill; on success it replaces `path`.

    replace=False refuses (raising `exists_error`) when `path` exists and is not an empty
    directory: before anything is written, and again when publishing, so a destination that
    something else filled meanwhile (another conversion, a user) is never replaced: the
    rename onto it is atomic and fails on a non-empty directory, and the output is dropped.
    replace=True swaps an existing `path` out and deletes it only after the new one is in
    place. On error the temporary is removed and `path` is untouched.
    """
    path = Path(path)
    if not replace:
        require_new_dir(path, exists_error)
    with new_parents_removed_on_error(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        _warn_of_leftovers(path)
        with _filled_and_published(path, replace, exists_error) as tmp:
            yield tmp


@contextlib.contextmanager
def _filled_and_published(path: Path, replace: bool, exists_error: type[Exception]) -> Iterator[Path]:
    tmp = Path(tempfile.mkdtemp(prefix=_partial_prefix(path.name), dir=path.parent))
    try:
        yield tmp
        umask_mode(tmp)
        fsync_tree(tmp)   # published only once its bytes are on the device
        if not replace:
            _publish_new(tmp, path, exists_error)
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()
            os.replace(tmp, path)
        elif path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.replace(path, old / path.name)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        fsync_path(path.parent)   # the rename itself survives a power cut
    except OSError as err:   # name the destination, not the temporary the user never sees
        if isinstance(err, DiskFullError) and err.directory.is_relative_to(tmp):
            shutil.rmtree(tmp, ignore_errors=True)   # the bytes free it reports: without the partial output
            raise DiskFullError(path / err.directory.relative_to(tmp), err.needed_bytes, err.what,
                                err.errno) from None
        if (isinstance(err.filename, str) and err.filename2 is None
                and Path(err.filename).is_relative_to(tmp)):
            raise OSError(err.errno, err.strerror, str(path / Path(err.filename).relative_to(tmp))) from None
        raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def new_parents_removed_on_error(path: str | Path) -> Iterator[None]:
    """The directories above `path` that do not exist yet are removed again (deepest first,
    while still empty) when the block raises (an error, a stop signal): a command that wrote
    nothing leaves no directory it created."""
    created = [a for a in reversed(Path(path).absolute().parents) if not a.exists()]
    try:
        yield
    except BaseException:
        for d in reversed(created):
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
