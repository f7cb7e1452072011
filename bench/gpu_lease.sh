#!/usr/bin/env bash
# The GPU rows of issue 66 in one command for a short device lease (about 8 minutes once inductor's and
# Triton's caches are warm; the first run compiles for longer): Mixtral-8x7B bfloat16, int8 and int4 at
# batch 1, 8 and 32 beside the floor of the same run, with and without grouped experts, Mixtral int8 at
# batch 1 with its chosen experts gathered (Tuning.gathered_int8_experts), Mistral-7B int8
# and int4 at batch 1 through GemLite, then one table against the targets (bench/gpu_table.py).
#
# On the device tool's machine:  OUT=$OUT bash bench/gpu_lease.sh
# The caches are written under $OUT (they come back with the results): carry them into the next lease
# (run's carry: bench/gpu-cache) and set GPU_CACHE=bench/gpu-cache to start warm.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench}"
CACHE="${GPU_CACHE:-$OUT/gpu-cache}"
export TORCHINDUCTOR_CACHE_DIR="$CACHE/inductor" TRITON_CACHE_DIR="$CACHE/triton"
mkdir -p "$TORCHINDUCTOR_CACHE_DIR" "$TRITON_CACHE_DIR"
if [ "$CACHE" != "$OUT/gpu-cache" ]; then mkdir -p "$OUT/gpu-cache" && cp -r "$CACHE"/. "$OUT/gpu-cache"/; fi
common=(--without-transformers --modes compiled --repeats 2 --prefill)
timeout 330 python bench/bench_gpu.py --models mixtral-8x7b --batches 1 8 32 --quantize int8-gemlite int4-gemlite \
    "${common[@]}" --out "$OUT/results_gpu_mixtral.json" || echo "mixtral rows cut short: the JSON keeps those done"
timeout 90 python bench/bench_gpu.py --models mixtral-8x7b --batches 8 32 --quantize --grouped-experts \
    "${common[@]}" --out "$OUT/results_gpu_mixtral_grouped.json" || echo "grouped rows cut short"
timeout 60 python bench/bench_gpu.py --models mixtral-8x7b --batches --quantize int8 --gathered-int8-experts \
    "${common[@]}" --out "$OUT/results_gpu_mixtral_gathered_int8.json" || echo "gathered int8 rows cut short"
timeout 90 python bench/bench_gpu.py --models mistral-7b --batches 1 --quantize int8-gemlite int4-gemlite \
    "${common[@]}" --out "$OUT/results_gpu_mistral.json" || echo "mistral rows cut short"
python bench/gpu_table.py "$OUT"/results_gpu_*.json | tee "$OUT/gpu_table.md"
