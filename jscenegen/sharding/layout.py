"""FSDP2-style parameter layout and batch sharding on the ("fsdp", "sp") mesh.

Every parameter and both Adam moments are split along dim 0 across all mesh devices
(fsdp x sp), dim 0 zero-padded to a multiple of the device count: device r holds rows
[r*c, (r+1)*c) with c = ceil(n / W), as torch FSDP2's `Shard(0)` does (the padding is its
last ranks' empty tail). Batches: rows over `fsdp`, sequence over `sp`. Specs: `rules`.
"""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from jscenegen.sharding.rules import PARAM, batch_spec, named, padded_shape, round_up


def shard_model(model: nnx.Module, mesh) -> nnx.Module:
    """Place every parameter of a model built with pad_multiple == mesh.size onto the mesh.

    Raises ValueError when a parameter's dim 0 is not a multiple of the device count.
    """
    sharding = named(mesh, PARAM)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var[...]
        if value.shape[0] % mesh.size:
            name = ".".join(map(str, path))
            raise ValueError(f"{name}: dim 0 ({value.shape[0]}) is not padded to a multiple of "
                             f"{mesh.size}; build the model with pad_multiple={mesh.size}")
        var.set_value(jax.device_put(value, sharding))
    return model


def pad_rows(n: int, mesh) -> int:
    """Rows after padding a batch of n to a multiple of the fsdp axis."""
    f = mesh.shape["fsdp"]
    return round_up(n, f)


def pad_batch(arrays: dict[str, np.ndarray], mesh, seq_multiple: int | None = None) -> dict[str, np.ndarray]:
    """Zero-pad every [B, T, ...] array: rows to a multiple of `fsdp` (zero-mask rows that count
    in no normaliser) and T to a multiple of `seq_multiple` (default: the `sp` size)."""
    seq_multiple = seq_multiple or mesh.shape["sp"]
    out = {}
    for k, a in arrays.items():
        a = np.asarray(a)
        rows = pad_rows(a.shape[0], mesh) - a.shape[0]
        widths = [(0, rows)] + [(0, 0)] * (a.ndim - 1)
        if a.ndim >= 2:
            widths[1] = (0, round_up(a.shape[1], seq_multiple) - a.shape[1])
        out[k] = np.pad(a, widths)
    return out


def shard_batch(arrays: dict[str, np.ndarray], mesh) -> dict[str, jax.Array]:
    """Place padded [B, T, ...] host arrays on the mesh (rows over fsdp, tokens over sp).

    Multi-host: every process passes the same global arrays; each device takes its slice.
    """
    out = {}
    for k, a in arrays.items():
        sharding = named(mesh, batch_spec(a.ndim))
        out[k] = jax.make_array_from_callback(a.shape, sharding, lambda idx, a=a: a[idx])
    return out


def layout_report(shapes: dict[str, tuple[int, ...]], n_devices: int,
                  mesh_axes: dict[str, int], frozen: dict[str, int] | None = None) -> dict:
    """Per-parameter global, padded and per-device shapes and bytes of params + Adam (fp32).

    shapes: {hf_name: logical shape} (`model.weights.param_shapes`, with `carried=True` to
    include carried tensors); no arrays are made. frozen: {hf_name: bytes per element} of
    tensors that are held but not trained (Qwen3.5's carried vision tower and MTP head, in
    their stored dtype): no Adam moments. `total_bytes` is params (+ two Adam moments for
    trained ones) at logical size; `max_device_bytes` is the fullest device's share including
    padding; `frozen_bytes` the part of total_bytes that is frozen.
    """
    frozen = frozen or {}
    rows = []
    total = frozen_total = device_bytes = 0   # every device holds the same padded rows
    for name, shape in shapes.items():
        padded = padded_shape(shape, n_devices)
        c = padded[0] // n_devices
        elements = int(np.prod(shape[1:], dtype=np.int64))
        per_row = elements * (frozen[name] if name in frozen else 4 * 3)  # param + mu + nu, fp32
        device_bytes += c * per_row
        total += shape[0] * per_row
        if name in frozen:
            frozen_total += shape[0] * per_row
        rows.append({"name": name, "shape": list(shape), "padded_shape": list(padded),
                     "spec": "P(('fsdp','sp'))", "rows_per_device": c,
                     "device_bytes": c * per_row, "trained": name not in frozen})
    return {
        "mesh": mesh_axes, "devices": n_devices, "params": rows,
        "num_params": int(sum(np.prod(r["shape"]) for r in rows)),
        "total_bytes": int(total), "frozen_bytes": int(frozen_total),
        "max_device_bytes": int(device_bytes),
        "ideal_device_bytes": int(total // n_devices),
    }
