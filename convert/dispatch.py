"""One entry point for every direction `jscenegen convert` offers (FORMATS x FORMATS)."""
from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, Callable

from convert.errors import ConvertError, require_torch

FORMATS = ("hf", "orbax", "verl")
MESH_DEVICES = ("cuda", "cpu")   # the DeviceMesh device types a VERL output can record


def _directions() -> dict[tuple[str, str], Callable[..., Any]]:
    from convert import directions as d

    table: dict[tuple[str, str], Callable[..., Any]] = {
        ("verl", "hf"): lambda src, dst, o: d.verl_to_hf(src, dst, dtype=o["dtype"],
                                                         carried_from=o["carried_from"]),
        ("hf", "verl"): lambda src, dst, o: d.hf_to_verl(
            src, dst, world_size=o["world_size"], placement=o["placement"], dtype=o["dtype"],
            device_type=o["mesh_device"]),
        ("verl", "verl"): lambda src, dst, o: d.verl_to_verl(
            src, dst, world_size=o["world_size"], placement=o["placement"], dtype=o["dtype"],
            device_type=o["mesh_device"]),
    }
    try:
        od = importlib.import_module("convert.orbax_directions")
    except ModuleNotFoundError as err:
        if err.name != "convert.orbax_directions":
            raise
    else:
        table.update(od.DIRECTIONS)
    return table


def refuse_nested(src: str | Path, dst: str | Path) -> None:
    """Raise ConvertError when `dst` is `src`, lies inside it or contains it: the output would
    be written into the checkpoint being read (and into later reads of it)."""
    a, b = Path(src).resolve(), Path(dst).resolve()
    if a == b or a in b.parents or b in a.parents:
        where = "is" if a == b else "lies inside" if a in b.parents else "contains"
        raise ConvertError(f"destination {dst} {where} the source {src}; choose a directory "
                           "outside it")


def verify_source(src: str | Path) -> None:
    """Verify the source against the `checksums.json` that covers it, when there is one (in
    `src` or up to three directories above: a VERL rank directory inside a converted or
    exported checkpoint), hashing every listed file under `src` and the files directly in each
    directory that a link inside `src` leads to elsewhere in that checkpoint (an export's
    `huggingface -> ../..`: the config and tokenizer the conversion reads). Raises ConvertError
    naming each file that is missing, altered or unlisted, under the path the user gave, then
    the manifest and the count (`checksums.failure_message`), or the manifest's file and entry
    when it cannot be read."""
    from jscenegen.checkpoint.checksums import covering_checksums

    _verify_covered(src, covering_checksums(src))


def verify_orbax_step(step_dir: str | Path) -> None:
    """Verify a complete orbax step (its own `checksums.json` already verified with hashes,
    `check_step`) against the manifest of the directory holding it, when that one lists the
    step: a converter's orbax output lists its step and `checkpoint-layout.json` in
    `DST/checksums.json`, which `convert --verify` checks. The step's files and the files
    directly beside it are checked (the step's own digests compared, not hashed again); a
    manifest that cannot be read (an entry outside its directory, not JSON) is refused naming
    the file and entry. Raises ConvertError as `verify_source` does."""
    from jscenegen.checkpoint.checksums import covering_checksums, read_checksums

    found = covering_checksums(step_dir, levels=1, above=True)
    if found is not None:
        own = read_checksums(step_dir)
        name = found[1]
        _verify_covered(step_dir, found, {f"{name}/{rel}": e["sha256"] for rel, e in own.items()},
                        beside=True)


def _verify_covered(src: str | Path, found: tuple[Path, str] | None,
                    known: dict[str, str] | None = None, beside: bool = False) -> None:
    """`src` against the manifest `found` (`covering_checksums`) lists it in: its files, the
    files directly in each directory a link inside `src` leads to (with `beside`, the files
    directly beside `src` too); ConvertError in one line, naming the files as the user named
    `src`."""
    from jscenegen.checkpoint.checksums import ChecksumError, verify_checksums

    if found is None:
        return
    root, rel = found
    flat = set(_linked_dirs(Path(src).resolve(), root))
    shown = _as_given(src, rel, root)   # the files named as the user named the source
    try:
        verify_checksums(shown, under=rel or None, known=known)
        for linked in sorted(flat | ({rel.rpartition("/")[0]} if beside else set())):
            verify_checksums(shown, under=linked, flat=True)
    except ChecksumError as err:
        raise ConvertError(str(err)) from None


def _as_given(src: str | Path, rel: str, root: Path) -> Path:
    """The directory `root` (resolved) named as the user named `src`, which lies at `rel`
    inside it: `src` with `rel`'s parts taken off its end, where that names `root` (a link
    inside the path may lead elsewhere); `root` otherwise."""
    parts, tail = Path(src).parts, Path(rel).parts if rel else ()
    if not tail:
        shown = Path(src)
    elif len(parts) >= len(tail) and parts[len(parts) - len(tail):] == tail:
        shown = Path(*parts[:len(parts) - len(tail)]) if len(parts) > len(tail) else Path(".")
    else:
        return root
    return shown if shown.resolve() == root else root


def _linked_dirs(src: Path, root: Path) -> list[str]:
    """Directories, relative to `root`, that symbolic links inside `src` lead to: those inside
    `root` but outside `src` (whose files `src`'s own check already hashed)."""
    found = set()
    for dirpath, dirnames, _files in os.walk(src, followlinks=False):
        for name in dirnames:
            link = Path(dirpath) / name
            if not link.is_symlink():
                continue
            target = link.resolve()
            if target.is_dir() and (target == root or root in target.parents) and not (
                    target == src or src in target.parents):
                rel = target.relative_to(root).as_posix()
                found.add("" if rel == "." else rel)
    return sorted(found)


