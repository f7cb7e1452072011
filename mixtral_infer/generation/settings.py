"""Checks of what a caller asks for, made before any work: prompts, a cache's capacity, memory.

Each raises GenerationError with one line naming the value and what was expected. The sampling
settings check themselves (``sampling_params.SamplingParams.check``). ``generate`` and the command
line run the checks first, so a bad setting costs nothing: the command line checks its options
before it even loads the model, or imports torch, so this module imports it only where needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Sequence

from mixtral_infer.errors import GenerationError, as_int

if TYPE_CHECKING:
    import torch

    from mixtral_infer.model.cache import RotatingBufferCache
    from mixtral_infer.model.parallel import Parallel
    from mixtral_infer.model.transformer import ModelArgs, Transformer

DECODE_MODES = ("auto", "eager", "static", "compiled")  # generate(decode=...), --decode


def check_chunk_size(chunk_size: object) -> None:
    """Prompt tokens per prefill chunk: None (the default), or an integer >= 1."""
    if chunk_size is not None and (as_int(chunk_size) is None or as_int(chunk_size) < 1):
        raise GenerationError(f"chunk_size={chunk_size!r} must be an integer >= 1")


def check_context(context: object, label: str = "context") -> Optional[int]:
    """A perplexity segment's length (``generation.perplexity``): None, or an integer >= 2 (a BOS
    and one token to score)."""
    if context is not None and (as_int(context) is None or as_int(context) < 2):
        raise GenerationError(f"{label}={context!r} must be an integer >= 2 (a BOS and one token to score)")
    return None if context is None else as_int(context)


def token_ids(prompt: Sequence[object], index: int | str, vocab_size: int) -> List[int]:
    """A prompt's token ids as Python ints; GenerationError naming the first one that is not an id
    (and the prompt: ``index``, or a name such as ``"the text"``)."""
    name = f"prompt {index}" if isinstance(index, int) else index
    ids = [as_int(token) for token in prompt]
    for token, value in zip(prompt, ids):
        if value is None:
            raise GenerationError(
                f"{name} has token id {token!r} of type {type(token).__name__}: token ids must be integers"
            )
        if not 0 <= value < vocab_size:
            raise GenerationError(f"{name} has token id {value!r} outside the vocabulary [0, {vocab_size})")
    return ids


def proc_kb_field(path: str, field: str) -> Optional[int]:
    """A ``Field:  N kB`` line of a ``/proc`` file in bytes; None where there is none."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def meminfo_bytes(field: str) -> Optional[int]:
    """A ``/proc/meminfo`` field (``MemAvailable``, ``MemTotal``) in bytes; None where there is none."""
    return proc_kb_field("/proc/meminfo", field)


def free_memory(device: torch.device) -> Optional[int]:
    """Bytes that can still be allocated on ``device`` (None when unknown)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    available = meminfo_bytes("MemAvailable")
    if available is not None:
        return available
    try:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def gigabytes(n_bytes: int) -> str:
    return f"{n_bytes / 1e9:.1f} GB"


def check_cache_fits(n_bytes: int, what: str, device: torch.device, advice: str) -> None:
    """Raise GenerationError, before allocating, when ``n_bytes`` exceed the memory free on ``device``."""
    free = free_memory(device)
    if free is not None and n_bytes > free:
        raise GenerationError(f"{what} needs {gigabytes(n_bytes)}, more than the {gigabytes(free)} free on {device}: {advice}")


def cache_slots_needed(model: "Transformer", n_tokens: int) -> List[int]:
    """Slots per sequence each of the model's layers (on this rank) needs for ``n_tokens`` tokens: all of
    them, or the layer's window when smaller (``model.cache.layer_cache_sizes``)."""
    from mixtral_infer.model.cache import layer_cache_sizes

    return layer_cache_sizes(model.layer_windows, n_tokens)


