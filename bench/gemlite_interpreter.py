"""GemLite's own kernels, run on a CPU by Triton's interpreter, on the weights we hand them.

``quant/gemlite_cuda.py`` hands GemLite our int8 and int4 weights in its format; the CPU suite checks
that format against the reference by its definition (``(W_q - zeros) * scales``). This runs the
real thing, GemLite's Triton kernels (its matrix-vector ones, at one row), in Triton's interpreter
(``TRITON_INTERPRET=1``: each program's block operations in numpy, minutes a product), with
GemLite's questions to the GPU answered as an H100 would (so its H100 tuning picks one
configuration: shapes it holds do not autotune). A scratch check, not a test: it needs Triton and
GemLite installed beside the CPU torch, and the interpreter has no bfloat16 (numpy lacks it: NaN),
so it multiplies float16.

Printed per scheme: the product's error relative to the reference (norm), a float16 product's
error for scale, and the error against two wrong formats (nibbles swapped in a byte; zeros off by
one), which a right format is far from::

    pip install --target /tmp/tri triton==3.6.0 tqdm
    pip download --no-deps -d /tmp/gl gemlite==0.6.0.post2
    pip install --no-deps --target /tmp/tri /tmp/gl/gemlite-*.tar.gz
    PYTHONPATH=/tmp/tri python bench/gemlite_interpreter.py int8 int4-128 int4
"""

from __future__ import annotations

import os
import sys
import time
import types
from pathlib import Path

import torch

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE = (1024, 4096)  # (OUT, IN): Mistral 7B's wk, whose H100 tuning GemLite ships for every scheme here


def pretend_a_hopper_gpu() -> None:
    """What GemLite asks of CUDA and of Triton's driver when imported and when it launches,
    answered as an H100 would, the tensors staying on the CPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import interpreter

    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(name="NVIDIA H100 80GB HBM3",
                                                                              multi_processor_count=132)  # fmt: skip
    torch.cuda.device_count = lambda: 0  # no per-GPU tables to place

    class Driver:
        utils = types.SimpleNamespace(get_device_properties=lambda device: {
            "multiprocessor_count": 132, "max_shared_mem": 232448, "max_num_regs": 65536, "warpSize": 32})  # fmt: skip

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_current_device(self):
            return 0

        def get_device_interface(self):
            return torch.cuda

        def get_benchmarker(self):
            return lambda run, *args, **kwargs: (run(), 1.0)[1]

        def get_empty_cache_for_benchmark(self):
            return torch.empty(1)

        def clear_cache(self, cache) -> None:
            pass

    triton.runtime.driver.set_active(Driver())
    patch_tensor = interpreter._patch_lang_tensor

    def with_index_of_one_element(tensor, scope) -> None:  # numpy 2 refuses int() of a 1-element array
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = with_index_of_one_element


def main(schemes) -> int:
    pretend_a_hopper_gpu()
    import gemlite

    from mixtral_infer.quant import gemlite_cuda, nf4
    from mixtral_infer.quant.weights import QuantizedWeight, QuantScheme, quantize

    gemlite_cuda.library = lambda: gemlite  # the real one declines without CUDA
    out_features, in_features = SHAPE
    dtype = torch.float16
    relative = lambda got, want: ((got.float() - want).norm() / want.norm()).item()  # noqa: E731
    for scheme in schemes:
        g = torch.Generator().manual_seed(0)
        weight = quantize(torch.randn(out_features, in_features, generator=g), QuantScheme.parse(scheme), dtype)
        x = torch.randn(1, in_features, generator=g).to(dtype)
        reference = x.float() @ weight.dequantize().T
        start = time.perf_counter()
        got = gemlite_cuda.product(weight)(x)
        seconds = time.perf_counter() - start
        in_float16 = x @ weight.dequantize(dtype).T
        line = f"{scheme:9s} GemLite {relative(got, reference):.1e}"
        line += f"  float16 F.linear {relative(in_float16, reference):.1e}"
        if weight.scheme.name == "int4":
            values = nf4.cuda_layout(weight.values)  # each byte's nibbles swapped: its two inputs the other way round
            swapped = QuantizedWeight(weight.scheme, values, weight.scales, in_features)
            groups = weight.scales.float().repeat_interleave(weight.scheme.group_size, dim=-1)  # (OUT, IN)
            line += f"  nibbles swapped {relative(got, x.float() @ swapped.dequantize().T):.2f}"
            line += f"  zeros 7 {relative(got, reference + x.float() @ groups.T):.2f}"
        print(f"{line}  ({seconds:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["int8", "int4-128", "int4"]))
