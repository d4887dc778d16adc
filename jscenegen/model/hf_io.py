"""Hugging Face model directories <-> `QwenForCausalLM`, tensor by tensor, without torch.

`load_hf` reads `config.json` and `model.safetensors` (or shards listed in
`model.safetensors.index.json`), checks every tensor against the weight table
(`weights.weight_table`) and hands them to the one loader (`loader.build_model`), which refuses
missing, unexpected or mis-shaped keys by name and places each tensor on its own, so host
memory stays bounded by the largest tensor. `save_hf` writes config, sharded safetensors +
index, generation_config.json and the model's other assets (`assets.ASSET_FILES`). Formats
follow transformers' `save_pretrained` (modeling_utils.py).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import jax
import numpy as np
from safetensors import SafetensorError, safe_open

from jscenegen.model.assets import copy_assets
from jscenegen.model.config import QwenConfig
from jscenegen.model.dtypes import np_dtype
from jscenegen.model.loader import build_model
from jscenegen.model.qwen import QwenForCausalLM
from jscenegen.model.safetensors_stream import INDEX_NAME, write_safetensors_streaming
from jscenegen.model.weights import CheckpointFormatError, named_params, param_shapes
from jscenegen.paths import atomic_dir

TIED_ALIAS = "lm_head.weight"


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


def load_hf(path: str | Path, *, mesh: jax.sharding.Mesh | None = None,
            **options: Any) -> QwenForCausalLM:
    """Load an HF Qwen2/Qwen3 directory (`loader.build_model` of its tensors).

    mesh: place the weights in the FSDP layout on this ("fsdp", "sp") mesh (None: unsharded).
    options: param_dtype (the weights are cast to it, whatever the file holds),
      compute_dtype, remat, attn_impl, causal_balance (see `loader.abstract_model`).
    Raises ModelConfigError (config) or CheckpointFormatError (tensors), naming file and key.
    """
    cfg = QwenConfig.from_dir(path)
    return build_model(cfg, iter_hf_tensors(path, cfg), mesh=mesh, source=str(path), **options)


def hf_state_dict(model: QwenForCausalLM, dtype: str | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (hf_name, host array at logical shape) in table order, one tensor at a time."""
    shapes = param_shapes(model.cfg)
    params = named_params(model)
    for name, shape in shapes.items():
        arr = np.asarray(jax.device_get(params[name][...]))[: shape[0]]
        yield name, (arr.astype(np_dtype(dtype)) if dtype else arr)


def write_hf_dir(out: str | Path, cfg: QwenConfig, tensors: Iterator[tuple[str, np.ndarray]], *,
                 dtype: str = "float32", tokenizer_src: str | Path | None = None,
                 max_shard_bytes: int = 2 * 1024**3) -> Path:
    """Write an HF directory from streamed (name, array) pairs; atomic (temp dir + rename).

    `tensors` yields every parameter of `param_shapes(cfg)` in that order; each is written as
    it arrives (`safetensors_stream`), so memory holds one tensor. Shards are
    `model-0000k-of-0000n.safetensors` with `model.safetensors.index.json` when more
    than one is needed, else `model.safetensors`. The model's other assets (tokenizer, chat
    template, processor files; `assets.ASSET_FILES` except config.json) are copied from
    `tokenizer_src` when given. An existing `out` is replaced only once the new directory is
    complete. Raises OSError on write failure (the old dir stays).
    """
    out = Path(out)
    with atomic_dir(out, replace=True) as tmp:
        dt = np_dtype(dtype)
        specs = {n: (tuple(s), dt) for n, s in param_shapes(cfg).items()}
        write_safetensors_streaming(tmp, specs, ((n, np.ascontiguousarray(a.astype(dt)))
                                                 for n, a in tensors), max_shard_bytes)
        hf = cfg.to_hf_dict()
        hf["torch_dtype"] = dtype
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        if tokenizer_src is not None:
            copy_assets(tokenizer_src, tmp, skip=("config.json",))
        if not (tmp / "generation_config.json").exists():
            gen = {"do_sample": True, "temperature": 1.0, "top_p": 1.0}
            if cfg.eos_token_id is not None:
                eos = cfg.eos_token_id
                gen["eos_token_id"] = list(eos) if isinstance(eos, tuple) else eos
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out


def save_hf(model: QwenForCausalLM, out: str | Path, *, dtype: str = "float32",
            tokenizer_src: str | Path | None = None, max_shard_bytes: int = 2 * 1024**3) -> Path:
    """Save a model as an HF directory transformers can load (see `write_hf_dir`)."""
    return write_hf_dir(out, model.cfg, hf_state_dict(model), dtype=dtype,
                        tokenizer_src=tokenizer_src, max_shard_bytes=max_shard_bytes)
