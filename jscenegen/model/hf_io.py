"""Hugging Face model directories <-> jscenegen models, tensor by tensor, without torch.

`load_hf` reads `config.json` and `model.safetensors` (or the shards listed in
`model.safetensors.index.json`, whatever they are called), checks every tensor against the
weight table (`weights.weight_table`) and hands them to the one loader (`loader.build_model`),
which refuses missing, unexpected or mis-shaped keys by name and places each tensor on its own,
so host memory stays bounded by the largest tensor. `save_hf` writes config, sharded
safetensors + index, generation_config.json and the model's other assets
(`assets.ASSET_FILES`: tokenizer, chat template, processor files). Formats follow
transformers' `save_pretrained` (modeling_utils.py).

Nothing is lost for Qwen3.5: the vision tower (`model.visual.*`) and the MTP head (`mtp.*`),
which transformers drops on save, are carried and written back bit-exactly in the dtype they
were stored in; by default every other tensor is also written in its stored dtype (a release
keeps `A_log` and the gated norm fp32 inside a bf16 file), and `config.json` is written back
as it was read.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Mapping

import jax
import numpy as np

from jscenegen.model.assets import copy_assets
from jscenegen.model.config import QwenConfig, config_with_dtype
from jscenegen.model.dtypes import dtype_name, np_dtype
from jscenegen.model.loader import build_model
from jscenegen.model.qwen import CausalLM
from jscenegen.model.safetensors_stream import (
    read_tensor,
    safetensors_files,
    write_safetensors_streaming,
)
from jscenegen.model.weights import Carried, CheckpointFormatError, named_weights, param_shapes
from jscenegen.paths import atomic_dir, write_json

TIED_ALIAS = "lm_head.weight"


def iter_hf_tensors(path: str | Path, cfg: QwenConfig | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (hf_name, array) in table order after checking names and shapes.

    Every tensor of the file: parameters and carried tensors (`param_shapes(cfg, carried=True)`),
    each in its stored dtype. Raises CheckpointFormatError naming the missing, unexpected or
    mis-shaped key and its file. A tied model's file may carry the `lm_head.weight` alias; it
    is skipped when it equals the embedding, refused when it differs.
    """
    path = Path(path)
    cfg = cfg or QwenConfig.from_dir(path)
    shapes = param_shapes(cfg, carried=True)
    files = safetensors_files(path)
    names = set(files)
    if cfg.tie_word_embeddings:
        names.discard(TIED_ALIAS)
    missing = [n for n in shapes if n not in names]
    unexpected = sorted(names - set(shapes))
    if missing:
        other = (f"; the files hold {len(unexpected)} tensor(s) it does not name, e.g. "
                 f"{unexpected[:3]} (config.json's model_type {cfg.model_type} names its text "
                 f"tensors {cfg.text_prefix}*)" if unexpected else "")
        raise CheckpointFormatError(f"{path}: missing tensor(s) {missing[:5]}"
                                    f"{' ...' if len(missing) > 5 else ''}{other}"
                                    + (f" ({note})" if (note := cfg.assumed_tower_note()) else ""))
    if unexpected:
        raise CheckpointFormatError(
            f"{files[unexpected[0]]}: unexpected tensor(s) {unexpected[:5]} for {cfg.model_type}"
        )
    for name, shape in shapes.items():
        arr = read_tensor(files[name], name, shape, cfg.assumed_sizes_note())
        if (cfg.tie_word_embeddings and TIED_ALIAS in files
                and name == f"{cfg.text_prefix}embed_tokens.weight"):
            check_tied_head(read_tensor(files[TIED_ALIAS], TIED_ALIAS), arr, files[TIED_ALIAS], name)
        yield name, arr


def check_tied_head(head: np.ndarray, embedding: np.ndarray, file: str | Path,
                    embedding_name: str) -> None:
    """A stored `lm_head.weight` (rows of it) of a tied model must equal the embedding (the same
    rows; NaN equal to NaN): a different one is a trained head that loading or writing the model
    tied would silently drop. head, embedding: [rows, hidden] arrays of any float dtype (values
    compared, not bytes); a shape mismatch is a difference. Raises CheckpointFormatError naming
    `file`. The one rule for HF, VERL and conversion sources (transformers ties the head by
    `tie_word_embeddings`, modeling_utils `tie_weights`)."""
    if head.shape != embedding.shape or not np.array_equal(head, embedding, equal_nan=True):
        raise tied_head_error(file, embedding_name)


def tied_head_error(file: str | Path, embedding_name: str) -> CheckpointFormatError:
    """The refusal of `check_tied_head`."""
    return CheckpointFormatError(
        f"{file}: {TIED_ALIAS} differs from {embedding_name} but the config ties them "
        "(tie_word_embeddings: true; loaded or written tied, this head would be dropped); set "
        "tie_word_embeddings to false to keep it, or remove the tensor")


def load_hf(path: str | Path, *, mesh: jax.sharding.Mesh | None = None,
            cfg: QwenConfig | None = None, **options: Any) -> CausalLM:
    """Load an HF Qwen2/Qwen3/Qwen3.5 directory (`loader.build_model` of its tensors).

    mesh: place the weights in the FSDP layout on this ("fsdp", "sp") mesh (None: unsharded).
    cfg: the architecture to build, default the directory's config.json (the GRPO trainer
      passes that config with its tokenizer's pad token, `QwenConfig.with_pad_token_id`).
    options: param_dtype (parameters are cast to it, whatever the file holds; carried tensors
      keep their stored dtype), compute_dtype, remat, attn_impl, causal_balance (see
      `loader.abstract_model`).
    Raises ModelConfigError (config) or CheckpointFormatError (tensors), naming file and key.
    """
    cfg = cfg or QwenConfig.from_dir(path)
    return build_model(cfg, iter_hf_tensors(path, cfg), mesh=mesh, source=str(path), **options)


