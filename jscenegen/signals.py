"""Ending a command on SIGTERM or Ctrl-C by unwinding it, so `finally` blocks and context
managers run: a run's lock is released, an unfinished destination (`paths.atomic_dir`) removed.

Python raises a signal's exception (KeyboardInterrupt, or `Terminated` here) in the main thread
at the next bytecode; when that bytecode belongs to a callback Python runs where it cannot
propagate exceptions (a finaliser, JAX's garbage-collection callback), the exception is printed
as "Exception ignored" and the signal would be lost. `UnwindOnSignals` catches that case in
`sys.unraisablehook` and delivers the signal to the main thread again. A second SIGTERM, or
`grace_s` seconds without finishing the unwind, ends the process at once (exit 143).

One request can arrive as two signals: coreutils `timeout` signals the command and then its
process group, which holds the command again. A repeat within REPEAT_WINDOW_S of the first
is that same request (`RepeatFilter`); taken for a second one, it would end the process in
the middle of its cleanup.
"""
from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
import time

REDELIVERY_DELAY_S = 0.01
REPEAT_WINDOW_S = 1.0


class RepeatFilter:
    """Tells a signal delivered again for the same request from a new request: a delivery
    within `window_s` of the first of its kind is a repeat."""

    def __init__(self, window_s: float = REPEAT_WINDOW_S):
        self.window_s = window_s
        self._first: dict[int, float] = {}

    def is_repeat(self, signum: int) -> bool:
        now = time.monotonic()
        first = self._first.get(signum)
        if first is not None and now - first < self.window_s:
            return True
        self._first[signum] = now
        return False


class Terminated(BaseException):
    """SIGTERM, raised in the main thread like KeyboardInterrupt for Ctrl-C."""


class UnwindOnSignals:
    """Context manager: SIGTERM raises `Terminated` and Ctrl-C KeyboardInterrupt in the main
    thread while it is active, a repeat of the same request is ignored, and a SIGTERM or
    Ctrl-C swallowed by a callback is delivered again. Outside the main thread it does nothing
    (Python only runs signal handlers there)."""

    def __init__(self, grace_s: float = 60.0):
        self.grace_s = grace_s
        self._watchdog: threading.Timer | None = None
        self._active = False
        self._repeats = RepeatFilter()
        self._redelivered: set[int] = set()

    def __enter__(self) -> "UnwindOnSignals":
        self._active = threading.current_thread() is threading.main_thread()
        if self._active:
            self._previous_handlers = {s: signal.signal(s, self._on_signal)
                                       for s in (signal.SIGTERM, signal.SIGINT)}
            self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._on_unraisable
        return self

    def __exit__(self, *exc) -> None:
        if not self._active:
            return
        self._active = False
        if self._watchdog is not None:
            self._watchdog.cancel()
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        sys.unraisablehook = self._previous_hook

    def _on_signal(self, signum, frame):
        exc = KeyboardInterrupt if signum == signal.SIGINT else Terminated
        if signum in self._redelivered:   # swallowed by a callback before: raise it again
            self._redelivered.discard(signum)
            raise exc
        if self._repeats.is_repeat(signum):
            return
        if signum == signal.SIGTERM:
            if self._watchdog is not None:     # a second SIGTERM: end at once
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            self._watchdog = threading.Timer(self.grace_s, os._exit, args=(128 + signal.SIGTERM,))
            self._watchdog.daemon = True
            self._watchdog.start()
        raise exc

    def _on_unraisable(self, unraisable) -> None:
        if isinstance(unraisable.exc_value, Terminated):
            self._deliver_again(signal.SIGTERM)
        elif isinstance(unraisable.exc_value, KeyboardInterrupt):
            self._deliver_again(signal.SIGINT)
        else:
            self._previous_hook(unraisable)

    def _deliver_again(self, signum: int) -> None:
        # from another thread, a moment later: raised in this hook, it would be swallowed too
        def resend():
            if self._active:  # not once the command has ended
                self._redelivered.add(signum)
                _thread.interrupt_main(signum)

        timer = threading.Timer(REDELIVERY_DELAY_S, resend)
        timer.daemon = True
        timer.start()
