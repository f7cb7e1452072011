"""A batch of prompts that begin alike reads their common beginning once.

Few-shot prompts, a system prompt before each question, one document asked several things: the
prompts of a batch often share their first hundreds of tokens. ``generate`` reads those tokens into
the first row of the cache only and copies that row's state into the others (the row holds exactly
the prefix, so the copy is exact however long it is, past the window too), then reads each prompt's
own tokens as usual.

Example: prompts ``[1 7 7 7 ... 7 4 5]`` and ``[1 7 7 7 ... 7 9]`` sharing 40 tokens: row 0 reads
40 tokens, rows 1.. get a copy, then the rows read ``[4 5]`` and ``[9]``: 43 tokens read, not 83.
The logprob of each prompt's first own token comes from the logits after the shared part.

A prompt given twice or more (``LLM``'s ``n`` answers of one prompt) is read once whatever its length:
the rows that repeat it sit the prefill out and get a copy of the first one's row, its logits and its
logprobs (``repeated_prompts``, ``copy_repeated_rows``).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from mixtral_infer.generation.settings import forward
from mixtral_infer.model.cache import RotatingBufferCache
from mixtral_infer.model.transformer import Transformer

MIN_SHARED_TOKENS = 16  # a shorter common beginning is read with the rest


def shared_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """Tokens every prompt begins with, leaving each at least one of its own (its last token gives the
    first new one); 0 for one prompt or fewer than ``MIN_SHARED_TOKENS`` in common.

    ``shared_prefix_length([[1] * 20 + [4], [1] * 20 + [9, 9]]) == 20``.
    """
    if len(prompts) < 2:
        return 0
    length = min(len(p) for p in prompts) - 1
    first = prompts[0]
    for prompt in prompts[1:]:
        n = 0
        while n < length and prompt[n] == first[n]:
            n += 1
        length = n
    return length if length >= MIN_SHARED_TOKENS else 0


def repeated_prompts(prompts: Sequence[Sequence[int]]) -> List[int]:
    """For each prompt, the first row with the same tokens (itself where none comes before it).

    ``repeated_prompts([[1, 5], [1, 6], [1, 5], [1, 5]]) == [0, 1, 0, 0]``.
    """
    first: Dict[Tuple[int, ...], int] = {}
    return [first.setdefault(tuple(prompt), row) for row, prompt in enumerate(prompts)]


def copy_repeated_rows(cache: RotatingBufferCache, same_as: Sequence[int]) -> None:
    """Row ``i`` of ``cache`` takes the state of row ``same_as[i]``, which has read the same prompt."""
    for row, source in enumerate(same_as):
        if source != row:
            cache.copy_row(source, row)
            cache.tokens_seen[row] = cache.tokens_seen[source]


def read_shared_prefix(
    model: Transformer,
    cache: RotatingBufferCache,
    prefix: Sequence[int],
    chunk_size: int,
    with_logprobs: bool,
) -> Tuple[torch.Tensor, Optional[List[float]]]:
    """Read ``prefix`` into row 0 of a cache whose sequences have just started, in chunks of
    ``chunk_size``, and give every row that state. Returns the logits after its last token ``(V,)``
    and, ``with_logprobs``, the log-probability of each of its tokens after the first."""
    batch = len(cache.tokens_seen)
    logprobs: Optional[List[float]] = [] if with_logprobs else None
    last: Optional[torch.Tensor] = None
    for start in range(0, len(prefix), chunk_size):
        chunk = list(prefix[start : start + chunk_size])
        input_ids = torch.tensor(chunk, dtype=torch.long, device=model.device)  # (n,)
        seqlens = [len(chunk)] + [0] * (batch - 1)
        if with_logprobs:
            logits = forward(model, input_ids, seqlens, cache)  # (n, V)
            targets = list(prefix[start + 1 : start + len(chunk) + 1])
            if targets:
                scores = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
                logprobs.extend(scores.gather(1, torch.tensor(targets, device=logits.device)[:, None])[:, 0].tolist())
            last = logits[-1].clone()
        else:
            last = forward(model, input_ids, seqlens, cache, logit_rows=[len(chunk) - 1])[0]  # (V,)
    for row in range(1, batch):  # row 0's state into every row
        cache.copy_row(0, row)
        cache.tokens_seen[row] = cache.tokens_seen[0]
    assert last is not None
    return last, logprobs
