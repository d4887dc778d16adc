"""`checkpoint-layout.json`: where every written file came from, and with which versions.

{"format": ..., "source": str, "source_format": ..., "torch_version": ..., "created_utc": ...,
 "files": [{"written": relpath, "source": [source relpaths]}], ...extra fields}. The torch
version matters for VERL outputs: DTensor/DeviceMesh pickles of torch 2.13 may not load in a
much older torch, so write with the torch the receiving run uses.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
from pathlib import Path
from typing import Any

from jscenegen.paths import write_text

NAME = "checkpoint-layout.json"


def write_layout(root: str | Path, *, fmt: str, source: str | Path, source_format: str,
                 files: list[tuple[str, list[str]]], **extra: Any) -> dict[str, Any]:
    """Write `root/checkpoint-layout.json`; `files` is [(written relpath, [source relpaths])].
    `torch_version` is the installed torch's (read from its package metadata: an HF or orbax
    conversion does not import it), null when none is installed."""
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    doc = {
        "format": fmt,
        "source": str(source),
        "source_format": source_format,
        "torch_version": torch_version,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "files": [{"written": w, "source": s} for w, s in files],
        **extra,
    }
    write_text(Path(root) / NAME, json.dumps(doc, indent=1) + "\n")
    return doc
