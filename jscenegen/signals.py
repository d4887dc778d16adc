"""Ending a command on SIGTERM or Ctrl-C by unwinding it, so `finally` blocks and context
managers run: a run's lock is released, an unfinished destination (`paths.atomic_dir`) removed.

Python raises a signal's exception (KeyboardInterrupt, or `Terminated` here) in the main thread
at the next bytecode; when that bytecode belongs to a callback Python runs where it cannot
propagate exceptions (a finaliser, JAX's garbage-collection callback), the exception is printed
as "Exception ignored" and the signal would be lost. `UnwindOnSignals` catches that case in
`sys.unraisablehook` and delivers the signal to the main thread again. A second SIGTERM, or
`grace_s` seconds without finishing the unwind, ends the process at once (exit 143).
"""
from __future__ import annotations

import _thread
import os
import signal
import sys
import threading

REDELIVERY_DELAY_S = 0.01


class Terminated(BaseException):
    """SIGTERM, raised in the main thread like KeyboardInterrupt for Ctrl-C."""


class UnwindOnSignals:
    """Context manager: SIGTERM raises `Terminated` in the main thread while it is active, and
    a SIGTERM or Ctrl-C swallowed by a callback is delivered again. Outside the main thread
    it does nothing (Python only runs signal handlers there)."""

    def __init__(self, grace_s: float = 60.0):
        self.grace_s = grace_s
        self._watchdog: threading.Timer | None = None
        self._active = False

    def __enter__(self) -> "UnwindOnSignals":
        self._active = threading.current_thread() is threading.main_thread()
        if self._active:
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._on_unraisable
        return self

    def __exit__(self, *exc) -> None:
        if not self._active:
            return
        self._active = False
        if self._watchdog is not None:
            self._watchdog.cancel()
        signal.signal(signal.SIGTERM, self._previous_handler)
        sys.unraisablehook = self._previous_hook

    def _on_sigterm(self, signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
        if self._watchdog is None:
            self._watchdog = threading.Timer(self.grace_s, os._exit, args=(128 + signal.SIGTERM,))
            self._watchdog.daemon = True
            self._watchdog.start()
        raise Terminated

    def _on_unraisable(self, unraisable) -> None:
        if isinstance(unraisable.exc_value, Terminated):
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, self._on_sigterm)
            self._deliver_again(signal.SIGTERM)
        elif isinstance(unraisable.exc_value, KeyboardInterrupt):
            self._deliver_again(signal.SIGINT)
        else:
            self._previous_hook(unraisable)

    def _deliver_again(self, signum: int) -> None:
        # from another thread, a moment later: raised in this hook, it would be swallowed too
        def resend():
            if self._active:  # not once the command has ended
                _thread.interrupt_main(signum)

        timer = threading.Timer(REDELIVERY_DELAY_S, resend)
        timer.daemon = True
        timer.start()
