"""Conversions between VERL FSDP2 checkpoints and HF safetensors (and VERL resharding).

Every output is built in a staged temp directory (`paths.atomic_dir`) and renamed into place
only when complete, with `checkpoint-layout.json` and `checksums.json` written last.

- `verl_to_hf`: the model's fp32 master weights (or `dtype`) as sharded safetensors, streamed
  tensor by tensor, plus the checkpoint's `huggingface/` files (config, tokenizer, chat
  template). A tied `lm_head.weight` is not written (transformers re-ties it from the
  embedding; VERL 0.9's merger drops it the same way). Unlike VERL's merger nothing is cast
  to bf16 unless asked.
- `hf_to_verl`: model only (no optimizer or extra state), for starting a torch run.
- `verl_to_verl`: reshard to another world size / placement, Adam and extra state included.
"""
from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from convert.errors import ConversionWarning, ConvertError
from convert.layout import NAME as LAYOUT_NAME
from convert.layout import write_layout
from convert.safetensors_io import SafetensorsReader
from convert.sharding import shard_dim
from convert.tensor_sets import (
    carried_names,
    embedding_name,
    fix_config_file,
    hf_shapes,
    text_weights_dtype,
    verl_absent,
    verl_shapes,
)
from convert.tensors import cast
from convert.verl_read import VerlCheckpoint
from convert.verl_write import AdamSource, SliceReader, write_rank_files
from jscenegen.checkpoint.checksums import CHECKSUMS_NAME, write_checksums
from jscenegen.checkpoint.resume import RUN_STATE_FILE
from jscenegen.checkpoint.store import METADATA_NAME
from jscenegen.model.assets import TOKENIZER_FILES, copy_non_weights
from jscenegen.model.dtypes import np_dtype
from jscenegen.model.safetensors_stream import write_safetensors_streaming
from jscenegen.paths import atomic_dir, write_json

# what a checkpoint writes about itself: describes the source, stale in any output (the
# published layout's huggingface/ links to its root, which holds them)
CHECKPOINT_RECORDS = (CHECKSUMS_NAME, LAYOUT_NAME, METADATA_NAME)


def copy_hf_metadata(src_hf: Path, dst: Path) -> list[tuple[str, list[str]]]:
    """Copy every non-weight file (config, tokenizer, chat template, processor files, ...)
    except `CHECKPOINT_RECORDS` and links out of `src_hf` (`copy_non_weights`).

    Returns [(written name, [source path])] for the layout file.
    """
    return [(p.name, [str(p)]) for p in copy_non_weights(src_hf, dst, skip=CHECKPOINT_RECORDS)]


@dataclasses.dataclass
class VerlState:
    """What a VERL checkpoint holds, as readers: enough to write one for any W.

    params: SliceReader over full HF-shaped arrays; adam: moments, step, param_groups (None =
    model only); extra_states: per-rank `{"lr_scheduler", "rng"}` (None = none written);
    train_state: our trainer's train state of this step, written beside the rank files as
    `RUN_STATE_FILE` so that converting back keeps the run's identity (None = none). shapes: the
    parameters in the order to write them and index their AdamW state (a VERL source's own
    order, `VerlCheckpoint.param_order`); None = the weight table's (`verl_shapes`).
    """

    config: Any  # jscenegen.model.config.QwenConfig
    hf_dir: Path
    params: SliceReader
    adam: AdamSource | None = None
    extra_states: list[dict[str, Any]] | None = None
    global_step: int = 0
    train_state: dict[str, Any] | None = None
    shapes: dict[str, tuple[int, ...]] | None = None   # parameter order; None: `verl_shapes`


CACHE_BYTES = 1 << 30


