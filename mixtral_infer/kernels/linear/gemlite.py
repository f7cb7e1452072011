"""int8 and int4 products on CUDA through GemLite's Triton kernels, where GemLite is installed.

Why: PyTorch's CUDA kernels for weight-only int8 and int4 read far under the bandwidth at one row.
GemLite (Mobius Labs, Apache-2.0, ``pip install gemlite``) is the low-bit kernel library that
torchao, SGLang and vLLM call for weight-only quantization: matrix-vector kernels for 1-4 rows
(``GEMV_SPLITK`` for 8 bits, ``GEMV_REVSPLITK`` for 4), split-K for up to 64, tuned per GPU. It is
plain Python and Triton, so it runs with any torch that has Triton. Not a dependency: a GPU user
installs it; without it nothing here runs.

Its format is HQQ's, ``W ~ (W_q - zeros) * scales`` with groups along the inputs, so our weights go
in as they are (``arguments``):

* int8: ``W_q`` = the int8 integers, no zeros, one scale per output row (GemLite's
  ``A16W8_INT8`` of pre-quantized weights: group size = the inputs, each weight scaled before
  the dot product, so the kernel multiplies by ``(q * scale)`` rounded to bfloat16 as
  ``QuantizedWeight.dequantize`` does). GemLite reads our integers in place (a transposed view).
* int4: ``W_q`` = the codes ``q + 8`` in [0, 15] unpacked to one a byte, ``zeros = 8`` (an
  integer: GemLite's "symmetric with shift"), our scales ``(OUT, IN/G)``. GemLite packs the codes
  into its own int32 words (eight along the inputs); our plain bytes stay for prompts.

Example, int4, one group of 32 with scale 0.5: the stored byte 0x8F holds inputs ``[15 - 8, 8 - 8]
= [7, 0]``; GemLite gets codes ``[15, 8]``, zeros 8, scale 0.5, and multiplies by ``(15 - 8) * 0.5
= 3.5`` and ``0``, as the reference does (``tests/test_gemlite_cuda.py``).

Where: dense weights (not stacked experts: picking one expert's matrix in compiled code would copy
it, as the op cannot take an index) in bfloat16 or float16, inputs a multiple of 32, for chunks of
fewer than ``ROWS`` rows (GemLite's matrix-vector and split-K range). More rows take the path they
took before (int4 dequantizes, int8 ``F.linear`` of the converted integers).

Accuracy: GemLite's 4-bit matrix-vector kernel splits each output's sum among many programs that
add their parts into the output atomically, in the output's dtype where the GPU can (bfloat16 on
Hopper): one rounding to bfloat16 a part, far more error than a product rounded once. ``library``
turns that off (``set_native_atomic_bfp16(False)``, GemLite's own switch "for higher accuracy"):
the parts add up in float32 and the output is rounded once, as every other product here is.

Outputs: in the activations' dtype, as GemLite's own layers make them, unless
``Tuning.gemlite_float32_outputs`` (``product(..., float32_outputs=True)``) asks GemLite for float32
instead, converted by ``GemliteProduct`` to the activations' dtype through
``mixtral_infer::gemlite_mm``: where GemLite adds split sums in float32 (4-bit at 1-4 rows, every
product of more rows) it otherwise converts its output in a kernel of its own after the product,
which a compiled step cannot fuse; ours is a graph op, done by the kernel that reads the product
(rotary embedding, the SwiGLU product, the residual add). The same rounding, once; int8 at 1-2 rows
writes its output's dtype directly either way. It is off by default (``bench_gpu.py``'s ``-gemlite`` and
``-gemlite-f32`` schemes compare the two ways; docs/performance.md keeps what they measured). The tuned
configurations are the same: GemLite keys them by input type and bits, not output.

Tuning: GemLite autotunes each shape on first use, unless its cached configurations for the GPU
hold it. It ships them per GPU name (``h100.json``...). An H200 is an H100's chip with faster memory,
so on a GPU named H200, which no shipped file names, H100's are loaded (``library``). What it tunes
here is kept, as its README advises, in ``tuning_file()`` beside inductor's cache: written when the
process ends, loaded by the next (``keep_tuning``), so each shape autotunes once per machine.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import List, Optional, Tuple

import torch

from mixtral_infer.kernels.linear.backend import DEFAULT, LinearBackend
from mixtral_infer.kernels.linear.int4 import Int4Linear
from mixtral_infer.kernels.linear.int8 import Int8Linear
from mixtral_infer.quant import nf4
from mixtral_infer.quant.weights import QuantizedWeight
from mixtral_infer.tuning import Tuning

ROWS = 64  # GemLite's own limit for its matrix-vector and split-K kernels (its GEMM from there on)
MIN_INPUTS = 32  # GemLite's: inputs a multiple of this (and of the group size)
SAME_CHIP = {"h200": "h100"}  # GPU name -> the shipped tuning file it can use (same chip, faster memory)


@functools.lru_cache(maxsize=None)
def library() -> Optional[ModuleType]:
    """The ``gemlite`` package, imported, or None: no CUDA, not installed, or it fails to import
    (it asks the GPU for its properties when imported), or ``MIXTRAL_INFER_GEMLITE=0``. Split sums
    add up in float32, and H100's tuning is loaded on an H200 (module docstring)."""
    if os.environ.get("MIXTRAL_INFER_GEMLITE", "1") == "0" or not torch.cuda.is_available():
        return None
    try:
        import gemlite
    except Exception:  # not installed, or a Triton/torch it cannot run with
        return None
    return configured(gemlite, torch.cuda.get_device_name())


