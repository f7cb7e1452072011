"""Speculative decoding: a cheap proposer guesses up to k tokens a row, the model checks them all in
one pass, and every guess it agrees with is a token gained.

A decode step reads every weight once whether it checks one token or five, so at a small batch the
pass that feeds a row's last token and k guesses costs little more than the pass that feeds its last
token alone (``bench/bench_speculative.py`` measures how much more). Two proposers:

* ``PromptLookup`` (n-gram prompt lookup, as vLLM's ``ngram``, llama.cpp's ``lookup`` and transformers'
  ``prompt_lookup_num_tokens``): the row's last n tokens are looked for earlier in its text, prompt
  and answer so far, and what followed them there is the guess. No second model; it pays where the
  answer copies (code edits, quoting a passage, summaries that reuse phrases).
* ``DraftModel``: a smaller model with the same tokenizer (tiny-mistral for tiny-mixtral, Mistral 7B
  for Mixtral) decodes k tokens ahead in a cache of its own.

**Exact.** A row's tokens are chosen position by position from the model's logits after the last
token and after each guess, as plain decoding would choose them: the grammar, penalties and stop
strings of the row are applied to each position's logits after the tokens accepted before it
(``Shaping``). Greedy: the token is the argmax, the guess is accepted when it is that token, so the
tokens are plain decoding's. Sampling: rejection sampling (Leviathan et al. 2023, Chen et al. 2023,
``accept``): a guess g drawn from the proposer's distribution q is accepted with probability
``min(1, p(g) / q(g))``, p the model's (``sampling.token_distribution``: temperature, top-k, top-p);
a rejected one is replaced by a draw from ``max(0, p - q)`` normalised. Each token is then a draw from
p, whatever q. A guess that is certain (prompt lookup, a greedy draft) has q one-hot: it is accepted
with probability p(g), else the token is drawn from p without g. Once every guess is accepted, the
logits after the last guess give one more token: a step gives 1 to k + 1 tokens.

**The cache steps back.** The pass wrote keys and values for every guess; a rejected guess's slots
must go back to what they held. A windowed buffer that has wrapped overwrote, with each guess, a
position the row's next steps still read. So a row keeps the last k positions its windowed buffers
pushed out (``model.cache.SlackSlots`` with slack k: k/W more memory per row), the pass saves them
before it writes, and the row is cut back to the tokens whose logits were read
(``SlackSlots.cut_back``; ``model.cache.can_cut_back`` is the rule, shared with serving's prefix reuse).

Worked example, W = S = 4, k = 3: a row has fed 10 tokens and holds positions 6..9 (slots 2, 3, 0, 1);
its last sampled token t and guesses g1 g2 g3 go to positions 10..13, pushing out 6..9, of which the
slack keeps 7, 8, 9. The model chooses g1 after t and c2 != g2 after g1: two tokens, g1 and c2,
and the row is cut back to 12 tokens (t and g1 fed, g2 and g3 forgotten): its window before position
12 is 8..11, and 8 and 9 come back from the slack into slots 0 and 1.

**k.** Prompt lookup checks k guesses wherever it finds a match (``speculative_tokens``, 4 by
default): a guess costs the verify pass almost nothing at a small batch, so a guess that may fail is
cheap to make. A draft model costs a pass of its own per guess, so its k adapts per row as
transformers' heuristic schedule does: k + 2 after a step that accepted every guess, k - 1 (at least
1) after one that did not, never above ``speculative_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Callable, List, Optional, Protocol, Sequence, Tuple

import torch

from mixtral_infer.errors import GenerationError, as_int
from mixtral_infer.model.cache import RotatingBufferCache, SlackSlots, layer_cache_sizes
from mixtral_infer.model.transformer import Transformer
from mixtral_infer.sampling import Generators, Sampling, token_distribution, token_logprobs
from mixtral_infer.formats.modules import tuning_of
from mixtral_infer.steps.compiler import ADAPTED, VERIFY, StepCompiler
from mixtral_infer.steps.decode_loop import DecodeSettings
from mixtral_infer.steps.mixed_step import pack_chunk

DEFAULT_SPECULATIVE_TOKENS = 4  # k, the most guesses a row checks per step
DEFAULT_NGRAM = 3  # prompt lookup matches the last 3 tokens, then 2, then 1
MAX_SPECULATIVE_TOKENS = 64


@dataclass
class SpeculativeStats:
    """What speculation gained: verify passes (``steps``), guesses checked and accepted, and tokens chosen
    by those passes (``emitted``: accepted guesses and one more per row and pass)."""

    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    row_steps: int = 0  # rows times passes: the passes each row took part in

    @property
    def acceptance_rate(self) -> float:
        """Accepted guesses over guesses checked (0 when none was)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a row gained per verify pass it took part in (1 without speculation)."""
        return self.emitted / self.row_steps if self.row_steps else 0.0

    def add(self, other: "SpeculativeStats") -> None:
        for name in FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def since(self, before: "SpeculativeStats") -> "SpeculativeStats":
        """What was counted after ``before`` (a copy taken then): one call's share of a running count."""
        return SpeculativeStats(**{name: getattr(self, name) - getattr(before, name) for name in FIELDS})

    def copy(self) -> "SpeculativeStats":
        return replace(self)

    def line(self) -> str:
        """``"speculation: 71% of 120 guesses accepted, 3.1 tokens per step"``: the stats line's part."""
        return (f"speculation: {self.acceptance_rate:.0%} of {self.proposed} guesses accepted, "
                f"{self.tokens_per_step:.2f} tokens per step")  # fmt: skip


