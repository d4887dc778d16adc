"""Where the project's own files are: relative config/data paths resolve against the working
directory first, then the checkout (the parent of the `jscenegen` package)."""
from __future__ import annotations

import os
from pathlib import Path

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


def umask_mode(path: str | Path) -> None:
    """Give `path` the permissions a plain open()/mkdir() would (0o666 or 0o777 minus the umask):
    temporary files and directories are created private, so atomic writes call this before the
    rename that publishes them."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~mask)
