"""jscenegen/signals.py: SIGTERM unwinds the main thread, and a signal Python swallowed in a
callback (a finaliser, JAX's gc callback) is delivered again instead of being lost."""
import os
import signal
import time
from pathlib import Path

import pytest

from jscenegen.signals import Terminated, UnwindOnSignals, _RepeatsIgnored


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
    after = signal.getsignal(signal.SIGTERM)   # repeats of that request ignored, then `before`
    assert isinstance(after, _RepeatsIgnored) and after.action is before
    with UnwindOnSignals(grace_s=600):
        pass
    assert signal.getsignal(signal.SIGTERM) is after    # no request: what it found
    assert guard._watchdog is not None and guard._watchdog.finished.is_set()  # cancelled


@pytest.mark.parametrize("exc", [Terminated, KeyboardInterrupt])
def test_a_signal_swallowed_by_a_finaliser_is_delivered_again(exc):
    with pytest.raises(exc):
        with UnwindOnSignals(grace_s=600):
            _RaisesWhenCollected(exc)   # collected at once: its __del__'s exception is ignored
            _bytecodes()


def test_a_signal_delivered_again_is_not_a_second_request(monkeypatch):
    """`_thread.interrupt_main` writes the wakeup byte too: the redelivery of a SIGTERM that a
    finaliser swallowed (more than 1 s after it arrived) counted as a second request, and 2 s
    later the process ended in the middle of its cleanup."""
    from jscenegen.signals import REPEAT_WINDOW_S, STOP_REQUESTS

    monkeypatch.setattr(STOP_REQUESTS, "exit_untaken_s", 600.0)

    class SwallowsLate:
        def __del__(self):   # the signal arrives in a native call; the handler runs here
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            try:
                sender = _send_from_another_thread(0.1)
                time.sleep(REPEAT_WINDOW_S + 0.4)
                sender.join()
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            _bytecodes(0.2)

    with UnwindOnSignals(grace_s=600):
        with pytest.raises(Terminated):
            SwallowsLate()
            _bytecodes()
        time.sleep(0.2)
        assert STOP_REQUESTS._requests == 1
        assert not any(STOP_REQUESTS._untaken.values())


def test_other_unraisable_exceptions_reach_the_previous_hook(monkeypatch):
    import sys

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(type(u.exc_value)))
    with UnwindOnSignals(grace_s=600):
        _RaisesWhenCollected(ValueError)
        _bytecodes(0.1)
    assert seen == [ValueError]


def test_a_hook_installed_inside_survives_the_exit_and_still_reaches_the_one_before(monkeypatch):
    """A module imported while the command runs (the checkpoint store's filter of tensorstore's
    closed-loop callbacks) wraps the hook in place; the exit kept only the hook it had found,
    so those callbacks printed their tracebacks again once the command had unwound."""
    import sys

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(type(u.exc_value)))
    with UnwindOnSignals(grace_s=600):
        inner = sys.unraisablehook
        later = lambda u: None if isinstance(u.exc_value, OSError) else inner(u)  # noqa: E731
        sys.unraisablehook = later
    assert sys.unraisablehook is later
    _RaisesWhenCollected(OSError)
    _RaisesWhenCollected(ValueError)
    _RaisesWhenCollected(Terminated)   # after the exit: printed as before, not delivered again
    _bytecodes(0.1)
    assert seen == [ValueError, Terminated]


def _send_from_another_thread(*plan):
    """Send SIGTERM at each of `plan`'s delays (s, after the previous one) from a thread, while
    the main thread blocks SIGTERM: it stays in its C call (a sleep here, a native call that
    does not run handlers in a command), as the kernel delivers each signal to another
    thread. Python runs the handler as soon as the main thread runs bytecode, wherever the
    signal was delivered."""
    import threading

    def send():
        for delay in plan:
            time.sleep(delay)
            os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    return sender