FIELDS = ("steps", "proposed", "accepted", "emitted", "row_steps")


def lookup(text: Sequence[int], k: int, max_ngram: int = DEFAULT_NGRAM, min_ngram: int = 1) -> List[int]:
    """Prompt lookup's guesses: the up to ``k`` tokens that followed the latest earlier occurrence of
    ``text``'s last n tokens, n from ``max_ngram`` down to ``min_ngram``; none if no such n-gram occurs.

    >>> lookup([5, 6, 7, 8, 9, 1, 6, 7], k=3)  # "6 7" occurred at 1: what followed is 8 9 1
    [8, 9, 1]
    >>> lookup([5, 6, 7, 5, 6, 7, 5, 6], k=4)  # "7 5 6" last at 2: 7 5 6 (the text so far ends the guess)
    [7, 5, 6]
    >>> lookup([1, 2, 3], k=2)
    []
    """
    ids = torch.as_tensor(list(text), dtype=torch.long)  # (N,), on the host
    n_text = len(ids)
    for n in range(min(max_ngram, n_text - 1), min_ngram - 1, -1):
        # starts 0 .. N - n - 1 whose n tokens are the last n, compared a column at a time
        matches = torch.ones(n_text - n, dtype=torch.bool)
        for i in range(n):
            matches &= ids[i : n_text - n + i] == ids[n_text - n + i]
        found = torch.nonzero(matches)
        if len(found):
            start = int(found[-1])  # the latest occurrence
            return ids[start + n : start + n + k].tolist()
    return []


class PromptLookup:
    """Prompt lookup (``lookup``) as a proposer: no model, its guesses certain (q one-hot).
    ``stats``: what it gained over every call it served."""

    def __init__(self, max_ngram: int = DEFAULT_NGRAM, min_ngram: int = 1):
        if as_int(max_ngram) is None or as_int(min_ngram) is None or not 1 <= min_ngram <= max_ngram:
            raise GenerationError(f"prompt lookup n-grams {min_ngram}..{max_ngram}: need integers 1 <= min <= max")
        self.max_ngram, self.min_ngram = int(max_ngram), int(min_ngram)
        self.stats = SpeculativeStats()
        self.adaptive = False

    def begin(self, model: Transformer, batch: int, max_seqlen: int, slack: int, continuing: bool) -> None:
        pass

    def propose(
        self, rows: Sequence[int], texts: Sequence[Sequence[int]], ks: Sequence[int], sampling: Sampling, generators: Generators
    ) -> Tuple[List[List[int]], List[Optional[torch.Tensor]]]:
        """Each row's guesses (at most its k) and the distributions they were drawn from: None, certain."""
        guesses = [lookup(text, k, self.max_ngram, self.min_ngram) if k > 0 else [] for text, k in zip(texts, ks)]
        return guesses, [None] * len(guesses)


