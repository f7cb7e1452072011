"""The experts a Mixtral decode step chose, in Triton: each chosen expert's weights read once, in
place, dequantized where they are read, with the expert indices read on the device.

A layer's experts are two launches, whatever the batch (and ``dense_rows`` reads one quantized weight
the same way, as one expert):

* ``chosen_swiglu``: ``silu(x w1ᵀ) * (x w3ᵀ)`` for every assignment (a token and one of its k chosen
  experts): ``w1`` and ``w3`` read in one pass, ``(A, I)``.
* ``chosen_down``: the hidden rows times ``w2``, each assignment's row multiplied by its routing
  weight, in float32 ``(A, D)``; summing a token's k rows gives the layer's output.

Each picks one of two kernels by the shape of the work:

* ``_expert_rows`` (fewer assignments than experts: batch 1 to 3 of top-2 of 8): a matrix-vector
  product per assignment. One program per assignment and block of ``BLOCK_N`` outputs loads its
  expert's index, then that expert's rows of the weight, block of ``BLOCK_K`` inputs by block.
  ``w2``'s inputs are long (``I``) and its outputs few (``D``): there the inputs are split too
  (split-K), each part added to the float32 output atomically, so that enough programs read at once.
* ``_expert_blocks`` (as many assignments as experts or more): a grouped matrix product, as vLLM's
  fused MoE. The assignments are sorted by expert into blocks of ``BLOCK_M`` that each hold one
  expert's (``blocks_by_expert``), and one program per block and block of outputs multiplies the
  block's rows by its expert's weight with ``tl.dot``: each expert's weights are read once per
  block of its rows, and an expert no row chose is not read.

Activations in bfloat16, float16 or float32 (multiplied as float32). Weights, as ``quant.weights``
stores them (``kind``): ``PLAIN`` ``(E, N, K)`` in the activations' dtype; ``INT8`` ``(E, N, K)``
int8 with scales ``(E, N)``, ``w = q * scale``; ``INT4`` ``(E, N, K/2)`` bytes, input 2j in the low
nibble of byte j and 2j + 1 in the high one, ``w = (n - 8) * scale`` with scales ``(E, N, K/G)``,
one per group of G inputs.

Everything has fixed shapes and no host sync (the sort and the blocks are computed on the device,
the grids follow the shapes only), so a step that calls them can be captured in a CUDA graph. The
entry points are ``torch.library`` ops (``mixtral_infer::chosen_swiglu``, ``chosen_down``,
``dense_rows``), which ``torch.compile(fullgraph=True)`` keeps in its graph and AOTInductor's
library calls back. On CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set
before Triton is imported): that is how the tests check them against the readable path,
``reference_swiglu`` and ``reference_down``, which the ops compute instead where Triton is not
installed, or on CPU without the interpreter.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the ops then compute the readable way
    triton = None

PLAIN, INT8, INT4 = 0, 1, 2  # the kinds of weight (module docstring)
KINDS = {"plain": PLAIN, "int8": INT8, "int4": INT4}


def interpreting() -> bool:
    """Whether Triton's kernels run under its interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def runs_kernels(device: torch.device) -> bool:
    """Whether the ops run the Triton kernels on ``device`` (else they compute the readable way)."""
    return triton is not None and (device.type == "cuda" or (device.type == "cpu" and interpreting()))


# ---------------------------------------------------------------------------------------------
# The readable path: each assignment's expert dequantized and multiplied.


