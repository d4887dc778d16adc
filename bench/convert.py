"""Conversion throughput (MB/s) and peak RSS: VERL FSDP2 shards -> HF safetensors, HF -> orbax.

    python bench/convert.py [--arch qwen2.5-7b|qwen3.5-4b] [--layers 2] [--vocab 152064]
                            [--world-size 6] [--workdir DIR]

Input (`qwen2.5-7b`, the default): a Qwen2 model with Qwen2.5-7B widths (vocab 152064, hidden
3584, FFN 18944, 28 heads, 4 KV heads; untied head) and `--layers` layers, random fp32
weights (about 6.2 GB at 2 layers), written as W rank files by convert.directions.hf_to_verl
(setup, also timed).
`qwen3.5-4b`: the Qwen3.5-4B vision-language model (configs/model-shapes/qwen3.5-4b.json:
vocab 248320, hidden 2560, tied head, the whole 24-block vision tower, one MTP layer) with
`--layers` text layers alternating Gated DeltaNet and gated attention, random fp32 weights
(about 5.2 GB at 2 layers; the largest tensor is the 248320 x 2560 embedding, 2.54 GB). Its
HF source (with `mtp.*`) is kept and passed as `carried_from` to the VERL -> HF / orbax runs,
which take the MTP head from it as a user converting a run of the release would.

Measured, each in its own child process, whose VmHWM is that conversion's peak RSS:
- ours: convert.directions.verl_to_hf (streaming, fp32 kept).
- baseline: the naive merge, which is what VERL's model merger does in spirit
  (verl/model_merger/fsdp_model_merger.py): torch.load every rank file whole
  (weights_only, no mmap), torch.cat each tensor's shards along its shard dim, then
  safetensors.torch.save_file of the full state dict.
- VERL's own merger when the `verl` package is installed (it is not on this machine; the
  output says so).
- hf -> orbax (convert.orbax_directions.hf_to_orbax, fresh Adam state) on our HF output, and
  verl -> orbax on the rank files: both streamed (one LazyArray at a time into orbax).
MB/s counts the model's fp32 bytes (1e6 bytes per MB) over wall time, which ends when the
output is fsync'ed; the input files are evicted from the page cache before each run
(posix_fadvise DONTNEED), so every run starts cold and ends with its data on disk. The last line is JSON
with "ratio" = our MB/s / baseline MB/s.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # the convert package before this script, also named convert

from common import description, int_in, positive_int_arg  # noqa: E402

WIDTHS = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
              num_attention_heads=28, num_key_value_heads=4, head_dim=128)


ARCHS = ("qwen2.5-7b", "qwen3.5-4b")
CARRIED_FROM = "JSCENEGEN_BENCH_CARRIED_FROM"  # child processes: the HF dir holding mtp.*


def _config(layers: int, vocab: int, arch: str = "qwen2.5-7b") -> dict:
    if arch == "qwen3.5-4b":
        d = json.loads((ROOT / "configs/model-shapes/qwen3.5-4b.json").read_text())
        d.pop("_jscenegen_provenance", None)
        t = d["text_config"]
        t.update(num_hidden_layers=layers, dtype="float32", vocab_size=vocab,
                 layer_types=[("linear_attention", "full_attention")[i % 2] for i in range(layers)])
        d["dtype"] = "float32"
        return d
    return dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], num_hidden_layers=layers,
                tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1e6,
                max_position_embeddings=32768, hidden_act="silu", torch_dtype="float32",
                **dict(WIDTHS, vocab_size=vocab))


def make_source(work: Path, layers: int, vocab: int, world_size: int,
                arch: str = "qwen2.5-7b") -> tuple[Path, int, int]:
    """Random HF model -> VERL rank files. Returns (verl dir, model bytes, largest tensor bytes).

    Qwen3.5 keeps the HF source (work/hf_source, with mtp.*) for `carried_from`."""
    import numpy as np

    from convert.directions import hf_to_verl
    from convert.tensor_sets import hf_shapes
    from jscenegen.model.config import QwenConfig
    from jscenegen.model.safetensors_stream import write_safetensors_streaming

    hf = work / "hf_source"
    verl = work / "verl"
    cfg = QwenConfig.from_hf_dict(_config(layers, vocab, arch))
    shapes = hf_shapes(cfg)
    total = sum(int(np.prod(s)) * 4 for s in shapes.values())
    largest = max(int(np.prod(s)) * 4 for s in shapes.values())
    if not (verl / "checksums.json").is_file():
        shutil.rmtree(hf, ignore_errors=True)
        shutil.rmtree(verl, ignore_errors=True)
        hf.mkdir(parents=True)
        (hf / "config.json").write_text(json.dumps(_config(layers, vocab, arch), indent=2))
        from jscenegen.model.tokenizer.build import train_bpe_tokenizer

        train_bpe_tokenizer(["a bed, a desk and a lamp"] * 4, vocab_size=300).save_pretrained(hf)
        rng = np.random.default_rng(0)
        specs = {n: (s, np.dtype(np.float32)) for n, s in shapes.items()}
        arrays = ((n, rng.random(s, dtype=np.float32)) for n, s in shapes.items())
        write_safetensors_streaming(hf, specs, arrays)
        t = time.perf_counter()
        hf_to_verl(hf, verl, world_size=world_size, device_type="cpu")
        print(f"setup: hf -> verl (W={world_size}) {total / 1e6 / (time.perf_counter() - t):.0f} MB/s")
        if not cfg.hybrid:
            shutil.rmtree(hf)
    return verl, total, largest


def child(mode: str, src: str, dst: str) -> None:
    """Run one conversion and print {"seconds", "peak_rss_bytes"} as JSON."""
    t = time.perf_counter()
    carried_from = os.environ.get(CARRIED_FROM) or None
    if mode == "ours":
        from convert.directions import verl_to_hf

        verl_to_hf(src, dst, carried_from=carried_from)
    elif mode == "hf2orbax":
        from convert.orbax_directions import hf_to_orbax

        hf_to_orbax(src, dst)
    elif mode == "verl2orbax":
        from convert.orbax_directions import verl_to_orbax

        verl_to_orbax(src, dst, carried_from=carried_from)
    elif mode == "naive":
        naive_merge(Path(src), Path(dst))
    elif mode == "verl":
        subprocess.run([sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp",
                        "--local_dir", src, "--target_dir", dst], check=True)
    _fsync_tree(Path(dst))  # done = on disk: no run may leave its writing in the page cache
    seconds = time.perf_counter() - t
    rss = _peak_rss()
    if mode == "verl":
        rss = max(rss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
    print(json.dumps({"seconds": seconds, "peak_rss_bytes": rss}))


def _fsync_tree(root: Path) -> None:
    for f in root.rglob("*"):
        if f.is_file() and not f.is_symlink():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _peak_rss() -> int:
    """This process's peak resident set (VmHWM, bytes). Unlike ru_maxrss it starts afresh at
    exec, so a child does not inherit the parent's peak."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def naive_merge(shard_dir: Path, dst: Path) -> None:
    """The baseline: load all rank files whole, torch.cat per tensor, save_file everything."""
    import re

    import torch
    import torch.distributed.tensor  # noqa: F401
    from safetensors.torch import save_file

    files = sorted(shard_dir.glob("model_world_size_*_rank_*.pt"),
                   key=lambda p: int(re.search(r"rank_(\d+)", p.name).group(1)))
    ranks = [torch.load(f, map_location="cpu", weights_only=True) for f in files]
    full = {}
    for k in list(ranks[0]):
        dim = ranks[0][k].placements[-1].dim
        # shards are dropped as soon as merged: peak = all shards + one merged tensor
        full[k] = torch.cat([r.pop(k).to_local() for r in ranks], dim=dim).contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(full, str(dst / "model.safetensors"), metadata={"format": "pt"})


