"""Ending a command on SIGTERM or Ctrl-C by unwinding it, so `finally` blocks and context
managers run: a run's lock is released, an unfinished destination (`paths.atomic_dir`) removed.

Python raises a signal's exception (KeyboardInterrupt, or `Terminated` here) in the main thread
at the next bytecode; when that bytecode belongs to a callback Python runs where it cannot
propagate exceptions (a finaliser, JAX's garbage-collection callback), the exception is printed
as "Exception ignored" and the signal would be lost. `UnwindOnSignals` catches that case in
`sys.unraisablehook` and delivers the signal to the main thread again. A second SIGTERM, or
`grace_s` seconds without finishing the unwind, ends the process at once (exit 143).

Python runs a handler only when the main thread is back in bytecode, and several arrivals of
one signal before that run it once. JAX's compile and its waits for results run handlers while
they wait; a native call that does not (a blocking library call; a large safetensors or torch
read may be one) holds them back until it returns. `StopRequests` therefore learns of each arrival from
the C-level handler itself (`signal.set_wakeup_fd`, read by a thread): it groups arrivals into
requests by arrival time, tells a handler how many requests it has to act on, and ends the
process (exit 128 + signal) when a second request is not taken by the main thread within
EXIT_UNTAKEN_S.

One request can arrive as two signals: coreutils `timeout` signals the command and then its
process group, which holds the command again. A repeat within REPEAT_WINDOW_S of the first
is that same request; taken for a second one, it would end the process in the middle of its
cleanup. One arriving after the unwind has finished is ignored too (`_RepeatsIgnored`), not met
by the default action the command found.

A stop request that arrives while torch is being imported is acted on once that import is done
(`HELD_DURING_IMPORT`): raised there, the exception met C++ frames that cannot pass it on.
"""
from __future__ import annotations

import _thread
import contextlib
import os
import select
import signal
import sys
import threading
import time

REDELIVERY_DELAY_S = 0.01
REPEAT_WINDOW_S = 1.0
EXIT_UNTAKEN_S = 2.0
TAKE_WAIT_S = 0.2       # the reader and the exit timer hold the lock for microseconds
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Packages whose import runs native initialisers that call back into Python: a stop's
# exception raised in such a callback cannot cross the C++ frames around it, and the process
# aborts (`terminate called after throwing an instance of 'pybind11::error_already_set'`,
# SIGABRT: no error line, the destination's partial directory left behind). Seen with torch
# 2.13's `torch._C._c10d_init()`, a Ctrl-C 3.5 s into `convert SRC DST --to orbax` (1 in ~25).
# A request arriving while one of them is being imported waits until that import is done.
HELD_DURING_IMPORT = ("torch",)
HOLD_RETRY_S = 0.05     # how often a held request looks again whether the import is done
_WAKE_READER = b"\0"   # no signal has number 0: tells the reader thread to end


