"""`jscenegen init-model`: write a micro/tiny/small Qwen2, Qwen3 or Qwen3.5 HF directory with its own tokenizer."""
from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("init-model", help="write a fresh micro/tiny/small Qwen HF model directory")
    p.add_argument("out_dir")
    p.add_argument("--arch", choices=["qwen2", "qwen3", "qwen3_5"], default="qwen3",
                   help="default: qwen3; qwen3_5 writes a Qwen3.5 VLM directory (tiny vision tower)")
    p.add_argument("--preset", choices=["micro", "tiny", "small"], default="tiny", help="default: tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from jscenegen.model.init_model import init_model_dir
    from jscenegen.scene.corpus import tokenizer_corpus

    if Path(args.out_dir).exists() and any(Path(args.out_dir).iterdir()):
        raise ValueError(f"{args.out_dir} exists and is not empty; init-model never overwrites")
    out = init_model_dir(args.out_dir, arch=args.arch, preset=args.preset, seed=args.seed,
                         texts=tokenizer_corpus(), vocab_size=args.vocab_size)
    print(json.dumps({"model_dir": str(out), "arch": args.arch, "preset": args.preset}))
    return 0
