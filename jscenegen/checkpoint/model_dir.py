"""A model to decode with, from an HF directory or a training checkpoint step: its weights
(`load_model`), its chat tokenizer (`load_chat`) and digests that tell two copies apart
(`weights_digest`, `model_digest`).

The policy of `jscenegen eval` / `design` (`--model`) and the model judge (`judge.model_path`)
are read by these, so both accept the same directories: an HF model directory (config.json,
safetensors, tokenizer) or a checkpoint step directory (`RUN/checkpoints/N`: `params/` and
`hf/`, verified against its checksums before anything of it is read).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from jscenegen.checkpoint.checksums import file_sha256, read_checksums, sampled_file_digest
from jscenegen.checkpoint.store import (
    HF_DIR,
    PARAMS_ITEM,
    CheckpointError,
    check_step,
    is_checkpoint_dir,
    iter_arrays,
    model_assets_dir,
    not_a_model,
)
from jscenegen.model.assets import TOKENISATION_FILES
from jscenegen.model.tokenizer.chat import TEMPLATE_OPTION
from jscenegen.model.weights import CheckpointFormatError
from jscenegen.paths import json_sha256

_VERIFIED: set[tuple] = set()   # (step, its files' names, sizes and mtimes) verified here


def verify_step(step: Path, option: str = "--model") -> None:
    """Raise CheckpointError, naming `option` (the command's flag or the config key that gave
    `step`), unless the checkpoint step's files match its checksums. The chat and the weights
    read the same step: it is hashed once per process while no file of it changes (name, size,
    modification time)."""
    files = sorted((str(f.relative_to(step)), st.st_size, st.st_mtime_ns)
                   for f in step.rglob("*") if f.is_file() for st in [f.stat()])
    key = (step.resolve(), tuple(files))
    if key in _VERIFIED:
        return
    status = check_step(step)
    if not status.valid:
        raise CheckpointError(f"{option} {step}: checkpoint step is not usable: {status.reason}")
    _VERIFIED.add(key)


def load_model(path: str | Path, mesh, *, option: str = "--model", **options):
    """A QwenForCausalLM (or Qwen35ForCausalLM) sharded on `mesh` from an HF directory or a
    checkpoint step directory.

    HF directory: `hf_io.load_hf` (the trainer's path). Checkpoint step (`RUN/checkpoints/N/`):
    the step is verified against its checksums first, then every parameter is read at logical
    shape with `checkpoint.store.iter_arrays` (one array in host memory at a time) into
    `loader.build_model` with the architecture of `hf/config.json`. `options`: the loader's
    (param_dtype, compute_dtype, attn_impl, ...); `option`: how the user named `path` (the
    command's flag or the config key), named in the errors.
    Raises CheckpointError for an incomplete or corrupt step, CheckpointFormatError for a
    parameter-name mismatch (naming the step and the names), FileNotFoundError when `path`
    is neither.
    """
    from jscenegen.model.config import QwenConfig
    from jscenegen.model.hf_io import load_hf
    from jscenegen.model.loader import build_model

    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"{option} {p}: " + ("not a directory (give the model or checkpoint "
                                                     "directory)" if p.exists() else "no such directory"))
    if not is_checkpoint_dir(p):
        if not (p / "config.json").is_file():
            raise not_a_model(p, option)
        if p.name == HF_DIR and is_checkpoint_dir(p.parent):   # assets only: the weights are beside
            raise FileNotFoundError(f"{option} {p}: a checkpoint step's assets (config, tokenizer; "
                                    f"its weights are in params/): give the step, {p.parent}")
        return load_hf(p, mesh=mesh, **options)
    verify_step(p, option)
    return build_model(QwenConfig.from_dir(p / HF_DIR), iter_arrays(p, "params"), mesh=mesh,
                       source=str(p), **options)


def load_chat(path: str | Path, chat_template_path: str | Path | None = None, *,
              option: str = "--model", template_option: str = TEMPLATE_OPTION):
    """`load_chat_and_config`'s ChatTokenizer alone."""
    return load_chat_and_config(path, chat_template_path, option=option,
                                template_option=template_option)[0]


def load_chat_and_config(path: str | Path, chat_template_path: str | Path | None = None, *,
                         option: str = "--model", template_option: str = TEMPLATE_OPTION):
    """(ChatTokenizer, QwenConfig of its config.json, read once): the ChatTokenizer of `path`'s assets (HF directory or checkpoint step's `hf/`) with the
    replacement template `chat_template_path` (None: the directory's own), checked to fit the
    model's vocabulary and to be prefix-preserving (ValueError names the difference
    otherwise), after `config.json` (ModelConfigError naming it and the key). `option` names
    `path` in the errors (the command's flag or the config key), `template_option` the key
    that passes a replacement template (the policy's sampling.chat_template_path, the model
    judge's judge.chat_template_path).
    Loads no weights; verifies a checkpoint step first (`verify_step`)."""
    from jscenegen.model.config import QwenConfig, read_config_file
    from jscenegen.model.tokenizer.chat import ChatTokenizer

    p = Path(path)
    config = model_assets_dir(p) / "config.json"
    if not config.is_file():
        raise not_a_model(p, option)
    if is_checkpoint_dir(p):
        verify_step(p, option)   # before its tokenizer is read
    # transformers' tokenizer loader reads config.json too, and its errors would blame the tokenizer
    model_cfg = QwenConfig.from_hf_dict(read_config_file(config), str(config))
    chat = ChatTokenizer.from_dir(model_assets_dir(p), chat_template_path, template_option)
    chat.check_fits(model_cfg.vocab_size, str(p))
    chat.check_prefix_preserving()
    return chat, model_cfg


NO_READABLE_WEIGHTS = "no readable weights"


def weights_digest(model_dir: Path) -> str:
    """`sampled_file_digest` of each safetensors file the HF directory `model_dir` reads, by
    name; a directory whose weights cannot be listed says so (NO_READABLE_WEIGHTS: the load
    names the problem)."""
    from jscenegen.model.safetensors_stream import safetensors_files

    try:
        files = sorted(set(safetensors_files(model_dir).values()))
        return json_sha256([[f.name, sampled_file_digest(f)] for f in files])
    except (CheckpointFormatError, OSError):
        return NO_READABLE_WEIGHTS


def model_digest(path: str | Path, chat_template: str | None = None) -> str:
    """Hex SHA-256 that tells the model at `path` (HF directory or checkpoint step) apart from
    another, without its path: the bytes of config.json and of each tokenisation file
    (`model.assets.TOKENISATION_FILES`: tokenizer, chat template, generation config; null when
    absent) of its assets, and its weights: an HF directory's by `weights_digest` (sampled
    blocks of each safetensors file: equal files always agree, a fine-tune that left most of
    the sampled blocks alone may not be told apart), a checkpoint step's by the SHA-256 and
    size its checksums.json records for every file under `params/` (`verify_step` checks them
    against the files). `chat_template`: the text of the template used in place of the
    directory's own (a replacement, or the bundled Qwen3.5 protocol template), digested too;
    None (the directory's own) leaves the digest as without it.
    Raises OSError / ChecksumError when a file cannot be read."""
    p = Path(path)
    assets = model_assets_dir(p)
    files = {name: file_sha256(assets / name) if (assets / name).is_file() else None
             for name in ("config.json", *TOKENISATION_FILES)}
    if is_checkpoint_dir(p):
        table = read_checksums(p)
        weights = json_sha256({rel: [e["sha256"], e["bytes"]] for rel, e in table.items()
                               if rel.startswith(f"{PARAMS_ITEM}/")})
    else:
        weights = weights_digest(p)
    used = {} if chat_template is None else {
        "chat_template": hashlib.sha256(chat_template.encode("utf-8")).hexdigest()}
    return json_sha256({"files": files, "weights": weights, **used})
