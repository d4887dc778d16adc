"""JAX's CPU backend as a several-device machine: how many devices, and threads enough for them.

Set through environment variables before JAX starts its CPU backend, so nothing here imports JAX.

XLA:CPU runs every device of a program on one shared pool of `max(PJRT_NPROC or the machine's
cores, devices)` threads, and a thread that reaches a collective blocks until every participant
has arrived. XLA 0.10's thunk executor can run two collectives of one program on the same
device at once (an `sp` pair's all-gather and an all-gather over all six devices of the 3 x 2
mesh's train step, measured on a 2-core machine): with six threads, five devices then hold all
six in collectives and the sixth device never runs, and XLA aborts after 40 s ("Termination
timeout for `all gather ...`"). The pool is therefore sized at `THREADS_PER_DEVICE` per device.
"""
from __future__ import annotations

import os
import re

DEVICES_ENV = "JSCENEGEN_CPU_DEVICES"
DEFAULT_DEVICES = 6
THREADS_PER_DEVICE = 2
# XLA's own names for its thread-pool size (xla/pjrt/utils.cc DefaultThreadPoolSize)
POOL_SIZE_ENVS = ("PJRT_NPROC", "NPROC")
_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def force_cpu_devices(environ=os.environ) -> int:
    """Give JAX's CPU backend $JSCENEGEN_CPU_DEVICES (default 6) devices, so the 3 x 2 mesh is
    real on a CPU-only machine (`JAX_NUM_CPU_DEVICES`), and its thread pool
    `THREADS_PER_DEVICE` threads per device (`size_cpu_thread_pool`). A device count already
    chosen with XLA_FLAGS or JAX_NUM_CPU_DEVICES is kept, as is a pool size set with PJRT_NPROC
    or NPROC. GPU/TPU backends are unaffected. Returns the CPU device count.
    Raises ValueError naming the variable when a device count is not a positive integer."""
    flag = _FLAG.search(environ.get("XLA_FLAGS", ""))
    if flag:
        devices = int(flag.group(1))
    elif "JAX_NUM_CPU_DEVICES" in environ:
        devices = _positive(environ, "JAX_NUM_CPU_DEVICES")
    else:
        devices = _positive(environ, DEVICES_ENV) if DEVICES_ENV in environ else DEFAULT_DEVICES
        environ["JAX_NUM_CPU_DEVICES"] = str(devices)
    size_cpu_thread_pool(devices, environ)
    return devices


def size_cpu_thread_pool(devices: int, environ=os.environ) -> None:
    """Set PJRT_NPROC to max(cores, THREADS_PER_DEVICE x devices) unless PJRT_NPROC or NPROC
    is set. Only effective before JAX's CPU backend starts (its first array or device query)."""
    if any(name in environ for name in POOL_SIZE_ENVS):
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    environ["PJRT_NPROC"] = str(max(cores or 1, THREADS_PER_DEVICE * devices))


def _positive(environ, name: str) -> int:
    value = environ[name].strip()
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name}={environ[name]!r}: a CPU device count must be a positive integer")
    return int(value)
