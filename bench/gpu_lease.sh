#!/usr/bin/env bash
# The GPU measurements still owed, one step per call of the lent machine (each fits in its
# 10 minutes; a session has 30), in the order they matter. Results go to $OUT (the device tool's
# folder that comes back; ./gpu-results elsewhere) as JSON, with each step's log.
#
#   bash bench/gpu_lease.sh short     # a 15-minute lease's one call (560 s): the GPU region test and GemLite's and
#                                     # bitsandbytes' products; GemLite's products timed alone (where int8's 1.25x
#                                     # goes); Mistral-7B decode batch 1 in bf16, int4-128 through GemLite (outputs
#                                     # in bf16, then -f32 in float32), int8 through it, nf4, compiled; GemLite's
#                                     # and nf4's decoding tests in what is left. Everything it prints is in
#                                     # $OUT/short.log: the tool's reply keeps only the last 12,000 characters
#   bash bench/gpu_lease.sh first     # a short lease's one call: matvec, then the quantized kernels' product tests
#                                     # and whether each block compiles as one region on the GPU's torch
#   bash bench/gpu_lease.sh matvec    # which int8 / int4 product reads fastest (no model; GemLite's among them): ~4 min
#   bash bench/gpu_lease.sh gemlite   # Mistral-7B decode batch 1: bf16, int8 and int4-128 through GemLite, compiled
#   bash bench/gpu_lease.sh quant     # Mistral-7B decode batch 1: bf16, int8, int4 (2 k-tiles), compiled: ~9 min
#   bash bench/gpu_lease.sh nf4       # Mistral-7B decode batch 1: bf16 and nf4 (bitsandbytes' kernel), compiled
#   bash bench/gpu_lease.sh batches   # Mistral-7B decode batch 8 and 32, prefill 2048 and 8192, beside transformers
#   bash bench/gpu_lease.sh mixtral   # Mixtral-8x7B (layers cut to fit twice) beside transformers, batch 1
#   bash bench/gpu_lease.sh serve     # the serving engine on CUDA, Mistral-7B shape, 8 layers
#   bash bench/gpu_lease.sh regions   # Mistral-7B's widths, 32 layers: the step's compile time and speed, blocks as
#                                     # regions (the default since 2026-11-28) or written out
#
# A task's lease is 15 minutes of device time, start-up included: `first` (matvec, whose rows run in the
# order that matters most and whose JSON keeps each finished row, then GemLite's and bitsandbytes'
# products against the reference), then `gemlite` if 10 minutes remain.
#
# Issue 15's CUDA targets (H100/H200 class): Mistral-7B int8 >= 1.6x bfloat16, int4 >= 2.2x;
# Mixtral-8x7B int8 >= 150 tok/s. On the device machine the pure-Python wheels travel in
# .gpu_site (see bench/PERFORMANCE_LOG.md); the tool's command then starts
# `export PYTHONPATH=$PWD/.gpu_site:$PWD PYTHONUNBUFFERED=1; bash bench/gpu_lease.sh STEP`.
# nf4's CUDA kernel is bitsandbytes' CUDA library, which the machine lacks and whose wheel (43 MB)
# is too large to carry beside the others: carry only the library for its CUDA, as a folder our
# loader finds (quant/nf4.cuda_kernel reads no Python of the package):
#   mkdir -p .gpu_site/bitsandbytes
#   cp .venv/lib/python3.11/site-packages/bitsandbytes/libbitsandbytes_cuda130.so .gpu_site/bitsandbytes/
# GemLite (quant/gemlite_cuda.py) is plain Python over the machine's Triton 3.6 (and numpy, tqdm, which it
# has); PyPI holds only its source, so carry the package folder itself:
#   pip download --no-deps -d /tmp/gl gemlite==0.6.0.post2 && tar xzf /tmp/gl/gemlite-0.6.0.post2.tar.gz -C /tmp/gl
#   cp -r /tmp/gl/gemlite-0.6.0.post2/gemlite .gpu_site/
# (tests/test_cuda.py's bitsandbytes-folder test writes its folder with bitsandbytes' own Python:
# for that run carry the wheel itself, .whl as the device README says, and little else.)
#
# Compiling a step took 170-250 s of a lease's device time with every block written out; each block is
# now one region compiled once (steps/decode_step.in_regions; on CPU 18 s against 121 s at 32 layers),
# which `regions` measures on the GPU. Inductor's and Triton's caches (graphs,
# kernels, coordinate-descent results) go to .gpu_cache, packed at the end into $OUT/gpu_cache.tgz.part0..3
# (15 MB each: a returned file may have 16 MiB, a call 8 files; not at all past 4 parts: the
# 2026-11-28 lease's cache was over 16 MB in one file); unpacked into .gpu_cache here and carried with the
# next lease (carry: [".gpu_site", ".gpu_cache"]; the working tree that travels has 64 MiB in all), the
# same step on the same machine kind finds its graphs and kernels compiled:
#   mkdir -p .gpu_cache && cat FILES_AT/gpu_cache.tgz.part* | tar xzf - -C .gpu_cache
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-results}"
mkdir -p "$out" .gpu_cache/inductor .gpu_cache/triton
export TORCHINDUCTOR_CACHE_DIR="$PWD/.gpu_cache/inductor" TRITON_CACHE_DIR="$PWD/.gpu_cache/triton"
pack_cache() {
  tar czf /tmp/gpu_cache.tgz -C .gpu_cache . 2>/dev/null || return 0
  if [ "$(stat -c %s /tmp/gpu_cache.tgz)" -le $((4 * 15000000)) ]; then
    split -b 15000000 -d -a 1 /tmp/gpu_cache.tgz "$out/gpu_cache.tgz.part"
  else
    echo "inductor's cache is over 60 MB packed: not returned" >&2
  fi
}
trap pack_cache EXIT
step="${1:?a step: short, first, matvec, gemlite, quant, nf4, batches, mixtral, serve or regions}"
run() { timeout -s INT "$1" "${@:2}" 2>&1 | tee "$out/$step.log"; }
case "$step" in
  matvec)  run 360 python bench/gpu_matvec.py --out "$out/matvec.json" ;;
  first)   run 540 bash -c "timeout -s INT 360 python bench/gpu_matvec.py --out '$out/matvec.json';
             timeout -s INT 170 python -m pytest -q -n 0 tests/test_cuda.py \
               -k 'gemlites_products or cuda_nf4_kernel or each_block_once'" ;;
  short)   end=$((SECONDS + 560))
           # Each test at most 60 s (pytest-timeout, on the lent machine): a slow one fails alone and the
           # report, with every failure's message, still prints (2026-11-28: a whole-run timeout lost it).
           each=$(python -c 'import pytest_timeout' 2>/dev/null && echo "--timeout 60" || true)
           { timeout -s INT 150 python -m pytest -q -n 0 $each -rf --tb=short tests/test_cuda.py \
               -k 'each_block_once or gemlites_products or cuda_nf4_kernel' || echo "tests: exit $?"
             timeout -s INT 60 python bench/gpu_matvec.py --ways bf16 'int8 gemlite' 'int4-128 gemlite' \
               'int4-128 gemlite native' 'int4-128 gemlite bf16 atomics' 'int8 gemlite linear()' \
               --out "$out/matvec.json" || echo "matvec: exit $?"
             timeout -s INT $((end - SECONDS - 60)) python bench/bench_gpu.py --models mistral-7b \
               --without-transformers --batches 1 --prefill --modes compiled --repeats 2 \
               --quantize int4-128-gemlite int4-128-gemlite-f32 int8-gemlite nf4 \
               --out "$out/short.json" || echo "bench: exit $?"
             timeout -s INT $((end - SECONDS)) python -m pytest -q -n 0 $each -rf --tb=short \
               tests/test_cuda.py -k 'quantized_cuda_decoding and (True or nf4)' || echo "decoding tests: exit $?"
           } 2>&1 | tee "$out/short.log" ;;
  quant)   run 580 python bench/bench_gpu.py --models mistral-7b --without-transformers --batches 1 --prefill \
             --quantize int8 int4 --modes compiled --repeats 2 --out "$out/quant.json" ;;
  gemlite) run 580 python bench/bench_gpu.py --models mistral-7b --without-transformers --batches 1 --prefill \
             --quantize int8-gemlite int4-128-gemlite --modes compiled --repeats 2 --out "$out/gemlite.json" ;;
  nf4)     run 580 python bench/bench_gpu.py --models mistral-7b --without-transformers --batches 1 --prefill \
             --quantize nf4 --modes compiled --repeats 2 --out "$out/nf4.json" ;;
  batches) run 580 python bench/bench_gpu.py --models mistral-7b --batches 8 32 --prefill 2048 8192 --quantize \
             --repeats 2 --out "$out/batches.json" ;;
  mixtral) run 580 python bench/bench_gpu.py --models mixtral-8x7b --batches 1 --prefill 2048 --quantize \
             --repeats 2 --out "$out/mixtral.json" ;;
  serve)   run 580 python bench/bench_serve.py --shape mistral-7b --layers 8 --device cuda --dtype bfloat16 \
             --requests 96 --clients 32 --out "$out/serve.json" ;;
  regions) run 580 python bench/regional_compile.py --device cuda --widths 7b --layers 32 --rounds 3 \
             --out "$out/regions.jsonl" ;;
  *) echo "unknown step $step: short, first, matvec, gemlite, quant, nf4, batches, mixtral, serve or regions" >&2; exit 2 ;;
esac
