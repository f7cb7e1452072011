"""The decode loop around the static step: launch step n+1, then read step n.

The host never waits for the device before it has queued the next step. Each step's
``emitted`` tokens ``(B,)`` and log-probabilities ``(B,)`` are copied to the host
asynchronously; the loop reads step n after it has launched step n+1, so the GPU is never
idle while Python hands tokens to the caller. When every row has finished, one step too
many has been launched: its rows are all finished, so it writes nothing and changes nothing.

The loop gives the same tokens, log-probabilities and final cache as ``decode_eager``:
the same uniforms are drawn at every step (one per row), the same rows are fed, and a
finished row keeps its cache slots and its position.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from mixtral_infer.errors import GenerationError
from mixtral_infer.steps.compiler import DECODE, StepCompiler
from mixtral_infer.steps.decode_step import NOT_FINITE, StepOutputs, choose_tokens, emitted_tokens, make_decode_step
from mixtral_infer.sampling import Sampling, draw_uniform, token_logprobs
from mixtral_infer.structured.rows import Shaping
from mixtral_infer.model.cache import RotatingBufferCache
from mixtral_infer.model.transformer import Transformer
from mixtral_infer.tuning import Tuning

TokenCallback = Callable[[int, int], None]  # (prompt index, token id)

# Compiled steps of one loop that run with dynamo's guards checked in full. From the next one on,
# the loop passes the same model, cache and sampling tensors, and the step's own outputs (same
# shapes, dtypes and strides), so every guard would pass, and checking them costs a good part of a
# step on a small model. The first step's inputs come from eager code and the second's from the
# graph, so both are checked; a model edited between two generate() calls (quantize_model,
# unpack_model) is caught there and recompiled. (Had a later step needed a recompile, torch raises
# rather than run a stale graph.) On CPU the step is built by AOTInductor and has no guards
# (``cpu_aot_step``: ``AotStep.current`` catches a replaced weight). What this mode still checks
# are the guards dynamo keeps to tell its graphs apart, which include every tensor's (each weight's
# dtype, shape, strides); skipping those too (``torch.compiler.skip_all_guards_unsafe``) would need
# a code object per compiled step so that no step finds another's graph.
GUARDED_STEPS = 2


@dataclass
class DecodeSettings:
    sampling: Sampling
    generator: Optional[torch.Generator]
    eos_id: Optional[int]
    max_tokens: int
    on_token: Optional[TokenCallback]
    shaping: Optional[Shaping] = None  # the rows' logits changes (grammar, penalties, stop strings)


def step_compiler(model: Transformer) -> StepCompiler:
    """``generate``'s step compiler for ``model``, made on first use and kept with the model: its
    compiled decode steps and the cache they decode into (``StepCompiler.cache_for``)."""
    compiler = model.__dict__.get("_step_compiler")
    if compiler is None:
        compiler = model.__dict__["_step_compiler"] = StepCompiler(model)
    return compiler


def compiled_step(
    model: Transformer, cache: RotatingBufferCache, batch: int, sampling: Sampling, eos_id: Optional[int], shaped: bool
) -> Callable[..., StepOutputs]:
    """The compiled ``decode_one_token`` for ``batch`` rows of ``cache`` and this sampling (built on its
    first call); ``shaped``: the step that takes the rows' logits changes (``make_decode_step``)."""
    options = (sampling.greedy, sampling.filtered, eos_id, shaped)
    return step_compiler(model).step(DECODE, cache, options, shape=(batch,))


def compile_seconds(model: Transformer) -> float:
    """Seconds spent so far building ``model``'s compiled decode steps (0 if none was built): a
    caller timing a generation takes the difference out of its tokens/s."""
    compiler = model.__dict__.get("_step_compiler")
    return 0.0 if compiler is None else compiler.compile_seconds