def configured(gemlite: ModuleType, gpu_name: str) -> Optional[ModuleType]:
    """``gemlite`` set up for this process: split sums in float32, H100's tuning on an H200, the
    tunings kept here loaded (module docstring). None, with one logged line, where a GemLite whose
    API moved refuses that: used half set up, its 4-bit products would be 2% off."""
    try:
        gemlite.set_native_atomic_bfp16(False)  # split sums add up in float32 (module docstring: accuracy)
        name, configs = gpu_name.lower(), Path(gemlite.__file__).parent / "configs"
        for gpu, shipped in SAME_CHIP.items():
            if gpu in name and not (configs / f"{gpu}.json").exists() and (configs / f"{shipped}.json").exists():
                gemlite.load_config(str(configs / f"{shipped}.json"))
        keep_tuning(gemlite, tuning_file(name, getattr(gemlite, "__version__", "")))
    except Exception as error:  # an optional accelerator: never the reason a model fails to load
        message = "GemLite %s could not be set up (%s: %s); using PyTorch's kernels"
        logging.getLogger(__name__).warning(message, getattr(gemlite, "__version__", "?"), type(error).__name__, error)
        return None
    return gemlite


def tuning_file(gpu_name: str, version: str) -> str:
    """Where GemLite's tunings for this GPU are kept: ``<inductor's cache>/mixtral_infer_gemlite/
    <gpu>-<version>.json`` (``nvidia_h200-0.6.0.post2.json``); a GemLite of another version tunes anew."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    gpu = "".join(c if c.isalnum() or c in "._-" else "_" for c in gpu_name.lower())
    return os.path.join(cache_dir(), "mixtral_infer_gemlite", f"{gpu}-{version}.json")


def keep_tuning(gemlite: ModuleType, path: str) -> None:
    """Load the tunings kept at ``path`` (if any) into ``gemlite``, and write them back, with what
    this process tuned, when it ends (GemLite merges the file's with its own)."""
    if os.path.isfile(path):
        gemlite.load_config(path, print_error=False)

    def save() -> None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            gemlite.cache_config(path)
        except OSError:  # a read-only cache: tuned again next time, nothing lost
            pass

    atexit.register(save)


@dataclass(frozen=True)
class GemliteProduct:
    """``x (M, IN) @ W.T`` by GemLite's op for one weight: the tensors and integers its packed
    layer hands the op (``GemLiteLinear.get_tensor_args`` / ``get_meta_args``), kept as they are.
    A plain object, not a module: ``model.to(...)`` leaves it where it was made (``usable``).
    ``float32_out``: GemLite was asked for float32 outputs (``product``'s ``float32_outputs``), converted here to
    the activations' dtype, through ``mixtral_infer::gemlite_mm`` (GemLite's own fake would say its
    output has the activations' dtype)."""

    tensors: Tuple[torch.Tensor, ...]
    meta: Tuple[int, ...]
    float32_out: bool = False

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if self.float32_out:
            return torch.ops.mixtral_infer.gemlite_mm(x, list(self.tensors), list(self.meta)).to(x.dtype)
        return torch.ops.gemlite.forward_functional(x, None, list(self.tensors), list(self.meta), -1)


def _gemlite_mm(x: torch.Tensor, tensors: List[torch.Tensor], meta: List[int]) -> torch.Tensor:
    """GemLite's op, its output as float32 (a no-op where GemLite wrote float32, as asked)."""
    return torch.ops.gemlite.forward_functional(x, None, list(tensors), list(meta), -1).float()


# GemLite's op as one of ours whose output is float32: compiled code converts it where it is read,
# in the kernel that reads it (``product``'s ``float32_outputs``). The CPU implementation is for the tests, whose
# stand-in takes GemLite's op's name.
_LIBRARY = torch.library.Library("mixtral_infer", "FRAGMENT")
_LIBRARY.define("gemlite_mm(Tensor x, Tensor[] tensors, int[] meta) -> Tensor")
_LIBRARY.impl("gemlite_mm", _gemlite_mm, "CUDA")
_LIBRARY.impl("gemlite_mm", _gemlite_mm, "CPU")


@torch.library.register_fake("mixtral_infer::gemlite_mm")
def _(x, tensors, meta):
    return _gemlite_mm(x, tensors, meta)  # GemLite's fake (its output's shape), made float32


def supports(weight) -> bool:
    """Whether GemLite can take ``weight`` (a ``QuantizedWeight``): int8 or int4, one matrix (not
    stacked experts), 16-bit scales, inputs a multiple of 32, the plain integers at hand."""
    return (
        weight.scheme.name in ("int8", "int4")
        and weight.values is not None
        and weight.values.dim() == 2
        and weight.dtype in (torch.bfloat16, torch.float16)
        and weight.in_features % MIN_INPUTS == 0
    )


def arguments(weight) -> Tuple[torch.Tensor, torch.Tensor, Optional[int], int, int]:
    """``(W_q, scales, zeros, bits, group_size)``: ``weight`` in GemLite's (HQQ's) format, ``W ~
    (W_q - zeros) * scales`` per group (module docstring). int8: the integers ``(OUT, IN)`` as
    stored, scales ``(OUT, 1)``, no zeros, one group a row. int4: codes ``(OUT, IN)`` uint8 in
    [0, 15], scales ``(OUT, IN/G)``, zeros 8."""
    if weight.scheme.name == "int8":
        return weight.values, weight.scales[:, None], None, 8, weight.in_features
    return nf4.nibbles(weight.values), weight.scales, 8, 4, weight.scheme.group_size  # codes (OUT, IN): q + 8


def dequantize(W_q: torch.Tensor, scales: torch.Tensor, zeros: Optional[int], group_size: int,
               dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """The weight GemLite's format stands for, ``(W_q - zeros) * scales`` with each scale repeated
    over its group, rounded once to ``dtype``: what its kernels multiply by."""
    integers = W_q.to(torch.float32) - (zeros or 0)  # (OUT, IN)
    return (integers * scales.to(torch.float32).repeat_interleave(group_size, dim=-1)).to(dtype)


def product_or_none(weight, float32_outputs: bool = False) -> Optional[GemliteProduct]:
    """``product(weight, float32_outputs)``, or None with one logged line where GemLite fails to pack
    it (a GemLite whose API moved, a shape it refuses): the weight then takes PyTorch's kernels, as
    without it."""
    try:
        return product(weight, float32_outputs)
    except Exception as error:  # an optional accelerator: never the reason a model fails to load
        shape = "x".join(map(str, weight.shape))
        message = "GemLite could not pack a %s weight of %s (%s: %s); using PyTorch's kernels"
        logging.getLogger(__name__).warning(message, shape, weight.scheme.name, type(error).__name__, error)
        return None


def product(weight, float32_outputs: bool = False) -> GemliteProduct:
    """GemLite's layer for ``weight`` (on its GPU), packed from ``arguments``: int8 as GemLite's
    ``A16W8_INT8`` packs pre-quantized weights, int4 by ``GemLiteLinear.pack`` (its README's use).
    Its outputs in the weight's dtype, or float32 with ``float32_outputs`` (module docstring)."""
    gemlite = library()
    W_q, scales, zeros, bits, group_size = arguments(weight)
    dtype = gemlite.DType.BF16 if weight.dtype == torch.bfloat16 else gemlite.DType.FP16
    output_dtype = gemlite.DType.FP32 if float32_outputs else dtype
    if bits == 8:
        layer = gemlite.helper.A16W8_INT8(device=weight.device, dtype=weight.dtype).from_weights(W_q, scales=scales)
        layer.output_dtype = output_dtype  # read by its forward only (get_meta_args), not by its packing
    else:
        out_features, in_features = weight.shape
        layer = gemlite.GemLiteLinear(4, group_size=group_size, in_features=in_features, out_features=out_features,
                                      input_dtype=dtype, output_dtype=output_dtype)  # fmt: skip
        layer.pack(W_q, scales, zeros)
    meta = tuple(int(m) for m in layer.get_meta_args())
    return GemliteProduct(tuple(layer.get_tensor_args()), meta, float32_out=float32_outputs)


def usable(x: torch.Tensor, weight) -> bool:
    """Whether ``GemliteLinear`` multiplies ``x`` by ``weight``'s GemLite product: it has one, on
    ``x``'s device, in ``x``'s dtype, for fewer than ``ROWS`` rows."""
    made = weight.gemlite
    return made is not None and x.device == made.device and x.dtype == weight.dtype and x.shape[0] < ROWS


def held_bytes(weights: List) -> int:
    """Bytes GemLite's packed layouts add beside the weights' own tensors (int4: its int32 words;
    int8 reads the integers in place)."""
    total = 0
    for weight in weights:
        made = weight.gemlite
        if made is not None and weight.scheme.name == "int4":
            total += made.tensors[0].numel() * made.tensors[0].element_size()
    return total


class GemliteLinear(LinearBackend):
    """An int8 or int4 weight that GemLite packed at load (``weight.gemlite``, ``product``) (module
    docstring); chunks it does not take (``usable``) go to the weight's own back-end."""

    @classmethod
    def reads(cls, weight: object) -> bool:
        return isinstance(weight, QuantizedWeight) and weight.gemlite is not None

    @classmethod
    def prepare(cls, weight: object, tuning: Tuning, keep_values: bool = False) -> bool:
        """GemLite's packed layer, on a GPU where GemLite is installed, for the weights it supports
        (their plain values kept for prompts); its outputs float32 with ``Tuning.gemlite_float32_outputs``."""
        if not isinstance(weight, QuantizedWeight) or weight.device.type != "cuda" or not supports(weight):
            return False
        if library() is None:
            return False
        weight.gemlite = product_or_none(weight, tuning.gemlite_float32_outputs)
        return weight.gemlite is not None

    @staticmethod
    def product(x: torch.Tensor, weight: QuantizedWeight, tuning: Tuning = DEFAULT) -> torch.Tensor:
        if usable(x, weight):
            return weight.gemlite(x)
        return (Int8Linear if weight.scheme.name == "int8" else Int4Linear).product(x, weight, tuning)