def kv_cache_bytes(args: "ModelArgs", batch: int, n_tokens: int, dtype: torch.dtype, parallel: "Parallel") -> int:
    """Bytes of the keys and values a cache for ``batch`` sequences of ``n_tokens`` tokens holds on this
    rank: the sum over its layers of each one's buffer (a windowed layer's at most its window)."""
    from mixtral_infer.model.cache import layer_cache_sizes

    windows = args.layer_windows
    windows = [windows[i] for i in parallel.layer_range(args.n_layers)]
    slots = sum(layer_cache_sizes(windows, max(n_tokens, 1)))
    n_kv_heads = len(parallel.share(args.n_kv_heads))
    return 2 * batch * slots * n_kv_heads * args.head_dim * dtype.itemsize


def describe_windows(args: "ModelArgs") -> str:
    """The model's attention in a few words: ``no sliding window``, ``window 4096``, or
    ``full attention in 9 of 36 layers, window 32768 in the others``."""
    windows = args.layer_windows
    full = sum(window is None for window in windows)
    windowed = sorted({window for window in windows if window is not None})
    if not windowed:
        return "no sliding window"
    sizes = "window " + "/".join(str(w) for w in windowed)
    return sizes if not full else f"full attention in {full} of {len(windows)} layers, {sizes} in the others"


def check_new_cache(
    args: "ModelArgs", batch: int, n_tokens: int, max_tokens: int, dtype: torch.dtype, device: torch.device,
    parallel: "Parallel",
) -> None:
    """Refuse, with the size, a cache for ``n_tokens`` tokens per sequence that cannot fit in memory."""
    what = (f"max_tokens={max_tokens}: the KV cache for {batch} sequence(s) of up to {n_tokens} tokens "
            f"({describe_windows(args)})")  # fmt: skip
    n_bytes = kv_cache_bytes(args, batch, n_tokens, dtype, parallel)
    check_cache_fits(n_bytes, what, device, "lower max_tokens or the batch")


def check_cache_capacity(
    cache: "RotatingBufferCache", model: "Transformer", prompts: Sequence[Sequence[int]], max_tokens: int
) -> None:
    """A cache handed to ``generate`` (made for the model: ``check_cache_matches``, which ``generate``
    calls first) must hold every sequence to its end (``check_slots``)."""
    seen = cache.tokens_seen or [0] * len(prompts)
    for index, (before, prompt) in enumerate(zip(seen, prompts)):
        what = f"{len(prompt)} prompt tokens + max_tokens={max_tokens}"
        check_slots(cache, model, index, before, len(prompt) + max_tokens, what)


def check_slots(
    cache: "RotatingBufferCache", model: "Transformer", index: int, before: int, more: int, what: str
) -> None:
    """Sequence ``index`` of ``cache``, ``before`` tokens seen, has room for ``more`` (``what`` they
    are). A cache of S slots stores position p in slot p % S: with fewer slots than a sequence needs
    (a model without a window, or S below the window) it would silently turn into a sliding window
    of S tokens."""
    n_tokens = before + more
    short = [(held, needed) for held, needed in zip(cache.layer_sizes, cache_slots_needed(model, n_tokens)) if held < needed]
    if short:
        held, needed = short[0]
        raise GenerationError(
            f"the cache holds {held} slots per sequence, but sequence {index} needs "
            f"{needed} ({before} already seen + {what}): make it with "
            f"model.make_cache(batch, max_seqlen={n_tokens}) or larger"
        )


