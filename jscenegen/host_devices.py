"""JAX's CPU backend as a several-device machine: how many devices, and threads enough for them.

Set through environment variables before JAX starts its CPU backend, so nothing here imports JAX.

XLA:CPU runs every device of a program on shared pools of max(`PJRT_NPROC`, else `NPROC`,
else the CPUs this process may use; devices) threads (xla/pjrt/utils.cc DefaultThreadPoolSize,
xla/pjrt/cpu/cpu_client.cc GetPjRtCpuClient), and a thread that reaches a collective blocks
until every participant has arrived. XLA 0.10's thunk executor can run two collectives of one
program on the same device at once (an `sp` pair's all-gather and an all-gather over all six
devices in the 3 x 2 mesh's train step, seen on a 2-core machine): with six threads, five
devices then held all six in collectives, the sixth device never ran, and XLA aborted after
40 s ("Termination timeout for `all gather ...`"). The pools are therefore sized at
`THREADS_PER_DEVICE` threads per device: a measured remedy (no abort in the runs that aborted
before), not a bound XLA guarantees. The extra threads mostly wait; the intra-op pool is then
larger than the cores (12 threads on 2 cores for 6 devices).
"""
from __future__ import annotations

import logging
import os
import re

log = logging.getLogger(__name__)

DEVICES_ENV = "JSCENEGEN_CPU_DEVICES"
DEFAULT_DEVICES = 6
MAX_DEVICES = 1024
THREADS_PER_DEVICE = 2
_FLAG = re.compile(r"(?:^|\s)--xla_force_host_platform_device_count=(\S*)")


def force_cpu_devices(environ=os.environ) -> int:
    """Choose the CPU backend's device count and size its thread pools, in `environ` (a
    mapping of environment variables, `os.environ` by default; written in place).

    The count, first found wins (JAX's own order): JAX_NUM_CPU_DEVICES (JAX's -1 means unset),
    the last `--xla_force_host_platform_device_count=N` in XLA_FLAGS, $JSCENEGEN_CPU_DEVICES,
    then `DEFAULT_DEVICES` (6: the 3 x 2 mesh is real on a CPU-only machine). Only the last two
    are written, as JAX_NUM_CPU_DEVICES. The pools: `size_cpu_thread_pool(count)`. Accelerator
    backends still use their own devices. Returns the CPU device count.
    Raises ValueError naming the variable when the count is not an integer in 1..MAX_DEVICES.
    """
    jax_count = environ.get("JAX_NUM_CPU_DEVICES", "").strip()
    flags = _FLAG.findall(environ.get("XLA_FLAGS", ""))
    if jax_count and jax_count != "-1":
        devices = _device_count("JAX_NUM_CPU_DEVICES", jax_count)
    elif flags:
        devices = _device_count("XLA_FLAGS --xla_force_host_platform_device_count", flags[-1])
    else:
        devices = (_device_count(DEVICES_ENV, environ[DEVICES_ENV]) if DEVICES_ENV in environ
                   else DEFAULT_DEVICES)
        environ["JAX_NUM_CPU_DEVICES"] = str(devices)
    size_cpu_thread_pool(devices, environ)
    return devices


def size_cpu_thread_pool(devices: int, environ=os.environ) -> None:
    """Set PJRT_NPROC in `environ` to max(CPUs this process may use, THREADS_PER_DEVICE x
    `devices`) unless it already holds a positive integer (the user's choice, kept; a warning
    when it is below THREADS_PER_DEVICE x devices). NPROC, which XLA reads after PJRT_NPROC
    and build shells often set to the core count, is overridden this way. Effective only
    before JAX's CPU backend starts (its first array or device query)."""
    wanted = THREADS_PER_DEVICE * devices
    chosen = environ.get("PJRT_NPROC", "").strip()
    if chosen.isascii() and chosen.isdigit() and int(chosen) > 0:
        if int(chosen) < wanted:
            log.warning("PJRT_NPROC=%s gives XLA:CPU fewer than %d threads for %d devices: a "
                        "program whose collectives overlap can deadlock (jscenegen/host_devices.py)",
                        chosen, wanted, devices)
        return
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    environ["PJRT_NPROC"] = str(max(cpus or 1, wanted))


def _device_count(name: str, value: str) -> int:
    value = value.strip()
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= MAX_DEVICES:
        raise ValueError(f"{name}={value!r}: a CPU device count must be an integer in "
                         f"1..{MAX_DEVICES}")
    return int(value)
