"""VERL-layout checkpoints made by real torch FSDP2, for the convert/ tests.

Run as a script in a fresh interpreter (no JAX imported), which forks W gloo ranks on CPU:

    python tests/fsdp_fixtures.py build OUT --arch qwen2|qwen3|qwen35|qwen35_tied_frozen --world-size 6 --placement dim0|first-divisible
    python tests/fsdp_fixtures.py load CKPT_DIR OUT --world-size W --placement ... [--freeze-vision] [--image]

`build` trains a tiny transformers Qwen2ForCausalLM (untied) or Qwen3ForCausalLM (tied) wrapped
with `fully_shard` for a few torch.optim.AdamW + LambdaLR steps (gradient clipping at 1.0), then
every rank saves its state dicts exactly as VERL's `FSDPCheckpointManager.save_checkpoint`
(verl/utils/checkpoint/fsdp_checkpoint_manager.py) does: `model_world_size_W_rank_R.pt`
(`module.state_dict()`, DTensors), `optim_world_size_W_rank_R.pt` (`optimizer.state_dict()`),
`extra_state_world_size_W_rank_R.pt` (`{"lr_scheduler": ..., "rng": {...}}`), rank 0 also
`fsdp_config.json` and `huggingface/`; the trainer's `latest_checkpointed_iteration.txt` sits
beside `global_step_N/`. Layout: OUT/ckpt/global_step_N/actor/... . Rank 0 also writes the
ground truth gathered by torch itself (`full_tensor()`) to OUT/reference/: params.safetensors
(the full model state dict, tied alias included), optim.safetensors (`{name}.exp_avg`,
`{name}.exp_avg_sq`), meta.json (parameter order, placements, step, scheduler state).

`load` mirrors VERL's `FSDPCheckpointManager.load_checkpoint`: each of W ranks builds the model
from CKPT_DIR/huggingface, loads its three files with `torch.load(weights_only=True)`, then
writes what torch holds (OUT/loaded_*.safetensors), takes one more AdamW step on a fixed batch
(identical on every rank, so the mean gradient does not depend on W) and writes the result
(OUT/stepped_*.safetensors, OUT/meta.json).

VERL 0.6 - 0.8 placement ("first-divisible", verl/utils/fsdp_utils.py::get_shard_placement_fn):
Shard on the first dimension divisible by W, else dim 0. VERL 0.9 ("dim0"): FSDP2's default.

Qwen3.5 (`qwen35*` archs): the tiny `qwen3_5` VLM of tests/qwen35_fixtures.py (or the HF
directory given with `--release`; its own tie and sizes then apply) is first written
as a release would be (bf16 with fp32 A_log / gated norm, `mtp.*` tensors, processor files, the
released shard name) to OUT/release; every rank loads it as VERL's actor does
(`Qwen3_5ForConditionalGeneration.from_pretrained(..., dtype=float32)`: transformers drops
`mtp.*`), optionally freezes the vision tower (VERL's `actor.freeze_vision_tower`:
`model.visual.requires_grad_(False)`), and wraps it as VERL's `apply_fsdp2` does
(verl/utils/fsdp_utils.py): `fully_shard` on every module of a `_no_split_modules` class (each
text decoder layer and each vision block) and, untied, on every `nn.Embedding`, then on the
root. The optimizer is built over all `module.parameters()`, as VERL's `build_optimizer` is, so
a frozen tower has indices in `param_groups` but no `state` entries. `qwen35` (untied, hidden 48
so that first-divisible gives Shard(1) tensors at W = 6) trains the tower on a batch holding
one image (real gradients); `qwen35_tied_frozen` (tied, hidden 44) trains on text with the tower
frozen. VERL's `huggingface/` is the model config as transformers saves it plus the release's
tokenizer, chat template and processor files.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

# Tiny architectures with sizes not divisible by 6 (uneven and empty shards at W = 6).
# qwen2 uses hidden 48 so that first-divisible gives Shard(1) for q/k/v, gate/up and the embedding.
ARCHS = {
    "qwen2": dict(model_type="qwen2", vocab_size=1003, hidden_size=48, intermediate_size=100,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0,
                  max_position_embeddings=128),
    "qwen3": dict(model_type="qwen3", vocab_size=1001, hidden_size=40, intermediate_size=70,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=10,
                  tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=10000.0,
                  max_position_embeddings=128),
}
# Qwen3.5: {arch: (tied, text size overrides, freeze the vision tower, train on an image)}
ARCHS35 = {
    "qwen35": dict(tie=False, text_sizes={"hidden_size": 48}, freeze_vision=False, image=True),
    "qwen35_tied_frozen": dict(tie=True, text_sizes={}, freeze_vision=True, image=False),
}
TRAIN_STEPS = 3
GLOBAL_STEP = 3
LR = 1e-3


def _build_model(hf_config):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)


def _build_qwen35(source, *, freeze_vision: bool, from_config: bool = False):
    """VERL's actor: the VLM in fp32 from the release (or, to load a checkpoint into, from its
    config), the tower frozen on request (fsdp_workers.py, `freeze_vision_tower`)."""
    import torch
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    if from_config:
        model = Qwen3_5ForConditionalGeneration._from_config(AutoConfig.from_pretrained(source),
                                                             dtype=torch.float32)
    else:
        model = Qwen3_5ForConditionalGeneration.from_pretrained(source, dtype=torch.float32)
    model.to(torch.float32)
    if freeze_vision:
        model.model.visual.requires_grad_(False)
    return model


def _shard(model, world_size: int, placement: str):
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))

    def first_divisible(param: nn.Parameter) -> Shard:
        for d, n in enumerate(param.shape):
            if n % world_size == 0:
                return Shard(d)
        return Shard(0)

    fn = first_divisible if placement == "first-divisible" else None
    if model.config.model_type == "qwen3_5":  # VERL's apply_fsdp2
        wrap = set(model._no_split_modules)
        tied = model.config.tie_word_embeddings
        for module in [m for m in model.modules()
                       if type(m).__name__ in wrap or (isinstance(m, nn.Embedding) and not tied)]:
            fully_shard(module, mesh=mesh, shard_placement_fn=fn)
    else:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, shard_placement_fn=fn)
    fully_shard(model, mesh=mesh, shard_placement_fn=fn)
    return mesh


def _batch(config, generator, image: bool) -> dict:
    """A training batch: 2 rows of 9 random token ids; with `image`, each row holds one
    2 x 2-patch image (one merged image token between vision start/end) and its pixels."""
    import torch

    text = getattr(config, "text_config", config)
    ids = torch.randint(0, min(text.vocab_size, 300), (2, 9), generator=generator)
    batch = {"input_ids": ids, "labels": ids}
    if image:
        ids[:, 2], ids[:, 3], ids[:, 4] = (config.vision_start_token_id, config.image_token_id,
                                           config.vision_end_token_id)
        v = config.vision_config
        patch = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
        batch.update(pixel_values=torch.randn(2 * 4, patch, generator=generator),
                     image_grid_thw=torch.tensor([[1, 2, 2], [1, 2, 2]]),
                     mm_token_type_ids=(ids == config.image_token_id).long())
    return batch


def _optimizer(model):
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return opt, sched


def _train_step(model, opt, batch):
    import torch

    loss = model(**batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


def _full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone().contiguous()


def _names_by_param(model):
    return [n for n, _ in model.named_parameters()]


def _build_rank(rank: int, world_size: int, args, init_file: str) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from transformers import AutoConfig

    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            init_method=f"file://{init_file}")
    out = Path(args.out)
    qwen35 = ARCHS35.get(args.arch)
    if qwen35:
        model = _build_qwen35(out / "release", freeze_vision=qwen35["freeze_vision"])
        hf_config = model.config
    else:
        hf_config = AutoConfig.for_model(**ARCHS[args.arch])
        model = _build_model(hf_config)
    _shard(model, world_size, args.placement)
    opt, sched = _optimizer(model)
    for step in range(TRAIN_STEPS):
        g = torch.Generator().manual_seed(1000 + step * world_size + rank)
        _train_step(model, opt, _batch(hf_config, g, bool(qwen35 and qwen35["image"])))
        sched.step()
    # distinct, known RNG streams per rank, as a real run has
    torch.manual_seed(77 + rank)
    np.random.seed(88 + rank)
    random.seed(99 + rank)
    np.random.standard_normal()  # leaves has_gauss/cached_gaussian set in numpy's state

    run = out / "ckpt"
    actor = run / f"global_step_{GLOBAL_STEP}" / "actor"
    W = world_size
    model_sd = model.state_dict()
    optim_sd = opt.state_dict()
    extra = {"lr_scheduler": sched.state_dict(),
             "rng": {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(),
                     "random": random.getstate()}}
    if rank == 0:
        actor.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    torch.save(model_sd, actor / f"model_world_size_{W}_rank_{rank}.pt")
    torch.save(optim_sd, actor / f"optim_world_size_{W}_rank_{rank}.pt")
    torch.save(extra, actor / f"extra_state_world_size_{W}_rank_{rank}.pt")

    full_params = {k: _full(v) for k, v in model_sd.items()}
    names = _names_by_param(model)
    full_optim = {}
    for idx, st in optim_sd["state"].items():
        full_optim[f"{names[idx]}.exp_avg"] = _full(st["exp_avg"])
        full_optim[f"{names[idx]}.exp_avg_sq"] = _full(st["exp_avg_sq"])
    dist.barrier()
    if rank == 0:
        with open(actor / "fsdp_config.json", "w") as f:
            json.dump({"FSDP_version": 2, "world_size": W}, f, indent=4)
        hf_config.save_pretrained(actor / "huggingface")
        if qwen35:  # VERL saves the tokenizer and processor beside the config
            import shutil

            for f in sorted((out / "release").iterdir()):
                if f.name != "config.json" and not f.name.startswith("model.safetensors"):
                    shutil.copy2(f, actor / "huggingface" / f.name)
        else:  # a tiny byte-level BPE with ChatML
            from jscenegen.model.tokenizer.build import train_bpe_tokenizer

            texts = ["a small bedroom with a bed, a desk and a lamp by the window"] * 4
            train_bpe_tokenizer(texts, vocab_size=300).save_pretrained(actor / "huggingface")
        (run / "latest_checkpointed_iteration.txt").write_text(str(GLOBAL_STEP))
        ref = out / "reference"
        ref.mkdir(parents=True, exist_ok=True)
        # safetensors refuses shared storage; the tied alias is cloned by _full already
        save_file(full_params, str(ref / "params.safetensors"))
        save_file(full_optim, str(ref / "optim.safetensors"))
        placements = {k: (v.placements[-1].dim if hasattr(v, "placements") else None)
                      for k, v in model_sd.items()}
        meta = {"param_order": names, "state_dict_keys": list(model_sd),
                "placements": placements,
                "state_indices": sorted(optim_sd["state"]),
                "frozen": [n for n, p in model.named_parameters() if not p.requires_grad],
                "step": float(next(iter(optim_sd["state"].values()))["step"]),
                "param_groups": [{k: v for k, v in g.items()} for g in optim_sd["param_groups"]],
                "lr_scheduler": {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"},
                "world_size": W, "arch": args.arch, "placement": args.placement,
                "torch_version": torch.__version__}
        (ref / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    dist.barrier()
    dist.destroy_process_group()


def _load_rank(rank: int, world_size: int, args, init_file: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.tensor  # noqa: F401  (registers DTensor for unpickling)
    from safetensors.torch import save_file
    from transformers import AutoConfig

    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            init_method=f"file://{init_file}")
    ckpt = Path(args.ckpt)
    out = Path(args.out)
    W = world_size
    hf_config = AutoConfig.from_pretrained(ckpt / "huggingface")
    if hf_config.model_type == "qwen3_5":
        model = _build_qwen35(ckpt / "huggingface", freeze_vision=args.freeze_vision,
                              from_config=True)
    else:
        model = _build_model(hf_config)
    _shard(model, W, args.placement)
    opt, sched = _optimizer(model)
    model_sd = torch.load(ckpt / f"model_world_size_{W}_rank_{rank}.pt", weights_only=True)
    model.load_state_dict(model_sd)
    # optimizer and extra state are optional (VERL's load_contents), as in a model-only start
    optim_file = ckpt / f"optim_world_size_{W}_rank_{rank}.pt"
    if optim_file.is_file():
        opt.load_state_dict(torch.load(optim_file, weights_only=True))
    extra_file = ckpt / f"extra_state_world_size_{W}_rank_{rank}.pt"
    extra = {"rng": {"cpu": torch.get_rng_state()}}
    if extra_file.is_file():
        from convert.torch_safe import load_pt  # the allowlist for numpy RNG state

        extra = load_pt(extra_file)
        sched.load_state_dict(extra["lr_scheduler"])
        if "rng" in extra:  # VERL's load tolerates a missing rng (a run that trained in JAX)
            torch.set_rng_state(extra["rng"]["cpu"])
    names = _names_by_param(model)

    def snapshot():
        p = {k: _full(v) for k, v in model.state_dict().items()}
        o = {}
        for idx, st in opt.state_dict()["state"].items():
            o[f"{names[idx]}.exp_avg"] = _full(st["exp_avg"])
            o[f"{names[idx]}.exp_avg_sq"] = _full(st["exp_avg_sq"])
        return p, o

    loaded_p, loaded_o = snapshot()
    loaded_state = opt.state_dict()["state"]
    step_before = float(next(iter(loaded_state.values()))["step"]) if loaded_state else 0.0
    g = torch.Generator().manual_seed(4242)
    _train_step(model, opt, _batch(hf_config, g, args.image))
    sched.step()
    stepped_p, stepped_o = snapshot()
    placements = {k: v.placements[-1].dim for k, v in model.state_dict().items()}
    shard_shapes = {k: list(v.to_local().shape) for k, v in model.state_dict().items()}
    all_shapes = [None] * W
    dist.all_gather_object(all_shapes, shard_shapes)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file(loaded_p, str(out / "loaded_params.safetensors"))
        if loaded_o:
            save_file(loaded_o, str(out / "loaded_optim.safetensors"))
        save_file(stepped_p, str(out / "stepped_params.safetensors"))
        save_file(stepped_o, str(out / "stepped_optim.safetensors"))
        meta = {"step_before": step_before,
                "step_after": float(next(iter(opt.state_dict()["state"].values()))["step"]),
                "state_indices_loaded": sorted(loaded_state),
                "state_indices_after": sorted(opt.state_dict()["state"]),
                "lr_after": opt.param_groups[0]["lr"],
                "last_epoch_after": sched.last_epoch,
                "rng_cpu_first_bytes": extra.get("rng", {}).get("cpu", torch.zeros(0))[:16].tolist(),
                "placements": placements, "local_shapes": all_shapes}
        (out / "meta.json").write_text(json.dumps(meta, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def _run_ranks(target, world_size: int, args) -> None:
    """Fork `world_size` ranks (CPU torch only: fork is safe and imports happen once)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        ctx = mp.start_processes(target, args=(world_size, args, init_file), nprocs=world_size,
                                 join=True, start_method="fork")
        del ctx


