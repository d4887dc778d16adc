"""`jscenegen export CHECKPOINT OUT_DIR [--world-size 6]`: the published checkpoint layout.

HF inference model at the root, `training_state/global_step_N/` in VERL's FSDP2 layout
(resumable by torch FSDP2 on W ranks), training_metadata.json, checkpoint-layout.json and
checksums.json. A thin layer over convert.export.export.
"""
from __future__ import annotations

import argparse

from convert.dispatch import MESH_DEVICES
from jscenegen.commands import world_size_arg


def register(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a checkpoint in the published layout",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="orbax step directory, or a run directory or its "
                   "checkpoints/ (the newest complete step)")
    p.add_argument("out_dir", help="destination (must not exist or be empty)")
    p.add_argument("--world-size", type=world_size_arg, default=6, help="VERL ranks W (default 6)")
    p.add_argument("--placement", choices=("dim0", "first-divisible"), default=None,
                   help="FSDP2 shard dims of the VERL files (default: the placement of the VERL "
                   "checkpoint the step was converted from, else dim0, VERL 0.9's)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="dtype of the HF weights at the root (default: the checkpoint's)")
    p.add_argument("--mesh-device", choices=MESH_DEVICES, default="cuda",
                   help="DeviceMesh device type in the VERL files (cuda: GPU run; cpu: gloo)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from convert.export import export

    source, step = export(args.checkpoint, args.out_dir, world_size=args.world_size,
                          placement=args.placement, dtype=args.dtype, device_type=args.mesh_device)
    from jscenegen.text import terminal_line

    print(terminal_line(f"exported {source} -> {args.out_dir} (training state: {step})"))
    return 0
