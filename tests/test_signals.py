"""jscenegen/signals.py: SIGTERM unwinds the main thread, and a signal Python swallowed in a
callback (a finaliser, JAX's gc callback) is delivered again instead of being lost."""
import os
import signal
import time
from pathlib import Path

import pytest

from jscenegen.signals import Terminated, UnwindOnSignals


def _bytecodes(seconds: float = 5.0) -> None:
    """Give the main thread bytecode boundaries, where Python runs pending signal handlers."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pass


class _RaisesWhenCollected:
    """Its finaliser raises what a signal handler raised there: Python can only print it."""

    def __init__(self, exc: type[BaseException]):
        self.exc = exc

    def __del__(self):
        raise self.exc


def test_sigterm_raises_terminated_and_the_handler_is_restored_after():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated):
        with UnwindOnSignals(grace_s=600) as guard:
            os.kill(os.getpid(), signal.SIGTERM)
            _bytecodes()
    assert signal.getsignal(signal.SIGTERM) is before
    assert guard._watchdog is not None and guard._watchdog.finished.is_set()  # cancelled


@pytest.mark.parametrize("exc", [Terminated, KeyboardInterrupt])
def test_a_signal_swallowed_by_a_finaliser_is_delivered_again(exc):
    with pytest.raises(exc):
        with UnwindOnSignals(grace_s=600):
            _RaisesWhenCollected(exc)   # collected at once: its __del__'s exception is ignored
            _bytecodes()


def test_other_unraisable_exceptions_reach_the_previous_hook(monkeypatch):
    import sys

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(type(u.exc_value)))
    with UnwindOnSignals(grace_s=600):
        _RaisesWhenCollected(ValueError)
        _bytecodes(0.1)
    assert seen == [ValueError]


def test_a_repeat_within_the_window_is_the_same_request():
    from jscenegen.signals import REPEAT_WINDOW_S, RepeatFilter

    repeats = RepeatFilter(window_s=0.2)
    assert not repeats.is_repeat(signal.SIGTERM)
    assert repeats.is_repeat(signal.SIGTERM)          # `timeout`'s second delivery
    assert not repeats.is_repeat(signal.SIGINT)       # another kind of signal
    time.sleep(0.25)
    assert not repeats.is_repeat(signal.SIGTERM)      # a new request
    assert REPEAT_WINDOW_S >= 0.5


_SECOND_SIGTERM = """
import os, signal, sys, time
from jscenegen.signals import Terminated, UnwindOnSignals
with UnwindOnSignals(grace_s=600):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    except Terminated:
        print("unwinding", flush=True)
    time.sleep(float(sys.argv[1]))
    os.kill(os.getpid(), signal.SIGTERM)     # the same request again, or a second one
    time.sleep(0.5)
print("cleaned up", flush=True)
"""


@pytest.mark.parametrize("pause, alive", [(0.0, True), (1.2, False)])
def test_a_second_sigterm_ends_at_once_but_a_repeat_does_not(pause, alive):
    """coreutils `timeout` signals the command, then its process group: both reach the command.
    Taken for a second request, the repeat killed conversions in their cleanup (a partial
    destination left behind)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _SECOND_SIGTERM, str(pause)],
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines()[0] == "unwinding"
    if alive:
        assert proc.returncode == 0 and proc.stdout.splitlines() == ["unwinding", "cleaned up"]
    else:
        assert proc.returncode == -signal.SIGTERM and "cleaned up" not in proc.stdout


_CTRL_C_AT_EXIT = """
import atexit, os, signal, sys
atexit.register(os.kill, os.getpid(), signal.SIGINT)   # runs after every later-registered one
from jscenegen.cli import main
assert "jax" not in sys.modules   # the command imports JAX, which registers its clean-up then
sys.exit(main(["mesh-report", "--model", sys.argv[1]]))
"""


def test_ctrl_c_while_the_interpreter_exits_prints_no_traceback_and_loses_no_output():
    """A Ctrl-C during JAX's atexit clean-up printed "Exception ignored in atexit callback"
    and a KeyboardInterrupt traceback after the command had finished."""
    import subprocess
    import sys

    shapes = Path(__file__).parent.parent / "configs/model-shapes/qwen2.5-7b.json"
    proc = subprocess.run([sys.executable, "-c", _CTRL_C_AT_EXIT, str(shapes)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -signal.SIGINT
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr
    assert "model.embed_tokens.weight" in proc.stdout   # the report, printed into a pipe, was flushed
