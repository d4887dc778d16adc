"""The rollout layout: where the sampler's weights and rows live, chosen once per run.

Three layouts (rules.py has the specs):
  - `replicated`: the weights whole on every device (matmul and embedding weights in the
    rollout dtype, the rest in their own: `rules.rollout_casts`), batch rows split
    over all devices (mesh ("data", "tp") = (devices, 1)). Decoding moves no weight bytes.
  - `tp`: Megatron tensor parallelism over a `tp` axis of `tp` devices (column/row split of
    q/k/v/o and the MLP, vocabulary split of the embedding), rows over the other
    devices / tp. Per token only activations cross devices: two all-reduces of [rows, hidden]
    per layer and one gather of the logits.
  - `fsdp`: decode on the training arrays (FSDP2 dim-0 shards over all devices): every layer's
    weights are all-gathered for every token. Today's behaviour, kept for comparison.
`auto` picks `replicated` when the rollout weights (those bytes) fit `memory_fraction` of one
device's memory, else `tp` with the smallest tensor size that fits and divides the heads.

The rollout mesh uses the training mesh's devices in the same order (a jit may read training
arrays and write rollout arrays), reshaped to ("data", "tp") with tp-adjacent devices grouped.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Literal

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding

from jscenegen.sharding.mesh import max_over_processes
from jscenegen.sharding.rules import ROLLOUT_AXES, ROLLOUT_SPECS, TRAINING_SPECS, ActivationSpecs

log = logging.getLogger(__name__)

LayoutName = Literal["replicated", "tp", "fsdp"]


@dataclasses.dataclass(frozen=True)
class RolloutLayout:
    """Where the sampler computes.

    name: "replicated" | "tp" | "fsdp"; mesh: the mesh its arrays live on (the rollout mesh
    ("data", "tp"), the training mesh for fsdp, or None: one device, no sharding); tp: tensor
    size; transposed: matmul weights stored [in, out] (the faster orientation of XLA:CPU's
    matmul; GPU/TPU read either); reason: why it was chosen (logged).
    """

    name: LayoutName
    mesh: Mesh | None
    tp: int = 1
    transposed: bool = False
    reason: str = ""

    @property
    def specs(self) -> ActivationSpecs:
        return TRAINING_SPECS if self.name == "fsdp" else ROLLOUT_SPECS

    @property
    def row_multiple(self) -> int:
        """Batch rows must be a multiple of this (rows are split over it)."""
        if self.mesh is None:
            return 1
        return self.mesh.shape["fsdp"] if self.name == "fsdp" else self.mesh.shape["data"]

    def sharding(self, role: str) -> NamedSharding | None:
        """The NamedSharding of activation role `role` (rules.ROWS, CACHED_KV, ...), or None
        without a mesh."""
        if self.mesh is None:
            return None
        return NamedSharding(self.mesh, self.specs.specs[role])

    def describe(self) -> str:
        shape = "" if self.mesh is None else " " + "x".join(
            f"{a}={n}" for a, n in self.mesh.shape.items())
        return f"{self.name}{shape} ({self.reason})" if self.reason else f"{self.name}{shape}"


def check_tp_divides(tp: int, n_devices: int) -> None:
    """Raise ValueError unless the tensor size `tp` (rollout.tp) divides `n_devices`."""
    if tp < 1 or n_devices % tp:
        raise ValueError(f"rollout.tp={tp} must divide the {n_devices} devices")


def rollout_mesh(mesh: Mesh, tp: int) -> Mesh:
    """The training mesh's devices, in order, as a ("data", "tp") mesh with tensor size `tp`.

    Raises ValueError when tp does not divide the device count."""
    devices = np.asarray(mesh.devices).reshape(-1)
    check_tp_divides(tp, devices.size)
    return Mesh(devices.reshape(devices.size // tp, tp), ROLLOUT_AXES,
                axis_types=(AxisType.Auto, AxisType.Auto))


def _least_over_processes(own: int | None) -> int | None:
    """The least of `own` over the processes of a run (whole MiB), None when a process says
    None; `own` itself with one process. A collective: every process calls it at the same point."""
    if jax.process_count() == 1:
        return own
    mib_cap = 2**31 - 1    # max_over_processes is int32
    if max_over_processes(int(own is None)):
        return None
    return -max_over_processes(-min(own // 2**20, mib_cap)) * 2**20


def least_device_memory_bytes() -> int | None:
    """The least `device_memory_bytes()` over the processes of a run (whole MiB), None when a
    process cannot tell; `device_memory_bytes()` itself with one process. A collective: every
    process calls it at the same point, so that all of them choose one rollout layout alike
    (hosts may differ in memory, cgroup limits or the allocator fraction)."""
    return _least_over_processes(device_memory_bytes())


def least_free_device_memory_bytes() -> int | None:
    """The least `free_device_memory_bytes()` over the processes of a run (whole MiB), None
    when a process cannot tell. A collective, so that every process judges a cache's fit alike
    (one refusing alone would leave its peers waiting in the next collective)."""
    return _least_over_processes(free_device_memory_bytes())


def device_memory_bytes(device: jax.Device | None = None) -> int | None:
    """Memory of one device (its allocator limit on GPU/TPU; on CPU the host's RAM divided by the
    local devices), or None when unknown."""
    device = device or jax.local_devices()[0]
    stats = _memory_stats(device)
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if device.platform == "cpu" and (total := host_memory_bytes()) is not None:
        return total // max(1, jax.local_device_count())
    return None


def free_device_memory_bytes(device: jax.Device | None = None) -> int | None:
    """Memory one device can still take, in bytes: its allocator's limit less its bytes in use
    (GPU/TPU: the weights, the optimizer state and every other live array); on CPU what the host
    has available now (`available_memory_bytes`) divided by the local devices; None when unknown."""
    device = device or jax.local_devices()[0]
    stats = _memory_stats(device)
    if stats and stats.get("bytes_limit") and "bytes_in_use" in stats:
        return max(int(stats["bytes_limit"]) - int(stats["bytes_in_use"]), 0)
    if device.platform == "cpu" and (free := available_memory_bytes()) is not None:
        return free // max(1, jax.local_device_count())
    return None


def _memory_stats(device: jax.Device) -> dict | None:
    try:
        return device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        return None


CGROUP_MEMORY = (   # (limit, usage) of the container's memory cgroup
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),                    # v2
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)
MEMINFO = "/proc/meminfo"


def _read_int(path: str) -> int | None:
    """The integer a small kernel file holds; None when it cannot be read or holds none
    (a cgroup v2 limit of "max")."""
    try:
        with open(path) as f:
            text = f.read(64).strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def host_memory_bytes() -> int | None:
    """The memory this process may use, in bytes: the host's physical memory (sysconf), or
    the container's cgroup limit when lower; None when the OS says neither."""
    try:
        limits = [int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))]
    except (ValueError, OSError, AttributeError):
        limits = []
    limits += [n for limit, _ in CGROUP_MEMORY if (n := _read_int(limit)) is not None]
    return min(limits) if limits else None


