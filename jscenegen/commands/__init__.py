"""The subcommands of `jscenegen`, one module each, and the argument types they share."""
from __future__ import annotations

import argparse
import math


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


def int_in(lo: int, hi: int | None = None):
    """argparse type of an integer in [lo, hi] (hi None: no upper bound; argparse names the
    flag): sizes a command allocates from are bounded before anything is built."""
    def parse(text: str) -> int:
        n = _int_arg(text)
        if n < lo or (hi is not None and n > hi):
            raise argparse.ArgumentTypeError(f"{n} must be >= {lo}" if hi is None
                                             else f"{n} is outside [{lo}, {hi:,}]")
        return n
    parse.__name__ = "integer"
    return parse


positive_int_arg = int_in(1)


def finite_float_arg(text: str) -> float:
    """argparse type of a finite number (nan and inf are refused; argparse names the flag)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number") from None
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a finite number")
    return x


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