def _evict(src: Path) -> None:
    """Drop the input files from the page cache, so every run starts cold (no root needed)."""
    for f in [*src.rglob("*.pt"), *src.rglob("*.safetensors")]:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(mode: str, src: Path, dst: Path, keep: bool = False,
            carried_from: Path | None = None) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    os.sync()
    _evict(src)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if carried_from is not None:
        env[CARRIED_FROM] = str(carried_from)
    proc = subprocess.run([sys.executable, __file__, "--child", mode, str(src), str(dst)],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if not keep:
        shutil.rmtree(dst, ignore_errors=True)
    return out


def _mem_available() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=description(__doc__))
    p.add_argument("--arch", choices=ARCHS, default="qwen2.5-7b")
    p.add_argument("--layers", type=positive_int_arg, default=2)
    p.add_argument("--vocab", type=positive_int_arg, default=None,
                   help="vocabulary (default: the arch's, 152064 / 248320)")
    p.add_argument("--world-size", type=int_in(1, 8192), default=6)
    p.add_argument("--workdir", default="/tmp", help="where the bench makes its own directory "
                   "(bench-convert-*: the generated model and the outputs)")
    p.add_argument("--keep", action="store_true", help="keep that directory (its path is printed)")
    p.add_argument("--child", nargs=3, metavar=("MODE", "SRC", "DST"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(*args.child)
        return 0
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-convert-", dir=args.workdir))
    try:
        return _compare(args, work)
    finally:   # the generated model is GBs: gone on a failure or Ctrl-C too (only what it made)
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _compare(args, work: Path) -> int:
    """Make the source under `work`, run every conversion mode, print the figures and the JSON
    line; 1 when the machine lacks the naive baseline's memory."""
    qwen35 = args.arch == "qwen3.5-4b"
    vocab = args.vocab or (248320 if qwen35 else WIDTHS["vocab_size"])
    verl, total, largest = make_source(work, args.layers, vocab, args.world_size, args.arch)
    shard_dir = verl / "global_step_0" / "actor"
    carried = work / "hf_source" if qwen35 else None
    gb = 1 << 30
    what = ("Qwen3.5-4B widths with its vision tower and MTP head" if qwen35
            else "Qwen2.5-7B widths")
    print(f"model: {args.layers} layers at {what} (vocab {vocab}), {total / 1e9:.2f} GB fp32, "
          f"largest tensor {largest / 1e9:.2f} GB, W={args.world_size}")
    available = _mem_available()
    if available < total + largest + gb:
        print(f"only {available / gb:.1f} GiB of memory available; the naive baseline needs about "
              f"{(total + largest + gb) / gb:.1f} GiB: free memory and rerun")
        return 1
    results = {}
    for mode, src in (("ours", verl), ("naive", shard_dir)):
        r = measure(mode, src, work / f"out_{mode}", keep=mode == "ours", carried_from=carried)
        r["mb_per_s"] = total / 1e6 / r["seconds"]
        results[mode] = r
        print(f"{mode:>6}: {r['seconds']:.1f} s, {r['mb_per_s']:.0f} MB/s, peak RSS "
              f"{r['peak_rss_bytes'] / gb:.2f} GiB ({r['peak_rss_bytes'] / largest:.2f} x largest tensor)")
    if importlib.util.find_spec("verl") is not None:
        r = measure("verl", shard_dir, work / "out_verl")
        r["mb_per_s"] = total / 1e6 / r["seconds"]
        results["verl_merger"] = r
        print(f"VERL merger: {r['seconds']:.1f} s, {r['mb_per_s']:.0f} MB/s, peak RSS "
              f"{r['peak_rss_bytes'] / gb:.2f} GiB")
    else:
        print("VERL is not installed here: its model merger was not run; the naive merge above "
              "is the baseline")
    for mode, src, label in (("hf2orbax", work / "out_ours", "hf -> orbax"),
                             ("verl2orbax", verl, "verl -> orbax")):
        r = measure(mode, src, work / f"out_{mode}", carried_from=carried)
        r["mb_per_s"] = total / 1e6 / r["seconds"]
        results[mode] = r
        print(f"{label}: {r['seconds']:.1f} s, {r['mb_per_s']:.0f} MB/s of weights (and the zero "
              f"Adam moments of the trainable ones written), peak RSS {r['peak_rss_bytes'] / gb:.2f} GiB "
              f"({r['peak_rss_bytes'] / largest:.2f} x largest tensor)")
    shutil.rmtree(work / "out_ours", ignore_errors=True)
    budget = 3 * largest + gb
    for mode in ("ours", "hf2orbax", "verl2orbax"):
        r = results[mode]
        print(f"target ({mode}): peak RSS <= 3 x largest + 1 GiB = {budget / gb:.2f} GiB "
              f"({'met' if r['peak_rss_bytes'] <= budget else 'NOT met'}), >= 200 MB/s "
              f"({'met' if r['mb_per_s'] >= 200 else 'NOT met'})")
    print(json.dumps({"arch": args.arch,
                      "ratio": results["ours"]["mb_per_s"] / results["naive"]["mb_per_s"],
                      "ours_mb_per_s": results["ours"]["mb_per_s"],
                      "baseline_mb_per_s": results["naive"]["mb_per_s"],
                      "ours_peak_rss_gib": results["ours"]["peak_rss_bytes"] / gb,
                      "baseline_peak_rss_gib": results["naive"]["peak_rss_bytes"] / gb,
                      "model_gb": total / 1e9, "largest_tensor_gb": largest / 1e9,
                      "verl_merger": "verl_merger" in results,
                      "hf_to_orbax_mb_per_s": results["hf2orbax"]["mb_per_s"],
                      "hf_to_orbax_peak_rss_gib": results["hf2orbax"]["peak_rss_bytes"] / gb,
                      "verl_to_orbax_mb_per_s": results["verl2orbax"]["mb_per_s"],
                      "verl_to_orbax_peak_rss_gib": results["verl2orbax"]["peak_rss_bytes"] / gb}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
