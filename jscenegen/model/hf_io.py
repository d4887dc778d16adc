"""Hugging Face model directories <-> `QwenForCausalLM`, tensor by tensor, without torch.

`load_hf` reads `config.json` and `model.safetensors` (or shards listed in
`model.safetensors.index.json`), checks every tensor against the parameter table
(`params.param_shapes`) and refuses missing, unexpected or mis-shaped keys by name. Each tensor
is read, cast, padded on dim 0 and placed on its devices on its own, so host memory stays
bounded by the largest tensor and no device ever holds a full replica of a sharded model.
`save_hf` writes config, sharded safetensors + index, generation_config.json and tokenizer
files. Formats follow transformers' `save_pretrained` (modeling_utils.py).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from jscenegen.model.config import ModelConfigError, QwenConfig
from jscenegen.model.weights import padded_shape, param_shapes
from jscenegen.model.qwen import QwenForCausalLM
from jscenegen.model.safetensors_stream import INDEX_NAME, write_safetensors_streaming

NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "chat_template.jinja", "chat_template.json", "added_tokens.json",
    "generation_config.json",
)
TIED_ALIAS = "lm_head.weight"


class CheckpointFormatError(ValueError):
    """A model directory whose tensors do not match the architecture; names file and key."""


def safetensors_files(path: str | Path) -> dict[str, Path]:
    """{tensor name: file} for a single-file or index-sharded HF directory.

    Raises CheckpointFormatError when neither exists or the index is malformed.
    """
    path = Path(path)
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointFormatError(f"{index}: malformed index ({err})") from None
        return {name: path / fname for name, fname in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise CheckpointFormatError(f"{path}: no model.safetensors or {INDEX_NAME}")
    return {name: single for name in _keys(single)}


def _keys(file: Path) -> list[str]:
    try:
        with safe_open(file, "np") as f:
            return list(f.keys())
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointFormatError(f"{file}: unreadable safetensors file ({err})") from None


def _read_tensor(file: Path, name: str) -> np.ndarray:
    try:
        with safe_open(file, "np") as f:
            return f.get_tensor(name)
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointFormatError(f"{file}: cannot read tensor {name!r} ({err})") from None


def iter_hf_tensors(path: str | Path, cfg: QwenConfig | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (hf_name, array) in table order after checking names and shapes.

    Raises CheckpointFormatError naming the missing, unexpected or mis-shaped key and its file.
    A tied model's file may carry the `lm_head.weight` alias; it is skipped.
    """
    path = Path(path)
    cfg = cfg or QwenConfig.from_dir(path)
    shapes = param_shapes(cfg)
    files = safetensors_files(path)
    names = set(files)
    if cfg.tie_word_embeddings:
        names.discard(TIED_ALIAS)
    missing = [n for n in shapes if n not in names]
    unexpected = sorted(names - set(shapes))
    if missing:
        raise CheckpointFormatError(f"{path}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        raise CheckpointFormatError(
            f"{files[unexpected[0]]}: unexpected tensor(s) {unexpected[:5]} for {cfg.model_type}"
        )
    for name, shape in shapes.items():
        arr = _read_tensor(files[name], name)
        if tuple(arr.shape) != shape:
            raise CheckpointFormatError(
                f"{files[name]}: tensor {name!r} has shape {tuple(arr.shape)}, expected {shape}"
            )
        yield name, arr