class DraftModel:
    """A smaller model of the same vocabulary as a proposer: it decodes k tokens ahead of each row in a
    cache of its own (made on first use, with k slack slots, so it steps back as the model's rows do).

    The draft holds, per row, the ids it has read (``fed``); asked for guesses after a row's text, it
    steps back to what the text shares with them (``SlackSlots.cut_back``, or from the start where it
    cannot) and reads the rest. So it follows any change of a row: a rejected guess, a new prompt, a
    serving engine's row given to another request. Greedy rows get its argmax (certain); sampled rows
    draw from its distribution at the row's temperature, top-k and top-p, and the model accepts with
    rejection sampling (module docstring).
    """

    def __init__(self, model: Transformer):
        if not isinstance(model, Transformer):
            raise GenerationError(f"draft={type(model).__name__}: give a loaded model (load_model), 'ngram' or a proposer")
        self.model = model
        self.cache: Optional[RotatingBufferCache] = None
        self.slack: Optional[SlackSlots] = None
        self.fed: List[List[int]] = []
        self.stats = SpeculativeStats()
        self.adaptive = True

    def check_matches(self, target: Transformer) -> None:
        """The draft must share the model's vocabulary (its tokenizer), and be on its device."""
        vocab, own = target.args.vocab_size, self.model.args.vocab_size
        if vocab != own:
            raise GenerationError(f"the draft model has {own} tokens, the model {vocab}: a draft must use the model's tokenizer")
        if self.model.device != target.device:
            raise GenerationError(f"the draft model is on {self.model.device}, the model on {target.device}: move it there")

    def begin(self, model: Transformer, batch: int, max_seqlen: int, slack: int, continuing: bool) -> None:
        """Ready the draft's cache for ``batch`` rows of up to ``max_seqlen`` tokens, stepping back up to ``slack``."""
        self.check_matches(model)
        cache = self.cache
        fits = (
            cache is not None and cache.max_batch_size == batch and self.slack.slack >= slack
            and all(size >= needed for size, needed in zip(cache.layer_sizes, layer_cache_sizes(self.model.layer_windows, max_seqlen)))
        )  # fmt: skip
        if not fits:
            self.cache = self.slack = None  # the old buffers freed first
            self.cache = self.model.make_cache(batch, max_seqlen=max_seqlen)
            self.cache.start_sequences(batch)
            self.slack = SlackSlots(self.cache, slack)
            self.fed = [[] for _ in range(batch)]
        elif not continuing:
            for row in range(len(self.fed)):
                self._restart(row)

    def _restart(self, row: int) -> None:
        self.cache.tokens_seen[row] = 0
        self.slack.forget(row)
        self.fed[row] = []

    def _sync(self, row: int, text: Sequence[int]) -> List[int]:
        """Step row back to what it shares with ``text`` (keeping at least one token of ``text`` to read);
        the tokens it has to read."""
        fed = self.fed[row]
        shared = 0
        for a, b in zip(fed, text[: len(text) - 1]):
            if a != b:
                break
            shared += 1
        if shared < len(fed):
            if self.slack.can_cut_back(row, shared):
                self.slack.cut_back(row, shared)
                del fed[shared:]
            else:
                self._restart(row)
        return list(text[len(self.fed[row]) :])

    @torch.inference_mode()
    def propose(
        self, rows: Sequence[int], texts: Sequence[Sequence[int]], ks: Sequence[int], sampling: Sampling, generators: Generators
    ) -> Tuple[List[List[int]], List[Optional[torch.Tensor]]]:
        """Each row's guesses and, for a sampled row, the draft's distributions they were drawn from ``(g, V)``."""
        device = self.model.device
        guesses: List[List[int]] = [[] for _ in rows]
        dists: List[List[torch.Tensor]] = [[] for _ in rows]
        feeds = {i: self._sync(row, text) for i, (row, text) in enumerate(zip(rows, texts)) if ks[i] > 0}
        batch = self.cache.max_batch_size
        while feeds:
            seqlens = [0] * batch
            order = sorted(feeds, key=lambda i: rows[i])  # the flat batch is in row order
            for i in order:
                seqlens[rows[i]] = len(feeds[i])
            input_ids = torch.tensor([t for i in order for t in feeds[i]], dtype=torch.long, device=device)
            ends = list(accumulate(seqlens))
            self.slack.save(seqlens)
            logits = self.model(input_ids, seqlens, self.cache, logit_rows=[ends[rows[i]] - 1 for i in order])  # (N, V)
            for i in order:
                self.fed[rows[i]].extend(feeds[i])
            index = torch.tensor([rows[i] for i in order], device=device)
            row_sampling = sampling.rows(index)
            greedy = logits.argmax(dim=-1).tolist()
            sampled = [False] * len(order) if sampling.greedy else (row_sampling.temperature > 0).tolist()
            q = token_distribution(logits, row_sampling) if any(sampled) else None  # (N, V), for sampled rows only
            next_feeds = {}
            for n, i in enumerate(order):
                if sampled[n]:
                    token = draw(q[n], generator_of(generators, rows[i]), device)
                    dists[i].append(q[n])
                else:
                    token = greedy[n]
                guesses[i].append(token)
                if len(guesses[i]) < ks[i]:
                    next_feeds[i] = [token]  # the last guess is never read: the model checks it
            feeds = next_feeds
        return guesses, [torch.stack(d) if d else None for d in dists]


