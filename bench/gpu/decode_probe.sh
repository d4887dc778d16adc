#!/usr/bin/env bash
# #16's decode probe on one GPU, each step in its own process (JAX preallocates GPU memory):
#   1. decode_probe.py at 64 and 8 rows, default XLA flags, the decode's optimised HLO dumped;
#   2. the same at 64 rows with CUDA graphs off (--xla_gpu_enable_command_buffer=), then with
#      the while loop and its conditionals added to them (=+WHILE,+CONDITIONAL): how much of a
#      step is kernel launches (2026-12-04: the second changed nothing; the first was not run);
#   3. Tunix 0.1.7's decode of the same shape (bench_gpu.py --engine tunix): the same-run ratio;
#   4. one decode under the JAX profiler, summarised by kernel (last: a crash loses nothing).
# Run from the repository root:  bash bench/gpu/decode_probe.sh [extra decode_probe.py flags]
# Writes probe.jsonl, probe.err and decode-hlo.tgz to $OUT (default /tmp/decode-probe).
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp/decode-probe}"
mkdir -p "$out"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
hlo=$(mktemp -d)
probe() {   # probe SECONDS XLA_FLAGS LABEL [decode_probe.py flags]
  XLA_FLAGS="$2" timeout "$1" python3 bench/gpu/decode_probe.py --label "$3" "${@:4}" \
    2>>"$out/probe.err" | tee -a "$out/probe.jsonl"
  echo "[$3: exit ${PIPESTATUS[0]}]" | tee -a "$out/probe.err"
}
probe 200 "--xla_dump_to=$hlo --xla_dump_hlo_module_re=.*_decode_impl.* --xla_dump_hlo_as_text" \
  default --rows 64 8 "$@"
(cd "$hlo" && tar czf "$out/decode-hlo.tgz" ./*after_optimizations.txt) || true
probe 110 "--xla_gpu_enable_command_buffer=" no-cuda-graphs --rows 64 "$@"
probe 110 "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" cmdbuf-while --rows 64 "$@"
timeout 130 python3 bench/gpu/bench_gpu.py --engine tunix ${TUNIX_ARGS:-} \
  2>>"$out/probe.err" | tee -a "$out/probe.jsonl"
echo "[tunix: exit ${PIPESTATUS[0]}]" | tee -a "$out/probe.err"
probe 130 "" trace --rows 64 --repeats 1 --trace "$(mktemp -d)" "$@"