class StopRequests:
    """Process-wide record of SIGTERM/SIGINT arrivals, as the C-level handler reports them.

    An arrival within `window_s` of the first arrival of a request of the same signal is a
    repeat of that request. `take(signum)` (from a Python handler) returns how many requests of
    that signal arrived since the last take. From the second request on (of either signal), a
    request still not taken `exit_untaken_s` after its arrival ends the process with exit code
    128 + signal: the main thread is inside a native call and cannot unwind.

    `open()` / `close()` (main thread only; counted, so nested users share one reader; the
    record starts afresh with the first) install and restore the wakeup fd. `open()` raises
    ValueError outside the main thread.
    """

    def __init__(self, window_s: float = REPEAT_WINDOW_S, exit_untaken_s: float = EXIT_UNTAKEN_S):
        self.window_s = window_s
        self.exit_untaken_s = exit_untaken_s
        self._lock = threading.Lock()
        self._users = 0
        self._read_fd: int | None = None
        self._write_fd: int | None = None
        self._previous_fd = -1
        self._session = 0
        self._reset()

    def _reset(self) -> None:
        self._session += 1      # a timer from an earlier session finds nothing to do
        self._requests = 0
        self._first_arrival: dict[int, float] = {}
        self._untaken: dict[int, list[int]] = {s: [] for s in STOP_SIGNALS}
        self._redeliveries: dict[int, int] = {s: 0 for s in STOP_SIGNALS}

    def expect_redelivery(self, signum: int) -> None:
        """The next arrival of `signum` is `_thread.interrupt_main` delivering again a signal
        a callback swallowed (CPython writes its wakeup byte too): not a new request."""
        with self._lock:
            self._redeliveries[signum] += 1

    def open(self) -> None:
        if self._users == 0:
            read_fd, write_fd = os.pipe()
            os.set_blocking(read_fd, False)
            os.set_blocking(write_fd, False)
            try:
                self._previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
            except BaseException:
                os.close(read_fd)
                os.close(write_fd)
                raise
            with self._lock:
                self._reset()
                self._read_fd, self._write_fd = read_fd, write_fd
            threading.Thread(target=self._read_arrivals, args=(read_fd, write_fd),
                             name="stop-requests", daemon=True).start()
        self._users += 1

    def close(self) -> None:
        self._users -= 1
        if self._users > 0 or self._write_fd is None:
            return
        signal.set_wakeup_fd(self._previous_fd)
        with self._lock:
            write_fd, self._read_fd, self._write_fd = self._write_fd, None, None
            self._reset()
        with contextlib.suppress(BlockingIOError):
            os.write(write_fd, _WAKE_READER)   # the reader ends and closes both ends

    def repeats_until(self, signum: int) -> float | None:
        """When (`time.monotonic()`) a repeat of the last request of `signum` stops being one;
        None if none arrived since `open()`."""
        with self._lock:
            first = self._first_arrival.get(signum)
        return None if first is None else first + self.window_s

    def take(self, signum: int) -> int:
        """The number of new requests of `signum` to act on (0: a repeat of one taken before).
        A handler that runs before its arrival was read counts as a request arriving now.

        A handler can run inside another one's `take` (or `close`), in the main thread that
        holds the lock: a signal repeated microseconds later, as coreutils `timeout` sends
        it. Waiting for the lock there would wait forever (and stall the reader and the exit
        timer), so such a call gives up after TAKE_WAIT_S and counts as a repeat."""
        if not self._lock.acquire(timeout=TAKE_WAIT_S):
            return 0
        try:
            if self._read_fd is not None:
                self._drain(self._read_fd)
            untaken = self._untaken.get(signum, [])
            if untaken:
                count = len(untaken)
                untaken.clear()
                return count
            return int(self._new_request(signum, time.monotonic()) is not None)
        finally:
            self._lock.release()

    def _read_arrivals(self, read_fd: int, write_fd: int) -> None:
        try:
            while True:
                select.select([read_fd], [], [])
                with self._lock:
                    if not self._drain(read_fd):
                        return
        finally:
            os.close(read_fd)
            os.close(write_fd)

    def _drain(self, read_fd: int) -> bool:
        """Record the arrivals waiting in the pipe (lock held); False once told to end."""
        try:
            data = os.read(read_fd, 4096)
        except BlockingIOError:
            return True
        if read_fd == self._read_fd:
            now = time.monotonic()
            for signum in data:
                if signum in self._untaken:
                    self._arrived(signum, now)
        return _WAKE_READER[0] not in data

    def _arrived(self, signum: int, now: float) -> None:
        if self._redeliveries[signum]:
            self._redeliveries[signum] -= 1
            return
        request = self._new_request(signum, now)
        if request is None:
            return
        self._untaken[signum].append(request)
        if request >= 2:
            timer = threading.Timer(self.exit_untaken_s, self._exit_if_untaken,
                                    args=(signum, self._session, request))
            timer.daemon = True
            timer.start()

    def _new_request(self, signum: int, now: float) -> int | None:
        """The number of the request an arrival at `now` starts (1, 2, ...; lock held), or
        None for a repeat: within `window_s` of the first arrival of the last request of its
        signal."""
        first = self._first_arrival.get(signum)
        if first is not None and now - first < self.window_s:
            return None
        self._first_arrival[signum] = now
        self._requests += 1
        return self._requests

    def _exit_if_untaken(self, signum: int, session: int, request: int) -> None:
        with self._lock:
            if session != self._session or request not in self._untaken[signum]:
                return
            name = signal.Signals(signum).name
            with contextlib.suppress(OSError):   # stderr closed: end all the same
                os.write(2, f"error: {name} again while the main thread is inside a native "
                            f"call: ending now, without unwinding\n".encode())
            os._exit(128 + signum)

    def _forget_in_child(self) -> None:
        """In a forked child (torch's and multiprocessing's fork workers): the parent's pipe
        is not the child's; a signal sent to a worker would count as the parent's request."""
        self._lock = threading.Lock()     # a reader holding it at the fork never releases it
        if self._write_fd is None:
            return
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(-1)
        for fd in (self._read_fd, self._write_fd):
            os.close(fd)
        self._users, self._read_fd, self._write_fd = 0, None, None
        self._reset()


