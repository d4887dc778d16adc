"""Tensors a VERL checkpoint cannot hold (Qwen3.5's `mtp.*`), taken from an HF directory or dropped.

VERL trains `Qwen3_5ForConditionalGeneration`, which never builds the multi-token-prediction
head, so its rank files have no `mtp.*` (convert/tensor_sets.py). Converting VERL to a format
that carries them (HF, orbax) takes them, bit-exactly and in their stored dtype, from:

1. `carried_from`, an HF directory given by the user (the release the run started from), or
   else
2. the checkpoint's own `huggingface/` directory when it holds weights with them (the
   published layout, where `huggingface` links to the HF model at the root, as
   `jscenegen export` writes it), or else
3. nowhere: they are dropped with a `ConversionWarning`, the output's config.json says
   `mtp_num_hidden_layers: 0` (convert/tensor_sets.py `config_json`), and
   `checkpoint-layout.json` lists them under `dropped`.

The reference directory must describe the same model: every tensor the VERL files hold must
have the same shape there (headers only are compared), else ConvertError naming the file and
tensor.
"""
from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Callable

import numpy as np

from convert.errors import ConversionWarning, ConvertError
from convert.tensor_sets import hf_shapes, verl_absent, verl_shapes, with_tensors


@dataclasses.dataclass(frozen=True)
class Complement:
    """What completes a VERL checkpoint's tensors for an HF or orbax output.

    config: the output's config (`mtp_layers` = the MTP layers carried). names: the tensors
    taken from `source` (table order); read(name) -> array in its stored dtype; dtypes: their
    stored dtypes. dropped: tensors the output loses. source: the HF directory read (or None);
    files: its safetensors files that hold `names`.
    """

    config: object  # jscenegen.model.config.QwenConfig
    names: tuple[str, ...] = ()
    read: Callable[[str], np.ndarray] | None = None
    dtypes: dict[str, np.dtype] = dataclasses.field(default_factory=dict)
    dropped: tuple[str, ...] = ()
    source: Path | None = None
    files: tuple[str, ...] = ()

    def layout_fields(self) -> dict:
        """Fields for checkpoint-layout.json: where carried tensors came from, what was lost."""
        return {"carried_from": str(self.source) if self.source else None,
                "carried_from_tensors": list(self.names), "dropped": list(self.dropped)}


def verl_complement(ck, carried_from: str | Path | None) -> Complement:
    """The tensors the VERL checkpoint `ck` (a convert.verl_read.VerlCheckpoint) lacks, and
    where they come from (module docstring). Raises ConvertError for a `carried_from` that is
    not an HF directory, holds no `mtp.*`, or describes another model, and for any
    `carried_from` when the model is no Qwen3.5 (its VERL files hold every tensor). Warns
    (ConversionWarning) when the checkpoint's frozen tensors differ from `carried_from`'s."""
    from convert.safetensors_io import SafetensorsReader
    from jscenegen.model.config import ModelConfigError, QwenConfig
    from jscenegen.model.safetensors_stream import stored_tensors

    cfg, hf_dir = ck.config, ck.hf_dir
    if not cfg.hybrid:
        if carried_from is not None:
            raise ConvertError(f"--carried-from completes a Qwen3.5 (qwen3_5) source; this one is "
                               f"{cfg.model_type}, whose VERL files hold every tensor")
        return Complement(config=cfg)
    if carried_from is not None:
        ref = Path(carried_from)
        try:
            ref_cfg = QwenConfig.from_dir(ref)
        except ModelConfigError as err:
            raise ConvertError(f"--carried-from (an HF model directory): {err}") from None
        if not ref_cfg.hybrid:
            raise ConvertError(f"{ref}: carried_from is a {ref_cfg.model_type} model, not the "
                               f"Qwen3.5 ({cfg.model_type}) the VERL checkpoint holds; pass the "
                               "released model directory")
        wanted = verl_absent(ref_cfg)
        if not wanted:
            raise ConvertError(f"{ref}: carried_from holds no mtp.* tensors (its weights were "
                               "written by transformers, which drops them); pass the released "
                               "model directory")
        reader = SafetensorsReader(ref)
        _check_same_model(cfg, reader, ref)
        _warn_unless_frozen_match(ck, reader, ref)
        return _taken(with_tensors(cfg, wanted), reader, wanted, ref)
    stored = stored_tensors(hf_dir) if hf_dir is not None else None
    if stored is not None:  # huggingface/ holds weights: the published layout
        have = [n for n in verl_absent(with_tensors(cfg, stored)) if n in stored]
        if have:
            reader = SafetensorsReader(hf_dir)
            _check_same_model(cfg, reader, hf_dir)
            return _taken(with_tensors(cfg, have), reader, have, hf_dir)
    dropped = tuple(verl_absent(cfg))
    if dropped:
        warnings.warn(
            f"{len(dropped)} mtp.* tensors ({dropped[0]}, ...) are not in VERL checkpoints "
            "(transformers never builds the MTP head) and no HF directory holding them was "
            "given: the output has none and its config.json says mtp_num_hidden_layers: 0. "
            "Pass --carried-from (Python: carried_from=) the released model directory to keep "
            "them.",
            ConversionWarning, stacklevel=3)
    return Complement(config=with_tensors(cfg, ()), dropped=dropped)