class Proposer(Protocol):
    """What ``decode_speculative`` asks of a proposer (``PromptLookup``, ``DraftModel``, or one of a
    researcher's own): ``begin`` once a call, before its first guesses, with the rows, their longest
    text and the most tokens a row steps back; ``propose`` each step: each row's guesses (at most its
    k) and the distributions they were drawn from (``(g, V)``, None where they are certain);
    ``adaptive``: k moves per row with the guesses' success; ``stats``: what it gained, over every call."""

    adaptive: bool
    stats: SpeculativeStats

    def begin(self, model: Transformer, batch: int, max_seqlen: int, slack: int, continuing: bool) -> None: ...

    def propose(
        self, rows: Sequence[int], texts: Sequence[Sequence[int]], ks: Sequence[int], sampling: Sampling, generators: Generators
    ) -> Tuple[List[List[int]], List[Optional[torch.Tensor]]]: ...


def proposer_of(draft: object) -> Proposer:
    """``generate``'s ``draft=``: ``"ngram"`` (prompt lookup), a model (``DraftModel``), or a proposer as it is."""
    if hasattr(draft, "propose"):
        return draft  # type: ignore[return-value]
    if isinstance(draft, str):
        if draft != "ngram":
            raise GenerationError(f"draft={draft!r}: give 'ngram' (prompt lookup) or a loaded draft model")
        return PromptLookup()
    return DraftModel(draft)  # type: ignore[arg-type]


def generator_of(generators: Generators, row: int) -> Optional[torch.Generator]:
    """Row ``row``'s generator: its own in a list, else the batch's (None: torch's default)."""
    if isinstance(generators, (list, tuple)):
        return generators[row]
    return generators


def draw(probs: torch.Tensor, generator: Optional[torch.Generator], device) -> int:
    """A token drawn from ``probs`` ``(V,)`` (not necessarily normalised) with one uniform number."""
    cumulative = torch.cumsum(probs.float(), dim=0)
    target = torch.rand(1, generator=generator, device=device) * cumulative[-1]
    return int(torch.searchsorted(cumulative, target, right=True).clamp_max(probs.shape[0] - 1))


