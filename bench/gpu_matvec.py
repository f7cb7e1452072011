"""Which weight-only product reads a decode step's weights fastest on this GPU (batch 1).

One row of bfloat16 times ``--weights`` matrices of Mistral 7B's FFN shape (14336 x 4096, 1.9 GB in
bfloat16 for 16 of them: far past the L2), every way in one CUDA graph replayed (as the decode
step is), timed by CUDA events, median of ``--repeats``; GB/s counts the bytes each way must read.
Each way's output is checked against the dequantize-then-matmul reference first (relative error).

* ``bf16``: ``F.linear`` on the bfloat16 weights (what int8 and int4 are measured against);
* ``int8 compiled``: ``F.linear(x, q.to(bfloat16)) * scales`` compiled as the decode step
  compiles it (``coordinate_descent_tuning``; gpt-fast's int8 product) — ours today;
* ``int8 _weight_int8pack_mm``: PyTorch's weight-only int8 op, where it has a CUDA kernel;
* ``int4 tinygemm tiles=K``: ``_weight_int4pack_mm`` (groups of 32) with inner_k_tiles K;
* ``nf4 bitsandbytes``: bitsandbytes' fused CUDA kernel (``cgemm_4bit_bf16``, groups of 64, its
  own format: ``quant/nf4.py``), what ``quantize="nf4"`` runs on CUDA; ``nf4 bitsandbytes gemv``:
  its older one-row kernel (``cgemm_4bit_inference_naive_bf16``), for comparison;
* ``int8 gemlite``, ``int4 gemlite`` (groups of 32) and ``int4-128 gemlite``: GemLite's Triton
  kernels (``quant/gemlite_cuda.py``: its matrix-vector kernels at one row), what ``linear()``
  runs on CUDA where GemLite is installed, their float32 outputs as they come (a compiled step
  converts them where they are read); carry its package folder (``bench/gpu_lease.sh``). Each also
  ``... native`` (outputs in bfloat16, as GemLite's own layers make them: int4 converts its float32
  sums in a kernel of its own; int8 at one row writes bfloat16 directly), the int4 ones ``... bf16
  atomics`` (GemLite's default: split sums added up in bfloat16, less accurate, no conversion),
  and each ``... linear()``, the product through ``linear()`` as the model calls it (uncompiled
  here: its conversion a kernel of its own);
* ``int8 words`` and ``int4 words``: the plain integers read as int32 words, 4 int8 or 8 int4
  values a load, unpacked by shifts in the compiled reduction (``int8_words``, ``int4_words``).
  Not yet run on a GPU: a guess at why int8 is no faster than bfloat16 for 14336 x 4096 (a
  reduction loading one byte per thread), and whether int4 needs tinygemm's layout at all.

    python bench/gpu_matvec.py --out bench/results_gpu_matvec.json
    python bench/gpu_matvec.py --ways bf16 "int8 gemlite" "int8 gemlite linear()"   # some rows only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gpu import cuda_graph_of  # noqa: E402

from mixtral_infer.formats.linear import linear  # noqa: E402
from mixtral_infer.quant import gemlite_cuda, nf4  # noqa: E402
from mixtral_infer.quant.kernels import _scales_and_zeros, prepare, tinygemm_bytes, with_cuda_nf4_layout  # noqa: E402
from mixtral_infer.quant.weights import QuantScheme, quantize  # noqa: E402

FFN_SHAPE = (14336, 4096)  # w1 and w3 of Mistral 7B: (OUT, IN)


def prepared_products(x: torch.Tensor, weights: list) -> Callable[[], list]:
    """``linear(x, q)`` for each weight given its GemLite product (``kernels.prepare``, on the first
    call): GemLite's product with whatever ``linear()`` adds around it, as the model runs it."""

    def run() -> list:
        if gemlite_cuda.library() is None:
            raise RuntimeError("GemLite does not import here: carry its package folder (bench/gpu_lease.sh)")
        for q in weights:
            if q.gemlite is None:
                prepare(q)
        return [linear(x, q) for q in weights]

    return run


