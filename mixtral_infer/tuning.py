"""What the fast paths do, as one object passed in: ``Tuning``.

``load_model(..., fast=True)`` swaps fast modules in for the reference's (``formats.modules``);
``fast=False``, or ``MIXTRAL_INFER_REFERENCE=1`` in the environment, keeps the readable
reference everywhere: plain ``F.linear``, SDPA attention, eager decoding. Quantized weights then
run as ``dequantize`` followed by ``F.linear``.

Every other field says how a fast path computes, never what: each choice gives the reference's
numbers (to the rounding of the dtype) either way; ``int_dots`` alone quantizes activations too, within
a stated bound. A ``Tuning()`` holds safe defaults, the same on
every machine. ``load_model`` gives a model the tuning of the machine it runs on
(``formats.measured.machine_tuning``): the choices that depend on the machine measured once there and
kept on disk. Tests and benches pass one of their own (``load_model(..., tuning=...)``,
``formats.modules.use_formats(model, tuning)``, ``make_decode_step(..., tuning=...)``).

The compiled steps read the fields when they are traced: a step built for one tuning keeps it.

Example: ``dataclasses.replace(tuning_of(model), streams=2)`` given to ``use_formats`` makes the
next compiled step read each weight in 2 places; its products are the same bits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Collection, Optional, Tuple

import torch
import torch.utils._pytree as pytree

REFERENCE_VARIABLE = "MIXTRAL_INFER_REFERENCE"
WIDE_DTYPES: Tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)  # what ``upcast`` may hold


@dataclass(frozen=True)
class Tuning:
    """What the fast paths do. Defaults: safe on any machine, measured nowhere."""

    # Swap in the fast modules and kernels; False: the reference path everywhere.
    fast: bool = True

    # Op by op, float32 products of a few rows on CPU: one ``bmm`` block of output rows per thread
    # (``kernels.linear``), for a library whose few-row product runs on one core; False: ``F.linear``.
    few_row_blocks: bool = False
    # Op by op, float32 products of up to 8 rows on x86 CPUs through the package's own kernel
    # (``kernels/float_dots.cpp``: the weight read once for all the rows), ahead of ``few_row_blocks``;
    # and plain float32 experts on up to 8 rows through its experts operator, eager and in compiled
    # steps (``kernels.moe.float_experts``). The machine's tuning turns it on where the library builds
    # and it measures faster (``formats.measured``).
    float_dots: bool = False
    # Op by op, bfloat16 products of up to 8 rows of plain (unpacked) weights on x86 CPUs through the
    # same kernel (``float_dots.cpp``'s ``bfloat16_dots``: each weight widened in registers, float32
    # sums, each output rounded once), where the library multiplies them under the speed of reading
    # them (a CPU without bfloat16 arithmetic). Measured as ``float_dots`` is, where a bfloat16 model loads on CPU.
    bfloat16_dots: bool = False
    # Compiled few-row products on CPU read a weight's rows in up to this many places at once, one
    # reduction each (``fast.cpu_reductions.row_sums``): more reads in flight where one stream per
    # core does not fill the memory's bandwidth, fewer where more places read slower.
    streams: int = 8
    # The same for a Mixtral's chosen experts, whose products inductor fuses into shared loops
    # (``kernels.moe.one_by_one.experts_one_by_one``); None: ``streams``.
    expert_streams: Optional[int] = None
    # Prompt-sized float32 products on CPU by oneDNN instead of MKL (``fast.cpu_float32``).
    onednn_float32: bool = False
    # 16-bit dtypes whose prompt-sized CPU products are computed in float32 (``fast.cpu_upcast``);
    # any collection of them, kept as a tuple in ``WIDE_DTYPES``' order.
    upcast: Tuple[torch.dtype, ...] = ()

    # Compiled steps trace a block once and call its code for every layer (``decode_step.in_regions``).
    regions: bool = True
    # On CPU the compiled step is built by AOTInductor (``steps.cpu_aot_step``); False: torch.compile.
    ahead_of_time: bool = True
    # Plain experts of at least this many weights a matrix go one by one on CPU, each product a
    # reduction (``kernels.moe.strategy``); smaller ones stay one gathered product.
    one_by_one_min_weights: int = 1 << 20
    # On CPU the chosen experts are read while the assignments ``B * k`` are at most this many times
    # the experts ``E``, every expert on every row beyond (0: only while ``B * k < E``): quantized
    # experts; large plain float32 and float16 ones; large plain bfloat16 ones.
    chosen_up_to_quantized: int = 2
    chosen_up_to_plain: int = 2
    chosen_up_to_bfloat16: int = 1
    # Where every expert would run on every row (``B * k >= E``), plain bfloat16 experts run as one grouped
    # product per projection instead (``kernels.moe.grouped``, ``torch._grouped_mm``): each
    # expert's weights read once and only its rows computed. On CPU with ``ahead_of_time``, torch
    # 2.13's AOTInductor cannot call the grouped product: set ``ahead_of_time=False`` with it there.
    grouped_experts: bool = False
    # The chosen int8 experts of a decode step (``B * k < E``) read as one gathered product per
    # projection, dequantized where they are read (``kernels.moe.gathered``: compiled, the gather,
    # the scales and the product are one reduction over the int8 rows), instead of one quantized
    # kernel per chosen expert on a gathered copy of its weights; needs the experts' plain int8 values.
    gathered_int8_experts: bool = False
    # Mixtral's experts (decode steps and prompt chunks) through two Triton kernels
    # (``kernels.moe.triton_mixture``, ``fast.triton_experts``): the chosen experts' plain, int8 or
    # int4 weights read once, in place, dequantized where they are read; a matrix-vector product per
    # assignment while ``B * k < E``, a grouped product over the assignments sorted by expert beyond.
    # On CUDA (on CPU under Triton's interpreter, for the tests); ahead of the two above.
    triton_experts: bool = False
    # Quantized int8 and int4 products of at most ``TRITON_DENSE_ROWS`` rows (decoding) through the same
    # kernels, the weight as one expert (``kernels.linear.triton``), ahead of GemLite and PyTorch's
    # kernels. Off by default; docs/performance.md says where it was measured, and how
    # (``bench/bench_gpu.py --triton-dense``).
    triton_dense: bool = False

    # int8 and int4 products on x86 CPUs through the package's integer dot products
    # (``kernels.linear.int_dots``): the activations quantized to int8 per block of 32, as llama.cpp's
    # Q8_0 and Q4_0 products do. The one field that moves the numbers, within the bound that back-end
    # states (``activation_error_bound``); the machine's tuning turns it on where it measures faster.
    int_dots: bool = False
    # With ``int_dots``: int8 prompt chunks of ``DOTS_ROWS`` rows or more through the integer dot
    # products too (the kernel's panels), else through int8's weight-only prompt path (dequantized, then
    # the float product, which a CPU with AMX multiplies fast); the machine's tuning measures which.
    int_dots_prompts: bool = True

    # GemLite (CUDA) asked for float32 outputs, converted by the compiled step where they are read
    # (``kernels.linear.gemlite``, "Outputs"); read when weights are packed for it. Off by default
    # (docs/performance.md, GemLite).
    gemlite_float32_outputs: bool = False

    def __post_init__(self) -> None:
        if self.streams < 1 or (self.expert_streams is not None and self.expert_streams < 1):
            raise ValueError(f"streams={self.streams}, expert_streams={self.expert_streams}: at least 1 place")
        if any(dtype not in WIDE_DTYPES for dtype in self.upcast):
            raise ValueError(f"upcast={tuple(self.upcast)}: only 16-bit float dtypes are widened")
        object.__setattr__(self, "upcast", widened(self.upcast))

    @classmethod
    def default(cls, fast: Optional[bool] = None) -> "Tuning":
        """The safe defaults, fast unless told (``fast``) or ``MIXTRAL_INFER_REFERENCE=1``."""
        if fast is None:
            fast = os.environ.get(REFERENCE_VARIABLE, "") not in ("1", "true", "yes")
        return cls(fast=fast)

    def for_experts(self) -> "Tuning":
        """This tuning for the chosen experts' products: read in ``expert_streams`` places."""
        if self.expert_streams is None or self.expert_streams == self.streams:
            return self
        return replace(self, streams=self.expert_streams)


def widened(dtypes: Collection[torch.dtype]) -> Tuple[torch.dtype, ...]:
    """``dtypes`` as ``Tuning.upcast`` keeps them: a tuple in ``WIDE_DTYPES``' order, so that two
    tunings that widen the same dtypes are equal."""
    return tuple(dtype for dtype in WIDE_DTYPES if dtype in dtypes)


# A compiled step takes its Tuning as an argument of each block's region (``steps.decode_step``):
# registered as a pytree of constants (its fields), a region is traced once and reused for every
# layer, as for its tensor and number arguments. An older torch without it writes blocks out.
if hasattr(pytree, "register_dataclass") and Tuning not in pytree.SUPPORTED_NODES:
    pytree.register_dataclass(Tuning)