STOP_REQUESTS = StopRequests()
os.register_at_fork(after_in_child=STOP_REQUESTS._forget_in_child)


class Terminated(BaseException):
    """SIGTERM, raised in the main thread like KeyboardInterrupt for Ctrl-C."""


_unwinding: "UnwindOnSignals | None" = None
_ACTED_ON = threading.Event()   # a stop request has been raised: the command is unwinding


def stop_acted_on() -> bool:
    """Whether a stop request (SIGTERM, Ctrl-C) has been raised in this process's main thread:
    what is finalised from then on may be an object the stop cut short."""
    return _ACTED_ON.is_set()


def _exception(signum: int) -> type[BaseException]:
    return KeyboardInterrupt if signum == signal.SIGINT else Terminated


def _end_now(signum: int) -> None:
    """End the process as the signal's default action does (main thread only)."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def unwind(signum: int) -> None:
    """Raise the signal's exception (`Terminated`, KeyboardInterrupt) in the calling (main)
    thread, as the active `UnwindOnSignals` does (its grace timer armed): a handler that took a
    request itself (the GRPO trainer's second one) hands it on here."""
    if _unwinding is not None:
        _unwinding.unwind(signum)
    _ACTED_ON.set()
    raise _exception(signum)


class _RepeatsIgnored:
    """The handler `UnwindOnSignals` leaves after a command that took a stop request, until the
    interpreter exits: a repeat of that request arriving after the unwind (before `until`) is
    ignored, as it is during the unwind, instead of meeting the handler the command found (the
    default action ends the process by the signal, skipping atexit). Later arrivals get
    `action`, that handler."""

    def __init__(self, action, until: float):
        self.action = action
        self.until = until

    def __call__(self, signum, frame) -> None:
        if time.monotonic() < self.until:
            return
        signal.signal(signum, self.action)
        if self.action == signal.SIG_DFL:
            _end_now(signum)
        elif callable(self.action):
            self.action(signum, frame)


def ignore_repeats_at_exit() -> set[int]:
    """At the interpreter's exit (atexit): ignore each stop signal whose taken request may still
    repeat (a `_RepeatsIgnored` within its window) for the rest of the process, and return
    those signals. CPython resets Python handlers to the default action after atexit, and a
    repeat during JAX's last second of shutdown would end the process by the signal; SIG_IGN
    is left in place, and the process is already ending with that request's exit code."""
    ignored = set()
    for signum in STOP_SIGNALS:
        current = signal.getsignal(signum)
        if isinstance(current, _RepeatsIgnored) and time.monotonic() < current.until:
            signal.signal(signum, signal.SIG_IGN)
            ignored.add(signum)
    return ignored


def importing_held_package(frame) -> bool:
    """Whether `frame` (a signal handler's) runs inside the import of a package of
    HELD_DURING_IMPORT: some frame up its stack executes such a module's top level. Python
    frames link through the native calls between them, so a callback of a native initialiser
    still finds the module being imported."""
    while frame is not None:
        if frame.f_code.co_name == "<module>":
            name = frame.f_globals.get("__name__")
            if isinstance(name, str) and name.partition(".")[0] in HELD_DURING_IMPORT:
                return True
        frame = frame.f_back
    return False


def raise_if_redelivered(signum: int) -> None:
    """Raise the signal's exception again if this handler call is the active `UnwindOnSignals`
    delivering one a callback swallowed (no new request: `StopRequests` does not count it).
    Every handler installed under `UnwindOnSignals` calls it first."""
    if _unwinding is not None and signum in _unwinding._redelivered:
        _unwinding._redelivered.discard(signum)
        raise _exception(signum)


class UnwindOnSignals:
    """Context manager: SIGTERM raises `Terminated` and Ctrl-C KeyboardInterrupt in the main
    thread while it is active, a repeat of the same request is ignored, a SIGTERM or Ctrl-C
    swallowed by a callback is delivered again, and one arriving while torch is being imported
    is raised once that import is done (`importing_held_package`). Outside the main thread it
    does nothing (Python only runs signal handlers there)."""

    def __init__(self, grace_s: float = 60.0):
        self.grace_s = grace_s
        self._watchdog: threading.Timer | None = None
        self._active = False
        self._redelivered: set[int] = set()
        self._held: set[int] = set()   # requests waiting for an import (HELD_DURING_IMPORT)

    def __enter__(self) -> "UnwindOnSignals":
        global _unwinding
        self._active = threading.current_thread() is threading.main_thread()
        if self._active:
            STOP_REQUESTS.open()
            self._previous_handlers = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
            self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._on_unraisable
            self._outer, _unwinding = _unwinding, self
        return self

    def __exit__(self, *exc) -> None:
        global _unwinding
        if not self._active:
            return
        self._active = False
        _unwinding = self._outer
        if self._watchdog is not None:
            self._watchdog.cancel()
        for signum, handler in self._previous_handlers.items():
            until = STOP_REQUESTS.repeats_until(signum)
            if until is not None and until > time.monotonic():
                handler = _RepeatsIgnored(handler, until)
            signal.signal(signum, handler)
        if sys.unraisablehook == self._on_unraisable:  # else a later hook wraps this one: keep it
            sys.unraisablehook = self._previous_hook
        STOP_REQUESTS.close()

    def _on_signal(self, signum, frame):
        if signum in self._held and signum in self._redelivered:   # a held request, again
            self._redelivered.discard(signum)
            if importing_held_package(frame):
                self._deliver_again(signum, HOLD_RETRY_S)
                return
            self._held.discard(signum)
            self.unwind(signum)
        raise_if_redelivered(signum)
        requests = STOP_REQUESTS.take(signum)
        if requests > 1 and signum == signal.SIGTERM:   # two during one native call
            _end_now(signum)
        elif requests and importing_held_package(frame):
            if signum not in self._held:   # a second Ctrl-C meanwhile: the same wait
                self._held.add(signum)
                self._deliver_again(signum, HOLD_RETRY_S)
        elif requests:
            self.unwind(signum)

    def unwind(self, signum: int) -> None:
        """Raise the signal's exception; for SIGTERM, end the process if the unwind takes
        `grace_s`, or at once if it is already unwinding from one."""
        if signum == signal.SIGTERM:
            if self._watchdog is not None:     # a second SIGTERM: end at once
                _end_now(signum)
                return
            self._watchdog = threading.Timer(self.grace_s, os._exit, args=(128 + signal.SIGTERM,))
            self._watchdog.daemon = True
            self._watchdog.start()
        _ACTED_ON.set()
        raise _exception(signum)

    def _on_unraisable(self, unraisable) -> None:
        if not self._active:
            self._previous_hook(unraisable)
        elif isinstance(unraisable.exc_value, Terminated):
            self._deliver_again(signal.SIGTERM)
        elif isinstance(unraisable.exc_value, KeyboardInterrupt):
            self._deliver_again(signal.SIGINT)
        else:
            self._previous_hook(unraisable)

    def _deliver_again(self, signum: int, delay_s: float = REDELIVERY_DELAY_S) -> None:
        # from another thread, a moment later: raised in this hook, it would be swallowed too
        def resend():
            if self._active:  # not once the command has ended
                self._redelivered.add(signum)
                STOP_REQUESTS.expect_redelivery(signum)
                _thread.interrupt_main(signum)

        timer = threading.Timer(delay_s, resend)
        timer.daemon = True
        timer.start()
