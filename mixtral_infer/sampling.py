"""Choosing the next token from logits: greedy, or temperature with top-k / top-p."""

from __future__ import annotations

from typing import Optional

import torch


def filter_top_k(probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """Zero all but the k most probable tokens of each row. probs: (B, V)."""
    if top_k >= probs.shape[-1]:
        return probs
    kth = torch.topk(probs, top_k, dim=-1).values[:, -1:]  # (B, 1)
    return probs.masked_fill(probs < kth, 0.0)


def filter_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most probable tokens whose mass reaches top_p. probs: (B, V)."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the tokens ranked above
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)  # the top token always stays
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


def sample_next(
    logits: torch.Tensor,  # (B, V) float
    temperature: float,
    top_p: float = 1.0,
    top_k: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Next token of each row, (B,). Greedy when temperature is 0."""
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_k is not None:
        probs = filter_top_k(probs, top_k)
    probs = filter_top_p(probs, top_p)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.multinomial(probs, num_samples=1, generator=generator)[:, 0]
