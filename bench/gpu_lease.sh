#!/usr/bin/env bash
# The GPU rows of issue 66 in one command for a short device lease (at most 8 minutes: each run has its
# timeout, and a run cut short keeps the rows it finished), then one table against the targets
# (bench/gpu_table.py). Most telling first, since a cold first run spends much of it compiling:
#   0. the Triton kernels' tests on the GPU (tests/test_triton_experts.py, where pytest is installed);
#   1. Mixtral-8x7B int8 at batch 1 with the experts through our Triton kernels (Tuning.triton_experts)
#      and the dense products too (Tuning.triton_dense): against 99.9 tok/s before, target 230;
#   2. Mixtral-8x7B bfloat16 at batch 1, 8 and 32 through the kernels, beside the floor of each batch;
#   3. Mixtral-8x7B int4 at batch 1 through the kernels (a run of its own: int8 and int4 copies do not
#      both fit beside the bfloat16 model, which is quantized in place);
#   4. Mistral-7B int8 and int4 at batch 1 through our dense kernel, then 5. through GemLite.
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
# 0. The Triton kernels' tests on this GPU first, through Triton's compiler (on CPU they run under its
#    interpreter): a failure here is printed, and the rows after it say whether the kernels can be used.
if python -c "import pytest" 2>/dev/null; then
    # the kernels against the readable path (the decode-step tests compile for minutes on a GPU: left out);
    # their compiles land in Triton's cache, which the rows below then find
    timeout 60 python -m pytest -q -o addopts="" tests/test_triton_experts.py -k "equal_each_expert or dense_quantized" \
        2>&1 | tail -15 | tee "$OUT/triton_tests.txt" \
        || echo "the Triton kernels' tests were cut short"
else
    echo "pytest is not installed here: the Triton kernels' tests were not run" | tee "$OUT/triton_tests.txt"
fi
common=(--without-transformers --modes compiled --repeats 2 --prefill)
triton=(--triton-experts --triton-dense)
timeout 140 python bench/bench_gpu.py --models mixtral-8x7b --batches --quantize int8 "${triton[@]}" "${common[@]}" \
    --out "$OUT/results_gpu_mixtral_int8_triton.json" || echo "mixtral int8 rows cut short: the JSON keeps those done"
timeout 120 python bench/bench_gpu.py --models mixtral-8x7b --batches 1 8 32 --quantize "${triton[@]}" "${common[@]}" \
    --out "$OUT/results_gpu_mixtral_triton.json" || echo "mixtral bfloat16 rows cut short"
timeout 80 python bench/bench_gpu.py --models mixtral-8x7b --batches --quantize int4 "${triton[@]}" "${common[@]}" \
    --out "$OUT/results_gpu_mixtral_int4_triton.json" || echo "mixtral int4 rows cut short"
timeout 40 python bench/bench_gpu.py --models mistral-7b --batches --quantize int8 int4 --triton-dense "${common[@]}" \
    --out "$OUT/results_gpu_mistral_triton.json" || echo "mistral triton rows cut short"
timeout 40 python bench/bench_gpu.py --models mistral-7b --batches --quantize int8-gemlite int4-gemlite "${common[@]}" \
    --out "$OUT/results_gpu_mistral.json" || echo "mistral gemlite rows cut short"
python bench/gpu_table.py "$OUT"/results_gpu_*.json | tee "$OUT/gpu_table.md"