def test_requests_are_counted_by_arrival_while_the_main_thread_is_in_a_c_call():
    """Python runs a handler once for all the arrivals it missed: two requests sent during
    one native call used to count as one (and a repeat by when the handler ran)."""
    from jscenegen.signals import StopRequests

    requests = StopRequests(window_s=1.0, exit_untaken_s=600)
    taken = []
    requests.open()
    previous = signal.signal(signal.SIGTERM, lambda s, f: taken.append(requests.take(s)))
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            sender = _send_from_another_thread(0.2, 0.05, 1.1)   # a request, its repeat, another
            time.sleep(1.9)          # one C call: the sender starts once it runs, ends before
            assert not sender.is_alive()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        _bytecodes(0.05)
        assert taken == [2]
        os.kill(os.getpid(), signal.SIGTERM)      # within the window of the second: a repeat
        _bytecodes(0.05)
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)      # a new request
        _bytecodes(0.1)
        assert taken == [2, 0, 1]
        assert requests.take(signal.SIGINT) == 1  # a handler ahead of its arrival: one request
        assert requests.take(signal.SIGINT) == 0  # ... whose arrival is then its repeat
    finally:
        signal.signal(signal.SIGTERM, previous)
        requests.close()
    from jscenegen.signals import REPEAT_WINDOW_S
    assert REPEAT_WINDOW_S >= 0.5


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")   # the child only exits
def test_a_forked_child_does_not_report_its_signals_to_the_parent():
    """torch's fork workers inherited the wakeup fd: a SIGTERM that ended a worker was counted
    as the parent's request (and a second one ended the parent)."""
    from jscenegen.signals import STOP_REQUESTS, StopRequests

    assert isinstance(STOP_REQUESTS, StopRequests)
    STOP_REQUESTS.open()
    try:
        pid = os.fork()
        if pid == 0:      # the child: its wakeup fd is unset, its record empty
            os._exit(0 if signal.set_wakeup_fd(-1) == -1 and STOP_REQUESTS._users == 0 else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert signal.set_wakeup_fd(STOP_REQUESTS._write_fd) == STOP_REQUESTS._write_fd  # kept here
    finally:
        STOP_REQUESTS.close()


_UNTAKEN_SECOND_SIGTERM = """
import os, signal, threading, time
from jscenegen.signals import UnwindOnSignals

def send():
    for delay in (0.0, 1.3):
        time.sleep(delay)
        os.kill(os.getpid(), signal.SIGTERM)

with UnwindOnSignals(grace_s=600):
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})   # as in a native call
    threading.Thread(target=send, daemon=True).start()
    time.sleep(60)
print("returned", flush=True)
"""


def test_a_second_sigterm_the_main_thread_cannot_take_ends_the_process():
    """A second request during a long native call acted only when it returned
    (minutes for a large read): now the process ends 2 s after it, without unwinding."""
    import subprocess
    import sys

    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _UNTAKEN_SECOND_SIGTERM], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "SIGTERM again while the main thread is inside a native call" in proc.stderr
    assert "returned" not in proc.stdout and time.monotonic() - t0 < 30


_SIGTERM_AGAIN = """
import atexit, os, signal, sys, time
from jscenegen.signals import REPEAT_WINDOW_S, Terminated, UnwindOnSignals
when, pause = sys.argv[1], float(sys.argv[2])
atexit.register(print, "atexit ran", flush=True)
with UnwindOnSignals(grace_s=600):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    except Terminated:
        print("unwinding", flush=True)
    first = time.monotonic()
    if when == "unwinding":
        time.sleep(pause)
        os.kill(os.getpid(), signal.SIGTERM)     # the same request again, or a second one
        time.sleep(0.5)
print("cleaned up", flush=True)
if when == "after":
    os.kill(os.getpid(), signal.SIGTERM)         # the same request, after the unwind
    time.sleep(0.2)
    print("repeat ignored", flush=True)
    if pause:
        time.sleep(max(0.0, first + REPEAT_WINDOW_S + 0.2 - time.monotonic()))
        os.kill(os.getpid(), signal.SIGTERM)     # a new request: the default action, as before
        time.sleep(5)
        print("survived a new request", flush=True)
"""


