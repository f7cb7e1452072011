"""The fast ways to run a Mixtral layer's chosen experts, side by side (as vLLM keeps ``fused_moe/``);
the readable reference, ``MoeLayer``, stays in ``model.moe``.

``FastMoeLayer`` (``layers``) is swapped in for the reference when a model is loaded
(``formats.modules.use_formats``) and chooses once, from its weights (kind, dtype, size) and the
tuning, a ``MoeStrategy`` (``strategy``); each call then picks by its shape, ``B * k`` assignments
against ``E`` experts, and device (the worked reasoning is ``strategy``'s docstring):

=====================  ==============================  ==============================================
strategy               module                          chosen
=====================  ==============================  ==============================================
Triton                 ``triton_mixture``              ``Tuning.triton_experts``, where the kernels
                       (``fast.triton_experts``)       run (CUDA) and take the weights: first, any B
float32 operator       ``float_experts``               ``Tuning.float_dots``, plain float32 experts on
                       (``kernels/float_dots.cpp``)    CPU: next, B up to 8 (eager decoding too)
gathered int8          ``gathered``                    ``Tuning.gathered_int8_experts``, plain int8
                                                       experts, ``B * k`` within the chosen range
one by one (chosen)    ``one_by_one``                  chosen range; quantized or packed experts, or
                                                       large plain ones on CPU
gathered               ``gathered``                    chosen range; other plain experts
every expert, loop     ``one_by_one``                  beyond it; quantized or packed experts
grouped                ``grouped`` (``_grouped_mm``)   beyond it; ``Tuning.grouped_experts``, plain
                                                       bfloat16 experts and activations
every expert batched   ``every_expert``                beyond it; other plain experts
=====================  ==============================  ==============================================

The chosen range: ``B * k < E``, and on CPU up to ``B * k <= up_to * E`` (``Tuning.chosen_up_to_*``
by the experts' kind). Prompt chunks (any number of tokens) run ``MoeLayer.forward``'s grouping by
expert, each expert through its weights' kernels, or the Triton kernels. With ``Tuning(fast=False)``,
``ReferenceQuantizedMoeLayer`` reads quantized experts dequantized.
"""

from mixtral_infer.kernels.moe.layers import FastMoeLayer, ReferenceQuantizedMoeLayer, moe_class
from mixtral_infer.kernels.moe.one_by_one import expert
from mixtral_infer.kernels.moe.strategy import MoeStrategy, moe_one_token
from mixtral_infer.kernels.moe.triton_mixture import triton_kind

__all__ = [
    "FastMoeLayer", "MoeStrategy", "ReferenceQuantizedMoeLayer", "expert", "moe_class", "moe_one_token",
    "triton_kind",
]  # fmt: skip