def _taken(cfg, reader, names: list[str], source: Path) -> Complement:
    shapes = hf_shapes(cfg)
    for n in names:
        if reader.shape(n) != tuple(shapes[n]):
            raise ConvertError(f"{reader.files[n]}: {n} has shape {reader.shape(n)}, the VERL "
                               f"checkpoint's config implies {tuple(shapes[n])}")
    return Complement(config=cfg, names=tuple(names), read=reader.full,
                      dtypes={n: reader.dtype(n) for n in names}, source=source,
                      files=tuple(sorted({str(reader.files[n]) for n in names})))


def _check_same_model(cfg, reader, ref: Path) -> None:
    """Every tensor of the VERL model exists in `ref` with the same shape (headers only)."""
    for name, shape in verl_shapes(cfg).items():
        if name not in reader.files:
            raise ConvertError(f"{ref}: carried_from lacks {name}; it is not the same model as "
                               "the VERL checkpoint")
        if reader.shape(name) != tuple(shape):
            raise ConvertError(f"{reader.files[name]}: {name} has shape {reader.shape(name)}, "
                               f"the VERL checkpoint has {tuple(shape)}; not the same model")


def _warn_unless_frozen_match(ck, reader, ref: Path) -> None:
    """Warn when the checkpoint's untrained tensors differ from `ref`'s: shapes alone accept
    another model of the same size (a base vs an instruct release). Untrained: those without
    Adam state when the checkpoint has an optimizer, else the vision tower (a model-only
    checkpoint, as `convert --to verl` writes, of a run that kept the tower frozen: jscenegen's
    default, VERL's freeze_vision_tower). The first and last of them are compared, in the
    checkpoint's dtype (a bf16 release widens exactly to fp32 master weights)."""
    if ck.has_optimizer():
        frozen = ck.frozen
    else:
        frozen = [n for n in verl_shapes(ck.config) if n.startswith("model.visual.")]
    picked = list(dict.fromkeys(frozen[:1] + frozen[-1:]))
    differ = []
    for name in picked:
        ours = ck.read_param(name)
        if not np.array_equal(ours, np.asarray(reader.full(name)).astype(ours.dtype)):
            differ.append(name)
    if differ:
        warnings.warn(
            f"{ref}: carried_from's {differ[0]} differs from the checkpoint's, which a run "
            "that froze it never changes: is this the release the run started from? Its mtp.* "
            "tensors are taken anyway", ConversionWarning, stacklevel=3)
