"""Which strategy runs a layer's chosen experts on rows of one token each (decode steps, fixed
shapes): ``MoeStrategy``, chosen once from the layer's weights and the tuning, then per call only by
the call's shape (``B * k`` against ``E``) and device.

Decoding is bound by reading weights. With ``B * k < E`` assignments only the chosen experts
are read (batch 1, top-2 of 8: two experts); with ``B * k >= E`` nearly every expert is needed
anyway (batch 8, top-2 of 8: 7.2 on average), so every expert runs on every row and a routing
matrix, zero where a row did not choose the expert, mixes them: each expert's weights are
read once, as a grouped matmul would. Both are one batched product of plain stacked experts
(``gathered_experts``, ``every_expert_batched``), or loops of fixed length over 2-D weights
through ``linear()`` for quantized or packed experts, whose kernels take one 2-D weight at a
time (``experts_one_by_one``, ``every_expert_one_by_one``).

The chosen experts go one by one on CPU too, where an expert's matrix holds at least
``tuning.one_by_one_min_weights`` weights. Compiled, both forms read the experts where they
lie (the index fused into the loops' loads), but one by one each product is
``cpu_reductions.rows_as_reductions``, whose loop reads a weight in several places at once from
a row widened once, where inductor writes the gathered product as one loop over all chosen
experts' rows, read in one place per core. The step takes longer to compile. Small experts stay
gathered: where the weights sit in the cache, the step's time is its kernels' count. Every
expert on every row stays one batched product on CPU: as products of a few rows one by one, the
step compiles for many minutes. On CUDA the compiled gather is one reduction too.

How far the chosen experts are read beyond ``B * k < E`` is the tuning's, by the experts' kind
(``chosen_up_to_field``): while ``B * k <= up_to * E``. At ``B * k = E`` both forms read E
expert matrices, one row each or B rows each; one row a product costs less arithmetic, and
every expert on a few rows is one batched product that may run far under the bandwidth
(float32, float16), while the chosen ones' products read near it. Large plain bfloat16 experts
(whose batched product may run on matrix units) stop sooner by default.

Example, 4 experts, top-2, large plain float32 experts on CPU (``chosen_up_to_plain = 2``): batch 1
to 4 (2 to 8 assignments, at most 2 * 4) read the chosen experts one by one, batch 5 every expert.

Ahead of all of these, with ``Tuning.triton_experts``, the Triton kernels where they run
(``triton_mixture``); with ``Tuning.float_dots``, plain float32 experts on CPU through the package's
operator, which groups the rows by expert itself (``float_experts``: each chosen expert read once); ahead of the chosen ones, with ``Tuning.gathered_int8_experts``, int8
experts gathered (``gathered_int8_experts``); instead of every expert, with
``Tuning.grouped_experts``, plain bfloat16 experts as grouped products (``grouped_experts``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from mixtral_infer.fast.cpu_column_blocks import ColumnBlocks
from mixtral_infer.fast.cpu_packed import PackedWeight
from mixtral_infer.fast.cpu_reductions import materialized
from mixtral_infer.kernels.moe import float_experts as floats
from mixtral_infer.kernels.moe.every_expert import every_expert_batched
from mixtral_infer.kernels.moe.gathered import gathered_experts, gathered_int8_experts, plain_int8
from mixtral_infer.kernels.moe.grouped import grouped_experts
from mixtral_infer.kernels.moe.one_by_one import every_expert_one_by_one, experts_one_by_one
from mixtral_infer.kernels.moe.triton_mixture import triton_experts_kind, triton_mixture
from mixtral_infer.model.moe import MoeLayer
from mixtral_infer.quant.weights import QuantizedWeight
from mixtral_infer.tuning import Tuning


def chosen_up_to_field(moe: MoeLayer, tuning: Tuning) -> Optional[str]:
    """The field of ``tuning`` that says how far these experts go one by one on CPU (``MoeStrategy``):
    ``"chosen_up_to_quantized"``; ``"chosen_up_to_bfloat16"`` or ``"chosen_up_to_plain"`` (float32,
    float16) for plain experts of at least ``tuning.one_by_one_min_weights`` weights each; None for
    smaller plain experts and oneDNN-packed ones (read gathered / every expert). Read once, when the
    strategy is chosen."""
    if isinstance(moe.w1, QuantizedWeight):
        return "chosen_up_to_quantized"
    if isinstance(moe.w1, PackedWeight) or math.prod(moe.w1.shape[1:]) < tuning.one_by_one_min_weights:
        return None
    return "chosen_up_to_bfloat16" if moe.w1.dtype == torch.bfloat16 else "chosen_up_to_plain"


@dataclass(frozen=True)
class MoeStrategy:
    """How a layer's experts run on rows of one token each, chosen from its weights and a tuning
    (``choose``); ``decode_rows`` picks among these by the call's shape and device."""

    tuning: Tuning  # the tuning the experts' products follow
    triton: bool  # Tuning.triton_experts: the Triton kernels first, where they take the weights and run
    gathered_int8: bool  # Tuning.gathered_int8_experts, and the experts are plain int8 weights
    two_d: bool  # quantized or packed experts: their kernels take one 2-D weight at a time (loops)
    large: bool  # an expert's matrix holds at least Tuning.one_by_one_min_weights weights
    up_to: int  # on CPU the chosen experts are read while B * k <= up_to * E (chosen_up_to_field)
    grouped: bool  # Tuning.grouped_experts, and stacked plain bfloat16 experts
    float_experts: bool  # Tuning.float_dots, plain float32 experts, the operator ready (float_experts.wanted)

    @classmethod
    def choose(cls, moe: MoeLayer, tuning: Tuning) -> "MoeStrategy":
        """The strategy for ``moe``'s weights as they are now, under ``tuning``. Equal choices are
        one object (compiled steps trace a block once and call it for every layer)."""
        two_d = isinstance(moe.w1, (QuantizedWeight, PackedWeight))
        field = chosen_up_to_field(moe, tuning)
        strategy = cls(
            tuning=tuning,
            triton=tuning.triton_experts,
            gathered_int8=tuning.gathered_int8_experts and plain_int8(moe),
            two_d=two_d,
            large=math.prod(moe.w1.shape[1:]) >= tuning.one_by_one_min_weights,  # (I, D): one expert's matrix
            up_to=getattr(tuning, field) if field is not None else 0,
            grouped=(
                tuning.grouped_experts and not two_d and not isinstance(moe.w1, ColumnBlocks)
                and moe.w1.dtype == torch.bfloat16
            ),
            float_experts=floats.wanted(moe, tuning),
        )  # fmt: skip
        return _CHOSEN.setdefault(strategy, strategy)

    def decode_rows(self, moe: MoeLayer, x: torch.Tensor) -> torch.Tensor:
        """The mixture of experts on one token per row, x ``(B, D)``, with shapes fixed by B: ``(B, D)``."""
        x = materialized(x)  # compiled on CPU: in memory, not recomputed for each row of the experts (fast.cpu_reductions)
        experts, weights = moe.route(x)  # (B, A), (B, A)
        kind = triton_experts_kind(moe, x) if self.triton else None
        if kind is not None:
            return triton_mixture(moe, x, experts, weights, kind)
        if self.float_experts and floats.takes_rows(moe, x):  # each chosen expert read once for its rows, any B * k
            return floats.float_experts(moe, x, experts, weights)
        batch, k = experts.shape
        n_experts = moe.w1.shape[0]
        on_cpu = x.device.type == "cpu"
        up_to = self.up_to if on_cpu else 0
        # the chosen experts are read while B * k <= up_to * E (and always while B * k < E)
        if batch * k < n_experts or batch * k <= up_to * n_experts:
            if self.gathered_int8:
                return gathered_int8_experts(moe, x, experts, weights)
            if self.two_d or (on_cpu and self.large):
                return experts_one_by_one(moe, x, experts, weights, self.tuning)
            return gathered_experts(moe, x, experts, weights)
        if self.two_d:
            return every_expert_one_by_one(moe, x, experts, weights, self.tuning)
        if self.grouped and x.dtype == torch.bfloat16:
            return grouped_experts(moe, x, experts, weights)
        return every_expert_batched(moe, x, experts, weights)


_CHOSEN: Dict[MoeStrategy, MoeStrategy] = {}  # each distinct choice once (MoeStrategy.choose)


def moe_one_token(moe: MoeLayer, x: torch.Tensor, tuning: Optional[Tuning] = None) -> torch.Tensor:
    """The mixture of experts on one token per row, x ``(B, D)``, with shapes fixed by B: ``(B, D)``.
    The layer's own strategy (``FastMoeLayer.strategy``, chosen when it was swapped in) where
    ``tuning`` is None or the one it was chosen for; else one chosen for ``tuning`` (a step built
    with a tuning of its own; a reference layer, which keeps none: ``Tuning()``'s defaults)."""
    strategy = getattr(moe, "strategy", None)
    if strategy is None or (tuning is not None and tuning is not strategy.tuning):
        strategy = MoeStrategy.choose(moe, tuning if tuning is not None else Tuning.default())
    return strategy.decode_rows(moe, x)