def graph_ms(run: Callable[[], None], repeats: int) -> float:
    """Median milliseconds of one replay of ``run`` captured as a CUDA graph."""
    graph = cuda_graph_of(run)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def tinygemm_products(x: torch.Tensor, weights: list, tiles: int) -> Callable[[], list]:
    """``_weight_int4pack_mm`` of ``x`` by each int4 weight, laid out with ``tiles`` inner k-tiles
    (packed on the first call, so a torch without the op fails inside the timed way's try).
    Bytes read: the nibbles and a bfloat16 (scale, zero) pair per 32 weights."""
    packed: list = []

    def run() -> list:
        if not packed:
            for q in weights:
                layout = torch.ops.aten._convert_weight_to_int4pack(tinygemm_bytes(q.values).contiguous(), tiles)
                packed.append((layout, _scales_and_zeros(q)))
        return [torch.ops.aten._weight_int4pack_mm(x, layout, 32, pairs) for layout, pairs in packed]

    return run


def bitsandbytes_gemv(x: torch.Tensor, weights: list) -> Callable[[], list]:
    """bitsandbytes' older one-row CUDA kernel, ``cgemm_4bit_inference_naive_bf16(M, N, K, x, bytes,
    scales, code, out, lda, ldb, ldc, G, stream)``, on the same format as ``nf4_cuda_mm``'s."""
    import ctypes
    import importlib.util

    folder = Path(next(iter(importlib.util.find_spec("bitsandbytes").submodule_search_locations)))
    library = ctypes.CDLL(str(folder / f"libbitsandbytes_cuda{torch.version.cuda.replace('.', '')}.so"))
    gemv = library.cgemm_4bit_inference_naive_bf16
    gemv.argtypes = [ctypes.c_int32] * 3 + [ctypes.c_void_p] * 5 + [ctypes.c_int32] * 4 + [ctypes.c_void_p]
    code = nf4.code_values(x.device)

    def run() -> list:
        outs = []
        for q in weights:
            (packed, scales), (out_features, in_features) = q.packed, q.shape
            out = x.new_empty(1, out_features)
            gemv(out_features, 1, in_features, x.data_ptr(), packed.data_ptr(), scales.data_ptr(), code.data_ptr(),
                 out.data_ptr(), out_features, in_features // 2, out_features, q.scheme.group_size,
                 torch.cuda.current_stream().cuda_stream)  # fmt: skip
            outs.append(out)
        return outs

    return run


def gemlite_products(x: torch.Tensor, weights: list, bf16_atomics: bool = False, native: bool = False
                     ) -> Callable[[], list]:  # fmt: skip
    """GemLite's product of ``x`` by each weight (``gemlite_cuda.product``, packed on the first
    call, so a machine without GemLite fails inside the timed way's try), the kernel alone: its
    float32 outputs as they come (``product``'s ``float32_outputs``; a compiled step converts them
    inside the kernel that reads them). Its first call of each shape autotunes where GemLite's
    cached configurations lack it (H100's are loaded on an H200). ``native``: outputs in the
    activations' dtype, as GemLite's own layers make them (converted by GemLite where it adds in
    float32). ``bf16_atomics`` (with ``native``): split sums added up in bfloat16, GemLite's default
    (``gemlite_cuda``'s docstring: ours add up in float32); read as the products are captured."""
    products: list = []

    def run() -> list:
        library = gemlite_cuda.library()
        if library is None:
            raise RuntimeError("GemLite does not import here: carry its package folder (bench/gpu_lease.sh)")
        if not products:
            products.extend(gemlite_cuda.product(q, float32_outputs=not native) for q in weights)
        library.set_native_atomic_bfp16(bf16_atomics)
        try:
            if native:
                return [product(x) for product in products]
            return [torch.ops.mixtral_infer.gemlite_mm(x, list(p.tensors), list(p.meta)) for p in products]
        finally:
            library.set_native_atomic_bfp16(False)

    return run


