"""The `jscenegen` command: a thin argparse layer over library functions.

Each subcommand lives in `jscenegen/commands/<module>.py` and exposes `register(subparsers)`,
which adds its parser and sets `func(args) -> int`; commands import their library code inside
`func`, so building the parser (and `--help`) imports no JAX. Bad input anywhere (a config key,
a path, a model file, a mesh that does not fit, a full disk) raises an exception; `main` is the
one place that turns it into one line `error: ...` and exit code 2 (`JSCENEGEN_DEBUG=1` shows
the traceback instead); a usage error (an unknown option, a value argparse refuses) is one line
and exit 2 too. SIGTERM is handled like Ctrl-C (`jscenegen.signals`): the command unwinds, so a
run's lock is released and a half-written output is removed, then it exits with 143 (130 for
Ctrl-C) and one line. Output piped into a reader that stops early (`| head`) ends the command
quietly with 141, as SIGPIPE ends a Unix tool. Warnings (Python logging, ours and the
libraries') print as `warning: ...` lines on stderr, like the error line.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import errno
import importlib
import logging
import os
import select
import signal
import sys
import threading
import traceback
import warnings

from jscenegen import __version__
from jscenegen.host_devices import force_cpu_devices
from jscenegen.paths import STORAGE_LIMITS, DiskFullError
from jscenegen.signals import Terminated, UnwindOnSignals, ignore_repeats_at_exit, stop_acted_on

MAX_ERROR_CHARS = 2000
COMMAND_MODULES = ("train", "init_model", "parity", "mesh_report", "scene", "convert", "export",
                   "eval", "sft", "design")



class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one `error: ...` line (exit 2), like every
    other refusal, instead of the usage block; `--help` still shows the usage."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {_echoed_words_redacted(message)} "
                     f"(see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        """As argparse's, recording in `usage_parser` the innermost parser that read the
        arguments (`scene check` inside `scene`): a later usage error names what was typed."""
        namespace, extras = super().parse_known_args(args, namespace)
        if getattr(namespace, "usage_parser", None) is None:
            namespace.usage_parser = self
        return namespace, extras


def _echoed_words_redacted(message: str) -> str:
    """`message` (argparse's, echoing arguments, some quoted: `invalid choice: 'x'`) with each
    word that is or holds a credential (`checkpoint.metadata.redact_argv`) redacted."""
    from jscenegen.checkpoint.metadata import redact_argv

    words = []
    for word in message.split(" "):
        bare = word.strip("'\",")
        if bare:
            word = word.replace(bare, redact_argv([bare])[0][0])
        words.append(word)
    return " ".join(words)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="jscenegen",
        description="GRPO post-training of a Qwen-style scene-design agent in JAX.",
    )
    parser.add_argument("--version", action="version", version=f"jscenegen {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"jscenegen.commands.{name}").register(sub)
    parser.commands = sub.choices  # name -> its parser, for parse_args
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse `argv` with its command's own parser; a command that takes `key=value` overrides
    (its parser's default `intermixed` is True) is parsed with `parse_intermixed_args`, so
    overrides may come before, between and after its options (`eval --model M a.b=1 --out X
    c.d=2`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = getattr(parser, "commands", {})
    if argv and argv[0] in commands:  # the command's own parser: its usage errors name it
        command = commands[argv[0]]
        parse = (command.parse_known_intermixed_args if command.get_default("intermixed")
                 else command.parse_known_args)
        args, unknown = parse(argv[1:])
        if unknown:
            args.usage_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        _refuse_empty_values(args.usage_parser, args)
        _refuse_broken_links(args.usage_parser, args)
        args.command = argv[0]
        return args
    return parser.parse_args(argv)


def _refuse_broken_links(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Raise ValueError for an argument that is a path through a loop of symbolic links or is
    itself a symbolic link to nothing: the commands' own checks (`is_dir`, `exists`) read such
    a path as missing or as no directory, each in its own words. (No input or output of any
    command may be either.)"""
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        for v in value if isinstance(value, list) else [value]:
            if not isinstance(v, str):
                continue
            name = "/".join(action.option_strings) or action.dest
            try:
                os.stat(v)
            except OSError as err:
                if err.errno == errno.ELOOP:
                    raise ValueError(f"{v}: a loop of symbolic links (it leads back to itself; "
                                     f"argument {name})") from None
                if err.errno == errno.ENOENT and os.path.islink(v):
                    raise ValueError(f"{v}: a broken symbolic link (to {os.readlink(v)}, which "
                                     f"does not exist; argument {name})") from None
            except ValueError:   # an embedded NUL: the command names it
                continue


def _refuse_empty_values(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A usage error for an argument given as "" (or only spaces, as `--model "$UNSET"` gives):
    every text argument names a path, a model, a scene set or a value to parse, and an empty
    path reads as the current directory."""
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if any(isinstance(v, str) and not v.strip()
               for v in (value if isinstance(value, list) else [value])):
            parser.error(f"argument {'/'.join(action.option_strings) or action.dest}: "
                         "an empty value")


def is_user_error(err: BaseException) -> bool:
    """Bad input rather than a bug: every jscenegen/convert error class is a ValueError (the
    checkpoint store's CheckpointError a RuntimeError of its own module); OSError covers
    missing files, permissions and a full disk; pathlib's "Symlink loop" RuntimeError (Python
    < 3.13) a path given as a loop of links."""
    if isinstance(err, (ValueError, OSError)) or _symlink_loop(err) is not None:
        return True
    module = type(err).__module__
    return module.startswith(("jscenegen.", "convert.")) and type(err).__name__.endswith("Error")


def _symlink_loop(err: BaseException) -> str | None:
    """The path of pathlib's `RuntimeError("Symlink loop from '...'")`, else None."""
    prefix = "Symlink loop from "
    text = str(err)
    return text[len(prefix):].strip("'\"") if type(err) is RuntimeError and text.startswith(prefix) else None


def error_line(err: BaseException) -> str:
    """One line for `err`: multi-line messages joined with '; ', OS errors with their file,
    control characters escaped, at most MAX_ERROR_CHARS characters."""
    if isinstance(err, OSError) and err.errno in STORAGE_LIMITS and not isinstance(err, DiskFullError):
        where = f" in {os.path.dirname(os.path.abspath(err.filename))}" if err.filename else ""
        return f"{STORAGE_LIMITS[err.errno]}{where} writing {err.filename or 'a file'}"
    # imported only on an error: `--help` stays light
    from jscenegen.text import clip_text, one_line

    text = str(err) or type(err).__name__
    loop = _symlink_loop(err)
    if loop is not None:
        text = f"{loop}: a loop of symbolic links (it leads back to itself)"
    if isinstance(err, OSError) and err.filename and err.strerror and err.filename2 is None:
        text = f"{clip_text(str(err.filename), MAX_ERROR_CHARS // 2)}: {err.strerror}"
    elif isinstance(err, OSError) and err.filename and str(err.filename) not in text:
        text = f"{err.filename}: {text}"

    # a message that echoes a huge input (a 100 KB path or key) stays readable, and is cut
    # before it is escaped (a 400 MiB one took a minute); one that echoes control characters
    # cannot drive the terminal
    return one_line(text, MAX_ERROR_CHARS) or type(err).__name__


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end was closed (poll reports an error on it)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


# orbax's writer threads log every exception they then hand to the caller
# (orbax/checkpoint/_src/futures/future.py, _SignalingThread.run)
RERAISED_BY_ORBAX = "_SignalingThread.run() raised an exception"


class StderrLogHandler(logging.Handler):
    """Log records as `warning: message` lines on the current sys.stderr (looked up at each
    record, so a replaced stderr is followed), one line each (`text.one_line`: a multi-line
    message joined by '; ', control characters escaped), at most MAX_ERROR_CHARS characters; a logged
    exception adds `(Type: its first line)` unless the message holds it, and its traceback only
    with JSCENEGEN_DEBUG=1 (a library's writer threads log one per thread, pages of them for
    one failure); orbax's logged copies of an exception it re-raises are left out."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and RERAISED_BY_ORBAX in str(record.msg):
            return   # the exception reaches the command, which prints it once
        from jscenegen.text import clip_line, one_line

        try:
            message = record.getMessage()
            text = f"{record.levelname.lower()}: {one_line(message, MAX_ERROR_CHARS) or '(no message)'}"
            err = record.exc_info[1] if record.exc_info else None
            first = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), "") if err else ""
            if err is not None and not (first and first in message):   # the cause, in one line
                text += f" ({type(err).__name__}{': ' + clip_line(first, MAX_ERROR_CHARS) if first else ''})"
            if len(text) > MAX_ERROR_CHARS:
                text = text[:MAX_ERROR_CHARS] + " ..."
            if record.exc_info and os.environ.get("JSCENEGEN_DEBUG"):
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            print(text, file=sys.stderr, flush=True)
        except Exception:
            self.handleError(record)


def install_log_handler() -> None:
    """One format for every warning, whoever logs it and when: without a root handler Python
    prints a bare message until some library (orbax, on import) calls `logging.basicConfig`,
    after which it prints `WARNING:name:message`. A program that configured logging itself
    (a root handler already there) keeps its own."""
    if not logging.root.handlers:
        logging.root.addHandler(StderrLogHandler())


def _default_interrupt_at_exit() -> None:
    """Ctrl-C while the interpreter shuts down (JAX's atexit clean-up) ends the process as the
    signal's default action does, after flushing what the command printed, instead of raising
    KeyboardInterrupt inside a clean-up callback (a traceback after the command's last line)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if signal.SIGINT not in ignore_repeats_at_exit():
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def _forget_caught_interrupt() -> None:
    """CPython marks a KeyboardInterrupt that leaves an `exec()` of a string as unhandled even
    when the command catches it (a Ctrl-C landing in code that dataclasses or typing generate,
    as while torch imports), and `python -m` then ends the process by SIGINT after the
    interpreter exits (Python/pythonrun.c `run_eval_code_obj`, Modules/main.c `exit_sigint`):
    the exit code the command returned (130) was lost. Every exec of a string clears the mark."""
    exec("")


_PYTHON_SHOW_WARNING = warnings.showwarning


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """`warnings.showwarning` for the program: a warning is a `warning: message` line like a
    logged one (StderrLogHandler), without Python's file, line number and source line (with
    JSCENEGEN_DEBUG=1 it keeps them)."""
    if os.environ.get("JSCENEGEN_DEBUG"):
        _PYTHON_SHOW_WARNING(message, category, filename, lineno, file, line)
    elif not (stop_acted_on() and _left_by_the_stop(category, message)):
        logging.getLogger("py.warnings").warning("%s", message)


def _left_by_the_stop(category, message) -> bool:
    """Whether a warning is one that a stop signal's unwind leaves: coroutines a library
    (orbax's reads and writes) had created and the stop kept from being awaited."""
    return issubclass(category, RuntimeWarning) and "was never awaited" in str(message)


def _quiet_after_a_stop(previous):
    """A `sys.unraisablehook` that drops what finalisers raise once a stop signal was acted
    on (`signals.stop_acted_on`): objects the stop cut short, finalised as the command unwinds
    (asyncio's event loop interrupted in its constructor: `AttributeError: ... '_ssock'` from
    its `__del__`), a traceback after the command's one line. JSCENEGEN_DEBUG=1 keeps them."""
    def hook(unraisable) -> None:
        if not stop_acted_on() or os.environ.get("JSCENEGEN_DEBUG"):
            previous(unraisable)

    return hook


def main(argv: list[str] | None = None) -> int:
    if argv is None:   # the program itself (not a caller's test): its uncaught tracebacks, warnings
        sys.excepthook = _traceback_without_credentials(argv)
        warnings.showwarning = _show_warning
        sys.unraisablehook = _quiet_after_a_stop(sys.unraisablehook)
    try:
        code = _run(argv)
    except Exception as err:   # a bug's traceback; in a joined run, then no shutdown barrier either
        if _must_skip_clean_up(1):
            if _runtime_error(err) and not os.environ.get("JSCENEGEN_DEBUG"):
                print(f"error: {type(err).__name__}: {error_line(err)} (a computation of this "
                      "multi-process run failed; when another process stopped first, its output "
                      "says why; JSCENEGEN_DEBUG=1 prints the traceback)", file=sys.stderr)
            else:
                sys.excepthook(type(err), err, err.__traceback__)
            _end_without_clean_up(1)
        raise
    finally:
        _forget_caught_interrupt()
        # atexit runs the last-registered callback first: registered after the command, when
        # JAX (imported by the command) has registered its clean-up
        atexit.unregister(_default_interrupt_at_exit)
        atexit.register(_default_interrupt_at_exit)
    if _must_skip_clean_up(code) or (argv is None and _UNWOUND_BY_SIGNAL.is_set()
                                     and "jax" in sys.modules):
        _end_without_clean_up(code)
    return code


# A signal that unwound the command (Ctrl-C, SIGTERM) may have cut into JAX's own bookkeeping
# around a native call (a jit compiling: the exception leaves its C++ caller half-done), and
# the interpreter's clean-up then crashed (exit 139 after the error line): the program ends
# without it, as a joined run's process does. What must outlive the command is released while
# it unwinds (run.lock, atomic temporaries, orbax's pending save, swanlab's run, the logs
# opened per row), never left to atexit or to thread joins.
_UNWOUND_BY_SIGNAL = threading.Event()


def _runtime_error(err: BaseException) -> bool:
    """Whether `err` is JAX's runtime error (a failed computation or collective, e.g. gloo's
    "Connection closed by peer" when another process of the run died), not a Python bug."""
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(err, jax.errors.JaxRuntimeError)


def _must_skip_clean_up(code: int) -> bool:
    """Whether ending with `code` must skip the interpreter's clean-up (`_end_without_clean_up`)."""
    mesh = sys.modules.get("jscenegen.sharding.mesh")   # not imported here: a command without JAX stays light
    return mesh is not None and (mesh.init_wait_abandoned()
                                 or (code != 0 and mesh.joined_other_processes()))


def _end_without_clean_up(code: int) -> None:
    """End the process now, after flushing what the command printed, skipping the interpreter's
    clean-up: JAX's initialization is still blocked in another thread
    (`mesh.init_wait_abandoned`); this process of a multi-process run failed or stopped and
    JAX's shutdown barrier would wait minutes for processes blocked in a collective with it
    (`mesh.joined_other_processes`; they end on their own when their collective or heartbeat
    loses this process); or a signal unwound the program after JAX loaded (`main`)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    mesh = sys.modules.get("jscenegen.sharding.mesh")
    if mesh is not None:
        mesh.end_after_peers_that_end()
    os._exit(code)


def _run(argv: list[str] | None) -> int:
    install_log_handler()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch was not found" advice
    try:
        with UnwindOnSignals():   # parsing imports what option types need (numpy, ml_dtypes)
            force_cpu_devices()
            parser = build_parser()
            args = parse_args(parser, argv)
            if not getattr(args, "func", None):
                parser.print_help()
                return 2
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("error: interrupted (Ctrl-C)", file=sys.stderr)
        _UNWOUND_BY_SIGNAL.set()
        return 130
    except Terminated:
        print("error: terminated (SIGTERM)", file=sys.stderr)
        _UNWOUND_BY_SIGNAL.set()
        return 128 + signal.SIGTERM
    except BrokenPipeError:
        if not stdout_reader_gone():
            raise
        # `jscenegen ... | head`: end quietly, as a Unix tool killed by SIGPIPE does; stdout goes
        # to /dev/null so the interpreter's last flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except Exception as err:
        if os.environ.get("JSCENEGEN_DEBUG") or not is_user_error(err):
            raise
        print(f"error: {_without_credentials(error_line(err), argv)}", file=sys.stderr)
        return 2


def _traceback_without_credentials(argv: list[str] | None):
    """A `sys.excepthook` printing the traceback of an uncaught exception (a bug, or any error
    under JSCENEGEN_DEBUG=1) with the command line's credentials redacted: an error that quotes
    an override holds its value."""
    def print_traceback(kind, value, tb) -> None:
        text = "".join(traceback.format_exception(kind, value, tb))
        sys.stderr.write(_without_credentials(text, argv))
        sys.stderr.flush()

    return print_traceback


def _without_credentials(text: str, argv: list[str] | None) -> str:
    """`text` with every credential the command line holds (a judge URL's password, an
    `api_key=` value: `checkpoint.metadata.redact_argv`) replaced by `<redacted>`: a refusal
    that echoes an override would print it into the job's log."""
    from jscenegen.checkpoint.metadata import mask_text, redact_argv

    return mask_text(text, redact_argv(sys.argv[1:] if argv is None else argv)[1])


if __name__ == "__main__":
    sys.exit(main())
