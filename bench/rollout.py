"""Rollout throughput, every ratio from one run.

One device (this process's default JAX device, no forced count): jscenegen's sampler vs
transformers `generate` vs Tunix 0.1.7's `Sampler` (the optional `bench` extra) on the same
random Qwen3 weights: `tiny` shape (vocab 8192, hidden 256, 4 layers, 4 heads, 2 kv heads,
tied), fp32, batch 8, 64-token prompts, 128 new tokens per row, top-k 50, temperature 1, no
stop token (every row generates exactly 128 tokens), log-probs returned where the engine can.
Our sampler's KV cache starts at the prompt plus one segment (128 slots) and grows to 192 as
the decode goes; Tunix's is 192 slots from the start (the least it allows), read every step.
A second jscenegen line, `jscenegen_fixed_cache`, runs our sampler with one fixed cache of
Tunix's size (`generate(..., cache_len=192)`): the same attention work as Tunix, so the gap
between the two jscenegen lines is what the growing cache saves. The headline stays our
default sampler.

The 3 x 2 CPU mesh (a subprocess with six forced CPU devices on the same cores): jscenegen's
rollout layouts `fsdp` (decode on the training shards), `replicated` and `tp` (tp = 2) on the
`small` shape (vocab 8192, hidden 512, 8 layers), 12 rows (G = 8 padded for 6 devices), 64-token
prompts, 64 new tokens, the same prompts and seeds in every layout. In the same rounds, each
layout's reshard (`Sampler.set_weights` from the training shards, which the trainer runs after
every train step): its seconds are the sampler's own `reshard_s` (the jitted reshard with the
transfer, the trainer's `rollout/reshard_s`; 0 for `fsdp` in fp32, which decodes on the
training arrays), one per round, reported as their median.

Beside them, in the same rounds, the host's memory floor: a compiled loop of 128 steps that
each read the decode step's bytes once and do nothing else (every weight, a tied embedding
once, and the mean K/V in use; `bench/weight_stream.py`'s chain). On a CPU whose last-level
cache is smaller than those bytes a decode step cannot beat it, so `floor_vs_tunix` estimates
the most `vs_tunix` any sampler could reach in that run (an estimate: the floor times the
decode steps' reads alone, the samplers' times include their prefill).

Each engine is warmed up (compiled) once, then timed once per round, the engines
interleaved (a load spike on the shared machine hits all of them) in a carry-over balanced
order (`common.round_order`, a Williams design: over 2n rounds for n engines, n for an even n,
each engine runs right after each other one equally often; the default 5 rounds with 5
engines are half of that; the mesh's 6, each layout's generate and reshard, are balanced
when --rounds is a multiple of 6, which the default 5 is not). Every ratio is taken per round (the two
engines timed in the same round) and reported as the median of the --rounds per-round
ratios with `_min`, `_max` and `_rounds`; `_of_medians` is the ratio of the two engines'
medians. CPU seconds (all threads of the process) are printed beside wall seconds: other
jobs barely change the JAX engines' (torch's OpenMP threads spin while they wait for a core,
so the CPU ratio against transformers flatters jscenegen on a busy machine). The mesh
layouts' ratios time `generate` only; their reshards are the `*_reshard_s` figures beside them.

    python bench/rollout.py [--rounds 5] [--skip-mesh] [--json-out FILE]

Prints every figure and, last, one JSON line (also written to --json-out, atomically) with
the ratios: `vs_transformers` and `vs_tunix` (our default sampler over the other, generated
tokens/s), `fixed_cache_vs_tunix` (our sampler with Tunix's fixed cache over Tunix),
`jscenegen_vs_fixed_cache` (what the growing cache gains), `jscenegen_of_floor` (the share of
the memory floor's rate reached) and `floor_vs_tunix`, `replicated_vs_fsdp`, `tp_vs_fsdp`,
each with `_min`/`_max`/`_rounds`/`_of_medians` and the same from CPU time (`cpu_*`); every
engine's median tokens/s; each mesh layout's reshard, `mesh_<layout>_reshard_s` (the median
over the rounds; `_rounds`: each round's) and `mesh_<layout>_reshard_bytes`; each round's
engine order (`round_orders`, the one-device rounds, and `mesh_round_orders`: lists of engine
names, first run first) to check the balance by; and the sitting: commit, dirty, cpu_model,
cpu_count, cores_usable, torch_threads, load_before/after, utc_start/end, environment (the
allocator, loader and XLA variables set).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from common import (
    IdTokenizer,
    description,
    median,
    paired,
    positive_int_arg,
    round_orders,
    rounds,
    sitting_end,
    sitting_start,
    tunix_qwen3_config,
    write_json,
)

from jscenegen.host_devices import size_cpu_thread_pool

VOCAB, BATCH, PROMPT, NEW, TOP_K = 8192, 8, 64, 128, 50
MESH_ROWS, MESH_NEW = 12, 64


def build(tmp: str, preset: str = "tiny"):
    from flax import nnx

    from jscenegen.model.config import preset_config
    from jscenegen.model.hf_io import save_hf
    from jscenegen.model.qwen import QwenForCausalLM

    model = QwenForCausalLM(preset_config("qwen3", preset, vocab_size=VOCAB), rngs=nnx.Rngs(0))
    save_hf(model, tmp)
    return model


def jscenegen_engine(model, prompts, new, mesh=None, layout="auto", cache_len=None):
    """Our sampler's `generate`; `cache_len`: one fixed cache size (None: the default, a
    cache that grows as the decode goes)."""
    from jscenegen.generate.sampler import Sampler
    from jscenegen.generate.sampling import SamplingParams

    sampler = Sampler(model, SamplingParams(temperature=1.0, top_k=TOP_K), buckets=(PROMPT,),
                      mesh=mesh, layout=layout)
    rows = len(prompts)

    def run(r):
        out = sampler.generate(prompts, new, seeds=[1000 * (r + 2) + i for i in range(rows)],
                               cache_len=cache_len)
        assert (out["lengths"] == new).all()
    return run, sampler


def transformers_engine(path: str, prompts):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor(prompts, dtype=torch.long)
    kw = dict(do_sample=True, top_k=TOP_K, top_p=1.0, temperature=1.0, max_new_tokens=NEW,
              min_new_tokens=NEW, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids))

    def run(r):
        torch.manual_seed(r + 2)
        with torch.no_grad():
            out = model.generate(input_ids=ids, **kw)
        assert out.shape == (BATCH, PROMPT + NEW)
    return run


def tunix_engine(path: str, cfg, prompts):
    """Tunix 0.1.7's Sampler on its own Qwen3 module, loaded from the same safetensors."""
    from tunix.generate.sampler import CacheConfig, Sampler
    from tunix.models.qwen3 import params as tparams

    tcfg = tunix_qwen3_config(cfg)
    model = tparams.create_model_from_safe_tensors(path, tcfg)
    sampler = Sampler(model, IdTokenizer(VOCAB), CacheConfig(
        cache_size=PROMPT + NEW, num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim))
    text = [" ".join(map(str, p)) for p in prompts]

    def run(r):
        out = sampler(text, max_generation_steps=NEW, max_prompt_length=PROMPT, temperature=1.0,
                      top_p=1.0, top_k=TOP_K, seed=r + 2, return_logprobs=True)
        assert all(len(t) == NEW for t in out.tokens)
    return run


