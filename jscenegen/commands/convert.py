"""`jscenegen convert`: checkpoints between HF safetensors, orbax and VERL FSDP2 shards.

    jscenegen convert SRC DST --from verl --to hf [--dtype bfloat16]
    jscenegen convert SRC DST --from hf --to verl --world-size 6 [--placement first-divisible]
    jscenegen convert SRC DST --from verl --to orbax [--carried-from RELEASE_DIR]   # Qwen3.5 mtp.*
    jscenegen convert SRC DST --to hf     # --from left out: read from SRC's file names
    jscenegen convert --verify DIR        # DIR against its checksums.json
    jscenegen convert --inspect DIR       # what DIR holds, as JSON

A thin layer over convert.dispatch.convert, convert.inspect.describe and
jscenegen.checkpoint.checksums.verify_checksums.
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings

from convert.dispatch import MESH_DEVICES
from jscenegen.commands import world_size_arg

NOT_CARRIED_TO_JAX = (
    "note: not carried into JAX: torch's RNG streams (JAX keys cannot continue them; those the "
    "rank files hold are kept in training_metadata.json for a return to VERL) and VERL's data "
    "loader state (data.pt, not read): a resumed run draws other samples and takes its scenes "
    "from its own schedule at the global step")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert", help="convert checkpoints between hf, orbax and verl; verify; inspect",
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:2]))
    p.add_argument("src", nargs="?", help="source directory")
    p.add_argument("dst", nargs="?", help="destination directory (must not exist or be empty)")
    p.add_argument("--from", dest="src_format", choices=("hf", "orbax", "verl"),
                   help="the source's format (default: from SRC's file names, as --inspect "
                        "reads them; an export holds two and needs it)")
    p.add_argument("--to", dest="dst_format", choices=("hf", "orbax", "verl"))
    p.add_argument("--world-size", type=world_size_arg, default=None,
                   help="VERL output ranks W (from a VERL source: its W by default; from hf or "
                        "orbax: required)")
    p.add_argument("--placement", choices=("dim0", "first-divisible"), default=None,
                   help="VERL output shard dim per tensor: dim0 (VERL 0.9) or first dim "
                        "divisible by W (VERL 0.6-0.8); default: the source's own (a VERL "
                        "source, or a step converted from one), else dim0")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="model weight dtype of the output (default: the source's); hf/orbax "
                        "outputs keep carried tensors (Qwen3.5's vision tower, mtp.*) in their "
                        "stored dtype and cast A_log and the gated norm too (docs/checkpoints.md)")
    p.add_argument("--mesh-device", choices=MESH_DEVICES, default=None,
                   help="device type of the DeviceMesh in VERL output files (cuda: GPU run; cpu: "
                        "gloo; default: a VERL source's own, else cuda)")
    p.add_argument("--carried-from", metavar="HF_DIR", default=None,
                   help="verl -> hf/orbax: take the tensors VERL files cannot hold (Qwen3.5's "
                        "mtp.*) from this HF directory (the release the run started from); "
                        "without it they are dropped with a warning")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--verify", metavar="DIR", help="check DIR against DIR/checksums.json (a "
                      "run or its checkpoints/: each finished step against its own)")
    mode.add_argument("--inspect", metavar="DIR", help="describe DIR (format, W, placements, ...)")
    p.set_defaults(func=run, intermixed=True)  # SRC and DST before, between or after the options


def run(args: argparse.Namespace) -> int:
    from jscenegen.checkpoint.checksums import CHECKSUMS_NAME, verify_checksums
    from jscenegen.paths import refuse_non_utf8
    from jscenegen.text import terminal_line

    _refuse_options_a_mode_ignores(args)
    for label, path in (("SRC", args.src), ("DST", args.dst), ("--carried-from", args.carried_from),
                        ("--inspect", args.inspect)):   # --verify only hashes files: any name
        if path is not None:   # the libraries reading them (safetensors, torch) take UTF-8 paths
            refuse_non_utf8(path, f"{label} {path}")
    if args.verify:
        from convert.inspect import orbax_steps_dir, verify_run

        steps_dir = orbax_steps_dir(args.verify)
        # a run: each step against its own manifest; a converter's output: its one manifest
        if steps_dir is not None and not (steps_dir / CHECKSUMS_NAME).exists():
            verified, unfinished, n = verify_run(steps_dir)
            for step in unfinished:
                print(terminal_line(f"warning: {steps_dir / str(step)}: an unfinished save (no "
                                    "checksums.json): a run skips it and saves that step again"),
                      file=sys.stderr)
            print(terminal_line(f"{args.verify}: steps {', '.join(map(str, verified))}: {n} files "
                                "verify against their checksums.json"))
            return 0
        tree = steps_dir or args.verify
        n = verify_checksums(tree)
        print(terminal_line(f"{tree}: {n} files verify against checksums.json"))
        return 0
    if args.inspect:
        from convert.inspect import describe

        print(json.dumps(describe(args.inspect), indent=2, default=str))
        return 0
    if not (args.src and args.dst and args.dst_format):
        raise ValueError("jscenegen convert: needs SRC DST --to G [--from F], or --verify/--inspect "
                         "DIR (see jscenegen convert --help)")
    from convert.dispatch import convert
    from convert.errors import ConversionWarning
    from convert.inspect import source_format

    if args.src_format is None:
        args.src_format = source_format(args.src)
        print(terminal_line(f"{args.src}: read as --from {args.src_format}"), file=sys.stderr)

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConversionWarning)
            convert(args.src, args.dst, src_format=args.src_format, dst_format=args.dst_format,
                    world_size=args.world_size, placement=args.placement, dtype=args.dtype,
                    mesh_device=args.mesh_device, carried_from=args.carried_from)
    finally:   # also when it fails: the warnings come before the error line (`cli.main`)
        for w in caught:  # what the output lost, one line each; other warnings as Python shows them
            if issubclass(w.category, ConversionWarning):
                print(terminal_line(f"warning: {w.message}"), file=sys.stderr)
            else:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    if (args.src_format, args.dst_format) == ("verl", "orbax"):
        print(terminal_line(NOT_CARRIED_TO_JAX), file=sys.stderr)
    if (args.src_format, args.dst_format) == ("hf", "verl"):
        from convert.directions import MODEL_ONLY_NOTE

        print(terminal_line(MODEL_ONLY_NOTE), file=sys.stderr)
    print(terminal_line(f"{args.src} ({args.src_format}) -> {args.dst} ({args.dst_format})"))
    return 0


def _refuse_options_a_mode_ignores(args: argparse.Namespace) -> None:
    """`--verify DIR` and `--inspect DIR` convert nothing: SRC, DST and the conversion options
    given with them were dropped without a word (a user could think a conversion ran)."""
    mode = "--verify" if args.verify else "--inspect" if args.inspect else None
    if mode is None:
        return
    given = [name for name, value in (("SRC", args.src), ("DST", args.dst),
                                      ("--from", args.src_format), ("--to", args.dst_format),
                                      ("--world-size", args.world_size), ("--placement", args.placement),
                                      ("--dtype", args.dtype), ("--mesh-device", args.mesh_device),
                                      ("--carried-from", args.carried_from)) if value is not None]
    if given:
        raise ValueError(f"jscenegen convert {mode} DIR takes no {', '.join(given)}: it converts "
                         "nothing (run the conversion on its own)")