def check_cache_matches(cache: "RotatingBufferCache", model: "Transformer") -> None:
    """The cache was made for this model: its layers, KV heads, head size, dtype, device and window
    (``model.make_cache``); GenerationError otherwise (a dtype that differs was index_copy_'s error)."""
    from mixtral_infer.model.cache import RotatingBufferCache

    if not isinstance(cache, RotatingBufferCache):
        raise GenerationError(f"cache={cache!r:.40} must be a cache from model.make_cache(batch), or None")
    expected = (len(model.layer_ids), len(model.parallel.share(model.args.n_kv_heads)), model.args.head_dim)
    got = (cache.n_layers, cache.n_kv_heads, cache.head_dim)
    if got != expected or cache.dtype != model.dtype or cache.device != model.device:
        raise GenerationError(
            f"the cache (layers, KV heads, head dim = {got}, {cache.dtype}, {cache.device}) does not fit the "
            f"model ({expected}, {model.dtype}, {model.device}): make it with model.make_cache"
        )
    windows = model.layer_windows
    if cache.layer_windows != windows:
        made, has = (w[0] if len(set(w)) == 1 else w for w in (cache.layer_windows, windows))
        raise GenerationError(
            f"the cache was made for sliding_window={made}, the model has "
            f"sliding_window={has}: make it with model.make_cache"
        )


def integers(values: object, name: str) -> List[int]:
    """``values`` (a list, tuple or 1-D tensor of integers) as Python ints; GenerationError otherwise
    (bools and floats too: a mask of bools read as indices 0 and 1, 2.7 as 2)."""
    import torch

    if isinstance(values, torch.Tensor) and values.dim() == 1:
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise GenerationError(f"{name}={values!r:.40} must be a list of integers")
    ints = [as_int(v) for v in values]
    if any(v is None for v in ints):
        raise GenerationError(f"{name}={list(values)!r:.60} must be a list of integers")
    return ints


def check_forward_inputs(
    model: "Transformer", input_ids: object, seqlens: object, cache: object, logit_rows: object
) -> "tuple[List[int], Optional[List[int]]]":
    """``model.forward``'s arguments checked before any work, GenerationError naming the first that
    cannot be (torch's own errors say little: an arange's step sign, an embedding's index);
    ``seqlens`` and ``logit_rows`` as lists of ints (tensors of them taken, bools and floats not)."""
    import torch

    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise GenerationError(f"input_ids must be a 1-D tensor of every sequence's token ids, concatenated; got {shape}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise GenerationError(f"input_ids must be an integer tensor of token ids, got {input_ids.dtype}")
    lengths = integers(seqlens, "seqlens")
    if any(n < 0 for n in lengths) or sum(lengths) != input_ids.shape[0]:
        raise GenerationError(f"seqlens={lengths!r:.60} must be lengths >= 0 that add up to the {input_ids.shape[0]} input_ids")
    if model.parallel.is_first_stage and input_ids.device.type == "cpu" and input_ids.numel():  # no sync on a GPU
        low, high = (int(v) for v in torch.aminmax(input_ids))
        if low < 0 or high >= model.args.vocab_size:
            outside = low if low < 0 else high
            raise GenerationError(f"input_ids has token id {outside} outside the vocabulary [0, {model.args.vocab_size})")
    rows = None if logit_rows is None else integers(logit_rows, "logit_rows")
    if rows is not None and any(not 0 <= r < input_ids.shape[0] for r in rows):
        raise GenerationError(f"logit_rows={rows!r:.60} must index the {input_ids.shape[0]} input_ids")
    if cache is not None:
        check_cache_matches(cache, model)  # (a damaged cache is refused by the forward itself)
        for index, (before, n) in enumerate(zip(cache.tokens_seen or [0] * len(lengths), lengths)):
            check_slots(cache, model, index, before, n, f"{n}")  # fewer slots would make a shorter window
    return lengths, rows


def forward(
    model: "Transformer",
    input_ids: "torch.Tensor",
    seqlens: Sequence[int],
    cache: "Optional[RotatingBufferCache]" = None,
    logit_rows: Optional[Sequence[int]] = None,
) -> "torch.Tensor":
    """``model(input_ids, seqlens, cache, logit_rows)`` with its inputs checked first
    (``check_forward_inputs``): the model's own forward checks nothing, so research code that
    feeds it what users typed calls this instead."""
    lengths, rows = check_forward_inputs(model, input_ids, seqlens, cache, logit_rows)
    return model(input_ids, lengths, cache, logit_rows=rows)
