"""The grouped mixture of experts equals a naive loop over tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mixtral_infer import MoeArgs, MoeLayer


def naive_moe(layer: MoeLayer, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax over all experts' logits, keep the top k, renormalise, mix."""
    out = torch.zeros_like(x)
    k = layer.args.num_experts_per_tok
    for t in range(x.shape[0]):
        probs = torch.softmax(layer.gate.weight @ x[t], dim=-1)
        top = torch.topk(probs, k)
        for weight, e in zip(top.values / top.values.sum(), top.indices.tolist()):
            hidden = F.silu(layer.w1[e] @ x[t]) * (layer.w3[e] @ x[t])
            out[t] += weight * (layer.w2[e] @ hidden)
    return out


@pytest.mark.parametrize("n_experts, k, n_tokens", [(8, 2, 37), (4, 1, 5), (4, 4, 3), (8, 2, 1)])
def test_grouped_moe_equals_naive_loop(n_experts, k, n_tokens):
    torch.manual_seed(n_experts * 10 + k)
    layer = MoeLayer(dim=32, hidden_dim=48, args=MoeArgs(num_experts=n_experts, num_experts_per_tok=k))
    x = torch.randn(n_tokens, 32)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), naive_moe(layer, x), atol=1e-5, rtol=1e-5)


def test_experts_nobody_chose_are_skipped():
    torch.manual_seed(0)
    layer = MoeLayer(dim=16, hidden_dim=24, args=MoeArgs(num_experts=8, num_experts_per_tok=2))
    x = torch.randn(1, 16)
    calls = []
    original = layer.expert
    layer.expert = lambda e, tokens: calls.append((e, tokens.shape[0])) or original(e, tokens)
    with torch.no_grad():
        layer(x)
    chosen = sorted(layer.route(x)[0][0].tolist())
    assert sorted(e for e, _ in calls) == chosen
    assert all(n == 1 for _, n in calls)


def test_the_strategy_docstring_example(monkeypatch):
    """``kernels.moe.strategy``'s example: 4 experts, top-2, large plain float32 experts on CPU
    (``chosen_up_to_plain = 2``): batches 1 to 4 read the chosen experts one by one, batch 5 every
    expert; the strategy is chosen once, when the layer is swapped in, and equals the reference."""
    from conftest import random_model, tiny_args

    from mixtral_infer.formats.modules import use_formats
    from mixtral_infer.kernels.moe import MoeStrategy, moe_one_token, strategy
    from mixtral_infer.tuning import Tuning

    tuning = Tuning(one_by_one_min_weights=0)
    layer = use_formats(random_model(tiny_args(moe=True), seed=25), tuning).layers["0"].feed_forward
    assert layer.strategy == MoeStrategy.choose(layer, tuning) and layer.strategy.tuning == tuning
    assert (layer.strategy.up_to, layer.strategy.large, layer.strategy.two_d) == (2, True, False)
    forms = []
    for name, letter in {"experts_one_by_one": "c", "every_expert_batched": "v"}.items():
        form = getattr(strategy, name)
        monkeypatch.setattr(strategy, name, lambda *a, form=form, letter=letter: forms.append(letter) or form(*a))
    for batch in (1, 2, 3, 4, 5):
        x = torch.randn(batch, 64, generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            torch.testing.assert_close(layer.decode_rows(x), MoeLayer.forward(layer, x), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(moe_one_token(layer, x, tuning), layer.decode_rows(x), atol=0, rtol=0)
    assert "".join(forms) == "ccc" * 4 + "vvv"  # three calls a batch: decode_rows twice, moe_one_token