@pytest.mark.parametrize("when, pause, rc, lines", [
    ("unwinding", 0.0, 0, ["unwinding", "cleaned up", "atexit ran"]),
    ("unwinding", 1.2, -signal.SIGTERM, ["unwinding"]),
    ("after", 0.0, 0, ["unwinding", "cleaned up", "repeat ignored", "atexit ran"]),
    ("after", 1.0, -signal.SIGTERM, ["unwinding", "cleaned up", "repeat ignored"]),
])
def test_a_second_sigterm_ends_at_once_but_a_repeat_does_not(when, pause, rc, lines):
    """coreutils `timeout` signals the command, then its process group: both reach the command.
    Taken for a second request, the repeat killed conversions in their cleanup (a partial
    destination left behind); arriving after the unwind (`kill` twice a few ms apart), it met
    the default handler the exit had put back (the process died by it, atexit skipped)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _SIGTERM_AGAIN, when, str(pause)],
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout.splitlines()) == (rc, lines), proc.stderr


_REPEAT_DURING_SHUTDOWN = """
import atexit, os, signal, sys, time
from jscenegen import cli
from jscenegen.signals import Terminated, UnwindOnSignals

class SlowToFinalise:          # finalised after CPython reset the handlers, as JAX's shutdown
    def __del__(self):
        time.sleep(1.0)

keep = SlowToFinalise()
with UnwindOnSignals(grace_s=600):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    except Terminated:
        pass
atexit.register(print, "exiting", flush=True)
atexit.register(cli._default_interrupt_at_exit)   # as cli.main registers it: runs first
sys.exit(143)
"""


def test_a_repeat_during_the_interpreter_shutdown_does_not_kill_the_process():
    """After atexit CPython resets Python handlers to the default action; a repeat sent 0.3 s
    later, during the last second of shutdown, ended train/eval/sft by the signal."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _REPEAT_DURING_SHUTDOWN],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "exiting"
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143


_CTRL_C_INSIDE_EXEC = """
import sys
from jscenegen import cli

def interrupted_inside_exec():
    exec("raise KeyboardInterrupt")   # a Ctrl-C landing in code that dataclasses generate

cli.build_parser = interrupted_inside_exec
sys.exit(cli.main([]))
"""


