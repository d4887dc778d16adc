"""Where files are and how they are written: relative config/data paths resolve against the
working directory first, then the checkout (the parent of the `jscenegen` package); single files
are written atomically (`atomic_file`: temporary file beside the target, then rename)."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

PROJECT_ROOT = Path(__file__).resolve().parent.parent


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
    raise FileNotFoundError(f"{path}: not found in {Path.cwd()} nor in {PROJECT_ROOT}")


def cache_dir() -> Path:
    """Models the CPU default creates (tiny model, SFT warm start): $JSCENEGEN_CACHE or ~/.cache/jscenegen."""
    return Path(os.environ.get("JSCENEGEN_CACHE", Path.home() / ".cache" / "jscenegen"))


@contextlib.contextmanager
def atomic_file(path: str | Path, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temporary path beside `path` to write; on success it gets the umask's
    permissions and is renamed to `path` (atomic on one filesystem), on error it is deleted and
    `path` is left as it was. The parent directory is created if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        umask_mode(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def umask_mode(path: str | Path) -> None:
    """Give `path` the permissions a plain open()/mkdir() would (0o666 or 0o777 minus the umask):
    temporary files and directories are created private, so atomic writes call this before the
    rename that publishes them."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~mask)