def named_params(model: nnx.Module) -> dict[str, nnx.Variable]:
    """{hf_name: nnx.Param} of a QwenForCausalLM (dotted state paths are the HF names)."""
    return {
        ".".join(str(p) for p in path): var
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def pad_dim0(arr: np.ndarray, multiple: int) -> np.ndarray:
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


def load_hf(path: str | Path, *, param_dtype: str = "float32", compute_dtype: str = "float32",
            pad_multiple: int = 1, remat: bool = False, attn_impl: str = "xla",
            balance_shards: int = 1,
            sharding_for: Callable[[str, tuple[int, ...]], jax.sharding.Sharding] | None = None,
            ) -> QwenForCausalLM:
    """Load an HF Qwen2/Qwen3 directory into a QwenForCausalLM.

    Args:
      path: directory with config.json and safetensors.
      param_dtype: dtype the weights are cast to (explicitly, whatever the file holds).
      pad_multiple: dim-0 padding multiple (the device count for FSDP2-style sharding).
      balance_shards: causal load balancing over this many sequence shards (see qwen.py).
      sharding_for: optional (hf_name, padded_shape) -> Sharding; tensors are placed directly
        into that layout, one at a time.
    Raises ModelConfigError (config) or CheckpointFormatError (tensors), naming file and key.
    """
    cfg = QwenConfig.from_dir(path)
    abstract = nnx.eval_shape(lambda: QwenForCausalLM(
        cfg, rngs=nnx.Rngs(0), pad_multiple=pad_multiple, param_dtype=param_dtype,
        compute_dtype=compute_dtype, remat=remat, attn_impl=attn_impl,
        balance_shards=balance_shards))
    graphdef, state = nnx.split(abstract)
    targets = named_params(abstract)
    dtype = NP_DTYPES[param_dtype]
    for name, arr in iter_hf_tensors(path, cfg):
        padded = pad_dim0(arr.astype(dtype), pad_multiple)
        sharding = sharding_for(name, padded.shape) if sharding_for else None
        targets[name].set_value(place(padded, sharding))
    return nnx.merge(graphdef, nnx.state(abstract))


def hf_state_dict(model: QwenForCausalLM, dtype: str | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (hf_name, host array at logical shape) in table order, one tensor at a time."""
    shapes = param_shapes(model.cfg)
    params = named_params(model)
    for name, shape in shapes.items():
        arr = np.asarray(jax.device_get(params[name][...]))[: shape[0]]
        yield name, (arr.astype(NP_DTYPES[dtype]) if dtype else arr)


def _atomic_dir(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)
    return tmp


def _commit_dir(tmp: Path, out: Path) -> None:
    for f in tmp.iterdir():
        f.chmod(0o644)
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)


def write_hf_dir(out: str | Path, cfg: QwenConfig, tensors: Iterator[tuple[str, np.ndarray]], *,
                 dtype: str = "float32", tokenizer_src: str | Path | None = None,
                 max_shard_bytes: int = 2 * 1024**3) -> Path:
    """Write an HF directory from streamed (name, array) pairs; atomic (temp dir + rename).

    `tensors` yields every parameter of `param_shapes(cfg)` in that order; each is written as
    it arrives (`safetensors_stream`), so memory holds one tensor. Shards are
    `model-0000k-of-0000n.safetensors` with `model.safetensors.index.json` when more
    than one is needed, else `model.safetensors`. Tokenizer files and chat template are copied
    from `tokenizer_src` when given. Raises OSError on write failure (the old dir stays).
    """
    out = Path(out)
    tmp = _atomic_dir(out)
    try:
        np_dtype = np.dtype(NP_DTYPES[dtype])
        specs = {n: (tuple(s), np_dtype) for n, s in param_shapes(cfg).items()}
        write_safetensors_streaming(tmp, specs, ((n, np.ascontiguousarray(a.astype(np_dtype)))
                                                 for n, a in tensors), max_shard_bytes)
        hf = cfg.to_hf_dict()
        hf["torch_dtype"] = dtype
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        if tokenizer_src is not None:
            copy_tokenizer_files(tokenizer_src, tmp)
        if not (tmp / "generation_config.json").exists():
            gen = {"do_sample": True, "temperature": 1.0, "top_p": 1.0}
            if cfg.eos_token_id is not None:
                eos = cfg.eos_token_id
                gen["eos_token_id"] = list(eos) if isinstance(eos, tuple) else eos
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        _commit_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy tokenizer, chat template and generation config files that exist in `src`."""
    copied = []
    for name in TOKENIZER_FILES:
        f = Path(src) / name
        if f.is_file():
            shutil.copy2(f, Path(dst) / name)
            copied.append(name)
    return copied


def save_hf(model: QwenForCausalLM, out: str | Path, *, dtype: str = "float32",
            tokenizer_src: str | Path | None = None, max_shard_bytes: int = 2 * 1024**3) -> Path:
    """Save a model as an HF directory transformers can load (see `write_hf_dir`)."""
    return write_hf_dir(out, model.cfg, hf_state_dict(model), dtype=dtype,
                        tokenizer_src=tokenizer_src, max_shard_bytes=max_shard_bytes)


__all__ = [
    "CheckpointFormatError", "ModelConfigError", "load_hf", "save_hf", "write_hf_dir",
    "iter_hf_tensors", "hf_state_dict", "named_params", "safetensors_files", "copy_tokenizer_files",
]
