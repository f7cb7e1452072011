"""Perplexity of a text under a model: how well it predicts each token from the ones before it.

The text's ids (without BOS) are cut into segments of at most ``context`` tokens, each read after
a BOS of its own, so that every id is predicted exactly once, from the ids before it in its
segment (the first one from the BOS alone); perplexity = exp(summed negative log-likelihood /
ids). Worked example, ids ``[a b c d e f g]`` and ``context=4`` (BOS + 3 ids a segment)::

    segments   [BOS a b c]  [BOS d e f]  [BOS g]
    scored     a | BOS      b | BOS a    c | BOS a b    d | BOS   ...   g | BOS     (7 ids, 3 segments)

Each segment is a prompt to ``generate`` (``max_tokens=0``, ``prompt_logprobs``): read in chunks,
up to ``max_batch_size`` segments at once. A model with a sliding window W reads a segment of any
length in a cache of W slots, so by default its whole text is one segment and each id is
predicted from everything before it; a model without a window keeps every token of a segment in
its cache, so by default its segments are ``DEFAULT_CONTEXT`` tokens long.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

from mixtral_infer.errors import GenerationError, as_int
from mixtral_infer.generation.generate import generate
from mixtral_infer.generation.settings import check_cache_fits, check_context, kv_cache_bytes, token_ids
from mixtral_infer.model.transformer import Transformer

DEFAULT_CONTEXT = 4096  # tokens a segment for a model without a sliding window (BOS included)


@dataclass
class Perplexity:
    perplexity: float  # exp(nll / tokens)
    nll: float  # summed negative log-likelihood of the scored ids, in nats
    tokens: int  # ids scored: every id of the text
    segments: int
    context: Optional[int]  # tokens a segment at most (BOS included); None: the whole text was one

    def __str__(self) -> str:
        cut = f"{self.segments} segments of up to {self.context} tokens" if self.context else "one segment"
        return f"perplexity {self.perplexity:.4f} over {self.tokens} tokens ({cut})"


def text_segments(ids: Sequence[int], context: Optional[int], bos_id: int) -> List[List[int]]:
    """``ids`` cut into segments of BOS + at most ``context - 1`` ids (the module's worked example);
    ``context=None``: one segment."""
    body = len(ids) if context is None else context - 1
    return [[bos_id, *ids[start : start + body]] for start in range(0, len(ids), body)]


def perplexity(
    model: Transformer,
    ids: Sequence[int],
    bos_id: int,
    *,
    context: Optional[int] = None,
    chunk_size: Optional[int] = None,
    on_segments: Optional[Callable[[int, int], None]] = None,
) -> Perplexity:
    """Perplexity of the token ids of a text (``tokenizer.encode(text, bos=False)``) under ``model``.

    ``context``: tokens a segment at most, BOS included (see the module docstring); default: the
    whole text for a model with a sliding window, ``DEFAULT_CONTEXT`` for one without.
    ``on_segments(done, total)`` is called after each batch of segments (progress).
    """
    context = check_context(context)
    if context is None and model.args.full_attention:
        context = DEFAULT_CONTEXT
    if isinstance(ids, (str, bytes)):
        raise GenerationError("ids is text: pass its token ids, tokenizer.encode(text, bos=False)")
    if not hasattr(ids, "__iter__") or (hasattr(ids, "dim") and ids.dim() != 1):  # None; a (1, T) tensor
        raise GenerationError(f"ids={ids!r:.40} must be the text's token ids, a list or a 1-D tensor")
    if on_segments is not None and not callable(on_segments):  # it failed after the first batch was scored
        raise GenerationError(f"on_segments={on_segments!r:.40} must be a function on_segments(done, total), or None")
    if as_int(bos_id) is None or not 0 <= as_int(bos_id) < model.args.vocab_size:
        raise GenerationError(f"bos_id={bos_id!r:.40} must be a token id in [0, {model.args.vocab_size})")
    ids = token_ids(ids, "the text", model.args.vocab_size)
    if not ids:
        raise GenerationError("no tokens to score: the text is empty")
    segments = text_segments(ids, context, bos_id)
    batch = min(model.args.max_batch_size, len(segments))
    longest = max(len(s) for s in segments)
    what = f"scoring {len(segments)} segment(s) of up to {longest} tokens, {batch} at once: their KV cache"
    n_bytes = kv_cache_bytes(model.args, batch, longest, model.dtype, model.parallel)
    check_cache_fits(n_bytes, what, model.device, "pass a smaller context")
    nll = 0.0
    for start in range(0, len(segments), batch):
        group = segments[start : start + batch]
        _, logprobs = generate(group, model, max_tokens=0, chunk_size=chunk_size, decode="eager")
        nll -= math.fsum(lp for scored in logprobs for lp in scored)
        if on_segments is not None:
            on_segments(start + len(group), len(segments))
    return Perplexity(math.exp(nll / len(ids)), nll, len(ids), len(segments), context)