def one_device(n_rounds: int) -> tuple[dict, dict, list]:
    """The one-device engines' report (`_report`), their per-round times (`rounds`) and each
    round's engine order (`round_orders`)."""
    import jax
    import torch

    print(f"one device: jax {jax.devices()}; torch threads {torch.get_num_threads()}")
    print(f"shape: qwen3 tiny vocab {VOCAB} hidden 256 layers 4, batch {BATCH}, prompt {PROMPT}, "
          f"new {NEW}, top-k {TOP_K}, fp32")
    prompts = np.random.default_rng(0).integers(3, VOCAB, (BATCH, PROMPT)).tolist()
    engines = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build(tmp)
        engines["jscenegen"] = jscenegen_engine(model, prompts, NEW)[0]
        # Tunix's cache: PROMPT + NEW slots from the start (its CacheConfig below)
        engines["jscenegen_fixed_cache"] = jscenegen_engine(model, prompts, NEW,
                                                            cache_len=PROMPT + NEW)[0]
        engines["transformers"] = transformers_engine(tmp, prompts)
        if importlib.util.find_spec("tunix") is not None:
            engines["tunix"] = tunix_engine(tmp, model.cfg, prompts)
        else:
            print("tunix: not installed (pip install -e '.[bench]'); its sampler is not measured")
        from weight_stream import stream_loop

        stream, streamed = stream_loop(decode_step_bytes(model), steps=NEW)
        engines["memory floor"] = lambda r: stream()
        print(f"memory floor: {NEW} steps each reading {streamed / 1e6:.1f} MB of fp32 weights "
              "once (the decode step's weights and mean KV cache in use, in whole 1 MiB "
              "matrices; bench/weight_stream.py)")
        times = rounds(engines, n_rounds)
    return _report(times, BATCH * NEW), times, round_orders(engines, n_rounds)


