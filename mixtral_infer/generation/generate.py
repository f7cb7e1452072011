"""Batched generation: chunked prefill of ragged prompts, then token-by-token decoding.

Prompts of different lengths are prefilled together, ``chunk_size`` tokens of each
at a time; a prompt that has run out simply sits the later chunks out (length 0).
Each sequence then decodes until its own EOS; the loop ends when all have.
"""

from __future__ import annotations

import dataclasses
import os
from itertools import accumulate
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from mixtral_infer.errors import GenerationError, as_int
from mixtral_infer.formats.modules import tuning_of
from mixtral_infer.steps.compiler import DECODE
from mixtral_infer.steps.cpu_aot_step import builds_ahead_of_time
from mixtral_infer.steps.decode_loop import DecodeSettings, TokenCallback, compiled_step, decode_static, step_compiler
from mixtral_infer.steps.decode_step import supports_static_decode
from mixtral_infer.sampling import Generators, draw_uniform, sample, token_logprobs
from mixtral_infer.generation.shared_prefix import (
    copy_repeated_rows,
    read_shared_prefix,
    repeated_prompts,
    shared_prefix_length,
)
from mixtral_infer.generation.sampling_params import SamplingParams
from mixtral_infer.generation.speculative import Piece, check_speculation, decode_speculative, static_verify
from mixtral_infer.generation.text_stream import AnswerText
from mixtral_infer.generation.settings import (
    DECODE_MODES,
    check_cache_capacity,
    check_cache_matches,
    check_chunk_size,
    check_new_cache,
    forward,
    token_ids,
)
from mixtral_infer.model.cache import RotatingBufferCache
from mixtral_infer.model.transformer import Transformer
from mixtral_infer.structured.grammar import Constraint, check_constraint
from mixtral_infer.structured.rows import Shaping
from mixtral_infer.tokenizer import Tokenizer

# Prompt tokens per forward pass when no chunk_size is given, over the whole batch. Large
# enough that each expert gets a real matrix product (top-2 of 8 experts: ~512 rows each);
# bounded so that a prefill's activations do not grow with the prompt (docs/performance.md,
# "Prompt-sized products", has the chunk sizes measured).
PREFILL_TOKENS = 2048


