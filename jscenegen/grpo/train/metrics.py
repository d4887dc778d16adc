"""Per-update metrics: one JSON line per attempt in `RUN_DIR/metrics.jsonl`, and swanlab.

swanlab runs `offline` by default (files under `RUN_DIR/swanlab`, no network; open them with
`swanlab watch RUN_DIR/swanlab`, which needs `pip install "swanlab[dashboard]"`), `local`,
`online` (cloud, only when configured; the API key comes from swanlab's own login/environment)
or `disabled`. Only process 0 logs. No credential reaches swanlab's files (see MetricsLogger).
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Literal

from pydantic import Field

from jscenegen.checkpoint.metadata import (
    environment_secrets,
    mask_credentials,
    mask_text,
    redact,
    redact_argv,
)
from jscenegen.config import Section
from jscenegen.paths import (
    atomic_file,
    finite_number,
    hidden_name,
    json_line,
    loads_json,
    not_a_file,
)
from jscenegen.run_files import METRICS_LOG, RUN_LOGS, RUN_SWANLAB

log = logging.getLogger(__name__)


class LoggingConfig(Section):
    """Where per-update metrics go besides RUN_DIR/metrics.jsonl: swanlab's mode and names."""

    swanlab_mode: Literal["offline", "local", "online", "disabled"] = Field(
        "offline", description="swanlab.init's mode (process 0 only): offline: files under "
        "RUN_DIR/swanlab, no network (view with swanlab watch); local: swanlab's local mode, "
        "also under RUN_DIR/swanlab; online: syncs to the SwanLab cloud (swanlab's own login); "
        "disabled: swanlab is not started (metrics.jsonl is written either way)")
    # swanlab's own bounds (swanlab/sdk/internal/pkg/constraints), checked before any model loads
    project: str = Field("jscenegen", min_length=1, max_length=100, pattern=r"^[0-9a-zA-Z_\-+.]+$",
                         description="swanlab project the run is logged under (swanlab.init "
                         "project: 1-100 of A-Z a-z 0-9 _ - + .)")
    experiment: str | None = Field(None, min_length=1, max_length=512, description="run name, at "
                                   "most 512 characters (default: the run directory's name)")


def command_line() -> list[str]:
    """This process's command line as the OS records it (/proc/self/cmdline, what swanlab
    >= 0.10 stores), else `sys.argv`."""
    try:
        raw = Path("/proc/self/cmdline").read_bytes()
    except OSError:
        return list(sys.argv)
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _private_settings(swanlab):
    """swanlab settings that keep the command line out of its files (swanlab >= 0.10's runtime
    probe records it); None where this swanlab has no such setting."""
    try:
        return swanlab.Settings(probe={"runtime": False})
    except Exception:  # other swanlab versions: their Settings differ
        return None


def _swanlab_console():
    """swanlab's rich Console, through which it prints its banner and hints (swanlab >= 0.10:
    `swanlab.sdk.internal.pkg.console.c`); None for other versions."""
    try:
        from swanlab.sdk.internal.pkg import console
    except ImportError:
        return None
    rich_console = getattr(console, "c", None)
    if not all(hasattr(rich_console, name) for name in ("quiet", "soft_wrap")):
        return None
    return rich_console


@contextlib.contextmanager
def _to_stderr(quiet: bool = False):
    """swanlab's console output while it runs: on stderr (it prints its banner and hints to
    stdout; a run's stdout is its JSON lines only), each message on one line (rich's soft
    wrap: otherwise rich breaks every line at the console's width, 80 columns in a log file or
    a pipe, a terminal's width where one is open, in the middle of a path), and with `quiet`
    none at all (while it finishes: its start banner already said where the run is, and it
    would print the same `swanlab sync`/`watch` hint a second time)."""
    rich_console = _swanlab_console()
    saved = None if rich_console is None else (rich_console.quiet, rich_console.soft_wrap)
    if rich_console is not None:
        rich_console.soft_wrap = True
        rich_console.quiet = quiet or rich_console.quiet
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if rich_console is not None:
            rich_console.quiet, rich_console.soft_wrap = saved


