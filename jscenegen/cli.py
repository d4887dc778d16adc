"""The `jscenegen` command: a thin argparse layer over library functions.

Each subcommand lives in `jscenegen/commands/<module>.py` and exposes
`register(subparsers)`, which adds its parser and sets `func(args) -> int`.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand modules, imported lazily so `jscenegen scene ...` never imports JAX models.
COMMAND_MODULES = (
    "train",
    "init_model",
    "parity",
    "mesh_report",
    "scene",
    "convert",
    "export",
    "eval",
    "sft",
    "design",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jscenegen",
        description="GRPO post-training of a Qwen-style scene-design agent in JAX.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"jscenegen.commands.{name}")
        except ModuleNotFoundError as err:
            if err.name == f"jscenegen.commands.{name}":
                continue  # not built yet
            raise
        module.register(sub)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input rather than a bug: reported as one line, exit 2."""
    errors: list[type[BaseException]] = [ValueError, FileNotFoundError, NotADirectoryError,
                                         IsADirectoryError, PermissionError]
    for module, name in (("jscenegen.checkpoint.store", "CheckpointError"),
                         ("convert.errors", "ConvertError")):
        try:
            errors.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def force_cpu_devices() -> None:
    """Give JAX's CPU backend $JSCENEGEN_CPU_DEVICES (default 6) devices, so the 3 x 2 mesh is
    real on a CPU-only machine; GPU/TPU backends are unaffected. Runs before JAX is imported."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        n = int(os.environ.get("JSCENEGEN_CPU_DEVICES", "6"))
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def main(argv: list[str] | None = None) -> int:
    force_cpu_devices()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except _user_errors() as err:
        # bad input (config, paths, model files, meshes): one line, no traceback;
        # JSCENEGEN_DEBUG=1 shows the traceback
        if os.environ.get("JSCENEGEN_DEBUG"):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