def tensor_dtypes(model: CausalLM, dtype: str | None = None) -> dict[str, str]:
    """{hf_name: dtype name} a model's tensors are written in, in table order.

    Carried tensors: the dtype the model holds them in (the file's). Parameters: `dtype`, or
    with None the dtype the source directory stored each in (`QwenConfig.stored_dtype`:
    config.json's dtype and the per-tensor exceptions read from the weights' headers).
    """
    weights = named_weights(model)
    out = {}
    for name in param_shapes(model.cfg, carried=True):
        var = weights[name]
        if isinstance(var, Carried):
            out[name] = dtype_name(var.dtype)
        else:
            out[name] = dtype or model.cfg.stored_dtype(name)
    return out


def hf_state_dict(model: CausalLM, dtype: str | Mapping[str, str] | None = None
                  ) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (hf_name, host array at logical shape) in table order, one tensor at a time:
    parameters and carried tensors. dtype: one dtype name for the parameters, a {name: dtype}
    mapping (`tensor_dtypes`), or None (as held in memory). Carried tensors are never cast
    by a single dtype name."""
    weights = named_weights(model)
    for name, shape in param_shapes(model.cfg, carried=True).items():
        var = weights[name]
        arr = np.asarray(jax.device_get(var[...]))[: shape[0]]
        if isinstance(dtype, Mapping):
            arr = arr.astype(np_dtype(dtype[name]), copy=False)
        elif dtype is not None and not isinstance(var, Carried):
            arr = arr.astype(np_dtype(dtype), copy=False)
        yield name, arr


def write_hf_dir(out: str | Path, cfg: QwenConfig, tensors: Iterator[tuple[str, np.ndarray]], *,
                 dtype: str | Mapping[str, str] = "float32", config_dtype: str | None = None,
                 tokenizer_src: str | Path | None = None,
                 max_shard_bytes: int = 2 * 1024**3, replace: bool = False,
                 extra_files: Mapping[str, str] | None = None) -> Path:
    """Write an HF directory from streamed (name, array) pairs; atomic (temp dir + rename).

    `tensors` yields every tensor of `param_shapes(cfg, carried=True)` in that order; each is
    written as it arrives (`safetensors_stream`), so memory holds one tensor. dtype: one dtype
    for every tensor, or {name: dtype} (`tensor_dtypes`); config_dtype: the dtype config.json
    declares (default: `dtype` when it is one name, else the config's own). Shards are
    `model-0000k-of-0000n.safetensors` with `model.safetensors.index.json` when more than one
    is needed, else `model.safetensors`. config.json: `cfg.to_hf_dict()` (Qwen3.5: the file
    that was read, its dtype fields changed only when config_dtype differs from it, and
    `mtp_num_hidden_layers` set to the MTP layers carried). The model's other assets (tokenizer, chat template, processor files;
    `assets.ASSET_FILES` except config.json) are copied from `tokenizer_src` when given. `out`
    must be new or empty (FileExistsError before anything is written); with `replace`, an
    existing `out` is replaced once the new directory is complete. `extra_files` {name: text}
    are written inside it too (a run's summary: present exactly when the weights are). Raises
    OSError on write failure (the old dir stays).
    """
    out = Path(out)
    shapes = param_shapes(cfg, carried=True)
    dtypes = dict(dtype) if isinstance(dtype, Mapping) else {n: dtype for n in shapes}
    with atomic_dir(out, replace=replace) as tmp:
        specs = {n: (tuple(s), np_dtype(dtypes[n])) for n, s in shapes.items()}
        def cast(name, a):
            if name not in specs:
                raise ValueError(f"{out}: tensor {name!r} is not one of {cfg.model_type}'s tensors "
                                 f"(e.g. {next(iter(specs))})")
            return name, np.ascontiguousarray(a.astype(specs[name][1], copy=False))

        write_safetensors_streaming(tmp, specs, (cast(n, a) for n, a in tensors), max_shard_bytes)
        if config_dtype is None and isinstance(dtype, str):
            config_dtype = dtype
        write_json(tmp / "config.json", _config_json(cfg, config_dtype))
        if tokenizer_src is not None:
            copy_assets(tokenizer_src, tmp, skip=("config.json",))
        if not (tmp / "generation_config.json").exists():
            gen = {"do_sample": True, "temperature": 1.0, "top_p": 1.0}
            if cfg.eos_token_id is not None:
                eos = cfg.eos_token_id
                gen["eos_token_id"] = list(eos) if isinstance(eos, tuple) else eos
            write_json(tmp / "generation_config.json", gen)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
    return out


def _config_json(cfg: QwenConfig, dtype: str | None) -> dict:
    """config.json for weights written in `dtype` (None: as stored)."""
    return config_with_dtype(cfg.to_hf_dict(), dtype or cfg.torch_dtype)


def save_hf(model: CausalLM, out: str | Path, *, dtype: str | None = None,
            tokenizer_src: str | Path | None = None, max_shard_bytes: int = 2 * 1024**3,
            replace: bool = False, extra_files: Mapping[str, str] | None = None) -> Path:
    """Save a model as an HF directory transformers can load (see `write_hf_dir`).

    dtype: None writes every tensor in the dtype its source stored it (`tensor_dtypes`; a
    model made from scratch: its config's dtype); a name casts every parameter to it. Carried
    tensors are always written as they were stored.
    """
    dtypes = tensor_dtypes(model, dtype)
    return write_hf_dir(out, model.cfg, hf_state_dict(model, dtypes), dtype=dtypes,
                        config_dtype=dtype, tokenizer_src=tokenizer_src,
                        max_shard_bytes=max_shard_bytes, replace=replace, extra_files=extra_files)