def convert(src: str | Path, dst: str | Path, *, src_format: str, dst_format: str,
            world_size: int | None = None, placement: str | None = None, dtype: str | None = None,
            mesh_device: str | None = None, carried_from: str | Path | None = None) -> Any:
    """Convert `src` (in `src_format`) to `dst` (in `dst_format`); returns the direction's result.

    world_size: W for a VERL output (default: the VERL source's own W, else required).
    placement (VERL outputs only): "dim0" (VERL 0.9) | "first-divisible" (VERL 0.6 - 0.8);
    default: the source's own (a VERL source's shard dims, or those a step converted from VERL
    records), else "dim0"; an output placement other than the source's is warned. dtype: None keeps the source's (fp32 master weights), else "float32" |
    "bfloat16" for the model weights.
    mesh_device (VERL outputs only): the DeviceMesh device type pickled into VERL files:
    "cuda" for a GPU run, "cpu" for a CPU (gloo) run; torch refuses to copy between meshes of
    different types. Default: a VERL source's own, else "cuda".
    carried_from: an HF directory holding the tensors VERL files cannot (Qwen3.5's `mtp.*`),
    for a VERL source converted to HF or orbax (convert/carried.py); refused elsewhere.
    An HF or VERL source covered by a `checksums.json` is verified first (`verify_source`).
    Raises ConvertError for a missing source, a destination inside the source (or the other
    way round) or one that exists and is not empty (or is a symbolic link), a source that
    fails its checksums, a source whose file names say another format than `src_format`, an
    unknown direction, a missing world size, or a VERL-output
    option (world size, placement, mesh device) for another output.
    """
    from jscenegen.paths import require_new_dir

    if not Path(src).exists():
        raise ConvertError(f"{src}: no such file or directory")
    refuse_nested(src, dst)
    require_new_dir(dst, ConvertError)
    for f in (src_format, dst_format):
        if f not in FORMATS:
            raise ConvertError(f"format {f!r}: choose one of {', '.join(FORMATS)}")
    if "verl" in (src_format, dst_format):
        require_torch(f"convert {src_format} -> {dst_format}")
    _check_source_format(src, src_format)
    if src_format != "orbax":  # an orbax step: against its own checksums and its directory's
        # (`verify_orbax_step`), when read
        verify_source(src)
    table = _directions()
    if (src_format, dst_format) not in table:
        have = ", ".join(f"{a}->{b}" for a, b in sorted(table))
        raise ConvertError(f"{src_format} -> {dst_format} is not available (have: {have})")
    verl_options = {"--world-size": world_size, "--placement": placement,
                    "--mesh-device": mesh_device}
    for flag, value in verl_options.items():
        if value is not None and dst_format != "verl":
            raise ConvertError(f"{flag} shapes the rank files of a VERL output; --to {dst_format} "
                               "writes none (leave it out)")
    if src_format != "verl":   # a VERL source's own is the default (`verl_to_verl`)
        mesh_device = mesh_device or "cuda"
    if dst_format == "verl" and world_size is None:
        if src_format != "verl":
            raise ConvertError("--world-size is required to write VERL rank files")
        from convert.verl_read import find_verl

        world_size = find_verl(src).world_size
    if dst_format == "verl":
        from convert.verl_write import check_world_size

        check_world_size(world_size)
    if carried_from is not None and not (src_format == "verl" and dst_format in ("hf", "orbax")):
        raise ConvertError("--carried-from completes a VERL source converted to hf or orbax "
                           f"(the tensors VERL files cannot hold); not {src_format} -> {dst_format}")
    _check_source_assets(src, src_format)
    opts = dict(world_size=world_size, placement=placement, dtype=dtype, mesh_device=mesh_device,
                carried_from=carried_from)
    from convert.finite import watching

    with watching(str(src)):
        return table[(src_format, dst_format)](src, dst, opts)


def _check_source_format(src: str | Path, src_format: str) -> None:
    """Raise ConvertError when the reader of `src_format` cannot start from `src`'s files
    while their names say another format (each reader would refuse it in its own words, none
    naming the format it is). A directory that several readers can start from (VERL rank
    files beside an HF model) is left to the `src_format` given."""
    from convert.inspect import checkpoint_format, orbax_steps_dir
    from convert.verl_read import looks_like_verl

    path = Path(src)
    if not path.is_dir():
        return
    kind = "orbax" if orbax_steps_dir(path) else checkpoint_format(path)
    if kind is None:
        return
    starts = {"verl": looks_like_verl(path), "orbax": kind == "orbax",
              "hf": kind in ("hf", "export") or os.path.lexists(path / "config.json")}
    if starts[src_format]:
        return
    if kind == "export":
        how = ("an export: its root is an HF model (--from hf), its training state a VERL "
               "checkpoint under training_state/")
    else:
        named = {"hf": "an HF", "orbax": "an orbax", "verl": "a VERL"}[kind]
        how = f"{named} checkpoint: --from {kind}, or leave --from out"
    raise ConvertError(f"{src}: --from {src_format}, but it is {how}")


def _check_source_assets(src: str | Path, src_format: str) -> None:
    """Refuse, before anything is written, an HF or VERL source whose model files (the HF
    directory, a VERL checkpoint's `huggingface/`) hold an asset that is no regular file, a
    JSON file that is no object or a tokenizer that does not load (`check_asset_files`): every
    direction carries those files into its output as they are. (An orbax step's `hf/` is
    checked where the step is verified, `orbax_step_dir`.)"""
    from jscenegen.model.assets import check_asset_files

    if src_format == "orbax":
        return
    if src_format == "hf":
        model_files = Path(src)
    else:
        from convert.verl_read import find_verl

        model_files = find_verl(src).hf_dir
    if model_files is not None:
        check_asset_files(model_files, ConvertError)
