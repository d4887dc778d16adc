"""`jscenegen parity ...`: compare jscenegen against the torch baseline, one JSON line out."""
from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("parity", help="numbers against the torch baseline")
    kinds = p.add_subparsers(dest="parity_kind", metavar="KIND", required=True)
    lg = kinds.add_parser("logits", help="logits vs transformers' torch model")
    lg.add_argument("--model", required=True, help="HF model directory")
    lg.add_argument("--batch", type=int, default=2)
    lg.add_argument("--seq", type=int, default=64)
    lg.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    lg.add_argument("--seed", type=int, default=0)
    lg.set_defaults(func=run_logits)
    from jscenegen.parity.grpo_step import add_parser as add_grpo_step

    add_grpo_step(kinds)
    from jscenegen.parity.train import add_parser as add_train

    add_train(kinds)


def run_logits(args) -> int:
    from jscenegen.parity.logits import logits_parity

    result = logits_parity(args.model, batch=args.batch, seq=args.seq, dtype=args.dtype,
                           seed=args.seed)
    print(json.dumps(result))
    return 0 if result["ok"] else 1
