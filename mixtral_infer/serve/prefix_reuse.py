"""Which cache row a new request continues, and from how many of its tokens.

A row of the rotating cache holds the keys and values of the last ``S`` positions of its
sequence (position ``p`` in slot ``p % S``), with ``S`` the window ``W`` (or, without a window,
the longest sequence a row takes). A windowed model continuing a sequence of ``m`` tokens reads
only positions ``m - W .. m - 1``, so a row is a complete state of its sequence however long the
conversation was. When a request has finished, its row keeps its contents and the token ids they
came from (``RowState.ids``) until another request needs the row.

Cutting a row back. In a layer of ``S`` slots, a row that has seen ``h`` tokens holds positions
``max(0, h - S) .. h - 1`` in its buffer, and beside it, with slack (``model.cache.SlackSlots``),
the last ``saved`` positions the buffer pushed out: it holds positions ``held_from = max(0, h - S) -
saved .. h - 1``. It can serve a sequence of its first ``m <= h`` tokens when it holds the window
before ``m``, positions ``max(0, m - W) .. m - 1``: ``max(0, m - W) >= held_from`` (``can_cut_back``).
So a row that never wrapped (``h <= S``) cuts back anywhere, and a wrapped one steps back ``saved``
tokens (none without slack). Cutting back puts the saved positions the window needs back into
their slots (``SlackSlots.cut_back``); positions ``m .. h - 1`` left in the row are never seen: a row
at position ``m`` attends to slots below ``min(m, S)``, and writes position ``m`` over them as it goes on.

Worked example, ``S = W = 4``, slack 2 (a row keeps up to 2 pushed-out positions):

=====  ==========  =====  ==========================  ======================================
h      buffer      saved  cut back to m               why
=====  ==========  =====  ==========================  ======================================
3      p0 p1 p2 --  0     m = 0 .. 3                  never wrapped
4      p0 p1 p2 p3  0     m = 0 .. 4                  never wrapped (m = W)
5      p4 p1 p2 p3  0     m = 5 only                  no slack: p0 is gone, m = 4 needs p0
5      p4 p1 p2 p3  1     m = 0 .. 5                  p0 saved: it holds p0 .. p4 again
7      p4 p5 p6 p3  2     m = 5, 6, 7                 p1, p2 saved: m = 5 needs p1 .. p4
=====  ==========  =====  ==========================  ======================================

Per layer. Each layer's buffer is sized on its own (``model.cache.layer_cache_sizes``): a windowed
layer holds its window ``W`` (``S = W``), a full-attention one every position of the longest sequence
(``S = max_model_len``, never wrapped). The rule above holds in each layer, and a row can be cut
back to ``m`` only where every layer can: ``reusable_length`` takes the kinds of layers
(``RotatingBufferCache.kinds``) and what each one saved. Ministral's layers, ``[full, W, W, W]``:
the full-attention layers never stand in the way, the windowed ones decide. Worked example,
layers ``[full (64 slots), W = 4]``, slack 2, a row at ``h = 7`` that saved 2 positions in its
windowed layers: the full-attention layer holds ``p0 .. p6`` (cut back anywhere), the windowed one
``p1 .. p6`` (``m >= 5``): the row serves ``m = 5, 6, 7``. A prompt chunk longer than ``S`` pushes
out positions of its own, which no buffer held: ``Transformer.forward`` writes them to the slack
as it goes (``model.cache.slack_writes``); where only the static steps read prompts, the engine
reads the last ``min(slack, S)`` tokens of a long prompt in a step of their own (``Engine._plan``).

Matching. A request's prompt is compared with a row's ids token by token (ids after the chat
template, never text). The longest common prefix ``c`` is cut to the longest length the row can be
cut back to, and to ``len(prompt) - 1`` (the last prompt token is always fed: its logits give the
first new token), giving ``reusable_length``. A row left by a request that ended after its answer
holds the prompt and every answer token but the last sampled one (sampled, never fed); the next turn
of a chat sends the prompt, the whole answer and the next message, so it continues the row at its
exact end, and the answer's last token is the first one fed.

Answers sent back as text. The client sends an answer back as its text, and the chat template
encodes that text again; the ids it gets may differ from those the model generated (a generated
``,`` is encoded back as ``▁ ,``; an answer cut by ``max_tokens`` may end inside a word that encodes
otherwise). A row remembers the answers it generated (``RowState.answers``: where each starts, its
ids, and the text they decode to), those of earlier turns too, since every later prompt sends them
all back. Where a prompt holds the row's ids up to an answer's start and then ids that decode to
the answer's text and end the turn (``answer_length``: a token decoding to nothing follows, EOS or
``<|im_end|>``), the engine reads the generated ids in their place
(``with_generated_answer``), answer after answer: the same text, the ids the row holds, so the next
turn continues the row at its end. Worked example: a row holds ``[1, 7, 8, 30]``, the prompt ``[1, 7,
8]`` and the answer ``[30, 31]`` (``", and"``) but its last token, never fed; the next prompt is ``[1,
7, 8, 29, 30, 31, 2, 9]`` (``"▁", ",", "▁and"``, EOS, the next message), read as ``[1, 7, 8, 30, 31, 2,
9]``: it continues the row at its end, 4 tokens in. A row remembers the answers its prompt holds as
generated (``kept_answers``: found in whichever row, so they are not forgotten where the prompt is
read again in another row), and the one it generates.
The model then reads the ids it wrote, not the template's: a later turn's tokens equal those of
its prompt as read (the request's ``prompt``, and its usage) read whole, not always those of the
template's ids read whole. A completion's prompt that goes on past an answer's text is read as sent.

Placement (``place``): the row with the longest reusable prefix wins (ties: a free row, then the
most recently used). A free row is taken as it is, no copy, when the request continues it at its end, or when no
other free row is left; otherwise the prefix is copied into a free row (only the slots it needs), so
the source keeps its own sequence for its own next turn: this is how a shared system prompt serves
many users. A row that is still running can be a source too (the engine pauses a prompt being read
at the length a waiting request shares with it, so the copy is taken at the row's end, exact even
past the window). Among free rows, one that holds nothing goes first, then the least recently used.
A match shorter than ``MIN_REUSED_TOKENS`` is read again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Collection, List, Optional, Sequence, Tuple

from mixtral_infer.model.cache import BufferKind, can_cut_back  # noqa: F401 (the rule, used here and by speculation)

# A shorter prefix is read again: reading a few tokens costs little, and a prompt read after
# tokens already in its row takes the attention path over the cache, slower for a fresh prompt.
MIN_REUSED_TOKENS = 16


@dataclass
class Answer:
    """An answer a row generated: it begins at ``start`` in the row's ids, ``ids`` are every token
    sampled (the last one never fed when it ended on ``max_tokens`` or a stop string), ``text`` what
    they decode to (``Tokenizer.decode``), found when first asked for."""

    start: int
    ids: List[int]
    text: Optional[str] = None


@dataclass
class RowState:
    """What one row of the cache holds: the token ids of the positions it has seen (their keys and
    values are in the row), when it was last used (a counter: larger is more recent), and the answers
    it generated among them, in order (module docstring, "Answers sent back as text")."""

    ids: List[int] = field(default_factory=list)
    last_used: int = 0
    answers: List[Answer] = field(default_factory=list)
    adapter: int = 0  # the adapter kept apart its keys and values were computed with (0: none): shared only with its requests


@dataclass(frozen=True)
class Placement:
    """Where a request goes: ``row``, starting after ``reused`` tokens; those come from ``source``
    (copied) unless ``source`` is None (already in ``row``, or ``reused`` is 0)."""

    row: int
    reused: int
    source: Optional[int] = None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def reusable_length(
    held: Sequence[int], prompt: Sequence[int], kinds: Sequence[BufferKind], saved: Optional[Sequence[int]] = None
) -> int:
    """How many of ``prompt``'s first tokens a row holding ``held`` can skip: the longest common prefix,
    at most ``len(prompt) - 1``, cut to a length the row can be cut back to in every kind of layer
    (``kinds``: each one's slots and window; ``saved``: the positions each keeps beside its slots,
    none if not given; 0 if none).

    With ``slots = window = 4``, a row that has seen ``[1, 5, 6, 7, 8]`` (wrapped) serves
    ``[1, 5, 6, 7, 8, 9]`` from 5 tokens, but ``[1, 5, 6, 7, 2]`` from none: the row no longer holds
    the state of its first 4 tokens; with position 0 saved (slack) it serves it from 4. A
    full-attention layer of 64 slots beside it changes none of these.
    """
    longest = min(common_prefix(held, prompt), len(prompt) - 1)
    if longest <= 0:
        return 0
    saved = [0] * len(kinds) if saved is None else saved
    fits = all(can_cut_back(len(held), longest, kind.size, kind.window, n) for kind, n in zip(kinds, saved))
    return longest if fits else 0


def place(
    prompt: Sequence[int],
    rows: Sequence[RowState],
    busy: Collection[int],
    kinds: Sequence[BufferKind],
    saved: Optional[Sequence[Sequence[int]]] = None,
    adapter: int = 0,
) -> Optional[Placement]:
    """Where ``prompt`` goes among ``rows``, those in ``busy`` held by running requests (module
    docstring, "Placement"); None when no row is free. ``saved``: per row, the positions each kind
    of layer keeps beside its slots (``SlackSlots.saved``), none if not given. ``adapter``: the
    request's adapter kept apart; only rows computed with it are reused (their keys and values are its)."""
    free = [r for r in range(len(rows)) if r not in busy]
    if not free:
        return None
    best, source, best_key = 0, None, None
    for r, state in enumerate(rows):
        if state.adapter != adapter:
            continue
        n = reusable_length(state.ids, prompt, kinds, None if saved is None else saved[r])
        key = (n, r not in busy, state.last_used)  # the longest; then a free row (no copy); then the most recent
        if n > 0 and (best_key is None or key > best_key):
            best, source, best_key = n, r, key
    spare = spare_rows(rows, free)
    if source is None or best < MIN_REUSED_TOKENS:
        return Placement(spare[0], 0)
    others = [r for r in spare if r != source]
    if source not in busy and (best == len(rows[source].ids) or not others):
        return Placement(source, best)  # continued where it is, nothing copied
    return Placement(others[0], best, source)