def test_a_ctrl_c_caught_after_it_left_an_exec_still_exits_130(tmp_path):
    """`python -m jscenegen.cli`: CPython took a KeyboardInterrupt out of exec() for one nobody
    caught and killed the process by SIGINT after it had printed its line and returned 130
    (1 in 6 Ctrl-Cs sent during `export`'s torch import)."""
    import subprocess
    import sys

    (tmp_path / "ctrl_c_inside_exec.py").write_text(_CTRL_C_INSIDE_EXEC)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(__file__).parent.parent)])}
    proc = subprocess.run([sys.executable, "-m", "ctrl_c_inside_exec"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.stderr.strip() == "error: interrupted (Ctrl-C)"
    assert proc.returncode == 130


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


_REPEAT_INSIDE_A_TAKE = """
import os, signal, time
from jscenegen.signals import STOP_REQUESTS, UnwindOnSignals

with UnwindOnSignals(grace_s=600):
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    except KeyboardInterrupt:
        print("unwinding", flush=True)
    with STOP_REQUESTS._lock:              # where the main thread is during a handler's take
        os.kill(os.getpid(), signal.SIGINT)  # the repeat, microseconds later (coreutils timeout)
        deadline = time.monotonic() + 1
        while time.monotonic() < deadline:   # bytecodes: the handler runs in here
            pass
print("cleaned up", flush=True)
"""


def test_a_repeat_whose_handler_runs_inside_a_take_does_not_hang_the_process():
    """The handler's `take` waited for the lock the main thread itself held (a plain Lock):
    the process hung, deaf to SIGTERM and SIGINT, until SIGKILL (helper-68, caught in gdb)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _REPEAT_INSIDE_A_TAKE], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["unwinding", "cleaned", "up"]


@pytest.mark.parametrize("signum, exc", [(signal.SIGINT, KeyboardInterrupt),
                                         (signal.SIGTERM, Terminated)])
def test_a_stop_during_torchs_import_is_raised_once_the_import_is_done(signum, exc):
    """Raised inside torch's import, a Ctrl-C met `torch._C._c10d_init()`'s C++ frames: "terminate
    called after throwing an instance of 'pybind11::error_already_set'", SIGABRT, and `convert`'s
    partial destination left behind. Here the module's top level stands for torch's."""
    module_top_level = compile("import os, signal, time\n"
                               "os.kill(os.getpid(), SIGNUM)\n"
                               "deadline = time.monotonic() + 0.5\n"
                               "while time.monotonic() < deadline:\n"
                               "    pass\n"
                               "done = True\n", "<torch/__init__.py>", "exec")
    module = {"__name__": "torch._import_under_test", "SIGNUM": signum}
    with pytest.raises(exc):
        with UnwindOnSignals(grace_s=600):
            exec(module_top_level, module)
            assert module.get("done")     # the import finished ...
            _bytecodes()                  # ... and the request was acted on after it
    assert module.get("done")


_CTRL_C_IN_TORCH_IMPORT = """
import importlib.abc, os, signal, sys
from jscenegen.signals import UnwindOnSignals

class SignalAtDistributed(importlib.abc.MetaPathFinder):   # torch's native c10d set-up is next
    def find_spec(self, name, path, target=None):
        if name == "torch.distributed":
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, SignalAtDistributed())
try:
    with UnwindOnSignals(grace_s=600):
        import torch
        print("imported", flush=True)
        while True:
            pass
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


@pytest.mark.slow   # imports torch: ~3 s
def test_a_ctrl_c_during_the_real_torch_import_waits_for_it():
    import subprocess
    import sys

    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, "-c", _CTRL_C_IN_TORCH_IMPORT], capture_output=True,
                          text=True, timeout=120)
    assert (proc.returncode, proc.stdout.split()) == (0, ["imported", "interrupted"]), proc.stderr


_CTRL_C_MID_READ = """
import os, signal, sys
from jscenegen import cli

class CutShort:   # asyncio's event loop, its constructor cut short by the Ctrl-C
    def __del__(self):
        raise AttributeError("'_UnixSelectorEventLoop' object has no attribute '_ssock'")

async def read_metadata():   # orbax's coroutines, created and never awaited
    pass

def interrupted_mid_read():
    loop, pending = CutShort(), read_metadata()
    os.kill(os.getpid(), signal.SIGINT)
    while True:
        pass

cli.build_parser = interrupted_mid_read
sys.argv = ["jscenegen"]
sys.exit(cli.main())
"""


@pytest.mark.parametrize("debug", [False, True])
def test_what_a_ctrl_c_cut_short_prints_nothing_after_the_commands_one_line(debug):
    """A Ctrl-C 4.5 s into `jscenegen export` (orbax reading the step's metadata) printed, after
    `error: interrupted (Ctrl-C)`, an "Exception ignored in BaseEventLoop.__del__" traceback
    (AttributeError: '_ssock') and three "coroutine ... was never awaited" warnings."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    env.pop("JSCENEGEN_DEBUG", None)
    if debug:
        env["JSCENEGEN_DEBUG"] = "1"
    proc = subprocess.run([sys.executable, "-c", _CTRL_C_MID_READ], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 130, proc.stderr
    if debug:   # the debugging view keeps them
        assert "_ssock" in proc.stderr and "never awaited" in proc.stderr, proc.stderr
    else:
        assert proc.stderr == "error: interrupted (Ctrl-C)\n"
