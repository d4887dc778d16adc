"""`jscenegen init-model`: write a micro/tiny/small Qwen2, Qwen3 or Qwen3.5 HF directory with its own tokenizer."""
from __future__ import annotations

import json


COMPACT_PROMPTS = "configs/prompts-compact"


def tokenizer_corpus() -> list[str]:
    """Text the tokenizer is trained on: the scene protocol's own text when the runtime
    provides it (prompts, canonical scenes, scripted expert actions; with the packaged prompts
    and with the compact set the CPU default plays), else a built-in sample."""
    try:
        from jscenegen.scene.config import SceneRuntimeConfig
        from jscenegen.scene.corpus import protocol_texts
    except ImportError:
        return _fallback_texts()
    return [*protocol_texts(), *protocol_texts(cfg=SceneRuntimeConfig(prompts_dir=COMPACT_PROMPTS))]


def _fallback_texts() -> list[str]:
    import random

    rng = random.Random(0)
    cats = ["single_bed", "double_bed", "nightstand", "wardrobe", "dresser", "desk", "chair",
            "table_lamp", "floor_lamp", "rug", "bookshelf", "wall_shelf", "plant", "bench"]
    out = []
    for _ in range(2000):
        c = rng.choice(cats)
        op = {"op": "add_object", "category": c, "position": [round(rng.uniform(0, 5), 2),
              round(rng.uniform(0, 5), 2)], "yaw": rng.choice([0, 90, 180, 270]), "mount": "floor"}
        out.append(f"Designer: place a {c.replace('_', ' ')} near the wall.\n"
                   f"<action>{json.dumps({'ops': [op]})}</action>")
    return out


def register(sub) -> None:
    p = sub.add_parser("init-model", help="write a fresh tiny/small Qwen HF model directory")
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

    if Path(args.out_dir).exists() and any(Path(args.out_dir).iterdir()):
        raise ValueError(f"{args.out_dir} exists and is not empty; init-model never overwrites")
    out = init_model_dir(args.out_dir, arch=args.arch, preset=args.preset, seed=args.seed,
                         texts=tokenizer_corpus(), vocab_size=args.vocab_size)
    print(json.dumps({"model_dir": str(out), "arch": args.arch, "preset": args.preset}))
    return 0
