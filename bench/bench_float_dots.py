"""The package's float32 few-row product (``kernels/float_dots.cpp``, ``Tuning.float_dots``) beside the
libraries' products, one mixtral-bench layer at a time.

Per number of activation rows (``--rows``), float32 rows times the matrices of one mixtral-bench layer
(``bench_vs_transformers.SHAPES``: ``wq wk wv wo``, 1024 x 1024, 256 x 1024 twice, 1024 x 1024, then 8
experts' ``w1 w3`` 3584 x 1024 and ``w2`` 1024 x 3584; 91 M weights, 363 MB, beyond any cache) in turn,
each way:

* ``float_dots``: ``torch.ops.mixtral_infer_dots.float_dots`` (the weight read once for all the rows);
* ``mkl``: ``F.linear`` (MKL's GEMM in PyTorch's CPU wheels), what transformers and the package
  otherwise call;
* ``onednn``: oneDNN's product of the same plain weight (``fast.cpu_packed.onednn_linear``);
* ``blocks``: one ``bmm`` block of output rows per thread (``kernels.linear.few_row_blocks``).

``--dtype bfloat16`` times the bfloat16 product instead (``bfloat16_dots``, ``Tuning.bfloat16_dots``:
bfloat16 weights widened in registers) beside ``F.linear`` and oneDNN in bfloat16 and beside
``float32``: ``float_dots`` of the layer in float32, what a CPU without bfloat16 arithmetic computes a
bfloat16 checkpoint in by default (``checkpoint.compute_dtype``), reading twice the bytes.

``--against REV`` adds ``float_dots@REV``: the kernel's source at git revision ``REV`` (``float_dots.cpp``
and ``dots.h``), built here under another operator namespace, so a change to the kernel is timed beside
the kernel before it in one run.

Ways alternate within each round (``--rounds``; each call after an untimed one); the report is the median milliseconds per layer, GB/s of
weight bytes, each way's time over ``float_dots``', and the machine's read bandwidth before and after
(the ceiling: a float32 sum over 1.5 GB, best of 7).

    .venv/bin/python bench/bench_float_dots.py --out bench/results_float_dots.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_speculative import machine  # noqa: E402
from bench_vs_transformers import read_bandwidth  # noqa: E402

from mixtral_infer.fast.cpu_packed import onednn_linear  # noqa: E402
from mixtral_infer.formats.measured import alternated_medians  # noqa: E402
from mixtral_infer.kernels import native  # noqa: E402
from mixtral_infer.kernels.linear import few_row_blocks  # noqa: E402

DIM, HIDDEN, KV, EXPERTS = 1024, 3584, 256, 8
SHAPES = [(DIM, DIM), (KV, DIM), (KV, DIM), (DIM, DIM)] + [(HIDDEN, DIM), (HIDDEN, DIM), (DIM, HIDDEN)] * EXPERTS


def kernel_at(revision: str):
    """``float_dots`` as the source at git ``revision`` has it: ``float_dots.cpp`` and ``dots.h`` written
    to a temporary folder, the operators registered as ``mixtral_infer_dots_at`` instead, built there."""
    from torch.utils.cpp_extension import load

    root = Path(__file__).resolve().parents[1]
    folder = Path(tempfile.mkdtemp(prefix="float_dots_at_"))
    for name in ("float_dots.cpp", "dots.h"):
        text = subprocess.run(["git", "show", f"{revision}:mixtral_infer/kernels/{name}"], cwd=root, check=True,
                              capture_output=True, text=True).stdout  # fmt: skip
        (folder / name).write_text(text.replace("TORCH_LIBRARY_FRAGMENT(mixtral_infer_dots,", "TORCH_LIBRARY(mixtral_infer_dots_at,")
                                   .replace("TORCH_LIBRARY_IMPL(mixtral_infer_dots,", "TORCH_LIBRARY_IMPL(mixtral_infer_dots_at,"))  # fmt: skip
    os.environ["PATH"] = os.pathsep.join([native.ninja_folder(), os.environ.get("PATH", "")])
    try:
        load(name="float_dots_at", sources=[str(folder / "float_dots.cpp")], extra_cflags=list(native.FLAGS),
             extra_ldflags=["-fopenmp"], build_directory=str(folder), is_python_module=False)  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # the library stays mapped in this process
    return torch.ops.mixtral_infer_dots_at.float_dots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--ways", nargs="+", help="float_dots and these ways only (mkl, onednn, blocks)")
    parser.add_argument("--against", metavar="REV", help="also the kernel's source at this git revision")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--out", type=Path)
    options = parser.parse_args()
    if not native.loaded():
        sys.exit("the package's native kernels are not available here")
    if options.against:  # the revision's hash in the ways' names and the run file, not a name that moves
        options.against = subprocess.run(["git", "rev-parse", "--short", options.against], cwd=Path(__file__).resolve().parents[1],
                                         check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    before = kernel_at(options.against) if options.against else None
    dtype = getattr(torch, options.dtype)
    kernel = "float_dots" if dtype == torch.float32 else "bfloat16_dots"
    torch.manual_seed(0)
    weights = [(torch.randn(shape) * shape[1] ** -0.5).to(dtype) for shape in SHAPES]
    widened = [w.float() for w in weights] if dtype != torch.float32 else []
    size = sum(w.nbytes for w in weights)
    results = {"machine": machine(), "options": {k: str(v) for k, v in vars(options).items()}, "bytes_per_layer": size}
    results["bandwidth_gb_s_before"] = read_bandwidth() / 1e9
    table = {}
    for rows in options.rows:
        xs = {n: torch.randn(rows, n).to(dtype) for n in (DIM, HIDDEN)}
        xs_float = {n: x.float() for n, x in xs.items()}

        def each(product, matrices=weights, rows_of=xs):
            return lambda: [product(rows_of[w.shape[1]], w) for w in matrices]

        ways = {
            kernel: each(getattr(torch.ops.mixtral_infer_dots, kernel)),
            **({"float32": each(torch.ops.mixtral_infer_dots.float_dots, widened, xs_float)} if widened else {}),
            **({f"float_dots@{options.against}": each(before)} if before is not None else {}),
            "mkl": each(F.linear),
            "onednn": each(onednn_linear),
            **({"blocks": each(few_row_blocks)} if dtype == torch.float32 else {}),
        }
        for way, run in list(ways.items()):
            try:
                run()
            except RuntimeError as reason:  # oneDNN without bfloat16 on this CPU, say
                print(f"{way}: {str(reason).splitlines()[0][:120]}; left out", flush=True)
                del ways[way]
        keep = {kernel, *(options.ways or ways)}  # the others' times are given over the kernel's
        ways = {way: run for way, run in ways.items() if way in keep or way.startswith("float_dots@")}
        ms = {way: seconds * 1e3 for way, seconds in alternated_medians(ways, options.rounds).items()}
        read = {way: size * (2 if way == "float32" else 1) for way in ms}  # float32's copy is twice the bytes
        table[rows] = {way: {"ms": round(v, 2), "GB/s": round(read[way] / v / 1e6, 1), f"of_{kernel}": round(v / ms[kernel], 2)}
                       for way, v in ms.items()}  # fmt: skip
        print(f"rows={rows}", "  ".join(f"{way} {v:7.2f} ms ({v / ms[kernel]:.2f}x)" for way, v in ms.items()), flush=True)
    results["rows"] = table
    results["bandwidth_gb_s_after"] = read_bandwidth() / 1e9
    print(f"read bandwidth {results['bandwidth_gb_s_before']:.1f} GB/s before, {results['bandwidth_gb_s_after']:.1f} after")
    if options.out:
        options.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
