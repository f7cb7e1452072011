"""What a request changes in its rows' logits before sampling: a grammar's bitmask, a bias per
token, presence, frequency and repetition penalties, and EOS held back for ``min_tokens``.

Each is a fixed-shape tensor operation over ``(N, V)`` logits, as vLLM and transformers define it:

- ``apply_bitmask``: tokens whose bit is 0 get -inf (bit ``t % 32`` of word ``t // 32``).
- ``apply_penalties``, OpenAI's formula for presence and frequency over the tokens generated so far
  (``counts``): ``logit[t] -= frequency * counts[t] + presence * (counts[t] > 0)``; transformers'
  ``repetition_penalty`` over the prompt's and the generated tokens (``seen``): a seen token's logit
  is divided by the penalty where positive, multiplied where negative. Then ``bias`` is added.

Example, one row, logits ``[2.0, -1.0, 0.5]``, token 0 generated twice, token 1 seen in the prompt,
presence 0.5, frequency 0.25, repetition 2: the repetition penalty gives ``[1.0, -2.0, 0.5]``, the
penalties ``[1.0 - 0.5 - 0.5, -2.0, 0.5] = [0.0, -2.0, 0.5]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Sequence

import torch


def apply_bitmask(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``logits`` ``(N, V)`` with the tokens ``bits`` ``(N, W)`` int32 forbids at -inf; tokens past
    ``32 * W`` (a model's vocabulary padded past its tokenizer's) are forbidden too."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)  # (32,)
    allowed = ((bits[:, :, None] >> shifts) & 1).bool().reshape(bits.shape[0], -1)  # (N, 32 W)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return logits.masked_fill(~allowed[:, :vocab].to(logits.device), float("-inf"))


def apply_penalties(
    logits: torch.Tensor,  # (N, V) float
    counts: torch.Tensor,  # (N, V) times each token was generated
    seen: torch.Tensor,  # (N, V) bool: in the prompt or generated
    presence: torch.Tensor,  # (N,)
    frequency: torch.Tensor,  # (N,)
    repetition: torch.Tensor,  # (N,) 1: none
    bias: Optional[torch.Tensor] = None,  # (N, V) added last
) -> torch.Tensor:
    """The penalised logits (module docstring); rows with neutral settings are unchanged."""
    logits = logits.float()
    penalty = repetition[:, None]
    repeated = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = torch.where(seen, repeated, logits)
    logits = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)
    return logits if bias is None else logits + bias


@dataclass
class RowPenalties:
    """One row's penalty settings and what it has generated and seen so far, kept on the host
    as sparse dicts (a server's rows come and go) and made dense per step (``dense_penalties``)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias: Optional[Dict[int, float]] = None
    counts: Optional[Dict[int, int]] = None
    seen: Optional[set] = None

    @classmethod
    def of(cls, presence: float, frequency: float, repetition: float, bias: Optional[Dict[int, float]],
           prompt: Iterable[int]) -> Optional["RowPenalties"]:  # fmt: skip
        """The row's penalties, or None when every setting is neutral (nothing to apply)."""
        if presence == 0 and frequency == 0 and repetition == 1 and not bias:
            return None
        return cls(presence, frequency, repetition, dict(bias or {}), {}, set(prompt) if repetition != 1 else set())

    def add(self, token: int) -> None:
        self.counts[token] = self.counts.get(token, 0) + 1
        if self.repetition != 1:
            self.seen.add(token)


def dense_penalties(rows: Sequence[Optional[RowPenalties]], vocab: int, device: torch.device) -> tuple:
    """``apply_penalties``' tensors for these rows (neutral for a row of None)."""
    n = len(rows)
    counts = torch.zeros(n, vocab, dtype=torch.float32)
    seen = torch.zeros(n, vocab, dtype=torch.bool)
    bias = torch.zeros(n, vocab, dtype=torch.float32)
    presence, frequency, repetition = torch.zeros(n), torch.zeros(n), torch.ones(n)
    for i, row in enumerate(rows):
        if row is None:
            continue
        presence[i], frequency[i], repetition[i] = row.presence, row.frequency, row.repetition
        if row.counts:
            counts[i, list(row.counts)] = torch.tensor(list(row.counts.values()), dtype=torch.float32)
        if row.seen:
            seen[i, list(row.seen)] = True
        if row.bias:
            bias[i, list(row.bias)] = torch.tensor(list(row.bias.values()), dtype=torch.float32)
    move = lambda t: t.to(device)  # noqa: E731
    return tuple(map(move, (counts, seen, presence, frequency, repetition, bias)))
