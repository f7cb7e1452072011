"""Choosing the next token from logits: greedy, or temperature with top-k / top-p.

Every setting is a per-row tensor (``Sampling``), so one batch can mix greedy and sampled
rows (a server does) and the same code runs inside a compiled, static-shaped decode step:
no ``.item()``, no host sync, no shape that depends on the data.

A sampled token is drawn by inverse transform from one uniform number per row, which the
caller draws (``draw_uniform``) for the whole batch at every step, finished rows included.
So a row's draws do not depend on which other rows are still running, and the eager and
the static decode loops, fed the same uniforms, choose the same tokens. With a generator per
row (a seeded ``generate``, as the server's requests) row i's k-th uniform is its own
generator's k-th: its tokens do not depend on the batch at all.

Worked example, one row, probabilities ``[0.1, 0.5, 0.3, 0.1]``, top_k = 2 (no top-p)::

    sorted, descending      [0.5, 0.3, 0.1, 0.1]   (tokens 1, 2, 0, 3)
    kept (rank < top_k)     [0.5, 0.3, 0,   0  ]
    cumulative              [0.5, 0.8, 0.8, 0.8]
    uniform 0.7 -> 0.7 * 0.8 = 0.56: the first cumulative value above it is at rank 1 -> token 2
"""

from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Optional, Sequence, Union

import torch

FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass
class Sampling:
    """Per-row settings, each ``(B,)`` on the logits' device.

    ``temperature`` 0 means greedy for that row; ``top_k`` equal to the vocabulary size means no
    limit; ``top_p`` 1 means no nucleus cut. ``greedy`` and ``filtered`` are static facts about
    the whole batch (no row samples / some row has a top-k or top-p limit) that let the common
    cases skip the sort; they are fixed when the settings are made, never read from the tensors.
    """

    temperature: torch.Tensor  # (B,) float32
    top_p: torch.Tensor  # (B,) float32
    top_k: torch.Tensor  # (B,) int64
    greedy: bool
    filtered: bool

    @classmethod
    def uniform_settings(
        cls,
        batch: int,
        vocab_size: int,
        temperature: float,
        top_p: float = 1.0,
        top_k: Optional[int] = None,
        device: torch.device | str = "cpu",
    ) -> "Sampling":
        """The same settings for every row."""
        k = vocab_size if top_k is None else min(int(top_k), vocab_size)
        temperature = float(temperature) if float(temperature) <= FLOAT32_MAX else math.inf  # uniform: the limit
        return cls(
            temperature=torch.full((batch,), temperature, dtype=torch.float32, device=device),
            top_p=torch.full((batch,), float(top_p), dtype=torch.float32, device=device),
            top_k=torch.full((batch,), k, dtype=torch.long, device=device),
            greedy=temperature == 0,
            filtered=temperature != 0 and (k < vocab_size or top_p < 1.0),
        )

    def rows(self, index: torch.Tensor) -> "Sampling":
        """The settings of some rows (index: (B',) int64)."""
        return Sampling(self.temperature[index], self.top_p[index], self.top_k[index], self.greedy, self.filtered)


Generators = Union[None, torch.Generator, Sequence[torch.Generator]]  # one for the batch, or one per row


def draw_uniform(batch: int, sampling: Sampling, generator: Generators, device) -> Optional[torch.Tensor]:
    """One uniform number in [0, 1) per row, or None when no row samples (greedy draws nothing).
    ``generator``: one for the whole batch (None: torch's default), or a list of one per row, each
    drawing its row's number as ``torch.rand(1)`` would for that row alone."""
    if sampling.greedy:
        return None
    if isinstance(generator, (list, tuple)):
        return torch.cat([torch.rand(1, generator=g, device=device) for g in generator])  # (B,)
    return torch.rand(batch, generator=generator, device=device)


def sample(logits: torch.Tensor, sampling: Sampling, uniform: Optional[torch.Tensor]) -> torch.Tensor:
    """Next token of each row ``(B,)`` from float logits ``(B, V)``."""
    greedy = torch.argmax(logits, dim=-1)  # (B,)
    if sampling.greedy:
        return greedy
    # (logits - max) / T is <= 0 and finite for any T > 0, so a tiny temperature gives one-hot
    # probabilities (the greedy limit) rather than inf / inf = NaN.
    temperature = sampling.temperature.clamp_min(torch.finfo(torch.float32).tiny)[:, None]  # (B, 1)
    shifted = logits.float() - logits.float().amax(dim=-1, keepdim=True)
    probs = torch.softmax(shifted / temperature, dim=-1)  # (B, V)
    if sampling.filtered:
        # stable: tokens of equal probability in index order, so top_k=1 picks argmax's token
        probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # (B, V), (B, V)
        rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]  # (1, V)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above
        # The top token always stays, also where a top_p below 1e-45 is 0 in float32.
        keep = (rank < sampling.top_k[:, None]) & (mass_before < sampling.top_p[:, None]) | (rank == 0)
        probs = probs * keep
    cumulative = torch.cumsum(probs, dim=-1)  # (B, V)
    target = uniform[:, None] * cumulative[:, -1:]  # (B, 1) in [0, total)
    index = torch.searchsorted(cumulative, target, right=True).clamp_max(probs.shape[-1] - 1)  # (B, 1)
    sampled = (order.gather(1, index) if sampling.filtered else index)[:, 0]
    return torch.where(sampling.temperature == 0, greedy, sampled)


def token_distribution(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The probabilities ``sample`` draws each row's token from, ``(B, V)`` float32 in vocabulary
    order: softmax at the row's temperature, cut to its top-k / top-p and normalised; one-hot at
    argmax for a greedy row. Speculative decoding accepts a guess with these (``generation.speculative``).

    >>> settings = Sampling.uniform_settings(1, 4, temperature=1.0, top_k=2)
    >>> [round(p, 3) for p in token_distribution(torch.tensor([[0.0, 1.0, 0.5, 0.0]]), settings)[0].tolist()]
    [0.0, 0.622, 0.378, 0.0]
    """
    logits = logits.float()
    greedy = torch.nn.functional.one_hot(torch.argmax(logits, dim=-1), logits.shape[-1]).float()  # (B, V)
    if sampling.greedy:
        return greedy
    temperature = sampling.temperature.clamp_min(torch.finfo(torch.float32).tiny)[:, None]  # (B, 1)
    probs = torch.softmax((logits - logits.amax(dim=-1, keepdim=True)) / temperature, dim=-1)  # (B, V)
    if sampling.filtered:  # the cut ``sample`` makes, in sorted order, put back in vocabulary order
        ranked, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        mass_before = torch.cumsum(ranked, dim=-1) - ranked
        keep = (rank < sampling.top_k[:, None]) & (mass_before < sampling.top_p[:, None]) | (rank == 0)
        probs = torch.zeros_like(probs).scatter(1, order, ranked * keep)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.where((sampling.temperature == 0)[:, None], greedy, probs)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) of each row under the model (before temperature): ``(B,)``."""
    return torch.log_softmax(logits.float(), dim=-1).gather(1, tokens[:, None])[:, 0]


def sample_next(
    logits: torch.Tensor,  # (B, V) float
    temperature: float,
    top_p: float = 1.0,
    top_k: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Next token of each row, (B,), with the same settings for every row. Greedy when temperature is 0."""
    settings = Sampling.uniform_settings(logits.shape[0], logits.shape[-1], temperature, top_p, top_k, logits.device)
    return sample(logits, settings, draw_uniform(logits.shape[0], settings, generator, logits.device))
