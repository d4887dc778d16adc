#!/usr/bin/env bash
# One-GPU benchmark of jscenegen vs torch (see bench/gpu/bench_gpu.py): bf16 GRPO train-step MFU
# and decode tokens/s on a random Qwen3-1.7B-shaped model, cuDNN attention.
# Run from the repository root on a machine with one NVIDIA GPU and jax[cuda] installed:
#   bash bench/gpu/run.sh [extra bench_gpu.py flags]
# Writes the JSON lines to bench/gpu/result-<date>.jsonl as well as stdout.
set -euo pipefail
cd "$(dirname "$0")/../.."
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
export TOKENIZERS_PARALLELISM=false
python3 - <<'PY'
import jax
assert jax.default_backend() == "gpu", f"JAX sees no GPU (backend {jax.default_backend()}); install jax[cuda13]"
print("jax", jax.__version__, jax.devices()[0].device_kind)
PY
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
out="bench/gpu/result-$(date -u +%Y%m%dT%H%M%SZ).jsonl"
python3 bench/gpu/bench_gpu.py "$@" | tee "$out"
echo "wrote $out"