def accept(
    p: torch.Tensor, guess: Optional[int], q: Optional[torch.Tensor], generator: Optional[torch.Generator]
) -> Tuple[int, bool]:
    """The token at one checked position of a sampled row and whether it is the guess: rejection
    sampling (module docstring). ``p`` ``(V,)``: the model's distribution there; ``guess`` None after
    the last guess (the token is drawn from p); ``q`` ``(V,)`` the proposer's, None where the guess was
    certain.

    Example, p = [0.5, 0.3, 0.2], guess 1 from q = [0.1, 0.6, 0.3]: accepted with probability
    0.3 / 0.6 = 0.5; else drawn from max(0, p - q) = [0.4, 0, 0]: token 0. Over q's guesses, token 1
    comes out with probability q(1) * 0.5 = 0.3 = p(1): the guess q favours is cut down to p's share.
    """
    device = p.device
    if guess is None:
        return draw(p, generator, device), False
    q_guess = 1.0 if q is None else float(q[guess])
    if float(torch.rand(1, generator=generator, device=device)) * q_guess < float(p[guess]):
        return guess, True
    if q is None:
        residual = p.clone()
        residual[guess] = 0
    else:
        residual = (p - q).clamp_min(0)
    if float(residual.sum()) <= 0:  # p is q (up to rounding): nothing left to correct
        residual = p
    return draw(residual, generator, device), False


@dataclass
class RowStep:
    """One row's part of a verify pass: where its logits start in the pass's, its guesses, their q."""

    row: int
    start: int
    guesses: List[int]
    q: Optional[torch.Tensor] = None  # (g, V), None where the guesses were certain
    read: int = 0  # positions whose logits were read: the tokens of the pass the row keeps
    accepted: int = 0
    emitted: int = 0


@dataclass
class Speculation:
    """Speculative decoding's settings: the proposer, the most guesses a row checks per step, and
    (``context``) per row the tokens a cache already holds before a call's prompt, which the proposer
    reads as the start of the row's text (a ``Conversation``'s earlier turns); ``stats``: what it
    gained, over every call it served (the proposer's own count too)."""

    proposer: Proposer
    tokens: int = DEFAULT_SPECULATIVE_TOKENS
    context: Optional[List[List[int]]] = None
    stats: SpeculativeStats = field(default_factory=SpeculativeStats)


def check_speculation(draft: object, speculative_tokens: Optional[int]) -> Optional[Speculation]:
    """``generate``'s ``draft`` and ``speculative_tokens`` checked, as a ``Speculation`` (None: plain
    decoding). ``draft`` may be a ``Speculation`` already (``speculative_tokens`` then changes its k)."""
    if draft is None:
        if speculative_tokens is not None:
            raise GenerationError("speculative_tokens needs draft= (a draft model, or 'ngram' for prompt lookup)")
        return None
    k = DEFAULT_SPECULATIVE_TOKENS if speculative_tokens is None else as_int(speculative_tokens)
    if k is None or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise GenerationError(f"speculative_tokens={speculative_tokens!r} must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}")
    if isinstance(draft, Speculation):
        if speculative_tokens is not None:
            draft.tokens = k
        return draft
    return Speculation(proposer_of(draft), k)