def sliced(full: Any, cache_bytes: int = CACHE_BYTES) -> SliceReader:
    """A SliceReader over a function name -> full array.

    The writer asks for each tensor once per rank; full arrays are kept (first come) while
    their total stays within `cache_bytes`, so a small model is read once and a large one
    re-reads what did not fit instead of holding the model.
    """
    cache: dict[str, np.ndarray] = {}
    held = [0]

    def read(name: str, dim: int, start: int, stop: int) -> np.ndarray:
        a = cache.get(name)
        if a is None:
            a = full(name)
            if held[0] + a.nbytes <= cache_bytes:
                cache[name] = a
                held[0] += a.nbytes
        return a[(slice(None),) * dim + (slice(start, stop),)]

    return read


def verl_state(ck: VerlCheckpoint) -> VerlState:
    """Readers over an open VERL checkpoint (each tensor reassembled on demand)."""
    adam = None
    if ck.has_optimizer():
        adam = AdamSource(exp_avg=sliced(lambda n: ck.read_moment(n, "exp_avg")),
                          exp_avg_sq=sliced(lambda n: ck.read_moment(n, "exp_avg_sq")),
                          step=ck.adam_step(), param_groups=ck.param_groups(),
                          names=ck.trainable)
    extra = ck.extra_states() if "extra_state" in ck.layout.kinds else None
    step = ck.global_step()
    return VerlState(config=ck.config, hf_dir=ck.hf_dir, params=sliced(ck.read_param), adam=adam,
                     extra_states=extra, global_step=step, train_state=ck.run_train_state(),
                     shapes=dict(ck.shapes))


def write_verl_run(dst: str | Path, state: VerlState, *, world_size: int, placement: str = "dim0",
                   dtype: str | None = None, device_type: str = "cuda", source: str | Path = "",
                   source_format: str = "", flattened: bool = False,
                   source_files: dict[str, list[str]] | None = None) -> Path:
    """Write a VERL run directory at `dst` (atomically).

    Layout: dst/latest_checkpointed_iteration.txt, dst/global_step_N/actor/{rank files,
    fsdp_config.json, huggingface/} (or the rank files directly in global_step_N when
    `flattened`), dst/checkpoint-layout.json, dst/checksums.json. Returns the shard directory.
    `source_files`: {kind ("model", "optim", "extra_state"): source paths} for the layout file
    (a rank's own source file is named when the source has the same rank). Raises
    ConvertError for an existing non-empty `dst` or bad arguments.
    """
    with atomic_dir(dst, exists_error=ConvertError) as tmp:
        shard_dir, files, extra = write_verl_into(
            tmp, state, world_size=world_size, placement=placement, dtype=dtype,
            device_type=device_type, source=source, flattened=flattened,
            source_files=source_files, shown_as=Path(dst))
        write_layout(tmp, fmt="verl-fsdp2", source=source, source_format=source_format,
                     files=files, **extra)
        write_checksums(tmp)
    return Path(dst) / shard_dir.relative_to(tmp)


