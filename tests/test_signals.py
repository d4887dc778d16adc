"""jscenegen/signals.py: SIGTERM unwinds the main thread, and a signal Python swallowed in a
callback (a finaliser, JAX's gc callback) is delivered again instead of being lost."""
import os
import signal
import time

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