def int8_dequantizing(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-fast's int8 product, ours on CUDA: ``F.linear(x, q.to(x.dtype)) * scales``."""
    return F.linear(x, values.to(x.dtype)) * scales.to(x.dtype)


def compiled_products(product: Callable) -> Callable:
    """``product(x, weight, scales)`` over every weight in one graph, compiled as the decode step
    compiles on CUDA (``coordinate_descent_tuning``), on the first call."""

    def products(x: torch.Tensor, weights: list, scales: list) -> list:
        return [product(x, w, s) for w, s in zip(weights, scales)]

    return torch.compile(products, fullgraph=True, dynamic=False, options={"coordinate_descent_tuning": True})


def int8_words(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x (1, IN) @ q.T * scales`` for int8 ``q (OUT, IN)`` read as int32 ``words (OUT, IN/4)``: byte
    ``b`` of word ``j`` (little-endian) is input ``4j + b``, sign-extended by shifting it to the top
    and back. Example: word ``0x01FF02FE`` holds ``[-2, 2, -1, 1]``."""
    xs = x.float().view(-1, 4)  # (IN/4, 4)
    total = 0
    for b in range(4):
        byte = (words << (24 - 8 * b)) >> 24  # (OUT, IN/4) signed bytes b
        total = total + byte.float() * xs[:, b]
    return (total.sum(-1) * scales.float()).to(x.dtype)[None]  # (1, OUT)


def int4_words(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, group: int = 32) -> torch.Tensor:
    """``x (1, IN)`` times int4 in the plain layout (``quant/weights.py``: byte ``j`` holds input ``2j``
    low and ``2j + 1`` high, each plus 8) read as int32 ``words (OUT, IN/8)``: nibble ``k`` of word
    ``j`` is input ``8j + k``; ``scales (OUT, IN/G)``. Example: word ``0x00000F81`` holds
    ``[1, 8, 15, 0, ...] - 8 = [-7, 0, 7, -8, ...]``."""
    xs = x.float().view(-1, 8)  # (IN/8, 8)
    total = 0
    for k in range(8):
        nibble = ((words >> (4 * k)) & 15) - 8  # (OUT, IN/8)
        total = total + nibble.float() * xs[:, k]
    per_word_scale = scales.float()[:, :, None].expand(-1, -1, group // 8).reshape(words.shape)  # (OUT, IN/8)
    return (total * per_word_scale).sum(-1).to(x.dtype)[None]  # (1, OUT)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weights", type=int, default=16)
    parser.add_argument("--shape", type=int, nargs=2, default=list(FFN_SHAPE), metavar=("OUT", "IN"))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--ways", nargs="+", default=None, help="these rows only, by name (default: every one)")
    options = parser.parse_args(argv)
    out_features, in_features = options.shape
    device, bf16 = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    floats = [torch.randn(out_features, in_features, device=device, dtype=bf16) * in_features**-0.5 for _ in range(options.weights)]
    x = torch.randn(1, in_features, device=device, dtype=bf16)
    int8 = [quantize(w, QuantScheme.parse("int8"), bf16) for w in floats]
    int4 = [quantize(w, QuantScheme.parse("int4"), bf16) for w in floats]
    references = {
        "int8": [F.linear(x.float(), q.dequantize(torch.float32)) for q in int8],
        "int4": [F.linear(x.float(), q.dequantize(torch.float32)) for q in int4],
        "bf16": [F.linear(x.float(), w.float()) for w in floats],
    }
    n = options.weights * out_features * in_features
    ways: Dict[str, tuple] = {}  # name -> (products, reference kind, bytes read)

    ways["bf16"] = (lambda: [F.linear(x, w) for w in floats], "bf16", 2 * n)

    values8 = [q.values for q in int8]
    scales8 = [q.scales for q in int8]

    int8_bytes = n + 2 * options.weights * out_features  # the integers and a bfloat16 scale a row
    int8_compiled = compiled_products(int8_dequantizing)
    ways["int8 compiled"] = (lambda: int8_compiled(x, values8, scales8), "int8", int8_bytes)
    int8pack = torch.ops.aten._weight_int8pack_mm
    ways["int8 _weight_int8pack_mm"] = (
        lambda: [int8pack(x, v, s) for v, s in zip(values8, scales8)], "int8", int8_bytes
    )
    words8 = [v.contiguous().view(torch.int32) for v in values8]  # (OUT, IN/4)
    int8_words_compiled = compiled_products(int8_words)
    ways["int8 words"] = (lambda: int8_words_compiled(x, words8, scales8), "int8", int8_bytes)
    words4 = [q.values.contiguous().view(torch.int32) for q in int4]  # (OUT, IN/8)
    scales4 = [q.scales for q in int4]
    int4_words_compiled = compiled_products(int4_words)
    ways["int4 words"] = (lambda: int4_words_compiled(x, words4, scales4), "int4", n // 2 + 2 * n // 32)
    for tiles in (8, 4, 2):
        ways[f"int4 tinygemm tiles={tiles}"] = (tinygemm_products(x, int4, tiles), "int4", n // 2 + 4 * n // 32)
    nf4_weights = [with_cuda_nf4_layout(quantize(w, QuantScheme.parse("nf4"), bf16)) for w in floats]
    references["nf4"] = [F.linear(x.float(), q.dequantize(torch.float32)) for q in nf4_weights]
    nf4_bytes = n // 2 + 4 * n // 64  # the codes and a float32 scale a group
    def nf4_products() -> list:
        if nf4.cuda_kernel() is None:  # linear() would take the reference: not the kernel's row
            raise RuntimeError("bitsandbytes' CUDA library for this torch's CUDA did not load")
        return [linear(x, q) for q in nf4_weights]

    ways["nf4 bitsandbytes"] = (nf4_products, "nf4", nf4_bytes)
    ways["nf4 bitsandbytes gemv"] = (bitsandbytes_gemv(x, nf4_weights), "nf4", nf4_bytes)

    int4_128 = [quantize(w, QuantScheme.parse("int4-128"), bf16) for w in floats]
    references["int4-128"] = [F.linear(x.float(), q.dequantize(torch.float32)) for q in int4_128]
    gemlite_ways = (("int8", int8, int8_bytes), ("int4", int4, n // 2 + 2 * n // 32),
                    ("int4-128", int4_128, n // 2 + 2 * n // 128))  # fmt: skip
    for scheme, quantized, nbytes in gemlite_ways:
        ways[f"{scheme} gemlite"] = (gemlite_products(x, quantized), scheme, nbytes)
        ways[f"{scheme} gemlite native"] = (gemlite_products(x, quantized, native=True), scheme, nbytes)
        if scheme.startswith("int4"):  # GemLite's default: its split sums added up in bfloat16
            ways[f"{scheme} gemlite bf16 atomics"] = (gemlite_products(x, quantized, True, True), scheme, nbytes)
        ways[f"{scheme} gemlite linear()"] = (prepared_products(x, quantized), scheme, nbytes)

    # The ways a short lease most needs first (the JSON keeps every finished row): then the rest as built.
    first = ["bf16", "int8 compiled", "int8 gemlite", "int4-128 gemlite", "int4 tinygemm tiles=2", "nf4 bitsandbytes"]
    order = first + [name for name in ways if name not in first]
    if options.ways is not None:
        unknown = sorted(set(options.ways) - set(ways))
        if unknown:
            parser.error(f"no way named {', '.join(unknown)}; the ways: {', '.join(ways)}")
        order = [name for name in order if name in options.ways]
    results: List[Dict] = []
    for name in order:
        run, kind, nbytes = ways[name]
        row: Dict = {"way": name, "weights": options.weights, "shape": [out_features, in_features]}
        try:
            outputs = run()
            torch.cuda.synchronize()
            row["relative_error"] = max(
                ((o.float() - r).norm() / r.norm()).item() for o, r in zip(outputs, references[kind])
            )
            ms = graph_ms(lambda: run(), options.repeats)
            row.update(ms=ms, gb_s=nbytes / ms / 1e6, weights_per_s=n / ms / 1e6)
            print(f"{name:32s} {ms:7.3f} ms  {row['gb_s']:7.0f} GB/s  rel.err {row['relative_error']:.1e}", flush=True)
        except Exception as error:  # a way this torch lacks: say so, keep the others
            row["error"] = f"{type(error).__name__}: {error}"[:300]
            print(f"{name:32s} failed: {row['error']}", flush=True)
        results.append(row)
        if options.out is not None:
            machine = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
            options.out.write_text(json.dumps({**machine, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