def write_verl_into(root: Path, state: VerlState, *, world_size: int, placement: str,
                    dtype: str | None, device_type: str, source: str | Path, flattened: bool,
                    source_files: dict[str, list[str]] | None,
                    hf_link: str | None = None,
                    shown_as: Path | None = None) -> tuple[Path, list[tuple[str, list[str]]], dict]:
    """The files of `write_verl_run` under an existing directory `root` (no layout/checksums).

    `hf_link`: make `huggingface` a symlink to this relative path instead of copying the HF
    files (the published layout links `../..`). `shown_as`: what warnings call `root` (the
    destination of a temporary one). Returns (shard dir, [(written relpath, [sources])],
    layout fields).
    """
    cfg = state.config
    step_dir = root / f"global_step_{state.global_step}"
    shard_dir = step_dir if flattened else step_dir / "actor"
    extra_states = runnable_rng(state.extra_states, device_type, shown_as or root, source)
    dims = write_rank_files(shard_dir, shapes=state.shapes or verl_shapes(cfg), params=state.params,
                            world_size=world_size, placement=placement,
                            tied_alias=embedding_name(cfg) if cfg.tie_word_embeddings else None,
                            adam=state.adam,
                            extra_states=extra_states, dtype=dtype, device_type=device_type,
                            shown_as=(shown_as or root) / shard_dir.relative_to(root))
    if hf_link is None:
        hf_files = copy_hf_metadata(state.hf_dir, shard_dir / "huggingface")
    else:
        (shard_dir / "huggingface").symlink_to(hf_link, target_is_directory=True)
        hf_files = []
    (root / "latest_checkpointed_iteration.txt").write_text(str(state.global_step))
    rel = shard_dir.relative_to(root).as_posix()
    files = [(f"{rel}/{p.name}", _sources_of(p.name, source_files, source))
             for p in sorted(shard_dir.glob("*_world_size_*.pt"))]
    if state.train_state is not None:
        write_json(shard_dir / RUN_STATE_FILE, state.train_state)
        files.append((f"{rel}/{RUN_STATE_FILE}", (source_files or {}).get("train_state", [str(source)])))
    files += [(f"{rel}/huggingface/{w}", s) for w, s in hf_files]
    extra = dict(world_size=world_size, placement=placement, shard_dims=dims,
                 device_type=device_type, global_step=state.global_step, dtype=dtype or "source")
    if verl_absent(cfg):  # mtp.*: the torch model VERL trains has no place for them
        extra["not_in_verl"] = verl_absent(cfg)
    if state.adam is None and extra_states is None:   # VERL's default load_contents needs all three
        extra["load_contents"] = list(MODEL_ONLY_LOAD_CONTENTS)
    if state.adam is not None and state.adam.names is not None:
        extra["no_adam_state"] = [n for n in dims if n not in set(state.adam.names)]
    return shard_dir, files, extra


# what a model-only VERL output (`hf_to_verl`) needs VERL to load: its FSDPCheckpointManager
# loads model, optimizer and extra state by default and opens each rank file unconditionally
MODEL_ONLY_LOAD_CONTENTS = ("model",)
MODEL_ONLY_NOTE = ("note: model rank files only (no optim_ or extra_state_ files): VERL's resume "
                   "loads model, optimizer and extra state by default and fails on the missing "
                   "files; resume from it with actor_rollout_ref.actor.checkpoint.load_contents="
                   "[model] (fresh AdamW and LR schedule from the run's config), or start VERL "
                   "from the HF model itself")


def output_placement(placement: str | None, source_placements: tuple[str, ...],
                     shapes: Mapping[str, tuple[int, ...]], world_size: int, source: str | Path,
                     shown_as: str | Path) -> str:
    """The placement of a VERL output of `world_size` ranks holding tensors of `shapes`:
    `placement` when given, else the source's own (`source_placements`: the rules its shard
    dims fit, `sharding.placement_of`), else "dim0". Warns (ConversionWarning naming `shown_as`
    and `source`) when the output's is not one the source's dims fit and shards some tensor
    otherwise at `world_size` than the source's rule, so that a torch run of the source's VERL
    version would see other shard dims, and when the source fits both rules
    (each tensor on dim 0, where both put it over the source's ranks) and they shard some
    tensor otherwise at `world_size`: its VERL version cannot be told from the files."""
    def moved(a: str, b: str) -> str | None:   # a tensor the two rules shard otherwise
        return next((n for n, shape in shapes.items() if shard_dim(tuple(shape), world_size, a)
                     != shard_dim(tuple(shape), world_size, b)), None)

    if placement is not None or len(source_placements) < 2:
        chosen = placement or (source_placements[0] if source_placements else "dim0")
        if source_placements and chosen not in source_placements \
                and moved(chosen, source_placements[0]) is not None:
            (theirs,) = source_placements
            warnings.warn(ConversionWarning(
                f"{shown_as}: written with placement {chosen} where {source} is sharded by "
                f"{theirs} ({PLACEMENT_VERSIONS[theirs]}; {chosen}: "
                f"{PLACEMENT_VERSIONS[chosen]}): a run of the source's VERL version shards "
                "otherwise"), stacklevel=3)
        return chosen
    if (name := moved("dim0", "first-divisible")) is not None:
        other = shard_dim(tuple(shapes[name]), world_size, "first-divisible")
        warnings.warn(ConversionWarning(
            f"{shown_as}: {source}'s shard dims fit both VERL placements (each tensor on dim 0, "
            "where both rules put it over its ranks), so its VERL version cannot be told from them; "
            f"over {world_size} ranks they differ ({name}: dim 0 under dim0, {other} under "
            "first-divisible): written with dim0 (VERL 0.9); give --placement first-divisible "
            "for a VERL 0.6 - 0.8 run"), stacklevel=3)
    return "dim0"