# the two fixtures the tests use: (arch, world size, placement)
FIXTURES = {
    "qwen2_first_divisible": ("qwen2", 6, "first-divisible"),  # VERL 0.6 - 0.8: Shard(1) tensors
    "qwen3_tied_dim0": ("qwen3", 6, "dim0"),                   # VERL 0.9, tied embeddings
    # Qwen3.5 VLM: untied, tower trained on an image, VERL 0.6 - 0.8 placement
    "qwen35_first_divisible": ("qwen35", 6, "first-divisible"),
    # Qwen3.5 VLM: tied, tower frozen (no Adam state for it), VERL 0.9 placement
    "qwen35_tied_frozen_dim0": ("qwen35_tied_frozen", 6, "dim0"),
}


def _cache_root() -> Path:
    import hashlib

    import torch
    import transformers

    here = Path(__file__).resolve().parent
    recipe = b"".join((here / f).read_bytes() for f in ("fsdp_fixtures.py", "qwen35_fixtures.py"))
    key = hashlib.sha256(recipe + torch.__version__.encode()
                         + transformers.__version__.encode()).hexdigest()[:16]
    base = os.environ.get("JSCENEGEN_FIXTURE_CACHE",
                          os.path.join(os.path.expanduser("~"), ".cache", "jscenegen", "fsdp"))
    return Path(base) / key