def spare_rows(rows: Sequence[RowState], free: Sequence[int]) -> List[int]:
    """The ``free`` rows, the ones worth least first: those holding nothing, then the least recently used."""
    return sorted(free, key=lambda r: (len(rows[r].ids) > 0, rows[r].last_used))


# How far from the generated answer's length its text encoded again may be, in tokens (answer_length):
# each difference is a word or a space the model wrote in other pieces than the tokenizer would.
ANSWER_LENGTH_SPREAD = 8


def answer_length(
    prompt: Sequence[int], answer: Answer, decode: Callable[[List[int]], str], encode: Callable[[str], List[int]]
) -> Optional[int]:
    """How many of ``prompt``'s ids from ``answer.start`` on decode to the answer's text, where the
    turn ends there, if some do: first as many as the text encodes to (the chat templates encode an
    answer alone), then lengths near the answer's own, nearest first (at most
    ``ANSWER_LENGTH_SPREAD`` apart); the fewest that do, so that a token decoding to nothing after
    them (EOS) stays. The turn ends where such a token follows (EOS, ChatML's ``<|im_end|>``): a
    prompt that goes on with the answer's text and more (a completion's) is read as sent. None if
    none does.

    >>> pieces = {29: "", 30: ",", 31: " and", 2: "", 9: " why"}  # 2: EOS, decoded to nothing
    >>> decode = lambda ids: "".join(pieces[i] for i in ids)
    >>> answer_length([1, 7, 8, 29, 30, 31, 2, 9], Answer(3, [30, 31]), decode, lambda text: [29, 30, 31])
    3
    >>> answer_length([1, 7, 8, 29, 30, 31, 9], Answer(3, [30, 31]), decode, lambda text: [29, 30, 31])  # goes on
    >>> answer_length([1, 7, 8, 29, 30, 31], Answer(3, [30, 31, 9]), decode, lambda text: [30, 31, 9])  # cut short
    """
    if answer.text is None:
        answer.text = decode(list(answer.ids))
    start, n = answer.start, len(answer.ids)
    tail = len(prompt) - start
    near = sorted(range(max(1, n - ANSWER_LENGTH_SPREAD), n + ANSWER_LENGTH_SPREAD + 1), key=lambda k: (abs(k - n), k))
    for k in dict.fromkeys([len(encode(answer.text)), *near]):
        if 0 < k <= tail and decode(list(prompt[start : start + k])) == answer.text:
            while k > 1 and decode(list(prompt[start : start + k - 1])) == answer.text:
                k -= 1  # a token that decodes to nothing (EOS, a control token) ends the answer, not in it
            ends_turn = k < tail and decode(list(prompt[start : start + k + 1])) == answer.text
            return k if ends_turn else None
    return None


