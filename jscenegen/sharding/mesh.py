"""The ("fsdp", "sp") device mesh, on one host or many: the multi-host launch
(`initialize_distributed`, `check_same_settings`) and the few cross-process collectives the
trainer's host code needs (`host_array`, `max_over_processes`, `bytes_from_primary`,
`on_primary`).

Axes are `AxisType.Auto` (GSPMD propagation with explicit constraints at block boundaries),
chosen deliberately: in jax >= 0.10 `jax.make_mesh` defaults to Explicit axes, under which
sharding becomes part of every array type and indivisible Qwen sizes would need reshards
everywhere. Tests assert the resulting shardings of every parameter.
"""
from __future__ import annotations

import collections
import errno
import json
import math
import os
import socket
import threading
import time
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh
from pydantic import Field

from jscenegen.config import Section
from jscenegen.paths import is_decimal
from jscenegen.sharding.rules import AXES
from jscenegen.text import clip_text

MAX_PROCESSES = 1 << 20


class MeshConfig(Section):
    """The `mesh:` section: device mesh ("fsdp", "sp"); fsdp = -1 takes the remaining devices;
    the multi-host launch values (else from JSCENEGEN_COORDINATOR/_NUM_PROCESSES/_PROCESS_ID)."""

    fsdp: int = Field(-1, description="devices on the fsdp axis (training batch rows split over it; "
                      "parameters and Adam moments shard dim 0 over fsdp x sp); -1: the device "
                      "count / sp; fsdp x sp must equal the devices of all processes")
    sp: int = Field(2, description="devices on the sp (sequence-parallel) axis: training sequence "
                    "positions split over it; must divide the device count")
    coordinator_address: str | None = Field(None, min_length=1, description="host:port of process 0's JAX "
                                            "coordinator for a multi-host launch (jscenegen "
                                            "train only; give all three launch values, as keys "
                                            "or variables, or none); null: $JSCENEGEN_COORDINATOR")
    num_processes: int | None = Field(None, ge=1, le=MAX_PROCESSES, description="processes (one per "
                                      "host) of a multi-host launch; null: "
                                      "$JSCENEGEN_NUM_PROCESSES; 1 without a coordinator "
                                      "address: one process")
    process_id: int | None = Field(None, ge=0, lt=MAX_PROCESSES, description="this process's index "
                                   "in 0..num_processes-1 (0 writes the run files; each process's "
                                   "own, so a run's config.yaml keeps null); null: "
                                   "$JSCENEGEN_PROCESS_ID")
    init_timeout_s: int = Field(300, ge=1, le=86400, description="how long each process of a "
                                "multi-host launch waits for the others to join")


class MeshError(ValueError):
    """A mesh request the devices cannot satisfy; the message says what would fit."""


MAX_DEVICES = 1 << 20