class StepReader:
    """Copies each step's ``(emitted, logprobs)`` to the host without waiting, reads them later."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: List[Tuple[torch.Tensor, torch.Tensor, Optional[torch.cuda.Event]]] = []

    def push(self, emitted: torch.Tensor, logprobs: torch.Tensor) -> None:
        if not self.cuda:
            self.pending.append((emitted, logprobs, None))
            return
        # A non-blocking copy to the CPU lands in pinned memory; the event says when it has.
        host = (emitted.to("cpu", non_blocking=True), logprobs.to("cpu", non_blocking=True))
        event = torch.cuda.Event()
        event.record()
        self.pending.append((*host, event))

    def pop(self) -> Tuple[List[int], List[float]]:
        emitted, logprobs, event = self.pending.pop(0)
        if event is not None:
            event.synchronize()
        return emitted.tolist(), logprobs.tolist()


def decode_static(
    model: Transformer,
    cache: RotatingBufferCache,
    logits: torch.Tensor,  # (B, V) after each prompt's last token
    settings: DecodeSettings,
    generated: List[List[int]],
    logprobs: List[List[float]],
    step: Optional[Callable[..., StepOutputs]] = None,
    tuning: Optional[Tuning] = None,
    alive: Optional[torch.Tensor] = None,
) -> None:
    """Decode with the fixed-shape step: ``step`` (a compiled ``decode_one_token``), or, when
    None, the same step run op by op, as ``tuning`` says (None: the model's). With
    ``settings.shaping``, ``decode_shaped`` (``step`` then the shaped step). ``alive`` (B,) bool: the
    rows still decoding, where a loop before this one finished some (default all)."""
    if settings.shaping is not None:
        assert alive is None, "a shaped loop starts with every row"
        return decode_shaped(model, cache, logits, settings, generated, logprobs, step, tuning)
    batch, device = len(generated), model.device
    sampling = settings.sampling
    compiled = step is not None
    if step is None:
        step = make_decode_step(model, sampling.greedy, sampling.filtered, settings.eos_id, tuning)
    positions = torch.tensor(cache.tokens_seen, dtype=torch.long, device=device)  # (B,) tokens seen
    alive = torch.ones(batch, dtype=torch.bool, device=device) if alive is None else alive
    uniform = draw_uniform(batch, sampling, settings.generator, device)
    tokens, token_logprob, next_alive = choose_tokens(logits, alive, sampling, uniform, settings.eos_id)
    reader = StepReader(device)
    reader.push(emitted_tokens(logits, alive, tokens, next_alive), token_logprob)
    alive = next_alive

    counted = positions  # (B,) the tokens the cache holds for certain, should the loop be cut short
    try:
        for index in range(1, settings.max_tokens + 1):
            # Steps up to `index - 1` have run: they fed every token recorded so far (the one read
            # next, whose on_token may raise, is not counted, as in the eager loop).
            counted = positions
            if index < settings.max_tokens:  # launch step `index` before reading step `index - 1`
                outputs = _launch(step, compiled, index, cache, settings, tokens, positions, alive)
                tokens, token_logprob, positions, alive, emitted = outputs
                reader.push(emitted, token_logprob)
            if not _record(reader.pop(), index - 1, settings, generated, logprobs):
                break  # every row had finished; the step launched after it wrote nothing
    except BaseException:  # on_token raised, Ctrl-C: the count stayed at the prompt's (a later call misread the cache)
        cache.tokens_seen = counted.tolist()
        raise
    cache.tokens_seen = positions.tolist()


def decode_shaped(
    model: Transformer,
    cache: RotatingBufferCache,
    logits: torch.Tensor,  # (B, V) after each prompt's last token
    settings: DecodeSettings,
    generated: List[List[int]],
    logprobs: List[List[float]],
    step: Optional[Callable[..., tuple]] = None,
    tuning: Optional[Tuning] = None,
) -> None:
    """``decode_static`` for rows whose logits change before sampling (``settings.shaping``): the step
    made with ``shaped=True`` takes the changes as fixed-shape tensors, so it stays static and
    compiled. The host reads each step's tokens before it launches the next: a grammar's next mask
    and a stop string depend on them. The first token, from the prompt's logits, is shaped on the
    host as the eager loop shapes it."""
    batch, device = len(generated), model.device
    sampling, shaping = settings.sampling, settings.shaping
    compiled = step is not None
    if step is None:
        step = make_decode_step(model, sampling.greedy, sampling.filtered, settings.eos_id, tuning, shaped=True)
    positions = torch.tensor(cache.tokens_seen, dtype=torch.long, device=device)  # (B,)
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    uniform = draw_uniform(batch, sampling, settings.generator, device)
    tokens, _, next_alive = choose_tokens(shaping.shape(logits, range(batch)), alive, sampling, uniform, settings.eos_id)
    emitted = emitted_tokens(logits, alive, tokens, next_alive)
    chose = [(i, t) for i, (t, ok) in enumerate(zip(tokens.tolist(), next_alive.tolist())) if ok]  # not EOS
    if chose:
        shaping.advance(*zip(*chose))
    alive = _record_shaped((emitted.tolist(), token_logprobs(logits, tokens).tolist()), 0, settings, generated, logprobs, next_alive)
    try:
        for index in range(1, settings.max_tokens):
            if not alive.any():
                break
            outputs = _launch(step, compiled, index, cache, settings, tokens, positions, alive, *shaping.tensors())
            tokens, token_logprob, positions, next_alive, emitted, counts, seen, min_left = outputs
            shaping.update(counts, seen, min_left)
            alive = _record_shaped((emitted.tolist(), token_logprob.tolist()), index, settings, generated, logprobs, next_alive)
    finally:
        cache.tokens_seen = positions.tolist()


def _launch(step: Callable[..., tuple], compiled: bool, index: int, cache: RotatingBufferCache, settings: DecodeSettings,
            tokens: torch.Tensor, positions: torch.Tensor, alive: torch.Tensor, *shaping: torch.Tensor) -> tuple:  # fmt: skip
    """Run step ``index`` of a decode loop on the rows' last ``tokens``, with a fresh uniform per row
    (and the shaping tensors of ``decode_shaped``): the step's outputs."""
    sampling, device = settings.sampling, cache.device
    cuda_graph = compiled and device.type == "cuda"
    if cuda_graph:
        torch.compiler.cudagraph_mark_step_begin()
    uniform = draw_uniform(len(positions), sampling, settings.generator, device)
    with guards_checked(not compiled or index <= GUARDED_STEPS):
        outputs = step(
            cache.layer_keys, cache.layer_values, tokens, positions, alive, uniform,
            sampling.temperature, sampling.top_p, sampling.top_k, *shaping,
        )  # fmt: skip
    if cuda_graph:
        # A CUDA graph's outputs are overwritten by its next replay: keep copies of what is fed back in.
        # The token log-probabilities and emitted tokens (outputs 1 and 4) are only read by the host,
        # copied out before that replay, in stream order: they need no copy.
        outputs = tuple(t if i in (1, 4) else t.clone() for i, t in enumerate(outputs))
    return outputs


def _record_shaped(step_result, step: int, settings: DecodeSettings, generated, logprobs, alive: torch.Tensor) -> torch.Tensor:
    """``_record``, then each row that emitted a token moves its shaping on; ``alive`` without the rows
    that end there (a complete grammar, a stop string)."""
    before = [len(g) for g in generated]
    _record(step_result, step, settings, generated, logprobs)
    ended = [i for i, g in enumerate(generated) if len(g) > before[i] and settings.shaping.record(i, g[-1])]
    if ended:
        alive = alive.clone()
        alive[torch.tensor(ended, device=alive.device)] = False
    return alive


def guards_checked(checked: bool):
    """Dynamo's guards as usual (``checked``), or only those that tell its compiled graphs apart
    (``skip_guard_eval_unsafe``) for the one call inside this context. Only the step itself runs
    this way: the caller's ``on_token`` and any compiled code of its own keep every guard."""
    if checked:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)


def _record(
    step_result: Tuple[List[int], List[float]],
    step: int,
    settings: DecodeSettings,
    generated: List[List[int]],
    logprobs: List[List[float]],
) -> bool:
    """Append one step's tokens; False when no row generated one (all have finished)."""
    any_emitted = False
    for i, (token, logprob) in enumerate(zip(*step_result)):
        if token == NOT_FINITE:
            raise GenerationError(f"the model produced NaN or inf logits at generation step {step}: the weights may be broken")
        if token < 0:
            continue
        any_emitted = True
        generated[i].append(token)
        logprobs[i].append(logprob)
        if settings.on_token is not None:
            settings.on_token(i, token)
    return any_emitted