def with_generated_answer(
    prompt: List[int],
    rows: Sequence[RowState],
    decode: Callable[[List[int]], str],
    encode: Callable[[str], List[int]],
    longest: Optional[int] = None,
) -> Tuple[List[int], List[Answer]]:
    """``prompt`` with the ids rows generated for their answers in place of those that encode the
    answers' text again (module docstring, "Answers sent back as text"), or ``prompt`` itself where
    none is found in it; and the answers it then holds as generated (``kept_answers``), which the
    row it goes to remembers. ``longest``: the most ids the prompt may have (an answer's ids may be
    more than its text encodes to).

    Per row, answer after answer, while the prompt holds the row's ids up to the answer's start; the
    row whose ids the prompt then shares the most of is taken.
    """
    best, held, shared = prompt, [], 0
    for state in rows:
        if not state.answers:
            continue
        rewritten, n = prompt, common_prefix(state.ids, prompt)  # the prompt holds the row's first n ids
        for answer in state.answers:
            start, ids = answer.start, answer.ids
            if not ids or n < start:
                break
            if rewritten[start : start + len(ids)] == ids:
                continue  # sent back as generated
            k = answer_length(rewritten, answer, decode, encode)
            if k is None:
                break
            rewritten = rewritten[:start] + list(ids) + rewritten[start + k :]
            n = start + common_prefix(state.ids[start:], rewritten[start:])
        if longest is not None and len(rewritten) > longest:
            rewritten, n = prompt, common_prefix(state.ids, prompt)
        answers = kept_answers(state.answers, rewritten, n)
        if answers and n > shared:
            best, held, shared = rewritten, answers, n
    return best, held


def kept_answers(answers: Sequence[Answer], prompt: Sequence[int], shared: int) -> List[Answer]:
    """The ``answers`` of a row whose first ``shared`` ids ``prompt`` (as read) holds, that ``prompt``
    sends back as they were generated: those beginning within the shared ids whose ids ``prompt``
    holds there.

    >>> [a.start for a in kept_answers([Answer(3, [30, 31]), Answer(7, [40])], [1, 7, 8, 30, 31, 2, 9, 41], 7)]
    [3]
    """
    return [a for a in answers if a.start <= shared and list(prompt[a.start : a.start + len(a.ids)]) == a.ids]
