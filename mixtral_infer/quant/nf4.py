"""NF4: 4-bit weights from QLoRA's NormalFloat code, multiplied by bitsandbytes' kernels (CPU, CUDA).

int4 spaces its 16 values evenly; NF4 (Dettmers et al., "QLoRA", 2023) places them at the
quantiles of a normal distribution scaled to [-1, 1], where trained weights are dense, with an
exact 0. One scale per group of ``group_size`` consecutive inputs of a row, the group's largest
magnitude (``absmax``): ``w[o, i] ~= NF4[n[o, i]] * absmax[o, i // G]``, ``n`` the nearest code.
Two codes per byte in the plain layout int4 uses (input ``2j`` in the low nibble of byte ``j``).

Worked example, G = 4, one row ``w = [0.5, -0.25, 0.1, 0.0]``: absmax 0.5, ``w / 0.5 = [1.0,
-0.5, 0.2, 0.0]``, nearest codes ``n = [15, 2, 9, 7]`` (NF4[2] = -0.5251, NF4[9] = 0.1609),
bytes ``[15 | 2 << 4, 9 | 7 << 4] = [47, 121]``; dequantized ``[0.5, -0.2625, 0.0805, 0.0]``.

Why a second 4-bit scheme: on CPU every int4 product in PyTorch converts each weight to a float
and multiplies, at about the speed of our int8 loop, so int4 halves the bytes but not the time.
bitsandbytes ships an AVX512-BF16 kernel for NF4 rows (``gemv_4bit_inference_cpu_nf4_bf16``: a
16-entry table lookup per nibble, bfloat16 dot products) that multiplies more weights a second
than our int8 reductions (docs/performance.md, "nf4: bitsandbytes' CPU kernel").
It is loaded from the installed ``bitsandbytes`` package as a plain library (``kernel()``), not
through bitsandbytes' Python side, which probes for CUDA and looks for kernels on the network. Without the package, or
on a CPU without AVX512-BF16 (the library's own ``has_avx512bf16_cpu``), or on a GPU, NF4 takes
the reference path: dequantize, then ``F.linear``.

The kernel reads its own layout (``kernel_layout``), blocked by 32 output rows; the scales go
transposed, ``(IN/G, OUT)``. The tests check the layout by the products the kernel returns.

On CUDA, the same package's CUDA library has a fused dequantize-and-multiply for few rows
(``cuda_kernel()``: ``cgemm_4bit_bf16``, which picks its own SIMT or tensor-core variant per GPU).
It reads bitsandbytes' own format (``cuda_layout``: the plain bytes with their nibbles swapped)
and float32 scales ``(OUT, IN/G)``. The tests check that format on any machine with bitsandbytes'
CPU reader of it, and the products where a GPU is.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from pathlib import Path
from typing import Optional

import torch

# The 16 NormalFloat4 values (QLoRA, appendix E), code n -> value; NF4[7] = 0 exactly.
NF4 = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982251167297, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
ROW_BLOCK = 32  # output rows per block of the kernel's layout


def code_values(device: torch.device | str = "cpu") -> torch.Tensor:
    """``NF4`` as a float32 tensor ``(16,)``."""
    return torch.tensor(NF4, dtype=torch.float32, device=device)


BINS = 4096  # nearest_codes' table: [-1, 1] in bins of 1/2048, narrower than any two midpoints' gap


def midpoints() -> torch.Tensor:
    """``(15,)`` float32: the midpoint between each two neighbouring NF4 values."""
    return torch.tensor([(below + above) / 2 for below, above in zip(NF4[:-1], NF4[1:])], dtype=torch.float32)


@functools.lru_cache(maxsize=None)
def _bin_tables(device: torch.device = torch.device("cpu")) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of ``BINS`` bins, its lower edge ``e = b / 2048 - 1`` (exact in float32): the code
    below it, ``(BINS,) uint8``, how many midpoints lie below ``e``; and ``(BINS,) float32``, the
    next midpoint up (``inf`` past the last), which lies in the bin or above it. On ``device``
    (weights are quantized where they are loaded, a GPU's on the GPU)."""
    mids = midpoints()
    assert (mids.diff() > 2 / BINS).all(), "a bin may hold at most one midpoint"
    edges = torch.arange(BINS, dtype=torch.float32) * (2 / BINS) - 1  # (BINS,)
    below = (edges[:, None] > mids[None, :]).sum(dim=-1)  # (BINS,)
    next_midpoint = torch.cat([mids, torch.tensor([float("inf")])])[below]
    return below.to(torch.uint8).to(device), next_midpoint.to(device)