PLACEMENT_VERSIONS = {"dim0": "VERL 0.9", "first-divisible": "VERL 0.6 - 0.8"}


def runnable_rng(extra_states: list[dict[str, Any]] | None, device_type: str, shown_as: Path,
                 source: str | Path) -> list[dict[str, Any]] | None:
    """`extra_states` without their `rng` when a run on a `device_type` mesh could not resume
    from it: VERL's `load_rng_state` reads rng[get_device_name()] ("cuda") on a GPU run
    without a fallback (KeyError: states saved by a CPU run hold no "cuda" generator), while
    `FSDPCheckpointManager.load_checkpoint` skips a missing `rng` (the run keeps its own
    seeded streams). Warns (ConversionWarning naming `shown_as` and `source`) when it drops
    them; otherwise returns `extra_states` as given."""
    if not extra_states or device_type == "cpu":
        return extra_states
    lacking = [e for e in extra_states if e.get("rng") is not None and device_type not in e["rng"]]
    if not lacking:
        return extra_states
    warnings.warn(ConversionWarning(
        f"{shown_as}: the RNG states of {source} hold no {device_type!r} generator (saved by a "
        f"{'/'.join(sorted(lacking[0]['rng']))} run), which VERL restores on a {device_type} run "
        "without a fallback: left out of the extra_state files (VERL then keeps its own seeded "
        "random streams; the scheduler state is kept)"), stacklevel=3)
    return [{k: v for k, v in e.items() if k != "rng"} for e in extra_states]


def _sources_of(written: str, source_files: dict[str, list[str]] | None,
                source: str | Path) -> list[str]:
    kind, _, rest = written.partition("_world_size_")
    candidates = (source_files or {}).get(kind, [str(source)])
    rank_suffix = "_rank_" + rest.split("_rank_")[-1]
    same_rank = [s for s in candidates if s.endswith(rank_suffix)]
    same_w = all(Path(s).name.partition("_world_size_")[2].split("_rank_")[0]
                 == rest.split("_rank_")[0] for s in same_rank)
    return same_rank if same_rank and same_w else candidates


