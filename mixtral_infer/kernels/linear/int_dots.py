"""int8 and int4 weights on x86 CPUs through integer dot products (``kernels/int_dots.cpp``).

Every other CPU product of quantized weights converts each weight to a float and multiplies in
floating point, so decoding is bound by arithmetic, not by reading the weights. Here, as in
llama.cpp's Q8_0 and Q4_0 products, each activation row is quantized to int8 per block of 32 inputs
(``d = max|x| / 127``, ``q = round(x / d)``), multiplied by the weight's stored bytes in integers
(int4 nibbles unpacked in registers; VNNI's ``vpdpbusd`` or AVX2's pairwise products, whichever the
CPU has: ``kernels.native`` compiles the source for it), summed in 32 bits and scaled once a block.
int8 weights stay as ``quant.weights`` stores them, with one scale a row; int4 weights, one scale a group
(of a multiple of 32 inputs), are laid out with their scales inline (``fast.int4_inline``: a row read
is then one stream of memory), the plain values dropped. A row's numbers never depend on the other
rows of its batch.

**What it changes**: the activations lose what int8 per block of 32 cannot hold, at most half a step
``d / 2`` each, so a product moves by at most ``sum_blocks d / 2 * sum |w|`` from the weight-only one
(``activation_error_bound``, the bound the tests check); docs/quantization.md has the perplexities.
It is used where ``Tuning.int_dots`` says (the machine's tuning turns it on where the library builds
and measures faster, ``formats.measured``); ``MIXTRAL_INFER_NATIVE=0`` keeps weight-only products.

* **Any number of rows** (decoding, speculative verify passes, prompt chunks): the operators
  ``torch.ops.mixtral_infer_dots.int8_dots`` / ``int4_dots``, eager or compiled (a fake implementation
  each, below); Mixtral's chosen experts read in place, the expert index given to the operator
  (``weight.expert``). Up to 8 rows the kernel reads the weight once for them all; more rows (prompt
  chunks) meet the weight in panels that stay in the core's L2 cache, so it is read from memory once.
* **int8, ``DOTS_ROWS`` rows or more, where the machine measured it faster** (``Tuning.int_dots_prompts``
  False, as a CPU with AMX may): int8's weight-only product (``int8.py``), which dequantizes from there.
  int4's weight-only products are slower at every size measured (docs/performance.md, section 6).

Example: one row ``x = [0.5, -1.0, 0.25, 0, ...]`` (one block of 32, the rest zero) gives
``d = 1 / 127`` and ``q = [64, -127, 32, 0, ...]`` (63.5 rounds to the even 64): an int8 weight row
``[2, 1, -4, ...]`` with scale 0.1 yields ``0.1 * d * (128 - 127 - 128) = -0.1`` to float rounding,
where the weight-only product is ``0.1 * (1 - 1 - 1) = -0.1``; with ``x[0] = 0.51`` instead, ``q[0] = 65``
(64.77) and the product is ``0.1 * (2 * 65 - 127 - 128) / 127 = -0.0984`` against ``-0.098``.
"""

from __future__ import annotations

import torch

from mixtral_infer.fast.int4_inline import inline_scales
from mixtral_infer.kernels import native
from mixtral_infer.kernels.linear.backend import DEFAULT, LinearBackend, laid_out_for
from mixtral_infer.kernels.linear.int4 import Int4Linear
from mixtral_infer.kernels.linear.int8 import Int8Linear
from mixtral_infer.kernels.linear.reference import reference_linear
from mixtral_infer.quant.weights import QuantizedWeight
from mixtral_infer.tuning import Tuning

BLOCK = 32  # inputs per activation scale
DOTS_ROWS = 512  # from this many rows on, int8's weight-only prompt path dequantizes: the choice Tuning.int_dots_prompts makes


def _register_fakes() -> None:
    """Shapes for compiled code: ``(rows, OUT)`` in ``x``'s dtype."""

    @torch.library.register_fake("mixtral_infer_dots::int8_dots")
    def _(x, values, scales, expert=None):
        return x.new_empty(x.shape[0], values.shape[-2])

    @torch.library.register_fake("mixtral_infer_dots::int4_dots")
    def _(x, rows, in_features, group_size, expert=None):
        return x.new_empty(x.shape[0], rows.shape[-2])


def available() -> bool:
    """Whether the operators are loaded (built or read from the cache on the first call), their fake
    implementations registered."""
    global _FAKES
    if not native.loaded():
        return False
    if not _FAKES:
        _register_fakes()
        _FAKES = True
    return True


_FAKES = False