def decode_step_bytes(model) -> int:
    """Bytes a decode step must read at the least: every weight once (a tied embedding counted
    once: the head reads it whole, the lookup 8 rows) and the K/V of the slots in use, on
    average over the turn (PROMPT + NEW / 2)."""
    import jax
    from flax import nnx

    c = model.cfg
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    kv = (2 * c.num_hidden_layers * BATCH * c.num_key_value_heads * c.head_dim * 4
          * (PROMPT + NEW // 2))
    return weights + kv


def _report(times: dict, tokens: int) -> dict:
    out = {}
    for name, t in times.items():
        wall, cpu = median(t["wall_s"]), median(t["cpu_s"])
        out[name] = {"tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu,
                     "wall_s": wall, "cpu_s": cpu,
                     "rounds_tokens_per_s": [round(tokens / w) for w in t["wall_s"]],
                     "rounds_wall_s": t["wall_s"], "rounds_cpu_s": t["cpu_s"]}
        print(f"  {name:24s} {tokens / wall:9,.0f} generated tok/s (median)  "
              f"{tokens / cpu:9,.0f} tok per CPU-s   rounds {out[name]['rounds_tokens_per_s']}")
    return out


def mesh_layouts(n_rounds: int) -> dict:
    """Runs in a subprocess with six forced CPU devices."""
    import jax

    from jscenegen.model.hf_io import load_hf
    from jscenegen.sharding.mesh import make_mesh

    mesh = make_mesh(3, 2)
    print(f"3 x 2 mesh of {jax.device_count()} CPU devices; shape: qwen3 small vocab {VOCAB} "
          f"hidden 512 layers 8, {MESH_ROWS} rows, prompt {PROMPT}, new {MESH_NEW}, fp32")
    prompts = np.random.default_rng(1).integers(3, VOCAB, (MESH_ROWS, PROMPT)).tolist()
    engines, samplers, reshards = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        build(tmp, "small")
        model = load_hf(tmp, mesh=mesh)              # the training layout: FSDP2 shards
        for layout in ("fsdp", "replicated", "tp"):
            run, samplers[layout] = jscenegen_engine(model, prompts, MESH_NEW, mesh, layout)
            engines[layout] = run
        for layout, sampler in samplers.items():
            reshards[layout] = []
            engines[f"{layout} reshard"] = _reshard_engine(sampler, model, reshards[layout])
        times = rounds(engines, n_rounds)
    out = _report({k: v for k, v in times.items() if k in samplers}, MESH_ROWS * MESH_NEW)
    for layout, s in samplers.items():
        out[layout]["layout"] = s.layout.describe()
        out[layout]["reshard_bytes"] = s.reshard_stats["reshard_bytes"]
        out[layout]["reshard_s"] = median(reshards[layout])
        out[layout]["rounds_reshard_s"] = reshards[layout]
        print(f"  {layout + ' reshard':24s} {median(reshards[layout]):9.4f} s (median; the "
              f"sampler's reshard_s as the trainer logs it)   rounds "
              f"{[round(x, 4) for x in reshards[layout]]}")
    out["round_orders"] = round_orders(engines, n_rounds)
    return out


def _reshard_engine(sampler, model, seconds: list):
    """An engine of the mesh rounds: `sampler.set_weights(model)`, the reshard from the training
    shards into the sampler's rollout layout that the trainer runs after every train step;
    appends each timed round's `reshard_s` (the sampler's own wall seconds of the jitted
    reshard, transfer included: the trainer's `rollout/reshard_s`) to `seconds` (the warm-up's
    is left out)."""
    def run(r):
        stats = sampler.set_weights(model)
        if r >= 0:
            seconds.append(stats["reshard_s"])
    return run


def _times(report: dict) -> dict:
    """`rounds()`' per-round times back from a `_report` entry (the mesh subprocess's JSON)."""
    return {"wall_s": report["rounds_wall_s"], "cpu_s": report["rounds_cpu_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--rounds", type=positive_int_arg, default=5)
    ap.add_argument("--skip-mesh", action="store_true", help="only the one-device comparison")
    ap.add_argument("--json-out", metavar="FILE",
                    help="also write the final JSON to FILE (atomically: a temporary file renamed)")
    ap.add_argument("--mesh-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mesh_only:
        print("MESH " + json.dumps(mesh_layouts(args.rounds)))
        return
    import torch

    record = sitting_start()
    print(f"load average before: {record['load_before']}; {record['cpu_model']}, "
          f"{record['cores_usable']} cores; commit {record['commit']}"
          f"{' (dirty)' if record['dirty'] else ''}")
    single, times, orders = one_device(args.rounds)
    mesh = mesh_error = None
    if not args.skip_mesh:
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="6")
        size_cpu_thread_pool(6, env)
        proc = subprocess.run([sys.executable, __file__, "--mesh-only", "--rounds", str(args.rounds)],
                              env=env, capture_output=True, text=True)
        lines = proc.stdout.splitlines()
        print("\n".join(x for x in lines if not x.startswith("MESH ")))
        found = [x for x in lines if x.startswith("MESH ")]
        if proc.returncode or not found:
            print(proc.stderr[-3000:], file=sys.stderr)
            mesh_error = f"the 6-device mesh run failed (exit {proc.returncode})"
        else:
            mesh = json.loads(found[-1][5:])
    record = sitting_end(record)
    print(f"load average after: {record['load_after']}")
    ours = times["jscenegen"]
    result = {"bench": "rollout", "rounds": args.rounds, **record,
              "torch_threads": torch.get_num_threads(), "round_orders": orders}
    for name, r in single.items():
        result[f"{name.replace(' ', '_')}_tokens_per_s"] = r["tokens_per_s"]
    result.update(paired("vs_transformers", ours, times["transformers"]))
    result.update(paired("vs_tunix", ours, times.get("tunix")))
    result.update(paired("fixed_cache_vs_tunix", times["jscenegen_fixed_cache"], times.get("tunix")))
    result.update(paired("jscenegen_vs_fixed_cache", ours, times["jscenegen_fixed_cache"]))
    floor = times["memory floor"]
    result["floor_tokens_per_s"] = single["memory floor"]["tokens_per_s"]
    result.update(paired("jscenegen_of_floor", ours, floor))
    if "tunix" in times:   # the most `vs_tunix` a decode that only read its bytes could reach now
        result.update(paired("floor_vs_tunix", floor, times["tunix"]))
    if mesh is not None:
        for layout in ("fsdp", "replicated", "tp"):
            result[f"mesh_{layout}_tokens_per_s"] = mesh[layout]["tokens_per_s"]
        for layout in ("fsdp", "replicated", "tp"):
            result[f"mesh_{layout}_reshard_s"] = mesh[layout]["reshard_s"]
            result[f"mesh_{layout}_reshard_s_rounds"] = mesh[layout]["rounds_reshard_s"]
            result[f"mesh_{layout}_reshard_bytes"] = mesh[layout]["reshard_bytes"]
        for layout in ("replicated", "tp"):
            result.update(paired(f"{layout}_vs_fsdp", _times(mesh[layout]), _times(mesh["fsdp"])))
        result["mesh_round_orders"] = mesh["round_orders"]
    if mesh_error:
        result["mesh_error"] = mesh_error
    if mesh is not None:
        print(f"mesh: replicated {result['replicated_vs_fsdp']:.2f}x fsdp, tp "
              f"{result['tp_vs_fsdp']:.2f}x (generate only); reshard after each train step "
              + ", ".join(f"{layout} {result[f'mesh_{layout}_reshard_s']:.4f} s"
                          for layout in ("fsdp", "replicated", "tp"))
              + " (median of the rounds)")
    summary = (f"vs tunix {result['vs_tunix']:.2f}x [{result['vs_tunix_min']:.2f}-"
               f"{result['vs_tunix_max']:.2f}], with Tunix's fixed cache "
               f"{result['fixed_cache_vs_tunix']:.2f}x; " if "tunix" in times else "")
    print(f"{summary}vs transformers {result['vs_transformers']:.2f}x  (median of per-round "
          "ratios [min-max])")
    if args.json_out:
        write_json(args.json_out, result)
    print(json.dumps(result))
    if mesh_error:   # the figures above stand; the comparison it was asked for is missing
        sys.exit(1)


if __name__ == "__main__":
    main()