def available_memory_bytes() -> int | None:
    """The memory this process can take now, in bytes: the least of the kernel's MemAvailable
    (/proc/meminfo), what the container's cgroup has left (its limit less its usage) and
    `host_memory_bytes`; None when the OS says none of them."""
    free = [n for n in (host_memory_bytes(),) if n is not None]
    for limit, usage in CGROUP_MEMORY:
        cap, used = _read_int(limit), _read_int(usage)
        if cap is not None and used is not None:
            free.append(max(cap - used, 0))
    try:
        with open(MEMINFO) as f:
            for line in f.read(1 << 16).splitlines():
                fields = line.split()
                if fields[:1] == ["MemAvailable:"] and len(fields) > 1 and fields[1].isdigit():
                    free.append(int(fields[1]) * 1024)
    except OSError:
        pass
    return min(free) if free else None


def tp_candidates(n_devices: int, divides: tuple[int, ...]) -> list[int]:
    """Tensor sizes that divide the device count and every size in `divides` (head counts,
    FFN size), increasing."""
    return [t for t in range(1, n_devices + 1)
            if n_devices % t == 0 and all(d % t == 0 for d in divides)]


def choose_rollout_layout(mesh: Mesh | None, choice: str = "auto", *, weight_bytes: int,
                          divides: tuple[int, ...] = (), tp: int | None = None,
                          memory_fraction: float = 0.25,
                          device_bytes: int | None | Literal["local"] = "local",
                          platform: str | None = None) -> RolloutLayout:
    """Resolve the `rollout.layout` choice.

    mesh: the training mesh (None: one device, the unsharded sampler). choice: "auto",
    "replicated", "tp" or "fsdp". weight_bytes: the rollout weights' size (`Sampler`: matmul and embedding weights in the
    rollout dtype, the rest in their own).
    divides: sizes a tensor split must divide (kv heads, heads, FFN size). tp: the tensor size
    for "tp" (None: the smallest candidate > 1 that fits; "auto" with nothing fitting takes the
    largest). memory_fraction: the share of one device's memory the rollout weights may take
    under `replicated`; device_bytes: that memory in bytes, None when unknown (never read
    again: in a multi-process run every process must decide alike, see
    `least_device_memory_bytes`), "local" this process's own `device_memory_bytes()`.
    Without a mesh (one device) every choice is `replicated`. Raises ValueError for an
    unknown choice or, under "tp" and "auto", a tp that does not fit the mesh and heads
    (`replicated` and `fsdp` read no tp).
    """
    platform = platform or jax.default_backend()
    transposed = platform == "cpu"
    if choice not in ("auto", "replicated", "tp", "fsdp"):
        raise ValueError(f"rollout.layout must be auto, replicated, tp or fsdp, got {choice!r}")
    if mesh is None:
        return RolloutLayout("replicated", None, 1, transposed, "one device")
    if choice == "fsdp":
        return RolloutLayout("fsdp", mesh, 1, False, "configured")
    if choice == "replicated":   # rollout.tp is not read
        return RolloutLayout("replicated", rollout_mesh(mesh, 1), 1, transposed, "configured")
    n = mesh.size
    cands = tp_candidates(n, divides)
    if tp is not None and tp not in cands:
        raise ValueError(f"rollout.tp={tp} must divide the {n} devices and {divides} "
                         f"(kv heads, heads, FFN); choose from {cands}")
    budget = None
    if choice == "auto":
        device_bytes = device_memory_bytes() if device_bytes == "local" else device_bytes
        budget = None if device_bytes is None else memory_fraction * device_bytes
        if budget is None or weight_bytes <= budget:
            why = ("device memory unknown" if budget is None else
                   f"weights {weight_bytes / 2**30:.2f} GiB <= {memory_fraction:g} x "
                   f"{device_bytes / 2**30:.1f} GiB per device")
            return RolloutLayout("replicated", rollout_mesh(mesh, 1), 1, transposed, why)
    if tp is None:
        split = [t for t in cands if t > 1]
        if not split:
            raise ValueError(f"no tensor size > 1 divides the {n} devices and {divides}; "
                             "use rollout.layout=replicated or fsdp")
        fits = [t for t in split if budget is None or weight_bytes / t <= budget]
        tp = fits[0] if fits else split[-1]
    why = "configured" if choice == "tp" else (
        f"weights {weight_bytes / 2**30:.2f} GiB > {memory_fraction:g} x device memory; "
        f"1/{tp} per device")
    return RolloutLayout("tp", rollout_mesh(mesh, tp), tp, transposed, why)