def nearest_codes(v: torch.Tensor) -> torch.Tensor:
    """The code of the NF4 value nearest each of ``v`` (values in [-1, 1]), as uint8: how many of
    the 15 midpoints between neighbouring codes lie below it (a value on a midpoint takes the lower
    code). Two lookups, faster than 15 comparisons or ``torch.bucketize`` (docs/performance.md,
    "nf4: bitsandbytes' CPU kernel"): ``v``'s bin, ``floor(v * 2048) + 2048`` (exact), gives the
    code below the bin's lower edge and the one midpoint that can lie between that edge and ``v``;
    above it, one more.

    Example: ``v = 0.1205`` falls in bin 2294, ``[0.12012, 0.12061)``, whose lower edge has 8
    midpoints below it; the next, 0.12026 (between NF4[8] = 0.0796 and NF4[9] = 0.1609), lies in
    the bin, and ``v`` is above it: code 9 (0.1609 is 0.0404 away, 0.0796 is 0.0409).
    """
    below, next_midpoint = _bin_tables(v.device)
    flat = v.reshape(-1)  # (N,)
    bins = torch.floor(flat * (BINS // 2)).add_(BINS // 2).to(torch.int32).clamp_(0, BINS - 1)  # (N,): NaN -> an end
    codes = below.index_select(0, bins)
    codes += flat > next_midpoint.index_select(0, bins)
    return codes.view(v.shape)


def byte_values() -> torch.Tensor:
    """``(256, 2)`` float32: the values of the two codes of each byte, ``[NF4[b & 15], NF4[b >> 4]]``."""
    b, table = torch.arange(256), code_values()
    return torch.stack([table[b & 15], table[b >> 4]], dim=-1)


def nibbles(values: torch.Tensor) -> torch.Tensor:
    """Plain bytes ``(..., OUT, IN/2)`` -> the codes ``(..., OUT, IN)``, one a byte."""
    return torch.stack([values & 15, values >> 4], dim=-1).flatten(-2)


def dequantized(codes: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight ``(..., OUT, IN)`` that ``codes (..., OUT, IN)`` and ``scales (..., OUT, IN/G)``
    stand for: each code's value times its group's scale, in float32, rounded once to ``dtype``
    (``QuantizedWeight.dequantize``'s nf4 numbers)."""
    values = code_values(codes.device)[codes.long()]  # (..., OUT, IN)
    groups = scales.to(torch.float32).repeat_interleave(group_size, dim=-1)  # (..., OUT, IN)
    return (values * groups).to(dtype)


def kernel_layout(values: torch.Tensor) -> torch.Tensor:
    """Plain bytes ``(..., OUT, IN/2)`` in the order bitsandbytes' CPU kernel reads them (OUT a
    multiple of 32): for each block of 32 rows and each pair of inputs ``2i, 2i + 1``, 32 bytes;
    byte ``t`` holds row ``32b + t // 2``, input ``2i + t % 2`` in its low nibble and row
    ``32b + 16 + t // 2``, same input, in its high one. Example, OUT = 32, IN = 2, codes
    ``n[row][input]``: byte 0 is ``n[0][0] | n[16][0] << 4``, byte 1 ``n[0][1] | n[16][1] << 4``."""
    *lead, out_features, half = values.shape
    blocks = values.view(*lead, out_features // ROW_BLOCK, ROW_BLOCK, half)  # (..., OUT/32, 32, IN/2)
    top, bottom = blocks[..., : ROW_BLOCK // 2, :], blocks[..., ROW_BLOCK // 2 :, :]  # rows t and 16 + t
    first = (top & 15) | (bottom << 4)  # input 2i of both rows (each byte's low nibble); uint8 drops the rest
    second = (top >> 4) | (bottom & 240)  # input 2i + 1 (each byte's high nibble)
    pairs = torch.stack([first, second], dim=-1)  # (..., OUT/32, 16, IN/2, 2)
    return pairs.transpose(-3, -2).reshape(*lead, out_features, half)  # byte 2t + k of pair i: row t, input 2i + k


def plain_layout(packed: torch.Tensor) -> torch.Tensor:
    """``kernel_layout``'s inverse: the kernel's bytes ``(..., OUT, IN/2)`` back in the plain layout."""
    *lead, out_features, half = packed.shape
    blocks = packed.reshape(*lead, out_features // ROW_BLOCK, half, ROW_BLOCK)  # (..., OUT/32, IN/2, 32)
    pairs = torch.cat([blocks & 15, blocks >> 4], dim=-1).view(*lead, out_features // ROW_BLOCK, half, ROW_BLOCK, 2)
    codes = pairs.transpose(-3, -2).reshape(*lead, out_features, 2 * half)  # (..., OUT, IN)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


@functools.lru_cache(maxsize=None)
def kernel() -> Optional[ctypes._CFuncPtr]:
    """bitsandbytes' ``gemv_4bit_inference_cpu_nf4_bf16``, or None: not installed, no CPU
    library in it, or a CPU without AVX512-BF16. Arguments: ``M, N, K`` (rows, outputs, inputs),
    pointers to ``x (M, K)``, the kernel's bytes ``(N, K/2)``, the scales ``(K/G, N)`` and
    ``out (M, N)`` (all bfloat16 but the bytes), then ``G`` and the row strides of ``x`` and ``out``."""
    spec = importlib.util.find_spec("bitsandbytes")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "libbitsandbytes_cpu.so"
    try:
        library = ctypes.CDLL(str(path))
        if not library.has_avx512bf16_cpu():
            return None
        function = library.gemv_4bit_inference_cpu_nf4_bf16
    except (OSError, AttributeError):
        return None
    function.restype = None
    function.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
    return function


def _nf4_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x (M, IN) bfloat16 @ W.T`` -> ``(M, OUT)`` by the kernel, ``packed (OUT, IN/2)`` in its
    layout, ``scales (IN/G, OUT)`` bfloat16."""
    rows, out_features = x.shape[0], packed.shape[0]
    x = x.contiguous()
    out = x.new_empty(rows, out_features)
    kernel()(rows, out_features, x.shape[1], x.data_ptr(), packed.data_ptr(), scales.data_ptr(), out.data_ptr(),
             group_size, x.stride(0), out.stride(0))  # fmt: skip
    return out


def cuda_layout(values: torch.Tensor) -> torch.Tensor:
    """Plain bytes ``(..., OUT, IN/2)`` in bitsandbytes' own format, which its CUDA kernel reads:
    input ``2j`` in the high nibble of byte ``j``, ``2j + 1`` in the low one (the plain layout has
    them the other way round), rows and groups in order. Its own inverse. Byte 47 = 15 | 2 << 4
    (inputs [15, 2]) becomes 15 << 4 | 2 = 242."""
    return (values << 4) | (values >> 4)  # uint8: the shifted-out nibbles drop


def held_layout(packed: tuple) -> str:
    """Which layout an nf4 weight's ``packed = (bytes, scales)`` holds: ``"cuda"`` (``cuda_layout``,
    float32 scales ``(..., OUT, IN/G)``) or ``"cpu"`` (``kernel_layout``, bfloat16 scales
    ``(..., IN/G, OUT)``). A model moved between devices keeps its layout, which the other
    device's kernel must not read."""
    return "cuda" if packed[1].dtype == torch.float32 else "cpu"


@functools.lru_cache(maxsize=None)
def cuda_kernel() -> Optional[ctypes._CFuncPtr]:
    """bitsandbytes' ``cgemm_4bit_bf16`` from the CUDA library built for this torch's CUDA
    (``libbitsandbytes_cuda130.so`` for CUDA 13.0), or None: no CUDA, not installed, no such
    library. Arguments: pointers to ``x (M, K)``, the bytes ``(N, K/2)`` (``cuda_layout``), the
    float32 scales ``(N, K/G)``, three for nested scales (null here), ``out (M, N)`` and a bias
    (null), then ``M, N, K, G``, the code (2: NF4) and the CUDA stream."""
    spec = importlib.util.find_spec("bitsandbytes")
    if torch.version.cuda is None or spec is None or not spec.submodule_search_locations:
        return None
    name = "libbitsandbytes_cuda" + torch.version.cuda.replace(".", "") + ".so"
    try:
        torch.cuda.init()  # CUDA's libraries loaded first: the library needs libcudart and cuBLAS
        function = ctypes.CDLL(str(Path(next(iter(spec.submodule_search_locations))) / name)).cgemm_4bit_bf16
    except (OSError, AttributeError, RuntimeError):
        return None
    function.restype = None
    function.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int32] * 5 + [ctypes.c_void_p]
    return function


CUDA_NF4 = 2  # bitsandbytes' code for NF4 (1: FP4)


def _nf4_cuda_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x (M, IN) bfloat16 @ W.T`` -> ``(M, OUT)`` on a GPU by ``cuda_kernel()``, ``packed (OUT,
    IN/2)`` in ``cuda_layout``, ``scales (OUT, IN/G)`` float32; on the current stream, so a CUDA
    graph captures it. Where the library does not load (a model laid out in another process, or off
    the GPU), the reference's product: the weight dequantized, then ``F.linear``."""
    rows, out_features = x.shape[0], packed.shape[0]
    if x.device.type != "cuda" or cuda_kernel() is None:
        return torch.nn.functional.linear(x, dequantized(nibbles(cuda_layout(packed)), scales, group_size, x.dtype))
    x = x.contiguous()
    out = x.new_empty(rows, out_features)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    cuda_kernel()(x.data_ptr(), packed.data_ptr(), scales.data_ptr(), None, None, None, out.data_ptr(), None,
                  rows, out_features, x.shape[1], group_size, CUDA_NF4, stream)  # fmt: skip
    return out


# Ops, so that compiled code calls the kernel as it calls PyTorch's own (declared with
# torch.library.Library as kernels.linear's expert ops: the dispatcher calls the function directly).
# nf4_expert_mm multiplies by expert ``expert`` (a 0-d tensor) of stacked weights, in place.
_LIBRARY = torch.library.Library("mixtral_infer", "FRAGMENT")
_LIBRARY.define("nf4_mm(Tensor x, Tensor packed, Tensor scales, int group_size) -> Tensor")
_LIBRARY.define("nf4_expert_mm(Tensor x, Tensor packed, Tensor scales, int group_size, Tensor expert) -> Tensor")
_LIBRARY.define("nf4_cuda_mm(Tensor x, Tensor packed, Tensor scales, int group_size) -> Tensor")
_LIBRARY.impl("nf4_mm", _nf4_mm, "CPU")
_LIBRARY.impl("nf4_cuda_mm", _nf4_cuda_mm, "CUDA")
_LIBRARY.impl("nf4_cuda_mm", _nf4_cuda_mm, "CPU")  # the reference's product: what the CPU tests check
_LIBRARY.impl("nf4_expert_mm", lambda x, packed, scales, g, e: _nf4_mm(x, packed[int(e)], scales[int(e)], g), "CPU")


@torch.library.register_fake("mixtral_infer::nf4_mm")
def _(x, packed, scales, group_size):
    return x.new_empty(x.shape[0], packed.shape[-2])


@torch.library.register_fake("mixtral_infer::nf4_cuda_mm")
def _(x, packed, scales, group_size):
    return x.new_empty(x.shape[0], packed.shape[-2])


@torch.library.register_fake("mixtral_infer::nf4_expert_mm")
def _(x, packed, scales, group_size, expert):
    return x.new_empty(x.shape[0], packed.shape[-2])
