"""`jscenegen mesh-report`: per-parameter sharding and per-device bytes, from shapes alone.

Any supported config works, composite Qwen3.5 ones included (configs/model-shapes/qwen3.5-*.json):
their carried vision tower and MTP tensors are listed as frozen (held in their stored dtype,
no Adam state); `--train-vision` counts the tower as trained (fp32 master weights + Adam).
"""
from __future__ import annotations

import json
import os


def register(sub) -> None:
    p = sub.add_parser("mesh-report", help="how a model's params + Adam state shard over a mesh")
    p.add_argument("--model", required=True, help="HF model directory, its config.json, or a "
                   "checkpoint step directory")
    p.add_argument("--mesh", default="fsdp=3,sp=2", help="fsdp=N,sp=M (default fsdp=3,sp=2; an "
                   "axis left out: fsdp=-1, the rest of --devices, and sp=2)")
    p.add_argument("--devices", type=int, default=None,
                   help="device count to plan for (default: fsdp x sp)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    p.add_argument("--train-vision", action="store_true",
                   help="Qwen3.5: the vision tower trained (fp32 + Adam, model.train_vision) "
                        "instead of frozen in its stored dtype")
    p.set_defaults(func=run)


def _parse_mesh(text: str) -> dict[str, int]:
    """{"fsdp": N, "sp": M} from `--mesh`; each size positive or -1 ("the rest"), each axis once.
    Raises ValueError naming --mesh and the bad item."""
    out: dict[str, int] = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in ("fsdp", "sp") or not value.strip():
            raise ValueError(f"--mesh: expected fsdp=N,sp=M, got {part!r} in {text!r}")
        if key in out:
            raise ValueError(f"--mesh: {key} given twice in {text!r}")
        digits = value.strip()
        if not (digits.isascii() and digits.removeprefix("-").isdigit()):
            raise ValueError(f"--mesh: {part.strip()!r} is not an integer size in {text!r}")
        size = int(digits)
        if size < 1 and size != -1:
            raise ValueError(f"--mesh: {part.strip()!r}: sizes must be positive, or -1 for "
                             "the rest of the devices")
        out[key] = size
    return out


def run(args) -> int:
    from jscenegen.model.config import QwenConfig, read_config_file
    from jscenegen.model.dtypes import np_dtype
    from jscenegen.model.weights import param_shapes, weight_table
    from jscenegen.paths import resolve_data_path
    from jscenegen.sharding.layout import layout_report
    from jscenegen.sharding.mesh import mesh_shape

    axes = _parse_mesh(args.mesh)
    if args.devices is not None and args.devices < 1:
        raise ValueError(f"--devices {args.devices}: must be a positive device count")
    fsdp, sp = axes.get("fsdp", -1), axes.get("sp", 2)
    if sp == -1:
        raise ValueError("--mesh sp=-1: only fsdp may take the rest of the devices")
    n = args.devices or (fsdp * sp if fsdp > 0 else None)
    if n is None:
        given = "fsdp=-1" if "fsdp" in axes else "no fsdp (fsdp=-1: the rest of the devices)"
        raise ValueError(f"--mesh {args.mesh} gives {given}: say how many devices with --devices N")
    try:
        path = resolve_data_path(args.model)
    except FileNotFoundError as err:
        raise ValueError(f"--model {err}") from None
    if not path.exists():
        raise ValueError(f"--model {path}: no such model directory or config.json")
    from jscenegen.checkpoint.store import is_checkpoint_dir, model_assets_dir, not_a_model

    if path.is_dir() and not is_checkpoint_dir(path) and not os.path.lexists(path / "config.json"):
        raise not_a_model(path)   # a run or its checkpoints/: it names the newest step
    path = model_assets_dir(path)   # a checkpoint step: its hf/ directory
    cfg = QwenConfig.from_dir(path) if path.is_dir() else QwenConfig.from_hf_dict(
        read_config_file(path), str(path))
    try:
        fsdp, sp = mesh_shape(n, fsdp, sp)
    except ValueError as err:
        raise ValueError(f"--mesh {args.mesh}" + (f" --devices {args.devices}" if args.devices else "")
                         + f": {err}") from None
    frozen = {name: np_dtype(cfg.stored_dtype(name)).itemsize
              for name, spec in weight_table(cfg, train_vision=args.train_vision).items()
              if spec.carried}
    report = layout_report(param_shapes(cfg, carried=True), n, {"fsdp": fsdp, "sp": sp}, frozen)
    if args.json:
        print(json.dumps(report))
        return 0
    gb = 1024 ** 3
    print(f"{'parameter':58s} {'shape':>16s} {'padded':>16s} {'rows/dev':>8s} {'MiB/dev':>8s}")
    for r in report["params"]:
        note = "" if r["trained"] else "  frozen"
        print(f"{r['name']:58s} {str(tuple(r['shape'])):>16s} {str(tuple(r['padded_shape'])):>16s} "
              f"{r['rows_per_device']:8d} {r['device_bytes'] / 2**20:8.1f}{note}")
    print(f"\nmesh fsdp={fsdp} x sp={sp} ({n} device{'s' if n != 1 else ''}), sharding P(('fsdp','sp')) on dim 0 of every tensor")
    count = report["num_params"]
    count_text = f"{count / 1e9:,.2f} B" if count >= 1e9 else f"{count / 1e6:.2f} M"
    print(f"parameters: {count_text} ({count:,}); params + Adam (fp32): "
          f"{report['total_bytes'] / gb:.2f} GiB total, {report['max_device_bytes'] / gb:.2f} GiB on the "
          f"fullest device (ideal {report['ideal_device_bytes'] / gb:.2f} GiB)")
    if note := cfg.assumed_tower_note():
        print(f"note: {note}")
    if report["frozen_bytes"]:
        print(f"of which frozen (carried, stored dtype, no Adam): {report['frozen_bytes'] / gb:.2f} GiB")
    return 0
