"""`jscenegen export`: a training checkpoint in the published layout (../shared/specs/seed.md).

    OUT/                              the HF inference model: config.json, model*.safetensors,
                                      tokenizer files, chat template, generation config
    OUT/training_state/latest_checkpointed_iteration.txt
    OUT/training_state/global_step_N/ VERL FSDP2 rank files (model, Adam, extra state) for W
                                      ranks, fsdp_config.json, huggingface -> ../.. (symlink),
                                      jscenegen_train_state.json (the run's position and
                                      identity, for `convert --to orbax` back)
    OUT/training_metadata.json        the checkpoint's metadata (credentials redacted again)
    OUT/checkpoint-layout.json        written path <- source paths, torch version
    OUT/checksums.json                SHA-256 + bytes of every file (the symlink is not followed)

Only these are written: never a trajectory, prompt log or credential (the source checkpoint
holds none, and nothing else is copied). Built in a staged directory, renamed when complete.
"""
from __future__ import annotations

from pathlib import Path

from convert.directions import output_placement, write_verl_into
from convert.dispatch import refuse_nested
from convert.errors import ConvertError, require_torch
from convert.layout import write_layout
from convert.orbax_directions import orbax_state, orbax_step_dir, source_placement, write_hf_into
from convert.tensor_sets import verl_shapes
from convert.verl_write import check_world_size
from jscenegen.checkpoint.checksums import write_checksums
from jscenegen.paths import atomic_dir, read_json_object, require_new_dir, write_json


def export(checkpoint: str | Path, out: str | Path, *, world_size: int = 6,
           placement: str | None = None, dtype: str | None = None, device_type: str = "cuda",
           ) -> tuple[Path, Path]:
    """Export an orbax training checkpoint (a step directory, or a run's directory or its
    `checkpoints/`: the newest complete step) to `out`. Returns (the step directory exported,
    the training_state step directory written).

    The HF weights keep the checkpoint's dtype unless `dtype`; the VERL rank files always hold
    what the checkpoint holds (fp32 master weights and moments) for `world_size` ranks with
    `placement` (None: as `convert --to verl` chooses, `directions.output_placement`: the
    placement of the VERL checkpoint the step was converted from, else dim0) and a DeviceMesh
    of `device_type`. Raises ConvertError for an incomplete
    checkpoint, an existing non-empty `out` or one inside the checkpoint, a world size outside
    [1, MAX_WORLD_SIZE].
    """
    from convert.finite import watching
    from jscenegen.checkpoint import store as ckpt
    from jscenegen.checkpoint.metadata import redact

    require_torch("export")
    check_world_size(world_size)
    refuse_nested(checkpoint, out)
    require_new_dir(out, ConvertError)   # before the checkpoint is hashed (seconds to minutes)
    step_dir = orbax_step_dir(checkpoint)
    state = orbax_state(step_dir, world_size)
    placement = output_placement(placement, source_placement(step_dir, state.config),
                                 verl_shapes(state.config), world_size, step_dir, out)
    with watching(str(step_dir)), atomic_dir(out, exists_error=ConvertError) as tmp:
        files = write_hf_into(step_dir, tmp, dtype=dtype)
        shard_dir, verl_files, extra = write_verl_into(
            tmp / "training_state", state, world_size=world_size, placement=placement,
            dtype=None, device_type=device_type, source=step_dir, flattened=True,
            source_files={"model": [str(step_dir / ckpt.PARAMS_ITEM)],
                          "optim": [str(step_dir / ckpt.ADAM_ITEM)],
                          "extra_state": [str(step_dir / ckpt.TRAIN_STATE_ITEM),
                                          str(step_dir / ckpt.METADATA_NAME)],
                          "train_state": [str(step_dir / ckpt.TRAIN_STATE_ITEM)]},
            hf_link="../..")
        files += [(f"training_state/{w}", s) for w, s in verl_files]
        meta = redact(read_json_object(step_dir / ckpt.METADATA_NAME, ConvertError))
        write_json(tmp / "training_metadata.json", meta)
        files.append(("training_metadata.json", [str(step_dir / ckpt.METADATA_NAME)]))
        write_layout(tmp, fmt="published", source=step_dir, source_format="orbax", files=files,
                     hf_dtype=dtype or "source", training_state=extra)
        write_checksums(tmp)
    return step_dir, Path(out) / shard_dir.relative_to(tmp)
