"""Weight-only quantization: integer weights that carry their format and scales.

Decoding reads every weight once per token, so a weight stored in 8 or 4 bits is read
2x or 4x faster than in bfloat16. Only the weights are quantized; activations, the
embeddings, the norms and the MoE router stay in the model's dtype (except with ``w8a8``:
int8 weights whose CPU products quantize their activations too, ``kernels/linear/w8a8.py``).

Three schemes, all symmetric (zero maps to zero):

* **int8**, one scale per output row: ``w[o, i] ~= q[o, i] * scale[o]``, ``q`` in
  [-127, 127], ``scale[o] = max_i |w[o, i]| / 127``.
* **int4**, one scale per group of ``group_size`` consecutive inputs of a row:
  ``w[o, i] ~= (n[o, i] - 8) * scale[o, i // G]``, ``n`` in [1, 15], ``scale = max |w| / 7``
  over the group. Two values per byte: byte ``j`` of a row holds input ``2j`` in its low
  nibble and input ``2j + 1`` in its high nibble (the *plain* layout, written to disk).
* **nf4**, as int4 but the 16 values are QLoRA's NormalFloat code and the scale is the group's
  largest magnitude: ``w[o, i] ~= NF4[n[o, i]] * scale[o, i // G]`` (``quant/nf4.py``).

Scales are rounded to bfloat16 *before* the integers are chosen, so the scale a file
stores is the scale the integers were rounded with.

Worked example, int4, G = 4, one row ``w = [0.7, -0.35, 0.1, 0.0]``: scale = 0.7 / 7 = 0.1
(bfloat16 0.10009765625), ``n - 8 = round(w / scale) = [7, -3, 1, 0]``, ``n = [15, 5, 9, 8]``,
bytes ``[15 | 5 << 4, 9 | 8 << 4] = [95, 137]``; dequantized ``[0.7007, -0.3003, 0.1001, 0.0]``.

The matrix products are the weight back-ends of ``kernels/linear/`` (``int8.py``, ``int4.py``,
``nf4.py``... say which kernels and why); ``QuantizedWeight.dequantize`` is the readable reference
they are tested against.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from mixtral_infer.errors import CheckpointError
from mixtral_infer.fast import int4_inline
from mixtral_infer.fast.cpu_column_blocks import ColumnBlocks
from mixtral_infer.quant import nf4
from mixtral_infer.quant.scheme import QuantScheme

SCALE_DTYPE = torch.bfloat16  # scales are bfloat16 numbers, whatever dtype holds them


class QuantizedWeight:
    """A weight ``(..., OUT, IN)`` stored as integers and scales; ``linear(x, weight)`` takes it.

    ``values``: int8 ``(..., OUT, IN)``, or for int4 and nf4 uint8 ``(..., OUT, IN/2)`` in the plain
    layout. ``scales``: ``(..., OUT)`` for int8, ``(..., OUT, IN/G)`` for int4 and nf4, in the dtype
    of the activations. Leading dimensions are stacked experts: ``weight[e]`` is expert e
    (views for an int ``e``), a plain object that compiled code can make.

    A kernel may want its own layout (its back-end's ``prepare``, ``kernels.linear.prepare_weight``): it is kept in ``packed``
    (not saved), and ``values`` may then be dropped to save memory (``values is None``).

    ``expert``: on CPU, ``weight[e]`` for a 0-d tensor ``e`` (compiled code's expert index)
    keeps the stacked tensors and ``expert = e`` instead of gathering a copy of one expert:
    the CPU kernels' ops read ``e`` and multiply by that expert's views (``kernels.linear``).
    ``resolved()`` gives the gathered weight, which everything else uses.
    """

    expert: Optional[torch.Tensor] = None  # see the docstring; QuantizedParameter never has one
    prepacked = None  # w8a8 on CPU: a fast.cpu_packed.PackedWeight in fbgemm's layout (kernels.linear.w8a8)
    # nf4 weights joined side by side (kernels.linear.nf4.join_side_by_side): on the group's first weight,
    # ``joined = (bytes, scales)`` of all its weights in the kernel's layout; on each weight,
    # ``joined_rows = (start, stop, total)``, its rows among them (its own ``packed`` is a view).
    joined: Optional[tuple] = None
    joined_rows: Optional[tuple] = None
    # int8/int4 on CUDA where GemLite is installed: a kernels.linear.gemlite.GemliteProduct (its packed layer)
    gemlite = None

    def __init__(self, scheme: QuantScheme, values: Optional[torch.Tensor], scales: torch.Tensor, in_features: int,
                 packed: Optional[tuple] = None, expert: Optional[torch.Tensor] = None, prepacked=None):  # fmt: skip
        self.scheme, self.in_features = scheme, in_features
        self.values, self.scales, self.packed = values, scales, packed
        if expert is not None:
            self.expert = expert
        if prepacked is not None:
            self.prepacked = prepacked

    @property
    def shape(self) -> torch.Size:
        stacked = self.scales.shape[: -1 if self.scheme.four_bit else None]
        return torch.Size((*stacked[0 if self.expert is None else 1 :], self.in_features))

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def device(self) -> torch.device:
        return self.scales.device

    def __getitem__(self, index) -> "QuantizedWeight":
        """Expert ``index`` of stacked weights: an int gives views; a 0-d tensor a gathered copy,
        or on CPU the stacked weights with ``expert = index`` (class docstring)."""
        if self.expert is not None:
            raise IndexError("this weight is already one expert")
        prepacked = None if self.prepacked is None else self.prepacked[index]
        if isinstance(index, torch.Tensor):
            if self.device.type == "cpu":
                weight = QuantizedWeight(self.scheme, self.values, self.scales, self.in_features, self.packed, index,
                                         prepacked)  # fmt: skip
                return self._with_joined(weight, self.joined)
            return self._gathered(index)
        packed = None if self.packed is None else tuple(t[index] for t in self.packed)
        values = None if self.values is None else self.values[index]
        weight = QuantizedWeight(self.scheme, values, self.scales[index], self.in_features, packed, prepacked=prepacked)
        return self._with_joined(weight, None if self.joined is None else tuple(t[index] for t in self.joined))

    def _with_joined(self, weight: "QuantizedWeight", joined: Optional[tuple]) -> "QuantizedWeight":
        """``weight`` (an expert of this one) with this weight's place among joined weights."""
        if self.joined_rows is not None:
            weight.joined, weight.joined_rows = joined, self.joined_rows
        return weight

    def resolved(self) -> "QuantizedWeight":
        """This weight with its own tensors: ``self``, or the gathered copy of its ``expert``."""
        return self if self.expert is None else self._gathered(self.expert)

    def _gathered(self, index: torch.Tensor) -> "QuantizedWeight":
        """A copy of expert ``index`` (0-d tensor), indexed as a 1-element list: this compiles
        without reading the tensor on the host."""

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t[index.reshape(1)][0]

        values = None if self.values is None else pick(self.values)
        if values is None and self.prepacked is not None:  # int8 weights held only by fbgemm
            values = self.prepacked.dense() if self.prepacked.expert is not None else self.prepacked[index].dense()
        packed = None if self.packed is None else tuple(pick(t) for t in self.packed)
        return QuantizedWeight(self.scheme, values, pick(self.scales), self.in_features, packed)

    def integers(self) -> torch.Tensor:
        """The integers ``(..., OUT, IN)``: int8 as stored, int4 unpacked to [-8, 7], nf4's codes [0, 15]."""
        if self.expert is not None:
            return self.resolved().integers()
        if self.values is None and self.prepacked is not None:  # fbgemm's matrices give their integers back
            return self.prepacked.dense().to(self.device)  # (on CPU; the scales may have moved with the model)
        if self.values is None and self.scheme.name == "int8" and self.packed is not None:
            return ColumnBlocks(self.packed[0]).dense()  # int8 in column blocks (fast.cpu_column_blocks)
        if self.values is None and self.scheme.name == "nf4" and self.packed is not None:  # bitsandbytes' layouts
            layout = nf4.cuda_layout if nf4.held_layout(self.packed) == "cuda" else nf4.plain_layout
            return nf4.nibbles(layout(self.packed[0])).to(torch.int8)
        values = self.values
        if values is None and self.holds_inline_scales():  # the CPU integer dot products' rows
            values = int4_inline.plain_values(self.packed[0], self.in_features, self.scheme.group_size)
        if values is None:
            raise RuntimeError("this weight holds only its kernel layout; quantize again to get the integers")
        if self.scheme.name == "int8":
            return values
        codes = nf4.nibbles(values).to(torch.int8)  # (..., OUT, IN): inputs 2j, 2j+1 side by side
        return codes if self.scheme.name == "nf4" else codes - 8

    def holds_inline_scales(self) -> bool:
        """Whether ``packed`` holds int4 rows with their scales inline (``fast.int4_inline``, what the
        CPU's integer dot products read): ``(rows (..., OUT, bytes) uint8, scales (..., OUT, IN/G))``,
        where int4's CPU kernel layout has its scales as ``(..., IN/G, OUT, 2)``."""
        packed = self.packed
        return (
            self.scheme.name == "int4" and packed is not None and packed[0].dtype == torch.uint8
            and packed[1].dim() == packed[0].dim()
        )  # fmt: skip

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The readable reference: the weight ``(..., OUT, IN)`` these integers and scales stand for."""
        if self.expert is not None:
            return self.resolved().dequantize(dtype)
        q = self.integers().to(torch.float32)
        scales = self.scales.to(torch.float32)
        if self.scheme.name == "int8":
            return (q * scales[..., None]).to(dtype)
        if self.scheme.name == "nf4":
            q = nf4.code_values(q.device)[q.long()]  # (..., OUT, IN): the codes' values
        groups = scales.repeat_interleave(self.scheme.group_size, dim=-1)  # (..., OUT, IN)
        return (q * groups).to(dtype)


class QuantizedParameter(nn.Module, QuantizedWeight):
    """A ``QuantizedWeight`` held by a model in place of an ``nn.Parameter``: its tensors are
    buffers, so ``model.to(...)`` and ``state_dict()`` see them (``X.values``, ``X.scales``)."""

    def __init__(self, weight: QuantizedWeight):
        nn.Module.__init__(self)
        self.scheme, self.in_features = weight.scheme, weight.in_features
        self.register_buffer("values", weight.values)
        self.register_buffer("scales", weight.scales)
        kernel_values, kernel_scales = weight.packed or (None, None)
        self.register_buffer("kernel_values", kernel_values, persistent=False)
        self.register_buffer("kernel_scales", kernel_scales, persistent=False)
        self.prepacked = weight.prepacked
        self.gemlite = weight.gemlite
        self.register_buffer("joined_values", None, persistent=False)
        self.register_buffer("joined_scales", None, persistent=False)

    @property
    def packed(self) -> Optional[tuple]:
        return None if self.kernel_values is None else (self.kernel_values, self.kernel_scales)

    @property
    def joined(self) -> Optional[tuple]:
        return None if self.joined_values is None else (self.joined_values, self.joined_scales)

    def extra_repr(self) -> str:
        size = f", group_size={self.scheme.group_size}" if self.scheme.group_size else ""
        return f"{self.scheme.name}{size}, shape={tuple(self.shape)}, dtype={self.dtype}"


def quantize(weight: torch.Tensor, scheme: QuantScheme, dtype: Optional[torch.dtype] = None,
             name: str = "the weight") -> QuantizedWeight:  # fmt: skip
    """Quantize a float weight ``(..., OUT, IN)`` (see the module docstring); scales in ``dtype``.

    Rows are quantized a block at a time, so the float32 working copies stay small
    (1 MB) however large the weight: loading quantizes a model in little more memory
    than its quantized size. A weight holding NaN or inf is refused (CheckpointError naming
    ``name``): its row's or group's scale would be NaN or inf, every product of it garbage.
    """
    scheme.check_shape("weight", tuple(weight.shape))
    out_dtype = dtype or (weight.dtype if weight.is_floating_point() else torch.float32)
    rows = weight.reshape(-1, weight.shape[-1])  # (R, IN): every output row of every expert
    # The results are allocated first and filled block by block: the working copies, freed
    # after each block, then leave no holes between the tensors the model keeps.
    packed_in = weight.shape[-1] // (2 if scheme.four_bit else 1)
    values = torch.empty(rows.shape[0], packed_in, dtype=torch.int8 if scheme.name == "int8" else torch.uint8, device=weight.device)
    n_scales = 1 if scheme.name == "int8" else weight.shape[-1] // scheme.group_size
    scales = torch.empty(rows.shape[0], n_scales, dtype=out_dtype, device=weight.device)
    block = max(1, (1 << 18) // weight.shape[-1])  # 256K float32 values (1 MB) per block
    largest = torch.zeros((), device=weight.device)  # the largest float32 scale; NaN where a block held NaN
    for start in range(0, rows.shape[0], block):
        block_values, block_scales = _quantize_rows(rows[start : start + block].to(torch.float32, copy=True), scheme)
        values[start : start + block] = block_values
        scales[start : start + block] = block_scales.reshape(block_values.shape[0], n_scales)
        largest = torch.maximum(largest, block_scales.amax())  # NaN carries through
    check_scales_fit(name, float(largest), scheme, out_dtype, "use dtype bfloat16 or float32")
    scales = scales.reshape(weight.shape[:-1]) if scheme.name == "int8" else scales.reshape(*weight.shape[:-1], n_scales)
    return QuantizedWeight(scheme, values.reshape(*weight.shape[:-1], packed_in), scales, weight.shape[-1])


LARGEST_CODE = {"int8": 127, "int4": 8, "nf4": 1}  # the largest |integer| a scale multiplies (nf4's codes span [-1, 1])


def check_scales_fit(name: str, largest: float, scheme: QuantScheme, dtype: torch.dtype, remedy: str) -> None:
    """CheckpointError where the scales of ``name``, the largest ``largest``, are NaN or inf (a weight
    holding NaN or inf keeps it in its row's or group's scale, which would make every product of it
    garbage), or where a weight they stand for passes ``dtype``'s range (float16: 65504; an int8
    weight of 1e6 has a scale of 7874, finite in float16, but 127 times it is not)."""
    if not math.isfinite(largest):
        raise CheckpointError(f"{name} holds NaN or infinite values: the checkpoint is damaged, so it cannot be quantized")
    weights = largest * LARGEST_CODE[scheme.name]
    if weights > torch.finfo(dtype).max:
        raise CheckpointError(f"{name} holds values beyond {dtype}'s range (up to {weights:.3g}): {remedy}")


def _quantize_rows(w: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Integers and float32 scales of float32 rows ``(R, IN)`` (overwritten: no working copies)."""
    if scheme.name == "int8":
        scales = _bfloat16_scale(w.abs().amax(dim=-1) / 127)  # (R,)
        return w.div_(scales[:, None]).round_().clamp_(-127, 127).to(torch.int8), scales
    groups = w.unflatten(-1, (-1, scheme.group_size))  # (R, IN/G, G)
    if scheme.name == "nf4":
        scales = _bfloat16_scale(groups.abs().amax(dim=-1))  # (R, IN/G): NF4 spans [-1, 1]
        n = nf4.nearest_codes(groups.div_(scales[..., None])).flatten(-2)  # (R, IN)
        return n[:, 0::2] | (n[:, 1::2] << 4), scales
    scales = _bfloat16_scale(groups.abs().amax(dim=-1) / 7)  # (R, IN/G)
    n = groups.div_(scales[..., None]).round_().clamp_(-8, 7).add_(8).to(torch.uint8).flatten(-2)  # (R, IN)
    return n[:, 0::2] | (n[:, 1::2] << 4), scales  # (R, IN/2): inputs 2j and 2j+1 in one byte


def _bfloat16_scale(scale: torch.Tensor) -> torch.Tensor:
    """Round to bfloat16 (as stored), and keep all-zero rows or groups from dividing by zero. A row
    or group holding NaN or inf keeps its NaN or inf scale, for ``quantize`` to refuse by name,
    rather than a scale of 1 that would zero its weights."""
    scale = scale.to(SCALE_DTYPE).to(torch.float32)
    return torch.where(scale != 0, scale, torch.ones_like(scale))