def decode_speculative(
    model: Transformer,
    cache: RotatingBufferCache,
    logits: torch.Tensor,  # (B, V) after each prompt's last token
    settings: DecodeSettings,
    generated: List[List[int]],
    logprobs: List[List[float]],
    prompts: Sequence[Sequence[int]],
    speculation: Speculation,
    verify: Callable[[RotatingBufferCache, List[Piece]], torch.Tensor],
    k: Optional[int] = None,
) -> None:
    """The decode loop with a proposer: each step checks every running row's last token and guesses
    in one pass (``verify(cache, pieces)``: the logits after every token of the pieces, in order,
    ``(T, V)``; it counts them as seen), then chooses each row's tokens position by position (module
    docstring). ``k``: the most guesses a row checks (``speculation.tokens`` if None). The cache ends
    as plain decoding leaves it: every token fed but each row's last."""
    device = model.device
    k_max, proposer = speculation.tokens if k is None else k, speculation.proposer
    ks = [min(k_max, 2) if proposer.adaptive else k_max for _ in generated]
    previous_slack = cache.slack
    slack = SlackSlots(cache, max(k_max, 1))
    try:
        # The first token, from the prompts' logits, as plain decoding chooses it.
        active = choose_positions(logits, [RowStep(row, row, []) for row in range(len(generated))], settings, generated, logprobs, device)
        while active:
            context = speculation.context
            texts = [(context[row] if context else []) + list(prompts[row]) + generated[row] for row in active]  # last one unread
            room = [min(ks[row], settings.max_tokens - len(generated[row]) - 1) for row in active]
            guesses, q = proposer.propose(active, texts, room, settings.sampling, settings.generator)
            pieces = [(row, cache.tokens_seen[row], [generated[row][-1]] + g) for row, g in zip(active, guesses)]
            seqlens = [0] * len(cache.tokens_seen)
            for row, _, tokens in pieces:
                seqlens[row] = len(tokens)
            slack.save(seqlens)  # before the pass writes over them
            out = verify(cache, pieces)  # (T, V)
            if not torch.isfinite(out).all():
                raise GenerationError("the model produced NaN or inf logits while checking guesses: the weights may be broken")
            starts = accumulate([len(tokens) for _, _, tokens in pieces], initial=0)
            steps = [RowStep(row, start, g, dist) for (row, _, _), start, g, dist in zip(pieces, starts, guesses, q)]
            still = set(choose_positions(out, steps, settings, generated, logprobs, device))
            for step, (row, seen, _) in zip(steps, pieces):
                slack.cut_back(row, seen + step.read)  # the guesses after the last one read are forgotten
                if proposer.adaptive:
                    ks[row] = min(k_max, ks[row] + 2) if step.accepted == len(step.guesses) else max(1, ks[row] - 1)
            step_stats = SpeculativeStats(
                steps=1, row_steps=len(steps), proposed=sum(len(s.guesses) for s in steps),
                accepted=sum(s.accepted for s in steps), emitted=sum(s.emitted for s in steps),
            )  # fmt: skip
            speculation.stats.add(step_stats)
            if proposer.stats is not speculation.stats:
                proposer.stats.add(step_stats)
            active = [row for row in active if row in still]
    finally:
        cache.slack = previous_slack


def choose_checked(
    chosen_from: torch.Tensor,  # (N, V) the rows' logits at one checked position, shaped
    sampling: Sampling,  # the N rows' settings
    guesses: Sequence[Optional[int]],  # each row's guess there, None past its last
    qs: Sequence[Optional[torch.Tensor]],  # (V,) the distribution each guess was drawn from, None: certain
    generators: Sequence[Optional[torch.Generator]],
) -> Tuple[List[int], List[bool]]:
    """Each row's token at one checked position and whether it is the row's guess: a greedy row's
    argmax (as ``sample``), a sampled row's by rejection sampling (``accept``)."""
    greedy = chosen_from.argmax(dim=-1).tolist()
    sampled = [False] * len(greedy) if sampling.greedy else (sampling.temperature > 0).tolist()
    p = token_distribution(chosen_from, sampling) if any(sampled) else None  # (N, V)
    tokens, hits = [], []
    for n, guess in enumerate(guesses):
        if sampled[n]:
            token, hit = accept(p[n], guess, qs[n] if guess is not None else None, generators[n])
        else:
            token, hit = greedy[n], guess is not None and greedy[n] == guess
        tokens.append(token)
        hits.append(hit)
    return tokens, hits


Piece = Tuple[int, int, List[int]]  # (row, tokens it has seen, the tokens it feeds): a verify pass's part