def dequantized(weight: torch.Tensor, scales: Optional[torch.Tensor], kind: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight ``(..., N, K)`` that ``weight`` and ``scales`` of this ``kind`` stand for, in ``dtype``."""
    if kind == PLAIN:
        return weight.to(dtype)
    if kind == INT8:
        return (weight.float() * scales.float()[..., None]).to(dtype)
    nibbles = torch.stack([weight & 15, weight >> 4], dim=-1).flatten(-2)  # (..., N, K): input 2j, 2j+1
    group = nibbles.shape[-1] // scales.shape[-1]
    return ((nibbles.float() - 8) * scales.float().repeat_interleave(group, dim=-1)).to(dtype)


def reference_swiglu(x, experts, w1, s1, w3, s3, kind: int) -> torch.Tensor:
    """``chosen_swiglu`` the readable way: assignment a is row ``a // k`` of x ``(T, K)`` through expert
    ``experts[a]`` (``experts (T*k,)``): ``(T*k, I)`` in x's dtype."""
    rows = x.repeat_interleave(experts.numel() // x.shape[0], dim=0)  # (A, K)
    gate = torch.einsum("ak,ank->an", rows.float(), dequantized(w1[experts], _pick(s1, experts), kind, x.dtype).float())
    up = torch.einsum("ak,ank->an", rows.float(), dequantized(w3[experts], _pick(s3, experts), kind, x.dtype).float())
    return (F.silu(gate) * up).to(x.dtype)


def reference_down(h, experts, w2, s2, mix, kind: int) -> torch.Tensor:
    """``chosen_down`` the readable way: row a of h ``(A, I)`` through expert ``experts[a]``, times
    ``mix[a]``: ``(A, D)`` in float32."""
    out = torch.einsum("ai,adi->ad", h.float(), dequantized(w2[experts], _pick(s2, experts), kind, h.dtype).float())
    return out * mix.float()[:, None]


def _pick(scales: Optional[torch.Tensor], experts: torch.Tensor) -> Optional[torch.Tensor]:
    return None if scales is None else scales[experts]


# ---------------------------------------------------------------------------------------------
# The assignments sorted by expert, in blocks of one expert each.


def padded_length(assignments: int, n_experts: int, block_m: int) -> int:
    """The places ``blocks_by_expert`` lays ``assignments`` out in: each expert's run rounded up to a
    whole block wastes at most ``block_m - 1`` places, and at most ``min(E, A)`` experts have a run."""
    places = assignments + min(n_experts, assignments) * (block_m - 1)
    return -(-places // block_m) * block_m


def blocks_by_expert(experts: torch.Tensor, n_experts: int, block_m: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The assignments ``experts (A,)`` sorted by expert, each expert's run padded to whole blocks of
    ``block_m``: ``sorted_ids (P,)`` (the assignment in each place, ``A`` where a place is empty) and
    ``block_experts (P / block_m,)`` (each block's expert, -1 for the blocks past the last run). Fixed
    shapes (``padded_length``), computed on the device.

    Example: batch 2, top-2 of 4, ``experts = [2, 0, 2, 3]``, ``block_m = 2``: counts ``[1, 0, 2, 1]``,
    runs padded to ``[2, 0, 2, 2]``, ending at ``[2, 2, 4, 6]``; P = 4 + 4 * 1 = 8 places:
    ``sorted_ids = [1, 4, 0, 2, 3, 4, 4, 4]``, ``block_experts = [0, 2, 3, -1]``.
    """
    total = experts.numel()
    places = padded_length(total, n_experts, block_m)
    experts = experts.reshape(-1).long()
    counts = torch.zeros(n_experts, dtype=torch.long, device=experts.device).scatter_add_(0, experts, torch.ones_like(experts))
    padded = (counts + block_m - 1) // block_m * block_m  # (E,)
    ends = torch.cumsum(padded, 0)  # (E,) where each expert's blocks end
    order = torch.argsort(experts, stable=True)  # (A,) assignments grouped by expert
    grouped = experts[order]
    rank = torch.arange(total, device=experts.device) - (torch.cumsum(counts, 0) - counts)[grouped]  # place in its run
    sorted_ids = torch.full((places,), total, dtype=torch.int32, device=experts.device)
    sorted_ids = sorted_ids.scatter(0, (ends - padded)[grouped] + rank, order.to(torch.int32))
    block_starts = torch.arange(0, places, block_m, device=experts.device)
    block_experts = torch.searchsorted(ends, block_starts, right=True)  # the first expert whose blocks end later
    block_experts = torch.where(block_experts < n_experts, block_experts, -1).to(torch.int32)
    return sorted_ids, block_experts


# ---------------------------------------------------------------------------------------------
# The kernels.

if triton is not None:

    @triton.jit
    def _row_block_product(x_ptr, row, w_ptr, s_ptr, e, offs_n, n_ok, k0, N, K,
                           KIND: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        """One block of outputs of one row times one expert's block of inputs ``[k0, k0 + BLOCK_K)``:
        ``(BLOCK_N,)`` float32 (int8's row scales applied by the caller, after the sum)."""
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * K + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)  # (BLOCK_K,)
        if KIND == 2:  # INT4: bytes j hold inputs 2j (low nibble) and 2j + 1 (high)
            j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            bytes_ = tl.load(w_ptr + e * N * (K // 2) + offs_n[:, None] * (K // 2) + j[None, :],
                             mask=n_ok[:, None] & (j < K // 2)[None, :], other=8)  # fmt: skip
            x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_K // 2, 2)))  # (BLOCK_K / 2,) each
            sums = ((bytes_ & 15).to(tl.float32) - 8.0) * x_even[None, :] + ((bytes_ >> 4).to(tl.float32) - 8.0) * x_odd[None, :]
            part = tl.sum(sums * _group_scales(s_ptr, e, offs_n, n_ok, k0, N, K, GROUP, BLOCK_K), axis=1)
        else:
            w = tl.load(w_ptr + e * N * K + offs_n[:, None] * K + offs_k[None, :], mask=n_ok[:, None] & (offs_k < K)[None, :], other=0)
            part = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        return part

    @triton.jit
    def _group_scales(s_ptr, e, offs_n, n_ok, k0, N, K, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
        """int4's scales of outputs ``offs_n`` for the bytes of inputs ``[k0, k0 + BLOCK_K)``, one a byte
        ``(BLOCK_N, BLOCK_K / 2)`` float32: each group's scale loaded once (a block holds whole groups,
        or lies within one), then repeated over the group's bytes."""
        groups = K // GROUP
        if BLOCK_K >= GROUP:
            g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            scales = tl.load(s_ptr + e * N * groups + offs_n[:, None] * groups + g[None, :],
                             mask=n_ok[:, None] & (g < groups)[None, :], other=0.0).to(tl.float32)  # fmt: skip
            repeated = tl.broadcast_to(scales[:, :, None], (offs_n.shape[0], BLOCK_K // GROUP, GROUP // 2))
            return tl.reshape(repeated, (offs_n.shape[0], BLOCK_K // 2))
        else:
            scale = tl.load(s_ptr + e * N * groups + offs_n * groups + k0 // GROUP, mask=n_ok, other=0.0).to(tl.float32)
            return tl.broadcast_to(scale[:, None], (offs_n.shape[0], BLOCK_K // 2))

    @triton.jit
    def _expert_rows(x_ptr, experts_ptr, w_ptr, s_ptr, v_ptr, t_ptr, mix_ptr, out_ptr, N, K, PER_ROW,
                     KIND: tl.constexpr, GROUP: tl.constexpr, SWIGLU: tl.constexpr, DENSE: tl.constexpr,
                     SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        """Program (a, n, s): outputs ``[n * BLOCK_N, (n + 1) * BLOCK_N)`` of assignment a, over the s-th
        of SPLIT_K parts of the inputs. Row ``a // PER_ROW`` of x times expert ``experts[a]`` of w (and
        of v, w3, with SWIGLU: ``silu(x wᵀ) * (x vᵀ)``); without SWIGLU times ``mix[a]``, in float32.
        ``DENSE``: w holds one weight, each row of x is an assignment, nothing is mixed (``experts``
        and ``mix`` are not read)."""
        a = tl.program_id(0)
        if DENSE:
            e = 0
        else:
            e = tl.load(experts_ptr + a).to(tl.int64)
        row = (a // PER_ROW).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K  # each part a whole number of blocks
        k_start = tl.program_id(2) * span
        k_stop = tl.minimum(k_start + span, K)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc_v = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(k_start, k_stop, BLOCK_K):
            acc += _row_block_product(x_ptr, row, w_ptr, s_ptr, e, offs_n, n_ok, k0, N, K, KIND, GROUP, BLOCK_K)
            if SWIGLU:
                acc_v += _row_block_product(x_ptr, row, v_ptr, t_ptr, e, offs_n, n_ok, k0, N, K, KIND, GROUP, BLOCK_K)
        if KIND == 1:  # INT8: one scale per output row
            acc *= tl.load(s_ptr + e * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            if SWIGLU:
                acc_v *= tl.load(t_ptr + e * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        if SWIGLU:
            out = acc / (1.0 + tl.exp(-acc)) * acc_v
            tl.store(out_ptr + a * N + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)
        else:
            out = acc if DENSE else acc * tl.load(mix_ptr + a).to(tl.float32)
            if SPLIT_K == 1:
                tl.store(out_ptr + a * N + offs_n, out, mask=n_ok)
            else:
                tl.atomic_add(out_ptr + a * N + offs_n, out, mask=n_ok)

    @triton.jit
    def _block_product(acc, x_ptr, rows, row_ok, w_ptr, s_ptr, e, offs_n, n_ok, k0, N, K,
                       KIND: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, WIDEN: tl.constexpr):  # fmt: skip
        """``acc (BLOCK_M, BLOCK_N)`` plus the block's rows times one expert's block of inputs
        ``[k0, k0 + BLOCK_K)``, the weight dequantized to x's dtype where it is read. ``WIDEN``: the
        tiles go to ``tl.dot`` in float32, multiplied as float32 (not TF32): for float32 activations,
        and under Triton's interpreter, whose ``dot`` multiplies 16-bit floats' bits as integers
        (and whose conversion to bfloat16 truncates: int4's dequantized tiles then stay float32, the
        readable path's numbers to bfloat16's rounding)."""
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * K + offs_k[None, :], mask=row_ok[:, None] & (offs_k < K)[None, :], other=0.0)
        if KIND == 2:  # INT4
            j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            bytes_ = tl.load(w_ptr + e * N * (K // 2) + offs_n[:, None] * (K // 2) + j[None, :],
                             mask=n_ok[:, None] & (j < K // 2)[None, :], other=8)  # fmt: skip
            scales = _group_scales(s_ptr, e, offs_n, n_ok, k0, N, K, GROUP, BLOCK_K)  # (BLOCK_N, BLOCK_K / 2)
            low = ((bytes_ & 15).to(tl.float32) - 8.0) * scales
            high = ((bytes_ >> 4).to(tl.float32) - 8.0) * scales
            x_even, x_odd = tl.split(tl.reshape(x, (x.shape[0], BLOCK_K // 2, 2)))  # (BLOCK_M, BLOCK_K / 2) each
            if WIDEN:
                acc = tl.dot(x_even.to(tl.float32), tl.trans(low), acc, input_precision="ieee")
                acc = tl.dot(x_odd.to(tl.float32), tl.trans(high), acc, input_precision="ieee")
            else:
                acc = tl.dot(x_even, tl.trans(low.to(x.dtype)), acc)
                acc = tl.dot(x_odd, tl.trans(high.to(x.dtype)), acc)
        else:
            w = tl.load(w_ptr + e * N * K + offs_n[:, None] * K + offs_k[None, :], mask=n_ok[:, None] & (offs_k < K)[None, :], other=0)
            if WIDEN:
                acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)  # int8 values are exact in 16 bits
        return acc

    @triton.jit
    def _expert_blocks(x_ptr, sorted_ids_ptr, block_experts_ptr, w_ptr, s_ptr, v_ptr, t_ptr, mix_ptr, out_ptr,
                       N, K, PER_ROW, ASSIGNMENTS,
                       KIND: tl.constexpr, GROUP: tl.constexpr, SWIGLU: tl.constexpr, DENSE: tl.constexpr,
                       WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        """Program (m, n): the assignments of block m (``sorted_ids[m * BLOCK_M :]``, one expert's) times
        outputs ``[n * BLOCK_N, (n + 1) * BLOCK_N)`` of that expert's weight; as ``_expert_rows``
        (``DENSE``: rows ``[m * BLOCK_M, (m + 1) * BLOCK_M)`` of x through the one weight, nothing sorted)."""
        m = tl.program_id(0)
        if DENSE:
            e = 0
            ids = m * BLOCK_M + tl.arange(0, BLOCK_M)
        else:
            e = tl.load(block_experts_ptr + m).to(tl.int64)
            ids = tl.load(sorted_ids_ptr + m * BLOCK_M + tl.arange(0, BLOCK_M))
        if e < 0:  # a block past the last expert's run
            return
        row_ok = ids < ASSIGNMENTS
        rows = (ids // PER_ROW).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_v = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc = _block_product(acc, x_ptr, rows, row_ok, w_ptr, s_ptr, e, offs_n, n_ok, k0, N, K, KIND, GROUP, BLOCK_K, WIDEN)
            if SWIGLU:
                acc_v = _block_product(acc_v, x_ptr, rows, row_ok, v_ptr, t_ptr, e, offs_n, n_ok, k0, N, K, KIND, GROUP, BLOCK_K, WIDEN)
        if KIND == 1:  # INT8
            acc *= tl.load(s_ptr + e * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if SWIGLU:
                acc_v *= tl.load(t_ptr + e * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        ok = row_ok[:, None] & n_ok[None, :]
        places = ids.to(tl.int64)[:, None] * N + offs_n[None, :]
        if SWIGLU:
            out = acc / (1.0 + tl.exp(-acc)) * acc_v
            tl.store(out_ptr + places, out.to(out_ptr.dtype.element_ty), mask=ok)
        else:
            if not DENSE:
                acc *= tl.load(mix_ptr + ids, mask=row_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr + places, acc.to(out_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------------
# Launching them.

FEW_ROWS = 4  # a dense weight (one "expert") is read by a matrix-vector product per row below this many rows

# The block sizes and warps each kernel is tried with on a GPU: the fastest is kept per shape
# (``triton.autotune``, measured on the machine it runs on at the first call of a shape, kept on disk
# where the installed Triton can). The first is what runs under the interpreter, and sets ``split_k``.
ROWS_CONFIGS = (
    {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4},
    {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4},
    {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 8},
    {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4},
)
BLOCKS_CONFIGS = (
    {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
    {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
)
ROWS_BLOCK_N, ROWS_BLOCK_K = ROWS_CONFIGS[0]["BLOCK_N"], ROWS_CONFIGS[0]["BLOCK_K"]
_LAUNCH_OPTIONS = ("num_warps", "num_stages")


@functools.lru_cache(maxsize=None)
def _tuned(name: str):
    """The kernel ``name`` (``"rows"``, ``"blocks"``) under ``triton.autotune`` over its configurations,
    keyed by the shape (and the split, or the rows a block): built on first use, on a GPU only."""
    kernel, configs, keys = {
        "rows": (_expert_rows, ROWS_CONFIGS, ["N", "K", "SPLIT_K"]),
        "blocks": (_expert_blocks, BLOCKS_CONFIGS, ["N", "K", "BLOCK_M"]),
    }[name]
    options = {"reset_to_zero": ["out_ptr"]} if name == "rows" else {}  # split-K adds into its output
    if "cache_results" in inspect.signature(triton.autotune).parameters:
        options["cache_results"] = True
    tried = [triton.Config({k: v for k, v in c.items() if k not in _LAUNCH_OPTIONS},
                           **{k: v for k, v in c.items() if k in _LAUNCH_OPTIONS}) for c in configs]  # fmt: skip
    return triton.autotune(tried, key=keys, **options)(kernel)


def _run(name: str, grid_of, args: tuple, constants: dict, config: Optional[dict]) -> None:
    """Kernel ``name`` on ``args``: with ``config`` (block sizes and warps) where given or under the
    interpreter (the first configuration), else the autotuned one. ``grid_of(BLOCK_N)``: its grid."""
    if config is None and not interpreting():
        _tuned(name)[lambda meta: grid_of(meta["BLOCK_N"])](*args, **constants)
        return
    config = config or (ROWS_CONFIGS if name == "rows" else BLOCKS_CONFIGS)[0]
    kernel = _expert_rows if name == "rows" else _expert_blocks
    kernel[grid_of(config["BLOCK_N"])](*args, **constants, **config)


def block_m(assignments: int, n_experts: int) -> int:
    """Rows a block of the grouped product holds: the rows an expert gets on average, at least 16
    (``tl.dot``'s smallest) and at most 64."""
    return min(64, max(16, triton.next_power_of_2(-(-assignments // n_experts))))


def split_k(assignments: int, n: int, k: int, device: torch.device) -> int:
    """Parts a matrix-vector product's inputs are split in: enough programs to give each of the
    device's multiprocessors four, and no part shorter than 8 blocks of inputs."""
    processors = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    programs = assignments * -(-n // ROWS_BLOCK_N)
    wanted = -(-4 * processors // programs)
    return int(max(1, min(wanted, k // (8 * ROWS_BLOCK_K), 16)))


def _group(k: int, scales: Optional[torch.Tensor], kind: int) -> int:
    return k // scales.shape[-1] if kind == INT4 else 1


def _in_features(weight: torch.Tensor, kind: int) -> int:
    return weight.shape[-1] * (2 if kind == INT4 else 1)


def matrix_vector(assignments: int, n_experts: int) -> bool:
    """Whether ``_launch`` runs the matrix-vector kernel (else the grouped product): for fewer
    assignments than experts, or than ``FEW_ROWS``."""
    return assignments < max(n_experts, FEW_ROWS)


def _launch(x, experts, w, s, v, t, mix, out, kind: int, swiglu: bool, per_row: int, parts: Optional[int] = None,
            config: Optional[dict] = None) -> None:  # fmt: skip
    """Both kernels' launch: ``_expert_rows`` where ``matrix_vector`` (its inputs split in ``parts``,
    None: ``split_k``'s; ``out`` then zeros unless ``swiglu``), else ``_expert_blocks``; with ``config``
    (one of the kernel's configurations), else as ``_run`` chooses. ``experts`` None: x's rows through
    the one weight ``w (1, N, K)``, nothing mixed."""
    dense = experts is None
    assignments, n_experts, n = x.shape[0] if dense else experts.numel(), w.shape[0], w.shape[1]
    k = _in_features(w, kind)
    group = _group(k, s, kind)
    s = w if s is None else s  # plain weights: the pointers are never read
    v, t = (w, s) if v is None else (v, s if t is None else t)
    mix = out if mix is None else mix  # (nor is mix with swiglu or dense, nor experts when dense)
    experts = x if dense else experts
    if matrix_vector(assignments, n_experts):
        parts = 1 if swiglu else parts or split_k(assignments, n, k, x.device)
        args = (x, experts, w, s, v, t, mix, out, n, k, per_row)
        constants = {"KIND": kind, "GROUP": group, "SWIGLU": swiglu, "DENSE": dense, "SPLIT_K": parts}
        _run("rows", lambda block_n: (assignments, triton.cdiv(n, block_n), parts), args, constants, config)
        return
    rows_a_block = block_m(assignments, n_experts)
    if dense:
        sorted_ids = block_experts = x  # not read
        blocks = triton.cdiv(assignments, rows_a_block)
    else:
        sorted_ids, block_experts = blocks_by_expert(experts, n_experts, rows_a_block)
        blocks = block_experts.numel()
    args = (x, sorted_ids, block_experts, w, s, v, t, mix, out, n, k, per_row, assignments)
    constants = {"KIND": kind, "GROUP": group, "SWIGLU": swiglu, "DENSE": dense,
                 "WIDEN": interpreting() or x.dtype == torch.float32, "BLOCK_M": rows_a_block}  # fmt: skip
    _run("blocks", lambda block_n: (blocks, triton.cdiv(n, block_n)), args, constants, config)


def _chosen_swiglu(x, experts, w1, s1, w3, s3, kind: int) -> torch.Tensor:
    if not runs_kernels(x.device):
        return reference_swiglu(x, experts, w1, s1, w3, s3, kind)
    out = torch.empty(experts.numel(), w1.shape[1], dtype=x.dtype, device=x.device)
    _launch(x.contiguous(), experts.contiguous(), w1, s1, w3, s3, None, out, kind, True, experts.numel() // x.shape[0])
    return out


def _chosen_down(h, experts, w2, s2, mix, kind: int) -> torch.Tensor:
    if not runs_kernels(h.device):
        return reference_down(h, experts, w2, s2, mix, kind)
    fill = torch.zeros if matrix_vector(experts.numel(), w2.shape[0]) else torch.empty  # split-K adds into zeros
    out = fill(experts.numel(), w2.shape[1], dtype=torch.float32, device=h.device)
    _launch(h.contiguous(), experts.contiguous(), w2, s2, None, None, mix.contiguous(), out, kind, False, 1)
    return out


def _dense_rows(x, w, s, kind: int) -> torch.Tensor:
    if not runs_kernels(x.device):
        return F.linear(x, dequantized(w, s, kind, x.dtype))
    rows = x.shape[0]
    if matrix_vector(rows, 1):  # split-K: float32 parts added into zeros
        out = torch.zeros(rows, w.shape[0], dtype=torch.float32, device=x.device)
    else:  # the grouped product writes each output once, in x's dtype
        out = torch.empty(rows, w.shape[0], dtype=x.dtype, device=x.device)
    _launch(x.contiguous(), None, w[None], None if s is None else s[None], None, None, None, out, kind, False, 1)
    return out.to(x.dtype)


_LIBRARY = torch.library.Library("mixtral_infer", "FRAGMENT")
_LIBRARY.define("dense_rows(Tensor x, Tensor w, Tensor? s, int kind) -> Tensor")
_LIBRARY.define("chosen_swiglu(Tensor x, Tensor experts, Tensor w1, Tensor? s1, Tensor w3, Tensor? s3, int kind) -> Tensor")
_LIBRARY.define("chosen_down(Tensor h, Tensor experts, Tensor w2, Tensor? s2, Tensor mix, int kind) -> Tensor")
for _device in ("CPU", "CUDA"):
    _LIBRARY.impl("chosen_swiglu", _chosen_swiglu, _device)
    _LIBRARY.impl("chosen_down", _chosen_down, _device)
    _LIBRARY.impl("dense_rows", _dense_rows, _device)


@torch.library.register_fake("mixtral_infer::dense_rows")
def _(x, w, s, kind):
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.register_fake("mixtral_infer::chosen_swiglu")
def _(x, experts, w1, s1, w3, s3, kind):
    return x.new_empty(experts.numel(), w1.shape[1])


@torch.library.register_fake("mixtral_infer::chosen_down")
def _(h, experts, w2, s2, mix, kind):
    return h.new_empty(experts.numel(), w2.shape[1], dtype=torch.float32)


def chosen_swiglu(x: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor, s1: Optional[torch.Tensor],
                  w3: torch.Tensor, s3: Optional[torch.Tensor], kind: int) -> torch.Tensor:  # fmt: skip
    """``silu(x w1ᵀ) * (x w3ᵀ)`` for each assignment: row ``a // k`` of x ``(T, K)`` through expert
    ``experts[a]`` of ``experts (T*k,)``; weights and scales of ``kind`` (module docstring): ``(T*k, I)``
    in x's dtype."""
    return torch.ops.mixtral_infer.chosen_swiglu(x, experts, w1, s1, w3, s3, kind)


def chosen_down(h: torch.Tensor, experts: torch.Tensor, w2: torch.Tensor, s2: Optional[torch.Tensor],
                mix: torch.Tensor, kind: int) -> torch.Tensor:  # fmt: skip
    """Row a of h ``(A, I)`` through expert ``experts[a]`` of w2, times ``mix[a]``: ``(A, D)`` in float32."""
    return torch.ops.mixtral_infer.chosen_down(h, experts, w2, s2, mix, kind)


def mixture(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w1, s1, w3, s3, w2, s2, kind: int) -> torch.Tensor:
    """The mixture of experts on x ``(T, D)`` given each token's chosen ``experts (T, k)`` and their
    mixing ``weights (T, k)``: two launches, ``(T, D)`` in x's dtype."""
    flat = experts.reshape(-1)  # (T*k,) token t's assignments are t*k .. t*k + k - 1
    hidden = chosen_swiglu(x, flat, w1, s1, w3, s3, kind)  # (T*k, I)
    out = chosen_down(hidden, flat, w2, s2, weights.reshape(-1), kind)  # (T*k, D) float32, mixed
    return out.view(*experts.shape, -1).sum(1).to(x.dtype)  # (T, D)


def dense_rows(x: torch.Tensor, w: torch.Tensor, s: Optional[torch.Tensor], kind: int) -> torch.Tensor:
    """``x (M, K)`` times one weight ``w (N, K)`` of ``kind`` with its scales ``s``, read where it lies as
    the experts are (a matrix-vector product per row below ``FEW_ROWS`` rows, the grouped product's
    blocks beyond): ``(M, N)`` in x's dtype."""
    return torch.ops.mixtral_infer.dense_rows(x, w, s, kind)
