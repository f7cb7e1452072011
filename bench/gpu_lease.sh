#!/usr/bin/env bash
# The GPU rows of issue 66 in one command for a short device lease (at most 8 minutes: each run has its
# timeout, and a run cut short keeps the rows it finished), then one table against the targets
# (bench/gpu_table.py):
#   1. Mixtral-8x7B bfloat16, int8 and int4 at batch 1, 8 and 32 with the experts through our Triton
#      kernels (Tuning.triton_experts) and the dense int8/int4 products too (Tuning.triton_dense);
#   2. the same without them (GemLite for the dense quantized products), the floor of each batch, and
#      the 8,192-token prefill: the rows the first run is compared with;
#   3. Mistral-7B int8 and int4 at batch 1 through our kernels, then through GemLite.
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
common=(--without-transformers --modes compiled --repeats 2)
timeout 200 python bench/bench_gpu.py --models mixtral-8x7b --batches 1 8 32 --prefill --quantize int8 int4 \
    --triton-experts --triton-dense "${common[@]}" --out "$OUT/results_gpu_mixtral_triton.json" \
    || echo "triton rows cut short: the JSON keeps those done"
timeout 160 python bench/bench_gpu.py --models mixtral-8x7b --batches 1 8 32 --prefill 8192 \
    --quantize int8-gemlite int4-gemlite "${common[@]}" --out "$OUT/results_gpu_mixtral.json" \
    || echo "mixtral rows cut short: the JSON keeps those done"
timeout 55 python bench/bench_gpu.py --models mistral-7b --batches --prefill --quantize int8 int4 --triton-dense \
    "${common[@]}" --out "$OUT/results_gpu_mistral_triton.json" || echo "mistral triton rows cut short"
timeout 55 python bench/bench_gpu.py --models mistral-7b --batches --prefill --quantize int8-gemlite int4-gemlite \
    "${common[@]}" --out "$OUT/results_gpu_mistral.json" || echo "mistral rows cut short"
python bench/gpu_table.py "$OUT"/results_gpu_*.json | tee "$OUT/gpu_table.md"
