"""The subcommands of `jscenegen`, one module each, and the argument types they share."""
from __future__ import annotations

import argparse


def _int_arg(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def seed_arg(text: str) -> int:
    """argparse type of a `--seed`: an integer in [0, config.SEED_MAX] (argparse names the flag).
    pydantic is imported when a seed is parsed, not when the parsers are built (`--help`)."""
    from jscenegen.config import SEED_MAX

    seed = _int_arg(text)
    if not 0 <= seed <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"{seed} is outside [0, {SEED_MAX}]")
    return seed


def positive_int_arg(text: str) -> int:
    """argparse type of a count that must be >= 1 (argparse names the flag)."""
    n = _int_arg(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} must be >= 1")
    return n


def world_size_arg(text: str) -> int:
    """argparse type of a `--world-size` (VERL ranks to write): the bound of
    `convert.verl_write.check_world_size`, checked before any file is read."""
    from convert.errors import ConvertError
    from convert.verl_write import check_world_size

    n = _int_arg(text)
    try:
        check_world_size(n)
    except ConvertError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return n