def static_verify(
    model: Transformer, cache: RotatingBufferCache, pieces: List[Piece], k: int,
    compiler: Optional[StepCompiler] = None, grouped_moe: bool = True, row_adapters: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The verify pass in fixed shapes (``steps.mixed_step.verify_logits``): one segment per row of
    the cache, a line of k + 1 places each (``pack_chunk``'s ``line``), so the step's shapes depend on
    the cache and k only. Built by ``compiler`` (``VERIFY``: torch.compile, a CUDA graph on CUDA) or
    run op by op (None). ``row_adapters``: each row's adapter kept apart ``(R,)`` (``formats.adapters``;
    None: none). Counts the pieces' tokens as seen; the logits after each ``(T, V)``."""
    rows, device = cache.max_batch_size, cache.device
    chunk = pack_chunk(pieces, rows * (k + 1), rows, device, line=k + 1)
    seen = cache.tokens_seen + [0] * (rows - len(cache.tokens_seen))
    positions = torch.tensor(seen, dtype=torch.long, device=device)  # (R,)
    kind, adapters = (VERIFY, []) if row_adapters is None else (ADAPTED[VERIFY], [row_adapters])
    if compiler is not None:
        if device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        step = compiler.step(kind, cache, (grouped_moe,), shape=(rows, k + 1))
        out = step(cache.layer_keys, cache.layer_values, positions, chunk, *adapters)
    else:
        step = kind.make(model, tuning_of(model), grouped_moe)
        out = step(cache.layer_keys, cache.layer_values, positions, chunk, *adapters)
    for row, _, tokens in pieces:
        cache.tokens_seen[row] += len(tokens)
    return out[: sum(len(tokens) for _, _, tokens in pieces)]  # (T, V): the pieces' tokens come first


def choose_positions(
    logits: torch.Tensor, steps: List[RowStep], settings: DecodeSettings, generated, logprobs, device
) -> List[int]:
    """Choose each row's tokens from ``logits`` (row ``step.start + j`` after the row's j-th fed
    token), position by position: at position j, each row still checking gets its token as plain
    decoding would choose it (shaped, then greedy or sampled with ``accept``); a row goes on to j + 1
    when its token was its j-th guess and it has not ended. The rows still running after, in order."""
    sampling, shaping, eos = settings.sampling, settings.shaping, settings.eos_id
    still: List[int] = []
    checking, j = list(steps), 0
    while checking:
        rows = [s.row for s in checking]
        model_logits = logits[torch.tensor([s.start + j for s in checking], device=logits.device)]  # (N, V)
        chosen_from = model_logits if shaping is None else shaping.shape(model_logits, rows)
        guesses = [s.guesses[j] if j < len(s.guesses) else None for s in checking]
        qs = [s.q[j] if s.q is not None and j < len(s.guesses) else None for s in checking]
        generators = [generator_of(settings.generator, row) for row in rows]
        tokens, hits = choose_checked(chosen_from, sampling.rows(torch.tensor(rows, device=device)), guesses, qs, generators)
        token_logprob = token_logprobs(model_logits, torch.tensor(tokens, device=device)).tolist()
        emitting = [(s.row, t) for s, t in zip(checking, tokens) if eos is None or t != eos]
        if shaping is not None and emitting:
            shaping.advance(*zip(*emitting))
        going = []
        for s, token, hit, logprob in zip(checking, tokens, hits, token_logprob):
            s.read = j + 1
            if eos is not None and token == eos:
                continue  # the row ends; EOS is not returned
            row = s.row
            generated[row].append(token)
            logprobs[row].append(logprob)
            s.emitted += 1
            s.accepted += hit
            if settings.on_token is not None:
                settings.on_token(row, token)
            if (shaping is not None and shaping.record(row, token)) or len(generated[row]) >= settings.max_tokens:
                continue  # its grammar is complete, its text holds a stop string, or it has its tokens
            (going if hit else still).append(s if hit else row)
        checking, j = going, j + 1
    return sorted(still)