def _divisors(n: int) -> list[int]:
    """The divisors of n in increasing order (O(sqrt n))."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def mesh_shape(n_devices: int, fsdp: int = -1, sp: int = 2) -> tuple[int, int]:
    """Resolve (fsdp, sp) for `n_devices`; fsdp = -1 takes the remaining devices.

    Raises MeshError when the sizes are not positive or do not multiply to the device count
    (listing the sizes that would), or the count lies outside [1, MAX_DEVICES].
    """
    if not 1 <= n_devices <= MAX_DEVICES:
        raise MeshError(f"{n_devices:,} devices: plans cover 1 to {MAX_DEVICES:,} devices")
    if sp < 1 or (fsdp != -1 and fsdp < 1):
        raise MeshError(f"mesh.fsdp={fsdp}, mesh.sp={sp}: mesh sizes must be positive; "
                        "mesh.fsdp=-1 takes the rest")
    if fsdp == -1:
        if n_devices % sp:
            raise MeshError(f"mesh.sp={sp} does not divide the {n_devices} devices; "
                            f"choose mesh.sp from {_divisors(n_devices)}")
        fsdp = n_devices // sp
    if fsdp * sp != n_devices:
        fits = ", ".join(f"fsdp={n_devices // d} x sp={d}" for d in _divisors(n_devices))
        raise MeshError(f"mesh.fsdp={fsdp} x mesh.sp={sp} = {fsdp * sp} does not match the "
                        f"{n_devices} devices; sizes that fit: {fits} (mesh.fsdp=-1 takes the rest)")
    return fsdp, sp


def make_mesh(fsdp: int = -1, sp: int = 2, devices=None) -> Mesh:
    """A Mesh with axes ("fsdp", "sp") over `devices` (default: all devices of all processes)."""
    devices = list(devices if devices is not None else jax.devices())
    shape = mesh_shape(len(devices), fsdp, sp)
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, *,
                           announce: Callable[[str], None] | None = None,
                           timeout_s: int = 300, same: dict[str, str] | None = None,
                           same_install: dict[str, str] | None = None) -> bool:
    """Start JAX's multi-controller runtime when a multi-process launch is configured.

    Values come from the arguments (the run config's `mesh` section), else the environment
    (`JSCENEGEN_COORDINATOR`, `JSCENEGEN_NUM_PROCESSES`, `JSCENEGEN_PROCESS_ID`). Returns True
    when `jax.distributed.initialize` was called (False for one process). On CPU,
    cross-process collectives use gloo. Before waiting, `announce` gets one line saying what
    this process waits for; the wait (at most `timeout_s`, JAX's initialization timeout) keeps
    the main thread free, so Ctrl-C and SIGTERM end it. Once joined, the processes check that
    each runs the same install `same_install` (e.g. the package's code and jax's version: first,
    as another version may know other settings), then that each was given the same settings
    `same` and the same process count (`check_same_settings`).

    Raises MeshError, naming the config key or environment variable, when only some of the
    three values are given, an environment value is not an integer, num_processes is outside
    1..MAX_PROCESSES, the process id is outside 0..num_processes-1, the address is not host:port
    or its host does not resolve, or (process 0) its port is in use on this host; and when the
    processes did not all join in time, or were given other settings.
    """
    addr, addr_from = ((coordinator_address, "mesh.coordinator_address") if coordinator_address
                       else (os.environ.get("JSCENEGEN_COORDINATOR") or None, "JSCENEGEN_COORDINATOR"))
    n, n_from = _launch_value(num_processes, "num_processes", "JSCENEGEN_NUM_PROCESSES")
    pid, pid_from = _launch_value(process_id, "process_id", "JSCENEGEN_PROCESS_ID")
    if n is not None and not 1 <= n <= MAX_PROCESSES:
        raise MeshError(f"multi-host launch: {n_from}={clip_text(str(n), 40)} must lie in "
                        f"1..{MAX_PROCESSES:,}")
    if n is not None and pid is not None and not 0 <= pid < n:
        raise MeshError(f"multi-host launch: {pid_from}={clip_text(str(pid), 40)} must lie in 0..{n - 1} "
                        f"({n_from}={n})")
    if not _is_multi_host(addr, n, pid):
        return False
    if not all(v is not None for v in (addr, n, pid)):
        raise MeshError("multi-host launch needs coordinator_address, num_processes and process_id "
                        "(mesh.* config keys or JSCENEGEN_COORDINATOR/_NUM_PROCESSES/_PROCESS_ID)")
    host, _, port = addr.rpartition(":")
    if not host or not is_decimal(port):
        raise MeshError(f"multi-host launch: {addr_from}={addr!r} is not host:port "
                        "(e.g. host0:8476)")
    if not 0 < int(port) < 65536:
        raise MeshError(f"multi-host launch: {addr_from}={addr!r}: the port must lie in 1..65535")
    bracketed = host.startswith("[") and host.endswith("]")
    if (":" in host) != bracketed or (bracketed and ":" not in host[1:-1]):
        raise MeshError(f"multi-host launch: {addr_from}={addr!r}: an IPv6 host is written in "
                        "brackets ([::1]:8476), and only an IPv6 host")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port))
    except OSError as err:
        raise MeshError(f"multi-host launch: the coordinator host {host!r} ({addr_from}) does not "
                        f"resolve ({err.strerror or err})") from None
    hint = "; one that was not started or failed before joining says so in its own output"
    if pid == 0:
        _check_port_free(int(port), addr_from)
        if not _is_an_address_here(host.strip("[]")):   # may still route here (a cluster service)
            hint += (f"; process 0 serves the coordinator, and {host} is not an address of "
                     f"this host: check that {addr} reaches it")
    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service installs a native SIGTERM handler that only marks a sync point
    # (orbax saves there, treating a disabled service as no preemption): the CLI's own handlers
    # stop a run, and a SIGTERM between joining and the trainer's loop was lost
    jax.config.update("jax_enable_preemption_service", False)
    if announce is not None:
        announce(f"process {pid} of {n}: waiting for the others at {addr} (at most {timeout_s} s)")
    # JAX's own deadline comes later: when it passes, its client ends the process with a
    # native stack trace rather than an exception
    _wait_interruptibly(lambda: jax.distributed.initialize(
        coordinator_address=addr, num_processes=n, process_id=pid,
        initialization_timeout=timeout_s + 60), timeout_s,
        f"the {n} processes did not all join at {addr}", hint)
    if same_install:
        check_same_settings(same_install, "install the same jscenegen and jax on every host")
    check_same_settings({**(same or {}), "num_processes": str(n)})  # JAX does not compare them
    return True


def asks_for_multi_host(cfg: MeshConfig) -> bool:
    """Whether the launch keys of `cfg`, else the environment, ask for a multi-host launch: the
    values `initialize_distributed` then joins with (or refuses, when only some are given).
    Raises MeshError naming the environment variable whose value is not an integer."""
    addr = cfg.coordinator_address or os.environ.get("JSCENEGEN_COORDINATOR") or None
    n = _launch_value(cfg.num_processes, "num_processes", "JSCENEGEN_NUM_PROCESSES")[0]
    pid = _launch_value(cfg.process_id, "process_id", "JSCENEGEN_PROCESS_ID")[0]
    return _is_multi_host(addr, n, pid)


def _is_multi_host(addr: str | None, n: int | None, pid: int | None) -> bool:
    """Whether launch values (None: not given) ask for several processes: any of them but a
    process count of 1 without a coordinator address."""
    return any(v is not None for v in (addr, n, pid)) and not (n == 1 and addr is None)


_init_thread_left_running = False


def init_wait_abandoned() -> bool:
    """True when `initialize_distributed` stopped waiting (timeout, Ctrl-C, SIGTERM) while JAX's
    initialization still blocks in native code. The process should then end without the
    interpreter's clean-up: the coordination service's teardown waits for that call and logs
    its aborted barrier (seconds of native log lines after the command's own error)."""
    return _init_thread_left_running


def joined_other_processes() -> bool:
    """Whether this process joined a multi-process run (`jax.distributed` initialized, more
    than one process). Such a process that fails or stops should end without JAX's shutdown
    barrier: it waits up to 5 minutes for every other process, which may be blocked in a
    collective waiting for this one."""
    return jax.distributed.is_initialized() and jax.process_count() > 1


PEERS_ENDING_WAIT_S = 5.0


def end_after_peers_that_end(timeout_s: float = PEERS_ENDING_WAIT_S) -> None:
    """Call before a process of a joined run ends without JAX's clean-up (`os._exit`): it says
    so in the coordination service, and process 0, which hosts the service, waits (at most
    `timeout_s`) for every other process to say so too. A process still on its way out when
    the service goes (as after a refusal every process makes) is aborted by JAX with a native
    stack trace, exit -6, instead of its own exit code; a process that does not end (blocked in
    a collective) costs process 0 the wait."""
    from jax._src import distributed

    client = distributed.global_state.client
    if _init_thread_left_running or client is None or not joined_other_processes():
        return   # (an abandoned join: its client never connected)
    pid = jax.process_index()
    try:
        client.key_value_set(f"jscenegen/ending/{pid}", "1")
        if pid != 0:
            return
        deadline = time.monotonic() + timeout_s
        for other in range(1, jax.process_count()):
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                return
            client.blocking_key_value_get(f"jscenegen/ending/{other}", left_ms)
    except Exception:   # a timeout or the service gone: end now
        return
    time.sleep(0.1)     # their exit right after the key


def fails_the_joined_run(err: BaseException) -> bool:
    """Whether `err` is JAX's runtime error (a failed computation or collective: a peer gone)
    in a process of a multi-process run: the processes are then out of step, so no caller may
    mask it and go on (the next collective would fail again, or wait)."""
    return isinstance(err, jax.errors.JaxRuntimeError) and joined_other_processes()


def _wait_interruptibly(call: Callable[[], None], timeout_s: float, failure: str,
                        timeout_hint: str = "") -> None:
    """Run `call` in a daemon thread while the main thread waits in short steps, so a signal
    handler (Ctrl-C, SIGTERM) runs during a wait that blocks in native code. Raises MeshError
    naming `failure` when `call` raised, or naming `failure` and `timeout_hint` when it took
    longer than `timeout_s`."""
    global _init_thread_left_running
    errors: list[BaseException] = []
    # an Event, not Thread.is_alive: a join interrupted by Ctrl-C can leave a live thread
    # reported as ended (CPython 3.11)
    finished = threading.Event()

    def target():
        try:
            call()
        except BaseException as err:  # noqa: BLE001 - handed to the main thread
            errors.append(err)
        finally:
            finished.set()
    threading.Thread(target=target, name="jscenegen-distributed-init", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    try:
        while not finished.is_set() and time.monotonic() < deadline:
            finished.wait(0.2)
    finally:
        _init_thread_left_running = not finished.is_set()
    if _init_thread_left_running:
        raise MeshError(f"multi-host launch: {failure} within {timeout_s} s "
                        f"(mesh.init_timeout_s){timeout_hint}")
    if errors:
        raise MeshError(f"multi-host launch: {failure} ({type(errors[0]).__name__}: "
                        f"{str(errors[0]).splitlines()[0] if str(errors[0]) else ''})") from None


def check_same_settings(settings: dict[str, str],
                        advice: str = "start every process with the same command and settings "
                                      "(only JSCENEGEN_PROCESS_ID differs)") -> None:
    """Raise MeshError on every process unless every process of a multi-process run has the
    same number of devices (the exchange needs it) and was given the same `settings` (flat
    {name: value}; a no-op in one process): processes that disagree
    (another run directory, group size or process count) would train different batches as one
    and deadlock in the first collective that differs. The process that differs names the
    first setting; the others say that another process differs; both end with `advice`. Values
    are not printed (they may hold credentials)."""
    if jax.process_count() == 1:
        return
    # every process sees every device, so each finds a mismatch alone (the exchange below
    # needs the same number of devices in every process)
    per_process = collections.Counter(d.process_index for d in jax.devices())
    if len(set(per_process.values())) > 1:
        counts = ", ".join(f"process {i}: {n}" for i, n in sorted(per_process.items()))
        raise MeshError(f"multi-host launch: the processes have different numbers of devices "
                        f"({counts}); give each the same (on CPU, JSCENEGEN_CPU_DEVICES)")
    theirs = json.loads(bytes_from_primary(json.dumps(settings).encode() if is_primary() else None))
    differ = sorted(k for k in settings.keys() | theirs.keys() if settings.get(k) != theirs.get(k))
    if not max_over_processes(int(bool(differ))):
        return
    if differ:
        more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
        raise MeshError(f"multi-host launch: process {jax.process_index()} was given another "
                        f"{differ[0]}{more} than process 0; {advice}")
    raise MeshError("multi-host launch: another process was given other settings than this one "
                    f"(its error names them); {advice}")


def refuse_multi_host(command: str, cfg: MeshConfig) -> None:
    """Raise MeshError when `cfg` (its `mesh.*` launch keys) or the environment
    (JSCENEGEN_NUM_PROCESSES) asks for several processes: `command` runs in one process, and
    the same command on every host would write the same outputs."""
    asked = [f"mesh.{key}={value}" for key in ("coordinator_address", "num_processes", "process_id")
             if (value := getattr(cfg, key)) is not None and not (key == "num_processes" and value == 1)]
    env = os.environ.get("JSCENEGEN_NUM_PROCESSES", "").strip()
    if env not in ("", "1"):
        asked.append(f"JSCENEGEN_NUM_PROCESSES={env[:40]}")
    if asked:
        verb = "asks" if len(asked) == 1 else "ask"
        raise MeshError(f"jscenegen {command} runs in one process; {', '.join(asked)} {verb} for "
                        "a multi-host launch, which is for jscenegen train (unset it here)")


def _launch_value(value: int | None, key: str, variable: str) -> tuple[int | None, str]:
    """A launch count or index and where it came from: the `mesh.<key>` config value, else the
    environment `variable` (an integer in ASCII digits; empty: unset). Raises MeshError naming
    the variable when it is not one."""
    if value is not None:
        return value, f"mesh.{key}"
    v = os.environ.get(variable)
    if v in (None, ""):
        return None, variable
    text = v.strip()
    if not (text.isascii() and text.removeprefix("-").isdigit() and len(text) <= 4000):
        raise MeshError(f"multi-host launch: environment variable {variable}={v[:40]!r} is not "
                        "an integer")
    return int(text), variable


def _is_an_address_here(host: str) -> bool:
    """Whether some address `host` resolves to belongs to this machine (a socket binds to it)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((address[0], 0) + tuple(address[2:]))
            return True
        except OSError:
            continue
    return False


def _check_port_free(port: int, source: str) -> None:
    """Raise MeshError when `port` has a listener on this host (IPv4 or IPv6): process 0 serves
    the coordinator there, and JAX would report only that the processes "did not all join"."""
    for family, anywhere in ((socket.AF_INET, ""), (socket.AF_INET6, "::")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:   # a host without IPv6
            continue
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            probe.bind((anywhere, port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise MeshError(f"multi-host launch: port {port} of {source} is in use on this "
                                "host, where process 0 serves the coordinator (by another "
                                "program, or by a process 0 already started: each process "
                                "needs its own JSCENEGEN_PROCESS_ID); choose a free port") from None
        finally:
            probe.close()


def is_primary() -> bool:
    """True on the process that writes metadata and logs (process 0)."""
    return jax.process_index() == 0


# The helpers below are collectives in a multi-process run: every process calls them at the
# same point of the same program (each process runs the whole trainer on the same data).

def host_array(x) -> np.ndarray:
    """The whole value of `x` as a NumPy array on this host.

    A jax.Array that spans devices of other processes (rows split over a multi-host mesh) is
    all-gathered across processes (`multihost_utils.process_allgather`); an array this process
    holds entirely, or holds a full replica of, is read as it is (no collective).
    """
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def max_over_processes(value: int) -> int:
    """The largest of every process's `value` (int32 range); `value` itself in one process."""
    if jax.process_count() == 1:
        return int(value)
    return int(np.max(multihost_utils.process_allgather(np.int32(value))))


def processes_apart(values) -> list[int]:
    """The processes whose `values` (a small int array of the same shape everywhere) differ
    from process 0's; [] in one process. A collective (`multihost_utils.process_allgather`)."""
    if jax.process_count() == 1:
        return []
    seen = np.asarray(multihost_utils.process_allgather(np.asarray(values, np.int32)))
    return [p for p in range(seen.shape[0]) if not np.array_equal(seen[p], seen[0])]


def on_primary(fn: Callable[[], Any], error_type: type[Exception] = ValueError) -> None:
    """Run `fn` on process 0 only, and raise on every process when it raised there: process 0
    its own exception, the others `error_type` with process 0's message (an exception of another
    type prefixed with its name). A collective (`bytes_from_primary`): every process calls it at
    the same point, so that a refusal on process 0 does not leave the others in the next
    collective (they died in a native abort, exit 134, without the reason)."""
    refusal, shown = None, ""
    if is_primary():
        try:
            fn()
        except Exception as err:
            refusal = err
            shown = str(err) if isinstance(err, error_type) else f"{type(err).__name__}: {err}"
            shown = shown or type(err).__name__
    shared = bytes_from_primary(shown.encode())
    if refusal is not None:
        raise refusal
    if shared:
        raise error_type(shared.decode())


def bytes_from_primary(data: bytes | None) -> bytes:
    """Process 0's `data` on every process (the others' `data` is not read); `data` in one
    process.

    Two broadcasts: the length, then the bytes (`multihost_utils.broadcast_one_to_all`).
    """
    if jax.process_count() == 1:
        return data or b""
    payload = np.frombuffer(data, np.uint8) if is_primary() else np.zeros(0, np.uint8)
    n = int(multihost_utils.broadcast_one_to_all(np.int64(payload.size)))
    if n == 0:
        return b""
    buf = payload if is_primary() else np.zeros(n, np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(buf), np.uint8).tobytes()