def verl_to_verl(src: str | Path, dst: str | Path, *, world_size: int, placement: str | None = None,
                 dtype: str | None = None, device_type: str | None = None) -> Path:
    """Reshard a VERL checkpoint to `world_size` ranks with `placement`, everything carried over.

    `placement` None keeps the source's (`VerlCheckpoint.placement`: first-divisible when its
    shard dims follow that rule, some off dim 0; "dim0" when they matter not); another than the
    source's is warned (`output_placement`).

    `device_type` (the DeviceMesh's in the written files): None keeps the source's (a gloo
    run's `cpu` stays `cpu`: torch refuses to load across mesh types), "cuda" when the source
    holds plain tensors or a device type other than `convert.dispatch.MESH_DEVICES` (warned).
    Per-rank extra state (RNG streams) cannot be split or merged: with the same W it is copied
    rank by rank; with another W, rank 0's is given to every rank.
    """
    from convert.dispatch import MESH_DEVICES

    ck = VerlCheckpoint(src)
    if device_type is None:
        device_type = (ck.mesh() or {}).get("device_type") or "cuda"
        if device_type not in MESH_DEVICES:
            warnings.warn(f"{ck.layout.shard_dir}: its DeviceMesh is on {device_type!r}; writing "
                          "'cuda' (give --mesh-device to choose)", ConversionWarning, stacklevel=2)
            device_type = "cuda"
    placement = output_placement(placement, ck.placement(), ck.shapes, world_size, src, dst)
    state = verl_state(ck)
    if state.extra_states is not None and world_size != ck.world_size:
        state.extra_states = state.extra_states[:1]
    files = {k: [str(ck.layout.rank_file(k, r)) for r in range(ck.world_size)]
             for k in ck.layout.kinds}
    if state.train_state is not None:
        files["train_state"] = [str(ck.layout.shard_dir / RUN_STATE_FILE)]
    return write_verl_run(dst, state, world_size=world_size, placement=placement, dtype=dtype,
                          device_type=device_type, source=src, source_format="verl",
                          source_files=files)


def verl_to_hf(src: str | Path, dst: str | Path, *, dtype: str | None = None,
               max_shard_bytes: int = 5 << 30, carried_from: str | Path | None = None) -> list[str]:
    """Write the VERL checkpoint's model as an HF directory at `dst` (streaming, atomic).

    Arrays are the files' own values (bitwise equal to torch's `full_tensor()`), in the files'
    dtype (fp32 master weights). `dtype` casts the trainable parameters only; carried tensors
    (Qwen3.5's vision tower) keep the files' dtype, as `jscenegen.model.hf_io.save_hf` does.
    Qwen3.5's `mtp.*`, which VERL files cannot hold, come from `carried_from` or the
    checkpoint's `huggingface/` weights in their stored dtype, or are dropped with a warning
    (convert/carried.py). Warns (ConversionWarning) when `huggingface/` holds no tokenizer.
    Returns the safetensors file names.
    """
    from convert.carried import verl_complement

    ck = VerlCheckpoint(src)
    if not any((ck.hf_dir / f).is_file() for f in TOKENIZER_FILES):
        warnings.warn(ConversionWarning(
            f"{ck.hf_dir}: no tokenizer ({' or '.join(TOKENIZER_FILES)}); the HF model written "
            f"to {dst} has none either: copy the model's tokenizer files in before using it"),
            stacklevel=2)
    extra = verl_complement(ck, carried_from)
    info = ck.tensor_info()
    carried = carried_names(ck.config)
    specs = {}
    for name, shape in hf_shapes(extra.config).items():
        if name in extra.names:
            specs[name] = (shape, np.dtype(extra.dtypes[name]))
        else:
            keep = dtype is None or name in carried
            specs[name] = (shape, np.dtype(_np_of(info[name].dtype if keep else dtype)))

    def arrays():
        for n in specs:
            if n in extra.names:
                yield n, extra.read(n)
            else:
                yield n, cast(ck.read_param(n), None if n in carried else dtype)

    with atomic_dir(dst, exists_error=ConvertError) as tmp:
        names = write_safetensors_streaming(tmp, specs, arrays(), max_shard_bytes)
        hf_files = copy_hf_metadata(ck.hf_dir, tmp)
        fix_config_file(tmp / "config.json", extra.config, text_weights_dtype(specs, extra.config))
        model_files = [str(p) for p in sorted(ck.layout.shard_dir.glob("model_world_size_*.pt"))]
        write_layout(tmp, fmt="hf-safetensors", source=src, source_format="verl",
                     files=[(n, model_files) for n in names] + hf_files,
                     dtype=dtype or "source", tied_head_dropped=ck.tied,
                     **extra.layout_fields())
        write_checksums(tmp)
    return names


def _np_of(torch_dtype: str) -> Any:
    try:
        return np_dtype(torch_dtype)
    except ValueError as err:
        raise ConvertError(f"tensor {err}") from None