def default_chunk_size(batch: int) -> int:
    """Tokens of each prompt per prefill chunk: ``PREFILL_TOKENS`` shared by the batch."""
    return max(1, PREFILL_TOKENS // batch)


GREEDY = SamplingParams(temperature=0.0)  # generate's defaults: greedy (max_tokens has none: it is asked for)


def sampling_params(params: Optional[SamplingParams], given: dict, defaults: SamplingParams = GREEDY) -> SamplingParams:
    """The settings to run: ``params`` (else ``defaults``), with the fields given as keyword
    arguments over it (``generate(..., max_tokens=8, temperature=0.7)``, as before there was an object)."""
    if params is not None and not isinstance(params, SamplingParams):
        raise GenerationError(f"params must be a SamplingParams, got {type(params).__name__}")
    unknown = sorted(set(given) - set(SamplingParams.names()))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {unknown}: the sampling settings are {SamplingParams.names()}")
    return (defaults if params is None else params).updated(given)


def check_settings(
    encoded_prompts: Sequence[Sequence[int]],
    model: Transformer,
    params: SamplingParams,
    chunk_size: Optional[int],
    max_batch_size: int,
    eos_id: Optional[int] = None,
    on_token: Optional[TokenCallback] = None,
) -> Tuple[List[List[int]], SamplingParams]:
    """Raise GenerationError, before any work, on settings out of range; the prompts as lists of ints,
    and the settings checked (``SamplingParams.check``).

    Token ids may be any integers (numpy's, 0-d torch tensors); they come back as Python ints.
    The prompts may be a list of lists, of tensors or arrays, or a ``(B, T)`` tensor or array.
    """
    params.check()  # the per-prompt lists are matched to the prompts below
    check_chunk_size(chunk_size)
    if params.n != 1:
        raise GenerationError(f"n={params.n!r}: generate gives one answer per prompt; give a prompt n times (LLM.generate does)")
    if isinstance(encoded_prompts, (str, bytes, set, frozenset, dict)) or not hasattr(encoded_prompts, "__len__"):
        raise GenerationError(
            f"encoded_prompts={encoded_prompts!r:.40}: pass a list of prompts, each a list of token ids "
            "(tokenizer.encode(text, bos=True))"
        )
    if len(encoded_prompts) == 0:
        raise GenerationError("no prompts given: pass a list with at least one encoded prompt")
    if as_int(encoded_prompts[0]) is not None:  # [1, 415, ...] or a 1-D tensor: one prompt, not a list of them
        raise GenerationError(
            f"encoded_prompts={encoded_prompts!r:.40} holds token ids, not prompts: pass a list of prompts, [ids]"
        )
    prompts = []
    for index, prompt in enumerate(encoded_prompts):
        if isinstance(prompt, (str, bytes)):
            raise GenerationError(
                f"prompt {index} is text ({prompt!r:.40}): encode it first, tokenizer.encode(text, bos=True)"
            )
        if not hasattr(prompt, "__len__") or as_int(prompt) is not None:
            raise GenerationError(f"prompt {index} is {prompt!r:.40}, not a list of token ids")
        if len(prompt) == 0:
            raise GenerationError(f"prompt {index} is empty: encode it with bos=True or give at least one token")
        prompts.append(token_ids(prompt, index, model.args.vocab_size))
    if len(prompts) > max_batch_size:
        larger = "load the model with a larger max_batch_size"
        if max_batch_size != model.args.max_batch_size:  # the limit is a cache's: generate(cache=...)
            larger = "make the cache for more, model.make_cache(batch)"
        raise GenerationError(f"{len(prompts)} prompts exceed max_batch_size={max_batch_size}: pass fewer prompts or {larger}")
    params = params.check(len(prompts), model.args.vocab_size)
    if on_token is not None and not callable(on_token):
        raise GenerationError(f"on_token={on_token!r:.40} must be a function on_token(prompt_index, token), or None")
    eos = None if eos_id is None else as_int(eos_id)
    if eos_id is not None and (eos is None or not 0 <= eos < model.args.vocab_size):
        vocab = model.args.vocab_size
        raise GenerationError(f"eos_id={eos_id!r} must be a token id in [0, {vocab}), or None for no end token")
    return prompts, params


def _check_finite(logits: torch.Tensor, where: str) -> None:
    if not torch.isfinite(logits).all():
        raise GenerationError(f"the model produced NaN or inf logits {where}: the weights may be broken")


def prompt_chunks(
    encoded_prompts: Sequence[Sequence[int]], chunk_size: int, device: torch.device
) -> Iterator[Tuple[int, List[int], torch.Tensor, List[int]]]:
    """``(start, lengths, input_ids, ends)`` of each prefill chunk: tokens ``start .. start +
    chunk_size - 1`` of every prompt, flat ``(T,)``; ``ends`` lists the prompts that end in it.

    Prompts ``[a b c d e]``, ``[f g]`` in chunks of 2: ``(0, [2, 2], [a b f g], [1])``,
    ``(2, [2, 0], [c d], [])``, ``(4, [1, 0], [e], [0])``: the short prompt sits the later chunks out.
    """
    longest = max(len(p) for p in encoded_prompts)
    for start in range(0, longest, chunk_size):
        chunks = [list(p[start : start + chunk_size]) for p in encoded_prompts]
        lengths = [len(c) for c in chunks]
        input_ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=device)
        ends = [i for i, (p, n) in enumerate(zip(encoded_prompts, lengths)) if n and start + n == len(p)]
        yield start, lengths, input_ids, ends


