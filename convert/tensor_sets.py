"""Which tensors each checkpoint format holds for a model config (one rule for every direction).

All sets are ordered as `jscenegen.model.weights.weight_table`: transformers'
`module.parameters()` order (for `qwen3_5`: the vision tower, the text model, `lm_head`), which
is the index order of VERL's optimizer state, then `mtp.*`.

- HF safetensors and orbax `params/`: every tensor of the table, trainable and carried
  (`hf_shapes`): Qwen3.5's vision tower (`model.visual.*`) and MTP head (`mtp.*`) included.
- VERL FSDP2 rank files: the state dict of the torch model VERL trains. For `qwen3_5` that is
  `Qwen3_5ForConditionalGeneration` (VERL picks the vision-language class for a config with a
  `vision_config`: verl/workers/fsdp_workers.py, `_build_model_optimizer`), which holds the
  vision tower as ordinary parameters but never builds `mtp.*` (transformers ignores them on
  load: `_keys_to_ignore_on_load_unexpected = [r"^mtp.*"]`), so `verl_shapes` is `hf_shapes`
  without `mtp.*` and `verl_absent` names what a VERL checkpoint cannot hold.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterable

import numpy as np

from jscenegen.model.config import QwenConfig, config_with_dtype, config_with_mtp_layers
from jscenegen.model.dtypes import majority_dtype
from jscenegen.model.weights import param_shapes, weight_table
from jscenegen.paths import loads_json, write_json

# Tensor-name prefixes the torch model VERL trains never holds.
VERL_ABSENT_PREFIXES = ("mtp.",)


def embedding_name(cfg: QwenConfig) -> str:
    """The token embedding's name (`model.embed_tokens.weight`, or
    `model.language_model.embed_tokens.weight` in the composite `qwen3_5` layout): the tensor a
    tied `lm_head.weight` aliases."""
    return cfg.text_prefix + "embed_tokens.weight"


def hf_shapes(cfg: QwenConfig) -> dict[str, tuple[int, ...]]:
    """Ordered {name: shape} of every tensor an HF directory (and orbax `params/`) holds."""
    return param_shapes(cfg, carried=True)


def verl_shapes(cfg: QwenConfig) -> dict[str, tuple[int, ...]]:
    """Ordered {name: shape} of the parameters of the torch model VERL trains: the keys of its
    rank files (plus the tied `lm_head.weight` alias) and, in this order, the indices of its
    AdamW state."""
    return {n: s for n, s in hf_shapes(cfg).items() if not n.startswith(VERL_ABSENT_PREFIXES)}


def verl_absent(cfg: QwenConfig) -> list[str]:
    """Names of `hf_shapes` that VERL rank files cannot hold (`mtp.*`), in table order."""
    return [n for n in hf_shapes(cfg) if n.startswith(VERL_ABSENT_PREFIXES)]


def carried_names(cfg: QwenConfig) -> set[str]:
    """The carried tensors (`WeightSpec.carried`: Qwen3.5's vision tower and MTP head)."""
    return {n for n, s in weight_table(cfg).items() if s.carried}


def with_tensors(cfg: QwenConfig, names: Iterable[str]) -> QwenConfig:
    """`cfg` describing exactly the MTP layers whose tensors are in `names` (Qwen3.5; a
    directory without weights, such as a checkpoint's `hf/`, otherwise takes
    `mtp_num_hidden_layers` from config.json). Dense configs are returned unchanged."""
    if not cfg.hybrid:
        return cfg
    layers = {int(n.split(".")[2]) for n in names if n.startswith("mtp.layers.")}
    return dataclasses.replace(cfg, mtp_layers=max(layers) + 1 if layers else 0)


def config_json(cfg: QwenConfig, hf_config: dict) -> dict:
    """config.json content `hf_config` made to agree with the MTP layers `cfg` carries.

    Readers of a directory without weights (an orbax step's `hf/`, a resumed run) take the
    MTP layer count from `text_config.mtp_num_hidden_layers` (top level for `qwen3_5_text`);
    when a conversion could not carry the `mtp.*` tensors it must say 0 there
    (`model.config.config_with_mtp_layers`, the rule `QwenConfig.to_hf_dict` follows too).
    Unchanged otherwise (and for dense configs)."""
    if not cfg.hybrid:
        return hf_config
    return config_with_mtp_layers(hf_config, cfg.model_type, cfg.mtp_layers)


def text_weights_dtype(specs: dict[str, tuple[tuple[int, ...], np.dtype]], cfg: QwenConfig) -> str:
    """The dtype name most elements of the trained (not carried) tensors of `specs` ({name:
    (shape, dtype)}, what an HF directory is written with) are stored in: what its config.json
    must say (a Qwen3.5 release keeps A_log fp32 among bf16 weights and says bfloat16)."""
    carried = carried_names(cfg)
    return majority_dtype(spec for name, spec in specs.items() if name not in carried)


def fix_config_file(path: str | Path, cfg: QwenConfig, dtype: str | None = None) -> bool:
    """Rewrite the config.json at `path` with `config_json` when it disagrees with the MTP
    layers `cfg` carries or, given `dtype` (the text weights' dtype written beside it), with
    that dtype (`model.config.config_with_dtype`: transformers loads the weights in the dtype
    the config says); True when it was rewritten."""
    path = Path(path)
    text = path.read_bytes()
    doc = loads_json(text)
    fixed = config_json(cfg, loads_json(text))   # config_json may change the dict it is given
    if dtype is not None:
        fixed = config_with_dtype(fixed, dtype)
    if fixed == doc:
        return False
    write_json(path, fixed)
    return True
