"""The one way a model gets its weights: `build_model(cfg, named arrays, mesh=...)`.

HF directories (`hf_io.load_hf`), training checkpoints (the trainer's resume, `jscenegen eval`
on a checkpoint step) and converters all hand (hf_name, array) pairs to `build_model`, which
checks every name and shape against the weight table, casts, pads dim 0 for FSDP and places
each array on its devices one at a time (host memory: one tensor; no device ever holds a full
replica of a sharded model). The architecture picks the module (`model_class`): Qwen2/Qwen3
`QwenForCausalLM`, Qwen3.5 `Qwen35ForCausalLM`. Carried tensors (Qwen3.5's vision tower and
MTP head) keep the dtype they arrive in; parameters are cast to `param_dtype`.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jscenegen.model.config import QwenConfig
from jscenegen.model.dtypes import np_dtype
from jscenegen.model.qwen import CausalLM, QwenForCausalLM
from jscenegen.model.qwen35 import Qwen35ForCausalLM
from jscenegen.model.weights import Carried, CheckpointFormatError, named_weights
from jscenegen.sharding.rules import PARAM, named, padded_shape

log = logging.getLogger(__name__)


def pad_dim0(arr: np.ndarray, multiple: int) -> np.ndarray:
    """`arr` zero-padded on dim 0 to a multiple of `multiple` (itself when already a multiple)."""
    target = padded_shape(arr.shape, multiple)
    if target == arr.shape:
        return arr
    out = np.zeros(target, arr.dtype)
    out[: arr.shape[0]] = arr
    return out


def place(arr: np.ndarray, sharding: jax.sharding.Sharding | None) -> jax.Array:
    """Put a host array on devices; with a sharding each device receives only its own slice."""
    if sharding is None:
        return jnp.asarray(arr)
    return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])


def model_class(cfg: QwenConfig) -> type[CausalLM]:
    """The module class of an architecture: Qwen35ForCausalLM for qwen3_5/qwen3_5_text,
    QwenForCausalLM for qwen2/qwen3."""
    return Qwen35ForCausalLM if cfg.hybrid else QwenForCausalLM


def abstract_model(cfg: QwenConfig, *, mesh: jax.sharding.Mesh | None = None,
                   param_dtype: str = "float32", compute_dtype: str = "float32",
                   remat: bool | str = False, attn_impl: str = "xla",
                   causal_balance: bool = False, train_vision: bool = False,
                   scan_layers: bool | None = None) -> CausalLM:
    """The model's structure with abstract parameters (no memory), padded for `mesh`'s devices.

    `causal_balance` reorders full sequences for the mesh's `sp` shards (see qwen.py); Qwen3.5
    refuses it (ValueError). `train_vision` makes Qwen3.5's vision tower trainable
    parameters (`weights.weight_table`; ValueError without a tower). `scan_layers`
    (Qwen2/Qwen3): None scans the layers on a mesh of several devices and loops on one
    (Qwen3.5 always scans its layer pattern)."""
    pad = mesh.size if mesh is not None else 1
    balance = mesh.shape["sp"] if (causal_balance and mesh is not None) else 1
    cls = model_class(cfg)
    extra = {}
    if cls is QwenForCausalLM:
        extra["scan_layers"] = (mesh is not None and mesh.size > 1) if scan_layers is None else scan_layers
    return nnx.eval_shape(lambda: cls(
        cfg, rngs=nnx.Rngs(0), pad_multiple=pad, param_dtype=param_dtype,
        compute_dtype=compute_dtype, remat=remat, attn_impl=attn_impl, balance_shards=balance,
        train_vision=train_vision, **extra))


def build_model(cfg: QwenConfig, arrays: Iterable[tuple[str, Any]], *,
                mesh: jax.sharding.Mesh | None = None, source: str = "weights",
                **options: Any) -> CausalLM:
    """A model of architecture `cfg` holding `arrays`.

    arrays: (hf_name, array) pairs, every weight of `weight_table(cfg)` exactly once, each a
      host array at its logical shape (cast to the param dtype, padded, placed in the FSDP
      layout `rules.PARAM` on `mesh`) or a jax.Array already at the padded shape and dtype
      (e.g. restored into `checkpoint.store.padded_target`), used as it is. Carried tensors
      are never cast: they keep the dtype they arrive in.
    mesh: the ("fsdp", "sp") mesh, or None for an unsharded model on the default device.
    source: what the arrays come from, for error messages (a directory or file).
    options: `abstract_model` keywords (param_dtype, compute_dtype, remat, attn_impl,
      causal_balance, train_vision, scan_layers).
    Raises CheckpointFormatError naming `source` and the key for an unknown, duplicated,
    mis-shaped or missing weight. Logs a warning naming the tensors that hold NaN or Inf
    (`non_finite_tensors`): the model loads, but training from it skips every update.
    """
    model = abstract_model(cfg, mesh=mesh, **options)
    targets = named_weights(model)
    dtype = np_dtype(options.get("param_dtype", "float32"))
    sharding = named(mesh, PARAM) if mesh is not None else None
    filled: set[str] = set()
    for name, arr in arrays:
        target = targets.get(name)
        if target is None:
            raise CheckpointFormatError(f"{source}: unexpected tensor {name!r} for "
                                        f"{cfg.model_type}")
        if name in filled:
            raise CheckpointFormatError(f"{source}: tensor {name!r} appears twice")
        logical = (target.rows, *target.shape[1:])
        want = arr.dtype if isinstance(target, Carried) else dtype
        if isinstance(arr, jax.Array) and tuple(arr.shape) == tuple(target.shape):
            value = arr if arr.dtype == want else arr.astype(want)
        elif tuple(arr.shape) == logical:
            host = np.asarray(arr).astype(want, copy=False)
            value = place(pad_dim0(host, mesh.size if mesh is not None else 1), sharding)
        else:
            raise CheckpointFormatError(f"{source}: tensor {name!r} has shape {tuple(arr.shape)}, "
                                        f"expected {logical}")
        target.set_value(value)
        filled.add(name)
    missing = [n for n in targets if n not in filled]
    if missing:
        raise CheckpointFormatError(f"{source}: missing tensor(s) {missing[:5]}"
                                    f"{' ...' if len(missing) > 5 else ''} ({len(missing)} missing)")
    bad = non_finite_tensors({name: t.get_value() for name, t in targets.items()})
    if bad:
        log.warning("%s: %d tensor(s) hold NaN or Inf values: %s%s (every update from these "
                    "weights would be skipped for a non-finite gradient)", source, len(bad),
                    ", ".join(bad[:5]), " ..." if len(bad) > 5 else "")
    return model


def non_finite_tensors(arrays: dict[str, jax.Array]) -> list[str]:
    """Names of the floating-point arrays holding a NaN or an infinity, in `arrays`' order.

    One compiled program reduces every array where its shards lie (a sharded array is never
    gathered; its per-device flags meet in one all-reduce per array inside that program: many
    separate collectives in flight can stall XLA:CPU's thread pool on a small host). Integer
    arrays are skipped.
    """
    names = [n for n, a in arrays.items() if jnp.issubdtype(a.dtype, jnp.inexact)]
    if not names:
        return []
    flags = jax.device_get(_all_finite([arrays[n] for n in names]))
    return [n for n, ok in zip(names, flags) if not ok]


@jax.jit
def _all_finite(arrays: list[jax.Array]) -> jax.Array:
    return jnp.stack([jnp.all(jnp.isfinite(a)) for a in arrays])