def prefill(
    model: Transformer,
    cache: RotatingBufferCache,
    encoded_prompts: Sequence[Sequence[int]],
    chunk_size: int,
    same_as: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """Read every prompt into the cache in chunks; the logits after each prompt's last token ``(B, V)``.

    Only the rows of those last tokens go through the output matrix (``Transformer.forward``'s
    ``logit_rows``): what generation needs. ``same_as[i]``: the row whose prompt row ``i`` repeats
    (``shared_prefix.repeated_prompts``); a repeat is not read but copied.
    """
    same_as = list(range(len(encoded_prompts))) if same_as is None else same_as
    encoded_prompts = [p if same_as[i] == i else [] for i, p in enumerate(encoded_prompts)]
    last_logits: List[Optional[torch.Tensor]] = [None] * len(encoded_prompts)
    for start, lengths, input_ids, ends in prompt_chunks(encoded_prompts, chunk_size, model.device):
        ends_at = list(accumulate(lengths))  # each sequence's end in the flat chunk
        logits = forward(model, input_ids, lengths, cache, logit_rows=[ends_at[i] - 1 for i in ends])  # (len(ends), V)
        _check_finite(logits, f"while reading the prompts (tokens {start}..{start + max(lengths) - 1})")
        for row, i in enumerate(ends):
            last_logits[i] = logits[row]
    copy_repeated_rows(cache, same_as)
    return torch.stack([last_logits[source] for source in same_as])  # type: ignore[misc]


def prefill_with_logprobs(
    model: Transformer,
    cache: RotatingBufferCache,
    encoded_prompts: Sequence[Sequence[int]],
    chunk_size: int,
    same_as: Optional[Sequence[int]] = None,
) -> Tuple[torch.Tensor, List[List[float]]]:
    """``prefill``, scoring the prompts too: the logits after each prompt's last token ``(B, V)``
    and, per prompt, the log-probability of each of its tokens after the first."""
    same_as = list(range(len(encoded_prompts))) if same_as is None else same_as
    encoded_prompts = [p if same_as[i] == i else [] for i, p in enumerate(encoded_prompts)]
    last_logits: List[Optional[torch.Tensor]] = [None] * len(encoded_prompts)
    prompt_logprobs: List[List[float]] = [[] for _ in encoded_prompts]
    for start, lengths, input_ids, ends in prompt_chunks(encoded_prompts, chunk_size, model.device):
        logits = forward(model, input_ids, lengths, cache)  # (T, V)
        _check_finite(logits, f"while reading the prompts (tokens {start}..{start + max(lengths) - 1})")
        normalizer = torch.logsumexp(logits, dim=-1)  # (T,), so no second (T, V) tensor for log_softmax
        offset = 0
        for i, (prompt, n) in enumerate(zip(encoded_prompts, lengths)):
            # Row j of this chunk predicts prompt token start + j + 1 (when there is one).
            targets = list(prompt[start + 1 : start + n + 1])
            if targets:
                rows = slice(offset, offset + len(targets))
                index = torch.tensor(targets, device=logits.device)[:, None]
                prompt_logprobs[i].extend((logits[rows].gather(1, index)[:, 0] - normalizer[rows]).tolist())
            if i in ends:
                last_logits[i] = logits[offset + n - 1].clone()  # not a view that keeps the chunk's (T, V) alive
            offset += n
    copy_repeated_rows(cache, same_as)
    return torch.stack([last_logits[s] for s in same_as]), [list(prompt_logprobs[s]) for s in same_as]  # type: ignore[misc]


BACKGROUND_VARIABLE = "MIXTRAL_INFER_BACKGROUND_COMPILE"  # "0": decode="auto" on CPU stays eager


def decode_mode(decode: str, model: Transformer) -> str:
    """``eager``, ``static`` or ``compiled`` for the requested ``decode`` setting.

    ``auto`` is ``compiled`` on CUDA (the eager loop there is bound by the host, not the GPU).
    On CPU, where compiling takes longer than a short generation gains (docs/performance.md,
    "Compiled steps"), it is ``background``: the eager loop decodes while AOTInductor builds the
    compiled step in a child process, which takes over once built (``decode_then_compiled``;
    kept on disk, so the next run loads it before its first token); ``eager`` where AOTInductor cannot build
    the step (``builds_ahead_of_time``, ``Tuning.ahead_of_time``) or with
    ``MIXTRAL_INFER_BACKGROUND_COMPILE=0``. ``eager`` for a reference model
    (``load_model(..., fast=False)``), which reads its readable path only.
    """
    if decode not in DECODE_MODES:
        raise GenerationError(f"decode={decode!r} must be one of {', '.join(DECODE_MODES)}")
    if decode == "auto":
        tuning = tuning_of(model)
        if not tuning.fast or not supports_static_decode(model):
            return "eager"
        if model.device.type == "cuda":
            return "compiled"
        background = os.environ.get(BACKGROUND_VARIABLE, "1") not in ("0", "false", "no")
        ahead = model.device.type == "cpu" and tuning.ahead_of_time and builds_ahead_of_time(model)
        return "background" if background and ahead else "eager"
    if decode != "eager" and not supports_static_decode(model):
        raise GenerationError(f"decode={decode!r} needs the whole model in one process; use decode='eager'")
    return decode


@torch.inference_mode()
def generate(
    encoded_prompts: Sequence[Sequence[int]],
    model: Transformer,
    params: Optional[SamplingParams] = None,
    *,
    chunk_size: Optional[int] = None,
    eos_id: Optional[int] = None,
    cache: Optional[RotatingBufferCache] = None,
    on_token: Optional[TokenCallback] = None,
    prompt_logprobs: bool = True,
    decode: str = "auto",
    tokenizer: Optional[Tokenizer] = None,
    leading_space: bool = True,
    draft: object = None,
    speculative_tokens: Optional[int] = None,
    **sampling: Any,
) -> Tuple[List[List[int]], List[List[float]]]:
    """Continue each prompt by up to ``params.max_tokens`` tokens.

    ``params``: how to choose tokens (``SamplingParams``); its fields may be given as keyword
    arguments instead, or over it (``generate(prompts, model, max_tokens=8, temperature=0.7)``); here the
    temperature is 0 (greedy) unless given, and ``max_tokens`` must be. ``ignore_eos``: no row ends
    at ``eos_id``.

    Returns ``(generated, logprobs)``: ``generated[i]`` are prompt i's new tokens
    (EOS not included); ``logprobs[i]`` the log-probability of every prompt token
    after the first, then of every generated token. With ``prompt_logprobs=False``,
    ``logprobs[i]`` holds the generated tokens' only, and the prefill computes logits
    for each prompt's last token alone (faster; the tokens are the same).

    ``chunk_size``: prompt tokens of each sequence per forward pass; by default
    ``default_chunk_size(B)``, 2048 tokens shared by the B prompts. Any size gives the
    same results; it trades the activations' memory for speed.

    Prompts that begin alike (16 tokens or more, common to all) read that beginning once, and a
    prompt given several times is read once (``generation.shared_prefix``); the results are those of
    reading each prompt whole.

    ``cache``: continue sequences already in this cache (a conversation); the
    prompts are then appended to what it holds. Left None, a fresh cache is made.
    The cache holds what was fed: the prompt and every generated token but the last,
    which is sampled and never read back. To continue after it, begin the next prompt
    with ``generated[i][-1]`` (as ``generation.chat.Conversation`` does).
    ``on_token(i, token)`` is called as each token of prompt i is chosen (streaming).

    ``params.seed``: each prompt samples from a generator of its own, seeded with it (as the server's
    requests and vLLM's), so a prompt's tokens are those it gets alone, in any batch; a list gives
    each prompt its seed. None: one unseeded generator for the batch.

    What the answers must be, and how tokens are chosen (``params``' fields, as the server takes them;
    each needs ``tokenizer`` where it is about text): ``json_schema`` (a dict or its JSON text), ``regex``,
    ``choices`` (a list of strings) or ``grammar`` (Lark): the text of every answer follows it
    (``structured.grammar``, llguidance), and a row ends when it is complete. ``stop``: strings
    that end a row once its text holds one (its tokens up to the one that completed it are
    returned); the text is the server's (``generation.text_stream.AnswerText``): with
    ``leading_space`` (a continuation of the prompt) it keeps the space before its first word,
    without it (a chat's answer) it does not. ``presence_penalty``, ``frequency_penalty`` (OpenAI's), ``repetition_penalty``
    (transformers'): one number for every prompt, or a list of one per prompt; ``logit_bias`` (token id to a number added to its logit), ``min_tokens``
    (EOS held back until then): ``structured.logits``. Logprobs stay the model's.

    ``decode``: how the tokens after the prompt are produced, all with the same results:
    ``eager`` runs ``Transformer.forward`` per step (the readable reference); ``static``
    runs the fixed-shape step of ``mixtral_infer.steps.decode_step`` op by op; ``compiled``
    runs that step through ``torch.compile`` (on CUDA as a CUDA graph; on CPU built by
    AOTInductor, ``steps/cpu_aot_step.py``); ``auto``: compiled on CUDA, and on CPU eager while
    the compiled step is built in the background, compiled once it is (``decode_mode``).

    ``draft``: speculative decoding (``generation.speculative``), the same tokens (greedy) or the same
    distribution (sampling) in fewer passes: ``"ngram"`` (prompt lookup), a smaller model of the same
    tokenizer (``load_model``; a ``DraftModel`` of it keeps its cache between calls), or a proposer.
    ``speculative_tokens``: the most guesses a row checks per pass (4). Each pass checks them with
    ``Transformer.forward`` (``eager``) or the mixed step's verify step (``static``, ``compiled``). What
    it gained is added to the proposer's ``stats`` (``SpeculativeStats``).
    """
    if params is None and "max_tokens" not in sampling:
        raise TypeError("generate() needs max_tokens= (or params=SamplingParams(max_tokens=...))")
    params = sampling_params(params, sampling)
    if cache is not None:
        check_cache_matches(cache, model)  # made for this model (its batch limit is read next)
    max_batch_size = cache.max_batch_size if cache is not None else model.args.max_batch_size
    encoded_prompts, params = check_settings(encoded_prompts, model, params, chunk_size, max_batch_size, eos_id, on_token)
    eos_id = None if eos_id is None or params.ignore_eos else int(eos_id)
    max_tokens, chunk_size = params.max_tokens, None if chunk_size is None else int(chunk_size)
    grammar_text = check_shaping(params, tokenizer)
    mode = decode_mode(decode, model)
    speculation = check_speculation(draft, speculative_tokens)
    if mode == "background" and (speculation is not None or params.shaped):
        mode = "eager"  # verify passes and shaped rows: the eager loop's (the compiled step takes neither)
    batch = len(encoded_prompts)
    longest = max(len(p) for p in encoded_prompts)
    if cache is not None and cache.tokens_seen and len(cache.tokens_seen) != batch:
        raise GenerationError(f"the cache holds {len(cache.tokens_seen)} sequences but {batch} prompts were given")
    fresh = cache is None or not any(cache.tokens_seen)  # no sequence read yet: a shared beginning is read once
    if cache is None:
        check_new_cache(model.args, batch, longest + max_tokens, max_tokens, model.dtype, model.device, model.parallel)
        if mode in ("compiled", "background"):
            cache = step_compiler(model).cache_for(batch, longest + max_tokens)
        else:
            cache = model.make_cache(batch, max_seqlen=longest + max_tokens)
        cache.start_sequences(batch)
    else:
        check_cache_capacity(cache, model, encoded_prompts, max_tokens)
        if not cache.tokens_seen:
            cache.start_sequences(batch)
    chunk_size = chunk_size or default_chunk_size(batch)
    generator = row_generators(params.seed, batch, model)
    sampling = params.to_sampling(batch, model.args.vocab_size, model.device)

    shared = shared_prefix_length(encoded_prompts) if fresh else 0
    if shared:  # read once into row 0, copied into the others (generation.shared_prefix)
        after_shared, shared_logprobs = read_shared_prefix(model, cache, encoded_prompts[0][:shared], chunk_size, prompt_logprobs)
        own = [p[shared:] for p in encoded_prompts]
    else:
        own = encoded_prompts
    same_as = repeated_prompts(encoded_prompts) if fresh else None  # a prompt given twice is read once
    if prompt_logprobs:
        logits, logprobs = prefill_with_logprobs(model, cache, own, chunk_size, same_as)  # (B, V)
        if shared:
            first = torch.log_softmax(after_shared.float(), dim=-1)[[p[0] for p in own]].tolist()  # (B,)
            logprobs = [shared_logprobs + [first[i]] + logprobs[i] for i in range(batch)]
    else:
        logits, logprobs = prefill(model, cache, own, chunk_size, same_as), [[] for _ in encoded_prompts]
    generated: List[List[int]] = [[] for _ in range(batch)]
    if max_tokens == 0:
        return generated, logprobs
    shaping = None
    if params.shaped:
        stop = params.stop
        stops = [AnswerText(tokenizer, leading_space, stop) for _ in encoded_prompts] if stop else None  # the server's check
        shaping = Shaping(
            encoded_prompts, model.args.vocab_size, model.device, eos_id, grammar=grammar_text, tokenizer=tokenizer,
            presence=params.presence_penalty, frequency=params.frequency_penalty, repetition=params.repetition_penalty,
            bias=params.logit_bias, min_tokens=params.min_tokens, stops=stops,
        )  # fmt: skip
    settings = DecodeSettings(sampling, generator, eos_id, max_tokens, on_token, shaping)
    if speculation is not None:
        k = verify_tokens(cache, speculation.tokens, mode)
        before = max((len(c) for c in speculation.context or []), default=0)  # what the proposer reads before the prompts
        speculation.proposer.begin(model, batch, before + longest + max_tokens, k, continuing=not fresh)
        verify = verify_eager(model) if mode == "eager" else verify_static(model, k, compiled=mode == "compiled")
        decode_speculative(model, cache, logits, settings, generated, logprobs, encoded_prompts, speculation, verify, k)
    elif mode == "eager":
        decode_eager(model, cache, logits, settings, generated, logprobs)
    elif mode == "background":
        decode_then_compiled(model, cache, logits, settings, generated, logprobs)
    else:
        shaped = shaping is not None
        step = compiled_step(model, cache, batch, sampling, eos_id, shaped) if mode == "compiled" else None
        decode_static(model, cache, logits, settings, generated, logprobs, step)
    return generated, logprobs


def decode_eager(
    model: Transformer,
    cache: RotatingBufferCache,
    logits: torch.Tensor,  # (B, V) after each prompt's last token
    settings: DecodeSettings,
    generated: List[List[int]],
    logprobs: List[List[float]],
    until: Optional[Callable[[], bool]] = None,
) -> Optional[Tuple[torch.Tensor, List[int], int]]:
    """The reference decode loop: one ``Transformer.forward`` per step over the rows still running.

    ``until`` (asked after each pass): when it says True,
    the loop stops there and returns ``(logits, active, chosen)``, the logits ``(B_active, V)`` of the
    rows ``active`` still decoding after ``chosen`` tokens each, for another loop to go on from;
    None when it ran to the end."""
    batch = len(generated)
    active = list(range(batch))  # sequences still generating; row r of `logits` is sequence active[r]
    for step in range(settings.max_tokens):
        # One uniform per sequence at every step, finished ones included, as the static loop draws.
        uniform = draw_uniform(batch, settings.sampling, settings.generator, model.device)
        shaping = settings.shaping
        chosen_from = logits if shaping is None else shaping.shape(logits, active)  # (B_active, V)
        if uniform is None:  # greedy: no per-row settings to pick
            tokens = sample(chosen_from, settings.sampling, None)  # (B_active,)
        else:
            rows = torch.tensor(active, device=model.device)
            tokens = sample(chosen_from, settings.sampling.rows(rows), uniform[rows])  # (B_active,)
        token_logprob = token_logprobs(logits, tokens)
        still_active = []
        emitting = [(i, t) for i, t in zip(active, tokens.tolist()) if settings.eos_id is None or t != settings.eos_id]
        if shaping is not None and emitting:
            shaping.advance(*zip(*emitting))
        for i, token, logprob in zip(active, tokens.tolist(), token_logprob.tolist()):
            if settings.eos_id is not None and token == settings.eos_id:
                continue
            generated[i].append(token)
            logprobs[i].append(logprob)
            if settings.on_token is not None:
                settings.on_token(i, token)
            if shaping is not None and shaping.record(i, token):
                continue  # its grammar is complete, or its text holds a stop string
            still_active.append(i)
        if not still_active or step == settings.max_tokens - 1:
            break
        active = still_active
        seqlens = [0] * batch
        for i in active:
            seqlens[i] = 1
        input_ids = torch.tensor([generated[i][-1] for i in active], dtype=torch.long, device=model.device)
        logits = model(input_ids, seqlens, cache)  # (B_active, V)
        _check_finite(logits, f"at generation step {step + 1}")
        if until is not None and until():
            return logits, active, step + 1
    return None


def decode_then_compiled(
    model: Transformer,
    cache: RotatingBufferCache,
    logits: torch.Tensor,  # (B, V) after each prompt's last token
    settings: DecodeSettings,
    generated: List[List[int]],
    logprobs: List[List[float]],
) -> None:
    """``decode="auto"`` on CPU: the compiled step built in a child process while the eager loop
    decodes (``StepCompiler.build_in_background``), then the rest of the tokens through it
    (``decode_static``). The same tokens as either loop alone (both draw one uniform per row per
    step); where it cannot be built, the eager loop to the end. A build on disk from an earlier run
    (``cpu_aot_step.BuildCache``) is found by its signature and loaded before the first token
    (``AotStep.kept``), so a second start decodes compiled from its first token."""
    batch, sampling = len(generated), settings.sampling
    options = (sampling.greedy, sampling.filtered, settings.eos_id, False)
    device = model.device
    examples = (
        cache.layer_keys, cache.layer_values, torch.zeros(batch, dtype=torch.long, device=device),
        torch.zeros(batch, dtype=torch.long, device=device), torch.ones(batch, dtype=torch.bool, device=device),
        None if sampling.greedy else torch.zeros(batch, device=device), sampling.temperature, sampling.top_p, sampling.top_k,
    )  # fmt: skip
    build = step_compiler(model).build_in_background(DECODE, cache, options, (batch,), examples)
    if build is None:  # built already (an earlier call), or it cannot be built here
        step = compiled_step(model, cache, batch, sampling, settings.eos_id, False)
        if hasattr(step, "__wrapped_first_call__"):
            return decode_eager(model, cache, logits, settings, generated, logprobs)
        return decode_static(model, cache, logits, settings, generated, logprobs, step)
    left = decode_eager(model, cache, logits, settings, generated, logprobs, until=lambda: build.step() is not None)
    if left is None:
        return
    logits_active, active, chosen = left
    logits = logits_active.new_zeros(batch, logits_active.shape[-1])  # (B, V): finished rows choose nothing
    logits[active] = logits_active
    alive = torch.zeros(batch, dtype=torch.bool, device=device)
    alive[active] = True
    rest = dataclasses.replace(settings, max_tokens=settings.max_tokens - chosen)
    decode_static(model, cache, logits, rest, generated, logprobs, build.step(), alive=alive)


def verify_eager(model: Transformer):
    """The verify pass as ``Transformer.forward`` (the readable path): logits after every fed token."""

    def verify(cache: RotatingBufferCache, pieces: List[Piece]) -> torch.Tensor:
        seqlens = [0] * len(cache.tokens_seen)
        for row, _, tokens in pieces:
            seqlens[row] = len(tokens)
        input_ids = torch.tensor([t for _, _, tokens in pieces for t in tokens], dtype=torch.long, device=model.device)
        return model(input_ids, seqlens, cache)  # (T, V)

    return verify


def verify_static(model: Transformer, k: int, compiled: bool):
    """The verify pass as the mixed step's verify step (``speculative.static_verify``), built by
    ``generate``'s step compiler (``compiled``) or run op by op."""

    def verify(cache: RotatingBufferCache, pieces: List[Piece]) -> torch.Tensor:
        # Compiled, the experts run every one on every token (fixed shapes); op by op, grouped.
        return static_verify(model, cache, pieces, k, step_compiler(model) if compiled else None, grouped_moe=not compiled)

    return verify


def verify_tokens(cache: RotatingBufferCache, k: int, mode: str) -> int:
    """The most guesses a row checks in this call: ``k``, but the static verify step writes a row's
    k + 1 tokens into its buffers in one go, so there they must fit the smallest (a fresh cache holds
    the prompt and ``max_tokens``, which may be fewer than the window). ``Transformer.forward`` keeps
    what a longer chunk pushes out itself: the eager pass takes any k."""
    return k if mode == "eager" else max(0, min(k, min(cache.layer_sizes) - 1))


def check_shaping(params: SamplingParams, tokenizer: Optional[Tokenizer]) -> Optional[str]:
    """What of ``params`` is about text needs ``tokenizer``; the compiled grammar of what the answers
    must be, if anything (a ``GenerationError`` of one line naming the field if it cannot be)."""
    constraint = params.constraint
    if (constraint or params.stop) and tokenizer is None:
        name = next((name for name in ("json_schema", "regex", "choices", "grammar") if getattr(params, name) is not None), "stop")
        raise GenerationError(f"{name} is about text: pass tokenizer= as well")
    return None if constraint is None else check_constraint(Constraint(*constraint), tokenizer)


def row_generators(seed: Union[None, int, Sequence[int]], batch: int, model: Transformer) -> Generators:
    """The generators a batch samples with: one per row, seeded with ``seed`` (or with its row's, from
    a list); None for no seed, or, in a process group, one for the batch seeded as rank 0 says."""
    if seed is None and model.parallel.world_size == 1:
        return None
    if seed is None:
        return torch.Generator(device=model.device).manual_seed(shared_seed(None))  # every rank draws alike
    if isinstance(seed, (list, tuple)):
        seeds = [int(s) for s in seed]  # (in a process group: the caller gives every rank the same list)
    else:
        seeds = [shared_seed(int(seed))] * batch  # rank 0's
    return [torch.Generator(device=model.device).manual_seed(s) for s in seeds]


def shared_seed(seed: Optional[int]) -> Optional[int]:
    """In a process group, every rank must sample alike: rank 0's seed is used by all."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return seed
    value = torch.tensor([seed if seed is not None else int(torch.randint(0, 2**62, ()).item())], dtype=torch.long)
    if dist.get_backend() == "nccl":
        value = value.cuda()
    dist.broadcast(value, src=0)
    return int(value.item())
