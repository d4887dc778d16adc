"""`jscenegen init-model`: write a micro/tiny/small Qwen2, Qwen3 or Qwen3.5 HF directory with its own tokenizer."""
from __future__ import annotations

import json
import sys
import time

from jscenegen.commands import seed_arg
from jscenegen.model.names import ARCHS, PRESET_NAMES
from jscenegen.model.tokenizer.build import SPECIAL_TOKENS

# hidden size x layers of each Qwen2/Qwen3 preset (jscenegen.model.config.PRESETS; a test keeps
# them equal); qwen3_5 has its own (HYBRID_PRESETS: layers in multiples of 4)
PRESET_HELP = {"micro": "hidden 128 x 2 layers, the CPU default's policy",
               "tiny": "hidden 256 x 4 layers", "small": "hidden 512 x 8 layers"}


# the byte-level BPE's alphabet and its special tokens: a smaller --vocab-size cannot be honoured
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)


def register(sub) -> None:
    p = sub.add_parser("init-model", help="write a fresh micro/tiny/small Qwen HF model directory "
                       "(random weights, a tokenizer trained on the scene protocol's text)")
    p.add_argument("out_dir")
    p.add_argument("--arch", choices=ARCHS, default="qwen3",
                   help="default: qwen3; qwen3_5 writes a Qwen3.5 VLM directory (tiny vision tower)")
    p.add_argument("--preset", choices=PRESET_NAMES, default="tiny",
                   help="; ".join(f"{k}: {v}" for k, v in PRESET_HELP.items())
                   + " (qwen2/qwen3; qwen3_5 micro has 4 layers) (default: tiny)")
    p.add_argument("--seed", type=seed_arg, default=0)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--randomise-constant", action="store_true",
                   help="add N(0, 0.05^2) noise to every tensor that starts as one value (norms "
                        "of ones, zero biases), so that a parity check reads them")
    p.set_defaults(func=run)


def _say(text: str, t0: float) -> None:
    from jscenegen.text import terminal_line

    print(terminal_line(f"init-model [{time.perf_counter() - t0:5.1f} s] {text}"), file=sys.stderr,
          flush=True)


def run(args) -> int:
    """Progress goes to stderr (the corpus alone takes 15 s to 2 min on 2 cores); the result
    is one JSON line on stdout."""
    from jscenegen.model.config import SIZE_LIMITS
    from jscenegen.paths import require_new_dir

    limit = SIZE_LIMITS["vocab_size"]
    if not MIN_VOCAB <= args.vocab_size <= limit:
        raise ValueError(f"--vocab-size {args.vocab_size}: must be from {MIN_VOCAB} (the "
                         f"byte-level alphabet and 3 special tokens) to {limit:,}")
    require_new_dir(args.out_dir)  # init-model never overwrites
    t0 = time.perf_counter()
    _say("playing the scripted expert's episodes for the tokenizer corpus", t0)
    from jscenegen.scene.corpus import tokenizer_corpus

    texts = tokenizer_corpus()
    extra = " and the Qwen3.5 vision and tool tokens" if args.arch == "qwen3_5" else ""
    _say(f"training a BPE tokenizer (at most {args.vocab_size} tokens{extra}) on {len(texts)} texts, then "
         f"initialising {args.arch}/{args.preset} weights (seed {args.seed})", t0)
    from jscenegen.model.init_model import init_model_dir

    out = init_model_dir(args.out_dir, arch=args.arch, preset=args.preset, seed=args.seed,
                         texts=texts, vocab_size=args.vocab_size,
                         randomise_constant=args.randomise_constant)
    from jscenegen.model.config import QwenConfig

    vocab = QwenConfig.from_dir(out).vocab_size
    _say(f"wrote {out} (vocabulary: {vocab} tokens)", t0)
    print(json.dumps({"model_dir": str(out), "arch": args.arch, "preset": args.preset}))
    return 0