def hf_state(hf_dir: str | Path) -> VerlState:
    """Model-only VerlState over an HF safetensors directory (names and shapes checked).

    Every tensor of the directory is checked (`tensor_sets.hf_shapes`: Qwen3.5's vision tower
    and `mtp.*` included); the state reads the ones VERL files hold (`verl_shapes`).
    """
    from jscenegen.model.config import ModelConfigError, QwenConfig
    from jscenegen.model.weights import CheckpointFormatError

    hf_dir = Path(hf_dir)
    try:
        cfg = QwenConfig.from_dir(hf_dir)
    except (ModelConfigError, CheckpointFormatError) as err:
        raise ConvertError(str(err)) from None
    reader = SafetensorsReader(hf_dir)
    shapes = hf_shapes(cfg)
    allowed = set(shapes) | ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    missing = sorted(set(shapes) - set(reader.files))
    unexpected = sorted(set(reader.files) - allowed)
    if missing or unexpected:
        raise ConvertError(f"{hf_dir}: safetensors names do not match config.json "
                           f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
                           + (f" ({note})" if missing and (note := cfg.assumed_tower_note()) else ""))
    for name, shape in shapes.items():
        if reader.shape(name) != tuple(shape):
            raise ConvertError(f"{reader.files[name]}: {name} has shape {reader.shape(name)}, "
                               f"config.json implies {tuple(shape)}{cfg.assumed_sizes_note()}")
    if cfg.tie_word_embeddings and "lm_head.weight" in reader.files:
        _check_tied_head(reader, embedding_name(cfg))
    return VerlState(config=cfg, hf_dir=hf_dir, params=reader.read)


def _check_tied_head(reader: SafetensorsReader, embedding: str, block_bytes: int = 64 * 2**20) -> None:
    """`hf_io.check_tied_head` in row blocks of about `block_bytes` (the head and the embedding
    are not held whole). Raises ConvertError naming the file."""
    from jscenegen.model.hf_io import TIED_ALIAS, CheckpointFormatError, check_tied_head, tied_head_error

    file, shape = reader.files[TIED_ALIAS], reader.shape(embedding)
    if reader.shape(TIED_ALIAS) != shape:
        raise ConvertError(str(tied_head_error(file, embedding)))
    rows = max(1, block_bytes // max(1, int(np.prod(shape[1:])) * reader.dtype(embedding).itemsize))
    try:
        for start in range(0, shape[0], rows):
            stop = min(shape[0], start + rows)
            check_tied_head(reader.read(TIED_ALIAS, 0, start, stop),
                            reader.read(embedding, 0, start, stop), file, embedding)
    except CheckpointFormatError as err:
        raise ConvertError(str(err)) from None


def hf_to_verl(src: str | Path, dst: str | Path, *, world_size: int, placement: str | None = None,
               dtype: str | None = None, device_type: str = "cuda") -> Path:
    """Write an HF model as VERL rank files (model only) for a torch run to start from.

    No optimizer or extra state is written (AdamW settings written here would override the
    VERL run's `optim` config on load): VERL resumes from it only with
    `actor_rollout_ref.actor.checkpoint.load_contents=[model]`, which `checkpoint-layout.json`
    records as `load_contents` (`MODEL_ONLY_NOTE`, which the command prints).

    Qwen3.5: the vision tower is written (VERL trains the vision-language class); `mtp.*` are
    not (VERL's model has no place for them; `checkpoint-layout.json` lists them under
    `not_in_verl`, and VERL loading the HF directory itself drops them too).
    """
    state = hf_state(src)
    files = sorted({str(p) for p in SafetensorsReader(src).files.values()})
    return write_verl_run(dst, state, world_size=world_size, placement=placement or "dim0",
                          dtype=dtype, device_type=device_type, source=src, source_format="hf",
                          source_files={"model": files})
