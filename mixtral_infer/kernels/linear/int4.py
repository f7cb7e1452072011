"""int4 weight-only integers (groups of 32 or more inputs, one scale a group): PyTorch's int4 kernels.

* **CPU**: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` on the layout made by
  ``_convert_weight_to_int4pack_for_cpu`` (torchao has no CPU int4 layout of its own any more), for
  bfloat16 activations. Prompts, where ``Tuning.upcast`` multiplies in float32 (``fast.cpu_upcast``),
  read the kernel layout back (``dequantize_int4_kernel_layout``: the plain values are dropped) from
  ``INT4_DEQUANTIZE_ROWS`` rows on; where 16-bit products are the faster, into bfloat16, as the
  reference does, from ``DEQUANTIZE_ROWS`` rows on.
* **CUDA**: tinygemm, ``torch.ops.aten._weight_int4pack_mm`` on the layout made by
  ``_convert_weight_to_int4pack`` (gpt-fast's and torchao's int4 kernel), for bfloat16 chunks of
  fewer than ``CUDA_INT4_DEQUANTIZE_ROWS`` rows. It is made for few rows: for many, dequantizing and
  a bfloat16 product cost a fraction of it; so a CUDA int4 weight keeps its plain values beside the
  kernel layout (1 byte per weight in all, as int8) and prompt chunks dequantize. The CUDA ops
  exist only there: the CPU tests check the layout handed to them (``tinygemm_layout``), a CUDA
  test the product itself.

Both kernels take the scales as ``(IN/G, OUT, 2)`` pairs ``[scale, 0]`` (they compute
``(n - 8) * scale + zero``). ``CUDA_INT4_DEQUANTIZE_ROWS`` follows the library's own dispatch.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from mixtral_infer.fast.cpu_upcast import should_upcast, upcast_linear
from mixtral_infer.kernels.linear.backend import DEFAULT, LinearBackend
from mixtral_infer.kernels.linear.quantized_common import DEQUANTIZE_ROWS, in_kernel_layout, uses_cpu_kernel
from mixtral_infer.kernels.linear.reference import reference_linear
from mixtral_infer.quant import nf4
from mixtral_infer.quant.weights import QuantizedWeight
from mixtral_infer.tuning import Tuning

INT4_DEQUANTIZE_ROWS = 1024  # CPU int4, where float32 multiplies faster: reading the layout back costs more
CUDA_INT4_DEQUANTIZE_ROWS = 64  # CUDA int4: from this many rows on, dequantize + F.linear (module docstring)



# One expert of stacked weights, the expert a 0-d tensor (int8's op does the same).
_LIBRARY = torch.library.Library("mixtral_infer", "FRAGMENT")
_LIBRARY.define("int4_expert_mm(Tensor x, Tensor packed, int group_size, Tensor scales_and_zeros, Tensor expert) -> Tensor")


def _int4_expert_mm(x, packed, group_size, scales_and_zeros, expert):
    e = int(expert)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed[e], group_size, scales_and_zeros[e])


_LIBRARY.impl("int4_expert_mm", _int4_expert_mm, "CPU")


@torch.library.register_fake("mixtral_infer::int4_expert_mm")
def _(x, packed, group_size, scales_and_zeros, expert):
    return x.new_empty(x.shape[0], packed.shape[1])


def int4_layout(weight: QuantizedWeight) -> Optional[str]:
    """Which kernel's layout ``weight.packed`` holds: ``"cpu"`` (bytes, as the plain values),
    ``"cuda"`` (tinygemm's int32 tiles), ``"inline"`` (the integer dot products' rows with their
    scales inline, ``fast.int4_inline``) or None. A model moved between devices keeps its layout,
    which the other device's kernel must not read."""
    if weight.packed is None:
        return None
    if weight.holds_inline_scales():
        return "inline"
    return "cuda" if weight.packed[0].dtype == torch.int32 else "cpu"


