"""`jscenegen sft`: supervised warm start on scripted-expert episodes; writes an HF directory."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from jscenegen.paths import data_path_arg


def register(sub) -> None:
    p = sub.add_parser("sft", help="SFT warm start on scripted-expert demonstrations (all three roles)")
    p.add_argument("--config", default=None, type=data_path_arg, help="YAML file (e.g. configs/sft-cpu.yaml)")
    p.add_argument("--model", default=None, help="HF model directory to start from "
                   "(instead of model.path, not with a model.path override; default: a fresh "
                   "init-model next to --out)")
    p.add_argument("--out", default=None, help="output HF directory, new or empty (instead of "
                   "sft.out_dir, not with an sft.out_dir override)")
    p.add_argument("--chat-template", default=None, help="replacement prefix-preserving chat "
                   "template (jinja), e.g. for Qwen3 directories")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. sft.steps=10")
    p.set_defaults(func=run, intermixed=True)  # overrides anywhere among the options


def run(args) -> int:
    from jscenegen.checkpoint.store import is_checkpoint_dir
    from jscenegen.config import load_config, refuse_override_of
    from jscenegen.paths import (
        json_line,
        new_parents_removed_on_error,
        refuse_overwriting_input,
        require_new_dir,
    )
    from jscenegen.sft.config import SFTRunConfig
    from jscenegen.sharding.mesh import refuse_multi_host

    cfg = load_config(args.config, args.overrides, model=SFTRunConfig)
    if args.model:   # eval's and design's rule: a flag and the key it stands for, not both
        refuse_override_of("--model names the model to start from", {"model.path"}, args.overrides)
    if args.out:
        refuse_override_of("--out names the output directory", {"sft.out_dir"}, args.overrides)
    refuse_multi_host("sft", cfg.mesh)
    out = Path(args.out or cfg.sft.out_dir)
    model_dir = args.model or cfg.model.path
    model_key, out_key = ("--model" if args.model else "model.path"), ("--out" if args.out else "sft.out_dir")
    if model_dir is not None and is_checkpoint_dir(Path(model_dir)):
        raise ValueError(f"{model_key} {model_dir}: a checkpoint step; sft starts from an HF model "
                         f"directory (write one: jscenegen convert {model_dir} OUT --from orbax "
                         "--to hf)")
    # before anything is written (write checks create a probe file beside the output)
    refuse_overwriting_input(out, out_key, {model_key: model_dir, "--config": args.config})
    require_new_dir(out)  # before a fresh init-model or any demonstration is built
    with new_parents_removed_on_error(out):
        summary = _train(cfg, args, out, model_dir)
    print(json_line({"event": "done", "out_dir": str(out), "final_loss": summary["final_loss"],
                      "train_s": round(summary["train_s"], 1), "total_s": round(summary["total_s"], 1)}))
    return 0


def _train(cfg, args, out: Path, model_dir: str | None) -> dict:
    """SFT into `out` from `model_dir`, or from a fresh model made beside `out` (removed again
    when the SFT does not finish); returns run_sft's summary."""
    from jscenegen.paths import require_new_dir
    from jscenegen.sft.run import check_sft_inputs, run_sft

    fresh = model_dir is None
    mesh = None   # run_sft checks its inputs itself, unless they were checked here
    if fresh:   # what needs no model, before one is made (a minute of corpus and tokenizer)
        mesh = check_sft_inputs(cfg, args.chat_template)
    made_here = False   # an empty directory given for it stays when the SFT does not finish
    if fresh:
        from jscenegen.model.init_model import init_model_dir
        from jscenegen.scene.corpus import tokenizer_corpus

        model_dir = out.parent / f"{out.name}-init"
        if model_dir.exists() and not (model_dir.is_dir() and not any(model_dir.iterdir())):
            raise FileExistsError(f"{model_dir}: the fresh model sft makes next to --out (no "
                                  "--model given) already exists (a killed sft leaves it); start "
                                  "from it with --model, delete it, or choose another --out")
        require_new_dir(model_dir)
        made_here = not model_dir.exists()
        init_model_dir(model_dir, arch=cfg.sft.init_arch, preset=cfg.sft.init_preset,
                       seed=cfg.sft.seed, texts=tokenizer_corpus())
        print(json.dumps({"event": "init_model", "model_dir": str(model_dir)}), flush=True)
    try:
        return run_sft(cfg, model_dir, out, chat_template_path=args.chat_template, mesh=mesh)
    except BaseException:
        if fresh:   # the same command, run again, makes it afresh
            shutil.rmtree(model_dir, ignore_errors=True)
            if not made_here:
                model_dir.mkdir(exist_ok=True)
        raise