def quantized_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The readable form of the kernel's activation quantization: ``x (M, IN)`` -> ``q (M, IN/32, 32)``
    (integers in float32) and ``d (M, IN/32, 1)``, as the module docstring says (``127 / max`` divided
    once, as the kernel does, so the same integers come out)."""
    blocks = x.float().unflatten(-1, (-1, BLOCK))  # (M, IN/32, 32)
    largest = blocks.abs().amax(-1, keepdim=True)  # (M, IN/32, 1)
    inverse = torch.full_like(largest, 127.0) / largest  # inf for zeros and tiny blocks: their integers 0
    inverse = torch.where(inverse.isinf(), torch.zeros_like(inverse), inverse)
    return torch.round(blocks * inverse), largest / 127


def reference_int_dots(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """What the kernel computes, readably, in float64: the quantized activations times the dequantized
    weight, each block's sum scaled by its ``d``; ``(M, OUT)`` in float64."""
    q, d = quantized_blocks(x)
    w = weight.dequantize(torch.float64).unflatten(-1, (-1, BLOCK))  # (OUT, IN/32, 32)
    return torch.einsum("mbk,obk,mb->mo", q.double(), w, d[..., 0].double())


def activation_error_bound(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """``(M, OUT)``: how far the kernel's product may be from the weight-only one, ``x @ w.T`` in
    exact arithmetic: each activation moves by at most ``d / 2`` of its block."""
    _, d = quantized_blocks(x)  # (M, IN/32, 1)
    w = weight.dequantize(torch.float64).abs().unflatten(-1, (-1, BLOCK)).sum(-1)  # (OUT, IN/32)
    return (d[..., 0].double() / 2) @ w.T


class IntDotsLinear(LinearBackend):
    """int8 and int4 weights through integer dot products on x86 CPUs (module docstring)."""

    devices = ("cpu",)
    inline_int4 = True

    @classmethod
    def wanted(cls, tuning: Tuning) -> bool:
        return tuning.fast and tuning.int_dots and available()

    @classmethod
    def reads(cls, weight: object) -> bool:
        if not isinstance(weight, QuantizedWeight) or weight.prepacked is not None:
            return False
        if weight.scheme.name == "int8":
            return weight.values is not None and weight.values.dtype == torch.int8 and weight.in_features % BLOCK == 0
        if weight.scheme.name == "int4":
            plain = weight.values is not None and weight.packed is None
            fits = weight.in_features % 64 == 0 and weight.scheme.group_size % BLOCK == 0
            return fits and (plain or weight.holds_inline_scales())
        return False

    @classmethod
    def prepare(cls, weight: object, tuning: Tuning, keep_values: bool = False) -> bool:
        """int8: the plain layout is the kernel's. int4: the rows with their scales inline
        (``fast.int4_inline``), the plain values dropped unless ``keep_values``."""
        if not (device_is_cpu(weight) and cls.reads(weight)):
            return False
        if weight.scheme.name == "int4" and weight.packed is None:
            weight.packed = (inline_scales(weight.values, weight.scales, weight.scheme.group_size), weight.scales)
            if not keep_values:
                weight.values = None
        return True

    @classmethod
    def swapped_in(cls, module: torch.nn.Linear, tuning: Tuning) -> None:
        """As every back-end; an int4 weight still in the plain layout (quantized under another tuning)
        is laid out once here, not at every product."""
        super().swapped_in(module, tuning)
        laid_out = laid_out_for(module.weight, cls, tuning)
        if laid_out is not module.weight:
            module.weight = laid_out

    def __setstate__(self, state) -> None:
        """A layer unpickled (``torch.save`` of a model, read in another process): the operators loaded
        there, as choosing this back-end loaded them in the process that saved it, an int4 weight in
        the plain layout (saved by an older version) laid out for them; where they cannot be (the
        reason said once on stderr), or on another device, the weight-only back-end reads the weight,
        laid out for it as loading would have."""
        super().__setstate__(state)
        backend = type(self)
        if not device_is_cpu(self.weight) or not available():  # no compiler, MIXTRAL_INFER_NATIVE=0...
            backend = Int4Linear if self.weight.scheme.name == "int4" else Int8Linear
        self.weight = laid_out_for(self.weight, backend, self.tuning)
        self.__class__ = backend

    @staticmethod
    def product(x: torch.Tensor, weight: QuantizedWeight, tuning: Tuning = DEFAULT) -> torch.Tensor:
        if x.device.type != "cpu":
            return reference_linear(x, weight)
        if weight.scheme.name == "int8":
            if x.shape[0] >= DOTS_ROWS and not tuning.int_dots_prompts:  # the machine measured it faster
                return Int8Linear.product(x, weight, tuning)
            return torch.ops.mixtral_infer_dots.int8_dots(x, weight.values, weight.scales, weight.expert)
        group = weight.scheme.group_size
        if weight.holds_inline_scales():
            rows = weight.packed[0]
        else:  # a bare QuantizedWeight, never laid out (a module's weight is, when it is swapped in)
            stored = torch.bfloat16 if weight.scales.dtype == torch.bfloat16 else torch.float32  # exact, read nothing
            rows = inline_scales(weight.values, weight.scales, group, stored)
        return torch.ops.mixtral_infer_dots.int4_dots(x, rows, weight.in_features, group, weight.expert)


def device_is_cpu(weight: object) -> bool:
    return isinstance(weight, QuantizedWeight) and weight.device.type == "cpu"