def check_swanlab_mode(cfg: LoggingConfig) -> None:
    """Raise ValueError naming `logging.swanlab_mode` when swanlab could not start in it, as far
    as that is known without the network: `local` without the package it needs (swanboard,
    `swanlab[dashboard]`; swanlab itself only logs an error and goes on), and `online` with no
    API key where swanlab's login looks (SWANLAB_API_KEY, its `.netrc` files) and no terminal
    on stdin to ask for one. `jscenegen train` calls it before any model loads
    (`pipeline.check_run_inputs`), and `MetricsLogger` before it starts swanlab; a key the cloud
    refuses, or a cloud out of reach, is found only by that start."""
    if cfg.swanlab_mode == "local" and importlib.util.find_spec("swanboard") is None:
        raise ValueError("logging.swanlab_mode=local needs swanlab's dashboard (pip install "
                         "'swanlab[dashboard]'); offline writes the same RUN_DIR/swanlab files "
                         "without it")
    if cfg.swanlab_mode == "online" and not _stdin_is_terminal() and not _swanlab_has_api_key():
        raise ValueError("logging.swanlab_mode=online: swanlab has no API key (log in first with "
                         "`swanlab login`, or set the SWANLAB_API_KEY environment variable) and "
                         "no terminal to ask for one; or use offline")


def _stdin_is_terminal() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except ValueError:  # closed
        return False


def _swanlab_has_api_key() -> bool:
    """Whether swanlab's own settings resolve a non-empty API key (environment, then its
    `.netrc` files); True when this swanlab keeps its settings elsewhere or cannot read them
    (a bad SWANLAB_* variable): its start then decides, and its error names the setting."""
    try:
        from swanlab.sdk.internal.settings import create_settings

        key = create_settings().api_key
    except Exception:
        return True
    return bool(key and str(key).strip())


