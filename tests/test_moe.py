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
