"""One ``generate`` call's logits changes, per row, as fixed-shape tensors (``Shaping``).

The decode loops call it around each sampling: ``tensors()`` gives what the fixed-shape step takes
(the grammar bitmask, counts, seen tokens, penalties, bias, tokens left before EOS may come), or
``shape()`` applies the same to the logits of the eager loop's rows; ``record()`` moves each row on
past its sampled token and says whether the row has ended (its grammar is complete, or its text
holds a stop string).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Protocol, Sequence

import torch

from mixtral_infer.structured.grammar import RowGrammar, bitmask_words, fill_bitmask
from mixtral_infer.structured.logits import apply_bitmask, apply_penalties
from mixtral_infer.tokenizer import Tokenizer


class StopCheck(Protocol):
    """A row's text as its tokens arrive, and whether it holds a stop string by now
    (``generation.text_stream.AnswerText``, the server's own check)."""

    stopped: bool

    def push(self, token: int) -> str: ...


class Shaping:
    """Per-row logits changes of a batch of ``len(prompts)`` rows (see the module docstring)."""

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        vocab: int,
        device: torch.device,
        eos_id: Optional[int],
        *,
        grammar: Optional[str] = None,
        tokenizer: Optional[Tokenizer] = None,
        presence: float | Sequence[float] = 0.0,
        frequency: float | Sequence[float] = 0.0,
        repetition: float | Sequence[float] = 1.0,
        bias: Optional[Dict[int, float]] = None,
        min_tokens: int = 0,
        stops: Optional[Sequence[StopCheck]] = None,
    ):
        batch = len(prompts)
        self.vocab, self.device, self.eos_id, self.tokenizer = vocab, device, eos_id, tokenizer
        self.grammars: List[Optional[RowGrammar]] = [RowGrammar(grammar, tokenizer) if grammar else None for _ in prompts]
        self.words = bitmask_words(tokenizer.n_words) if grammar else bitmask_words(vocab)
        self.stops = stops  # one per row, or None: no stop strings
        self.generated: List[List[int]] = [[] for _ in prompts]
        self.counts = torch.zeros(batch, vocab, dtype=torch.float32, device=device)  # (B, V)
        self.seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device)  # (B, V)
        self.presence, self.frequency, self.repetition = (
            per_row(value, batch, device) for value in (presence, frequency, repetition)
        )  # (B,) each
        for row, prompt in enumerate(prompts):
            if self.repetition[row] != 1:
                self.seen[row, torch.tensor(list(prompt), device=device)] = True
        self.bias = torch.zeros(batch, vocab, dtype=torch.float32, device=device)  # (B, V)
        if bias:
            self.bias[:, list(bias)] = torch.tensor(list(bias.values()), dtype=torch.float32, device=device)
        self.min_left = torch.full((batch,), int(min_tokens), dtype=torch.long, device=device)  # (B,)
        self.penalised = bool(self.presence.any() or self.frequency.any() or (self.repetition != 1).any() or bias)
        self.holds_eos = min_tokens > 0 and eos_id is not None

    @property
    def needs_host(self) -> bool:
        """Whether each step's token must be read before the next step (a grammar, stop strings)."""
        return self.stops is not None or any(g is not None for g in self.grammars)

    def bits(self) -> torch.Tensor:
        """``(B, W)`` int32: each row's allowed next tokens (all where it has no grammar)."""
        if all(g is None for g in self.grammars):
            return torch.full((len(self.grammars), self.words), -1, dtype=torch.int32, device=self.device)
        return fill_bitmask(self.grammars, self.tokenizer.n_words).to(self.device)

    def tensors(self) -> tuple:
        """The fixed-shape step's shaping inputs: ``(bits, counts, seen, presence, frequency,
        repetition, bias, min_left)``."""
        return (self.bits(), self.counts, self.seen, self.presence, self.frequency, self.repetition, self.bias, self.min_left)

    def update(self, counts: torch.Tensor, seen: torch.Tensor, min_left: torch.Tensor) -> None:
        """Take the step's updated counts, seen tokens and tokens left before EOS."""
        self.counts, self.seen, self.min_left = counts, seen, min_left

    def shape(self, logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """The eager loop's ``logits`` ``(N, V)`` of these ``rows``, changed as the step does (the parts
        no row asks for are left out: the step computes them, at no cost once compiled)."""
        rows = list(rows)
        index = torch.tensor(rows, device=self.device)
        if self.penalised:
            logits = apply_penalties(logits, self.counts[index], self.seen[index], self.presence[index],
                                     self.frequency[index], self.repetition[index], self.bias[index])  # fmt: skip
        if self.holds_eos:
            logits = logits.clone()
            logits[torch.nonzero(self.min_left[index] > 0)[:, 0], self.eos_id] = float("-inf")  # rows still short
        if any(self.grammars[r] is not None for r in rows):
            logits = apply_bitmask(logits, fill_bitmask([self.grammars[r] for r in rows], self.tokenizer.n_words).to(self.device))
        return logits

    def advance(self, rows: Sequence[int], tokens: Sequence[int]) -> None:
        """The eager loop's counts after these rows sampled these tokens (the step does it itself)."""
        index = torch.tensor(list(rows), device=self.device)
        chosen = torch.tensor(list(tokens), device=self.device)
        self.counts[index, chosen] += 1
        self.seen[index, chosen] = self.seen[index, chosen] | (self.repetition[index] != 1)
        self.min_left[index] -= 1

    def record(self, row: int, token: int) -> bool:
        """Move ``row`` on past its sampled ``token`` (not EOS); True when the row ends after it."""
        grammar = self.grammars[row]
        if grammar is not None:
            grammar.accept(token)
        self.generated[row].append(token)
        if self.stops is not None:
            self.stops[row].push(token)
            if self.stops[row].stopped:
                return True
        return grammar is not None and grammar.done


def per_row(value: float | Sequence[float], batch: int, device: torch.device) -> torch.Tensor:
    """A setting for every row ``(B,)``: one number for all, or one per row."""
    if isinstance(value, (int, float)):
        return torch.full((batch,), float(value), device=device)
    return torch.tensor([float(v) for v in value], device=device)


def shaped_logits(
    logits: torch.Tensor,  # (N, V) the model's
    eos_id: Optional[int],
    bits: torch.Tensor,  # (N, W) int32
    counts: torch.Tensor,  # (N, V)
    seen: torch.Tensor,  # (N, V) bool
    presence: torch.Tensor,  # (N,)
    frequency: torch.Tensor,  # (N,)
    repetition: torch.Tensor,  # (N,)
    bias: torch.Tensor,  # (N, V)
    min_left: torch.Tensor,  # (N,) tokens still to come before EOS may
) -> torch.Tensor:
    """The logits a row samples from: penalties and bias, EOS held back while ``min_left > 0``, then
    the grammar's bitmask (``structured.logits``). Fixed shapes throughout: the compiled step runs it."""
    logits = apply_penalties(logits, counts, seen, presence, frequency, repetition, bias)
    if eos_id is not None:
        is_eos = torch.arange(logits.shape[-1], device=logits.device) == eos_id  # (V,)
        logits = logits.masked_fill((min_left > 0)[:, None] & is_eos, float("-inf"))
    return apply_bitmask(logits, bits)