class MetricsLogger:
    """Append metrics rows to JSONL (flushed per row) and forward numbers to swanlab.

    Credentials never reach swanlab's files: the config it gets is redacted, it sees a redacted
    `sys.argv` and no command line where it would record the OS's copy, and when the run
    finishes any credential of the command line left in `RUN_DIR/swanlab` is masked.
    """

    def __init__(self, run_dir: str | Path, cfg: LoggingConfig, config_dict: dict, *,
                 primary: bool = True):
        self.path = Path(run_dir) / METRICS_LOG
        self.swanlab_dir = Path(run_dir) / RUN_SWANLAB
        self.primary = primary
        self._swanlab = None
        self._credentials: list[str] = []
        self.made_swanlab_dir = False
        if not primary:
            return
        check_swanlab_mode(cfg)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if cfg.swanlab_mode != "disabled":
            import swanlab

            argv, removed = redact_argv(sys.argv)
            in_command_line = {*removed, *redact_argv(command_line())[1]}
            # and what the run's stderr may carry (swanlab records it)
            self._credentials = sorted({*in_command_line, *environment_secrets()}, key=len,
                                       reverse=True)
            saved_argv, sys.argv = sys.argv, argv  # swanlab < 0.10 records sys.argv
            self.made_swanlab_dir = not os.path.lexists(self.swanlab_dir)
            # swanlab installs a SIGINT handler of its own (it prints to stdout and marks the
            # run aborted): the program's handlers stay in charge (cli, trainer)
            sigint = (signal.getsignal(signal.SIGINT)
                      if threading.current_thread() is threading.main_thread() else None)
            try:
                with _to_stderr():
                    self._swanlab = swanlab.init(
                        project=cfg.project, name=cfg.experiment or Path(run_dir).name,
                        mode=cfg.swanlab_mode, log_dir=str(self.swanlab_dir),
                        config=redact(config_dict), reinit=True,
                        settings=_private_settings(swanlab) if in_command_line else None,
                    )
            except BaseException as err:   # online: no login and no terminal, a key refused, no
                if self.made_swanlab_dir:  # network; or a stop signal: the directory as it was
                    shutil.rmtree(self.swanlab_dir, ignore_errors=True)
                if os.environ.get("JSCENEGEN_DEBUG") or not isinstance(err, Exception):
                    raise
                advice = ("log in first (`swanlab login`, or the SWANLAB_API_KEY environment "
                          "variable) with the SwanLab cloud reachable, or use offline"
                          if cfg.swanlab_mode == "online" else "JSCENEGEN_DEBUG=1 shows where")
                raise ValueError(f"logging.swanlab_mode={cfg.swanlab_mode}: swanlab could not "
                                 f"start ({type(err).__name__}: "
                                 f"{mask_text(str(err), self._credentials)}); {advice}") from None
            finally:
                sys.argv = saved_argv
                if sigint is not None:
                    signal.signal(signal.SIGINT, sigint)

    def log(self, row: dict, step: int) -> None:
        if not self.primary:
            return
        with open(self.path, "a") as f:
            f.write(json_line(row, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self._swanlab is not None:
            numbers = {k: v for k, v in row.items() if finite_number(v)}
            with _to_stderr():
                self._swanlab.log(numbers, step=step)

    def close(self, discard: bool = False) -> None:
        """Finish swanlab's run; with `discard` (a start that ended before it wrote the run's
        files) remove the `swanlab/` directory this logger made."""
        if self._swanlab is not None:
            with _to_stderr(quiet=True):
                self._swanlab.finish()
            self._swanlab = None
            mask_credentials(self.swanlab_dir, self._credentials)
        if discard and self.made_swanlab_dir:
            shutil.rmtree(self.swanlab_dir, ignore_errors=True)


def check_run_logs(run_dir: str | Path) -> None:
    """Raise ValueError naming the file when one of the run's JSONL logs (RUN_LOGS) exists but
    cannot be appended to as a file (a directory, a broken link, a pipe) or rewritten by a
    resume's cut-back (a symbolic link: `truncate_run_logs` renames a new file over it):
    checked before the model loads, not at the first row after a rollout."""
    for name in RUN_LOGS:
        path = Path(run_dir) / name
        if not os.path.lexists(path):
            continue
        why = not_a_file(path) or ("is a symbolic link" if path.is_symlink() else None)
        if why:   # a link: a resume's cut-back renames a new file over it
            raise ValueError(f"{path}: {why}; the run appends its rows to this file and a resume "
                             "rewrites it (move it away, or start the run in another --run-dir)")


def truncate_run_logs(run_dir: str | Path, attempts: int) -> None:
    """Drop the rows of attempts >= `attempts` from the run's JSONL logs (RUN_LOGS): those
    written after the checkpoint a run resumes from (or, with 0, by a start that stopped before
    its first checkpoint), so a resumed log equals a straight one. A torn last line (the
    process killed mid-write) is dropped too. Streams each file into its replacement
    (`atomic_file`); raises ValueError naming the file and line for any other unreadable row.
    Warns when metrics.jsonl (one row per attempt) lacks the rows of some attempts between its
    first row and `attempts` (a torn or edited file): the resumed log has a gap there. Removes
    the temporaries of this cut-back that a killed run left (every `.metrics.jsonl.*.tmp` and
    `.trajectories.jsonl.*.tmp`: the caller holds the run's lock, so no other writer owns
    them)."""
    kept: set[int] = set()
    for name in RUN_LOGS:
        path = Path(run_dir) / name
        for left in Path(run_dir).glob(f"{hidden_name(name, '')}*.tmp"):
            if left.is_file() and not left.is_symlink():
                left.unlink()
        if not path.is_file():
            continue
        with open(path, "rb") as src, atomic_file(path) as tmp, open(tmp, "wb") as dst:
            pending = None              # a row that does not parse: fatal unless it is the last
            for number, line in enumerate(src, 1):
                if pending is not None:
                    raise ValueError(f"{path}:{pending}: not a JSON row; fix or remove the line")
                if not line.strip():
                    continue
                try:
                    attempt = loads_json(line)["attempt"]
                    keep = attempt < attempts
                except (ValueError, KeyError, TypeError):
                    pending = number
                    continue
                if keep:
                    dst.write(line if line.endswith(b"\n") else line + b"\n")
                    if name == METRICS_LOG:
                        kept.add(attempt)
    # from the log's first row on: a run resumed from a converted step starts its log there
    missing = [a for a in range(min(kept), attempts) if a not in kept] if kept else []
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (f", ... ({len(missing)} in all)"
                                                     if len(missing) > 10 else "")
        log.warning("%s has no row for attempt(s) %s of the %d before the checkpoint (lost or "
                    "torn): the resumed log has a gap there", Path(run_dir) / METRICS_LOG, shown,
                    attempts)