def fixture_dir(name: str) -> Path:
    """OUT directory of fixture `name` (see FIXTURES), built once per fixture-script version.

    The cache key hashes this file, tests/qwen35_fixtures.py and the torch and transformers
    versions, so a changed recipe rebuilds. Built
    in a fresh interpreter (`python tests/fsdp_fixtures.py build`), staged and renamed, under
    a file lock beside it.
    """
    import shutil

    from filelock import FileLock

    arch, world_size, placement = FIXTURES[name]
    out = _cache_root() / name
    if (out / "reference" / "meta.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # one builder at a time (the pytest-xdist workers, concurrent sessions); the others wait
    # and take its directory
    with FileLock(str(out.parent / f".{name}.lock"), timeout=1200):
        if (out / "reference" / "meta.json").is_file():
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
        try:
            run_script(["build", str(tmp), "--arch", arch, "--world-size", str(world_size),
                        "--placement", placement])
            shutil.rmtree(out, ignore_errors=True)    # an earlier build cut short
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def run_script(args: list[str]) -> None:
    """Run this file as a script (a fresh interpreter: no JAX, safe to fork torch ranks)."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"tests/fsdp_fixtures.py {' '.join(args)} failed:\n{proc.stderr[-4000:]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode", required=True)
    b = sub.add_parser("build")
    b.add_argument("out")
    b.add_argument("--arch", choices=sorted(ARCHS) + sorted(ARCHS35), required=True)
    b.add_argument("--world-size", type=int, default=6)
    b.add_argument("--placement", choices=("dim0", "first-divisible"), default="dim0")
    b.add_argument("--seed", type=int, default=0, help="Qwen3.5: the release's weight seed")
    b.add_argument("--release", default=None,
                   help="Qwen3.5: train from this HF directory instead of a generated one")
    ld = sub.add_parser("load")
    ld.add_argument("ckpt")
    ld.add_argument("out")
    ld.add_argument("--world-size", type=int, required=True)
    ld.add_argument("--placement", choices=("dim0", "first-divisible"), default="dim0")
    ld.add_argument("--freeze-vision", action="store_true", help="Qwen3.5: freeze the tower")
    ld.add_argument("--image", action="store_true", help="Qwen3.5: train on a batch with an image")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    if args.mode == "build" and args.arch in ARCHS35 and args.release:
        import shutil

        shutil.copytree(args.release, Path(args.out) / "release")
    elif args.mode == "build" and args.arch in ARCHS35:
        from qwen35_fixtures import make_qwen35_dir

        spec = ARCHS35[args.arch]
        release = make_qwen35_dir(Path(args.out), "qwen3_5", seed=args.seed, tie=spec["tie"],
                                  dtype="bfloat16", release_layout=True,
                                  text_sizes=spec["text_sizes"])
        release.rename(Path(args.out) / "release")
    _run_ranks(_build_rank if args.mode == "build" else _load_rank, args.world_size, args)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
