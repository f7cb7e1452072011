"""The chosen experts as one grouped product per projection (``kernels.moe.grouped``):
equal to the reference mixture of experts, in fixed shapes that compile whole (``fullgraph``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import random_model, tiny_args

from mixtral_infer import generate
from mixtral_infer.formats.modules import use_formats
from mixtral_infer.model.moe import MoeLayer
from mixtral_infer.kernels.moe import moe_one_token
from mixtral_infer.kernels.moe.gathered import gathered_int8_experts, plain_int8
from mixtral_infer.kernels.moe.grouped import grouped_experts
from mixtral_infer.tuning import Tuning

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def bfloat16_moe(seed: int):
    return random_model(tiny_args(moe=True), seed=seed).to(torch.bfloat16).layers["0"].feed_forward  # 4 experts, top-2


def reference(moe, x, experts, weights):
    """The readable loop, in float32 on the same bfloat16 weights: each row, each chosen expert."""
    w1, w2, w3 = (w.float() for w in (moe.w1, moe.w2, moe.w3))
    rows = []
    for b in range(x.shape[0]):
        row = x[b].float()
        rows.append(sum(float(w) * (w2[e] @ (torch.nn.functional.silu(w1[e] @ row) * (w3[e] @ row))) for e, w in zip(experts[b], weights[b])))
    return torch.stack(rows)


@pytest.mark.parametrize("batch", [1, 2, 3, 8, 32])
def test_grouped_experts_equal_the_readable_loop(batch):
    moe = bfloat16_moe(4)
    x = torch.randn(batch, moe.w1.shape[2], generator=torch.Generator().manual_seed(batch)).to(torch.bfloat16)
    with torch.no_grad():
        experts, weights = moe.route(x)
        got = grouped_experts(moe, x, experts, weights).float()
        expected = reference(moe, x, experts, weights)
    assert torch.allclose(got, expected, atol=0.05, rtol=0.02), (got - expected).abs().max()  # bfloat16 intermediates


def test_docstring_example_offsets():
    """experts [[2, 0], [2, 3]]: sorted [1, 0, 2, 3], offsets [1, 1, 3, 4] (only the rows each expert chose)."""
    experts = torch.tensor([[2, 0], [2, 3]])
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(4, dtype=torch.int32).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    assert order.tolist() == [1, 0, 2, 3] and torch.cumsum(counts, 0).tolist() == [1, 1, 3, 4]
    moe = bfloat16_moe(5)
    x = torch.randn(2, 64).to(torch.bfloat16)
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4]], dtype=torch.bfloat16)
    with torch.no_grad():
        got = grouped_experts(moe, x, experts, weights).float()
    assert torch.allclose(got, reference(moe, x, experts, weights), atol=0.05, rtol=0.02)


def test_grouped_experts_compile_whole_and_moe_one_token_takes_them():
    """fullgraph=True: no data-dependent shape, no host sync (what a CUDA graph needs)."""
    moe = bfloat16_moe(4)
    x = torch.randn(8, moe.w1.shape[2], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    step = torch.compile(lambda x: grouped_experts(moe, x, *moe.route(x)), fullgraph=True, dynamic=False)
    with torch.no_grad():
        eager = grouped_experts(moe, x, *moe.route(x))
        assert torch.allclose(step(x).float(), eager.float(), atol=0.05, rtol=0.02)
        assert torch.equal(moe_one_token(moe, x, Tuning(grouped_experts=True)), eager)  # B * k >= E: the grouped path
        assert torch.allclose(MoeLayer.forward(moe, x).float(), eager.float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("decode", ["static", "compiled"])
def test_the_static_step_with_grouped_experts_gives_the_eager_tokens(decode):
    """A batch of 4, top-2 of 4 experts, bfloat16: the step takes the grouped path; greedy tokens are the
    eager loop's. Compiled by torch.compile: torch 2.13's AOTInductor cannot call ``_grouped_mm`` from its
    C++ wrapper ("Mismatch between ints consumed"), so on CPU the option goes with ``ahead_of_time=False``."""
    model = random_model(dataclasses.replace(tiny_args(moe=True), max_batch_size=4), seed=6).to(torch.bfloat16)
    use_formats(model, Tuning(grouped_experts=True, ahead_of_time=False))
    prompts = [[1, 5, 9, 13], [1, 7], [1, 3, 3, 3, 8], [1, 20, 21]]
    eager, _ = generate(prompts, model, max_tokens=10, decode="eager", prompt_logprobs=False)
    grouped, _ = generate(prompts, model, max_tokens=10, decode=decode, prompt_logprobs=False)
    assert grouped == eager


def int8_moe_model(batch: int = 1):
    from mixtral_infer.formats.quantizing import quantize_model

    model = random_model(dataclasses.replace(tiny_args(moe=True), max_batch_size=batch), seed=7)
    quantize_model(model, "int8")
    return model


def test_gathered_int8_experts_equal_each_chosen_expert_dequantized():
    """Batch 1, top-2 of 4 (B * k < E): the chosen experts' int8 rows, scaled where they are read, give
    what each expert's dequantized weight gives; moe_one_token takes this path with the tuning's flag."""

    moe = int8_moe_model().layers["0"].feed_forward
    assert plain_int8(moe)
    x = torch.randn(1, moe.w1.shape[-1], generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        experts, weights = moe.route(x)
        expected = sum(
            float(w) * torch.nn.functional.linear(
                torch.nn.functional.silu(x @ moe.w1[int(e)].dequantize().T) * (x @ moe.w3[int(e)].dequantize().T),
                moe.w2[int(e)].dequantize())
            for e, w in zip(experts[0], weights[0])
        )  # fmt: skip
        got = gathered_int8_experts(moe, x, experts, weights)
        assert torch.allclose(got, expected, atol=1e-5)
        assert torch.allclose(moe_one_token(moe, x, Tuning(gathered_int8_experts=True)), expected, atol=1e-5)
        step = torch.compile(lambda x: gathered_int8_experts(moe, x, *moe.route(x)), fullgraph=True, dynamic=False)
        assert torch.allclose(step(x), expected, atol=1e-5)


@pytest.mark.parametrize("decode", ["static", "compiled"])
def test_the_static_step_with_gathered_int8_experts_gives_the_eager_tokens(decode):
    model = int8_moe_model()
    use_formats(model, Tuning(gathered_int8_experts=True))
    prompt = [[1, 5, 9, 13, 2, 40]]
    eager, eager_lp = generate(prompt, model, max_tokens=10, decode="eager", prompt_logprobs=False)
    gathered, gathered_lp = generate(prompt, model, max_tokens=10, decode=decode, prompt_logprobs=False)
    assert gathered == eager
    assert gathered_lp[0] == pytest.approx(eager_lp[0], abs=1e-4)