class Int4Linear(LinearBackend):
    """int4 integers and scales (``quant.weights.QuantizedWeight``) (module docstring)."""

    @classmethod
    def reads(cls, weight: object) -> bool:
        """Any int4 weight: its own layouts through its kernels, the integer dot products' rows (as a
        model is being loaded for them, or moved to CUDA) through the reference."""
        return isinstance(weight, QuantizedWeight) and weight.scheme.name == "int4"

    @classmethod
    def prepare(cls, weight: object, tuning: Tuning, keep_values: bool = False) -> bool:
        """The device's kernel layout, for bfloat16 scales (the kernels take them as activations):
        on CPU, rows in multiples of 16, per expert ``_convert_weight_to_int4pack_for_cpu`` of the
        unsigned nibbles (plain values dropped unless ``keep_values``); on CUDA, rows in multiples of
        8 and inputs of 32, ``tinygemm_layout`` (the plain values stay: prompt chunks dequantize)."""
        if not cls.reads(weight) or weight.dtype != torch.bfloat16:
            return False
        if weight.device.type == "cuda":
            if weight.shape[-2] % 8 == 0 and cuda_inner_k_tiles(weight.in_features) is not None:
                weight.packed = tinygemm_layout(weight, torch.ops.aten._convert_weight_to_int4pack)
            return True
        if weight.device.type != "cpu" or weight.shape[-2] % 16:
            return True
        int4_cpu_layout_reads_back()  # probed now, outside any compiled step that will ask

        def convert(part: torch.Tensor) -> torch.Tensor:  # (rows, IN/2) plain bytes -> the kernel's
            nibbles = torch.stack([part & 15, part >> 4], dim=-1).flatten(-2).to(torch.int32)  # (rows, IN)
            return torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1)

        in_kernel_layout(weight, convert, _scales_and_zeros(weight), keep_values)
        return True

    @staticmethod
    def product(x: torch.Tensor, weight: QuantizedWeight, tuning: Tuning = DEFAULT) -> torch.Tensor:
        if weight.expert is not None:
            if uses_cpu_kernel(x, weight) and x.shape[0] < DEQUANTIZE_ROWS and int4_layout(weight) == "cpu":
                packed, scales_and_zeros = weight.packed
                expert_mm = torch.ops.mixtral_infer.int4_expert_mm
                return expert_mm(x.contiguous(), packed, weight.scheme.group_size, scales_and_zeros, weight.expert)
            weight = weight.resolved()
        layout = int4_layout(weight)
        if layout == "cpu" and uses_cpu_kernel(x, weight):
            x = x.contiguous()
            upcast = should_upcast(x, tuning.upcast)  # this CPU multiplies float32 faster (fast.cpu_upcast)
            readable = weight.shape[-2] % INT4_BLOCK == 0 and int4_cpu_layout_reads_back()
            if readable and x.shape[0] >= DEQUANTIZE_ROWS:
                if not upcast:  # this CPU multiplies 16-bit faster: as reference_linear does
                    return F.linear(x, dequantize_int4_kernel_layout(weight, x.dtype))
                if x.shape[0] >= INT4_DEQUANTIZE_ROWS:
                    return upcast_linear(x, dequantize_int4_kernel_layout(weight), tuning.onednn_float32)
            packed, scales_and_zeros = weight.packed
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, weight.scheme.group_size, scales_and_zeros)
        if layout == "cuda" and x.device.type == "cuda" and x.dtype == weight.dtype and x.shape[0] < CUDA_INT4_DEQUANTIZE_ROWS:
            packed, scales_and_zeros = weight.packed
            return torch.ops.aten._weight_int4pack_mm(x.contiguous(), packed, weight.scheme.group_size, scales_and_zeros)
        return reference_linear(x, weight)


INT4_BLOCK = 64  # rows per block of the CPU int4 layout


