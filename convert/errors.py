"""The exception and warning types of convert/: every refusal names the file (and key) at fault."""
from pathlib import Path


class ConvertError(ValueError):
    """A checkpoint that cannot be read or written as asked; the message names the file and key."""


class ConversionWarning(UserWarning):
    """A conversion that had to leave something out, or could not check something (named in
    the message); `jscenegen convert` prints each as one `warning:` line."""


def require_source_dir(path) -> None:
    """Raise ConvertError naming `path` when it is no directory: "no such directory", or "not
    a directory" (a checkpoint source is one)."""
    if not Path(path).is_dir():
        raise ConvertError(f"{path}: not a directory" if Path(path).exists() else f"{path}: no such directory")


TORCH_INSTALL = "pip install -e '.[torch]' (torch==2.13.0)"


def require_torch(what: str) -> None:
    """Raise ConvertError when torch cannot be imported: `what` (a VERL direction, export) reads
    or writes VERL's rank files, which are torch pickles. HF and orbax directions need none."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise ConvertError(f"{what} reads or writes VERL's rank files (torch pickles) and needs "
                           f"torch, which is not installed: {TORCH_INSTALL}") from None