def documented_int4_layout(nibbles: torch.Tensor) -> torch.Tensor:
    """``(OUT, IN)`` nibbles (OUT a multiple of 64) in the layout ``dequantize_int4_kernel_layout``
    reads: per block of 64 rows, an ``(IN, 32)`` byte matrix, row ``64b + j`` in the low nibble of
    byte ``[k, j]``, row ``64b + 32 + j`` in its high nibble. Returns ``(OUT, IN/2)`` uint8."""
    out_features, in_features = nibbles.shape
    blocks = nibbles.to(torch.uint8).view(out_features // INT4_BLOCK, INT4_BLOCK, in_features)  # (OUT/64, 64, IN)
    half = INT4_BLOCK // 2
    paired = blocks[:, :half] | (blocks[:, half:] << 4)  # (OUT/64, 32, IN)
    return paired.transpose(1, 2).reshape(out_features, in_features // 2)


def int4_cpu_layout_reads_back() -> bool:
    """Whether this machine's ``_convert_weight_to_int4pack_for_cpu`` lays blocks out as
    ``documented_int4_layout`` (and so ``dequantize_int4_kernel_layout``) says. The layout is the one
    torch's CPU kernel reads on this CPU, which follows the vector width it runs with (AVX512 and AVX2
    builds differ), so it is probed once, on 64 rows of known nibbles; where it differs, prompts keep
    the int4 kernel instead of reading the layout back. Kept in a global, set when weights are
    prepared (``Int4Linear.prepare``): compiled steps read it as a constant, never trace the probe."""
    global _INT4_READS_BACK
    if _INT4_READS_BACK is None:
        _INT4_READS_BACK = _probe_int4_layout()
    return _INT4_READS_BACK


_INT4_READS_BACK: Optional[bool] = None


def _probe_int4_layout() -> bool:
    nibbles = (torch.arange(INT4_BLOCK)[:, None] * 3 + torch.arange(32)[None, :] * 5) % 16  # (64, 32)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles.to(torch.int32), 1)
    except (RuntimeError, NotImplementedError):  # no CPU int4 kernel in this torch: nothing to read back
        return False
    return packed.shape == (INT4_BLOCK, 16) and torch.equal(packed.view(torch.uint8), documented_int4_layout(nibbles))


def dequantize_int4_kernel_layout(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The matrix ``(OUT, IN)`` in ``dtype`` of a CPU int4 weight that holds only its kernel layout.

    ``_convert_weight_to_int4pack_for_cpu`` stores each block of 64 rows as an ``(IN, 32)``
    byte matrix: byte ``[k, j]`` of block ``b`` holds row ``64b + j``'s input ``k`` in its low
    nibble and row ``64b + 32 + j``'s in its high nibble (checked against the op for OUT =
    128, 1024, 4096, 14336; other row counts end in a block laid out otherwise, so callers
    keep the kernel for them). Example, OUT = 64, IN = 1: nibbles ``n[0..63]`` are the 32
    bytes ``n[j] | n[32 + j] << 4``.
    """
    packed, _ = weight.packed  # (OUT, IN/2) bytes, in the kernel's order
    out_features, in_features = weight.shape
    blocks = packed.reshape(out_features // INT4_BLOCK, in_features, INT4_BLOCK // 2)  # (OUT/64, IN, 32)
    nibbles = torch.empty(out_features // INT4_BLOCK, INT4_BLOCK, in_features, dtype=dtype)  # (OUT/64, 64, IN)
    nibbles[:, : INT4_BLOCK // 2] = (blocks & 15).transpose(1, 2)  # rows 64b + j
    nibbles[:, INT4_BLOCK // 2 :] = (blocks >> 4).transpose(1, 2)  # rows 64b + 32 + j
    # Written in dtype and scaled in place, as dequantize_int8 (one rounding, the reference's
    # numbers), rather than through float32 copies.
    grouped = nibbles.view(out_features, -1, weight.scheme.group_size).sub_(8)  # (OUT, IN/G, G)
    return grouped.mul_(weight.scales[..., None]).view(out_features, in_features)


def _scales_and_zeros(weight: QuantizedWeight) -> torch.Tensor:
    """The int4 kernels' scales: ``(..., IN/G, OUT, 2)`` pairs ``[scale, 0]`` of ``scales (..., OUT, IN/G)``."""
    scales = weight.scales.transpose(-1, -2)  # (..., IN/G, OUT)
    return torch.stack([scales, torch.zeros_like(scales)], dim=-1).contiguous()


# tinygemm's tiling along the inputs: it reads 16 x tiles inputs per step, tiles in {2, 4, 8}.
# gpt-fast uses 8; at batch 1, 2 reads Mistral 7B's shapes faster.
CUDA_INNER_K_TILES = 2


def cuda_inner_k_tiles(in_features: int) -> Optional[int]:
    """The tiling tinygemm's layout takes for ``in_features`` inputs (``CUDA_INNER_K_TILES``), or None
    when they are not a multiple of 16 x that (no tiling divides them then: 4 and 8 need more)."""
    return CUDA_INNER_K_TILES if in_features % (16 * CUDA_INNER_K_TILES) == 0 else None


def tinygemm_bytes(values: torch.Tensor) -> torch.Tensor:
    """Plain int4 bytes ``(..., OUT, IN/2)`` in the order ``_convert_weight_to_int4pack`` reads them.

    The plain layout keeps input 2j in a byte's low nibble and 2j + 1 in its high one; tinygemm
    (like gpt-fast's and torchao's packing, ``q[:, ::2] << 4 | q[:, 1::2]``) wants input 2j high.
    Byte 95 = 15 | 5 << 4 (inputs [15, 5]) becomes 15 << 4 | 5 = 245: the order of bitsandbytes'
    CUDA format too (``nf4.cuda_layout``, which swaps each byte's nibbles).
    """
    return nf4.cuda_layout(values)


def tinygemm_layout(weight: QuantizedWeight, convert: Callable[[torch.Tensor, int], torch.Tensor]) -> tuple:
    """``(packed, scales_and_zeros)`` for ``_weight_int4pack_mm``: ``convert`` (CUDA's
    ``_convert_weight_to_int4pack``) of each expert's ``tinygemm_bytes`` with ``cuda_inner_k_tiles``
    of the inputs, stacked as the experts are; the scales as the CPU kernel takes them."""
    tiles = cuda_inner_k_tiles(weight.in_features)
    plain = tinygemm_bytes(weight.values)  # (..., OUT, IN/2)
    matrices = [convert(matrix.contiguous(), tiles) for matrix in plain.view(-1, *plain.shape[-2:])]
    packed = torch.stack(matrices).view(*plain.shape[:-2], *matrices[0].shape)  # (..., <tinygemm's tiles>)
    return packed, _scales_and_zeros(weight)
