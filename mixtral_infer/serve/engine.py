"""Continuous batching over the rows of one rotating cache.

The cache has R rows. A request takes a free row when there is one, else waits in a
bounded queue. Each engine step is one forward pass over a ragged flat batch (the cache
metadata takes sequences of 0, 1 and n tokens in one pass): one token for every row that
is decoding, plus chunks of the prompts being read, up to ``prefill_tokens`` prompt tokens
per step (first come, first served). A sequence that finishes or is cancelled frees its
row at once; the next request reuses it from position 0, so its old slots are never
visible (a row at position p sees only slots below ``min(p, S)``, all written anew).

Worked example, R = 2 rows, ``prefill_tokens`` = 4, request A (3-token prompt) then B
(6 tokens), both arriving before the first step::

    step 1: A reads 3 tokens, B reads 1     seqlens [3, 1]  A samples its first token
    step 2: A decodes 1, B reads 4          seqlens [1, 4]
    step 3: A decodes 1, B reads its last 1 seqlens [1, 1]  B samples its first token
    step 4: both decode                     a decode-only step: the static step can run it

Sampling is per row and reproducible whatever the batch mates: each request with a seed
owns a ``torch.Generator`` seeded with it and draws one uniform number from it per sampled
token, exactly as ``generate([prompt], seed=seed)`` does for one prompt; rows are sampled
in groups that use the same code path as that single prompt would (greedy, plain
temperature, or top-k / top-p), because the filtered path orders the vocabulary by
probability and so turns the same uniform into another token.

The engine runs in its own thread (``start``); ``submit`` and ``cancel`` may be called
from any thread. Each request reports to its ``sink`` (called in the engine's thread)
a ``TokenEvent`` per generated token and one ``Finished`` at the end. The server runs the
engine in a process of its own (``engine_process``).
"""

from __future__ import annotations

import collections
import itertools
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from mixtral_infer.errors import GenerationError
from mixtral_infer.formats.modules import tuning_of
from mixtral_infer.formats.adapters import selected
from mixtral_infer.steps.compiler import ADAPTED, DECODE_LOGITS, MIXED, StepCompiler, one_line
from mixtral_infer.steps.decode_loop import GUARDED_STEPS, guards_checked
from mixtral_infer.steps.decode_step import finite_rows, supports_static_decode
from mixtral_infer.steps.mixed_step import pack_chunk
from mixtral_infer.generation.generate import decode_mode
from mixtral_infer.generation.speculative import SpeculativeStats, check_speculation, choose_checked, static_verify
from mixtral_infer.serve.speculation import SpeculationPolicy
from mixtral_infer.serve.step_group import EFFECTS, WITH_COLLECTIVES, GroupLost, StepGroup, check_in_step
from mixtral_infer.generation.sampling_params import SamplingParams, rows_sampling
from mixtral_infer.sampling import sample
from mixtral_infer.generation.text_stream import AnswerText
from mixtral_infer.model.transformer import Transformer
from mixtral_infer.model.cache import SlackSlots
from mixtral_infer.serve.prefix_reuse import (
    MIN_REUSED_TOKENS,
    Answer,
    Placement,
    RowState,
    common_prefix,
    place,
    spare_rows,
    with_generated_answer,
)
from mixtral_infer.structured.grammar import Constraint, RowGrammar, fill_bitmask, grammar_of
from mixtral_infer.structured.logits import RowPenalties, apply_bitmask, apply_penalties, dense_penalties
from mixtral_infer.tokenizer import Tokenizer
from mixtral_infer.tuning import Tuning

NOT_FINITE = (
    "the model produced NaN or inf logits for this request: its weights may be broken, or its activations "
    "overflow this dtype (float16 does first; try bfloat16 or float32)"
)


GATHER_COST = 2  # a key gathered for attention costs about two read in place (Engine._static_step_is_cheaper)
ADMIT_EVERY_COMPILED = 6  # admit_every's default where decode-only steps run compiled (Engine._admit_now)
MIXED_SEGMENTS = 4  # prompts one compiled mixed step reads at most (Engine._mixed)
MIXED_CHUNKS = (16, 64, 256)  # a compiled mixed step's chunk sizes, beside prefill_tokens (mixed_chunk_sizes)
MIXED_MOE_TOKENS = 64  # the largest compiled chunk of a mixture of experts (mixed_chunk_sizes)


class QueueFull(GenerationError):
    """Every row is busy and the queue holds ``max_queue`` requests: try again later."""

    @classmethod
    def of(cls, rows: int, waiting: int) -> "QueueFull":
        return cls(f"all {rows} rows are busy and {waiting} requests are waiting")


class ShuttingDown(GenerationError):
    """The engine takes no new requests (the server is stopping)."""


@dataclass
class RequestSettings(SamplingParams):
    """What one request asks for (already checked by ``protocol``): the sampling settings
    (``SamplingParams``: here greedy unless a temperature is given, ``max_tokens`` always given;
    ``ignore_eos``: EOS is a token like any other, for benchmarks; the penalties, ``structured.logits``;
    ``min_tokens``: EOS held back until then), and what the engine needs beside them."""

    max_tokens: int
    temperature: float = 0.0
    logprobs: Optional[int] = None  # None: none; n: the chosen token's and the n most likely
    leading_space: bool = True  # a completion's text keeps the space before its first word
    constraint: Optional[Constraint] = None  # what the text must be (structured.grammar), as compiled
    speculative: bool = True  # checks guesses where the engine speculates (False: one token a step)
    adapter: int = 0  # the model's adapter kept apart this request runs with (formats.adapters): 0 none, i the i-th


@dataclass
class TokenEvent:
    token: int
    text: str  # new text to show ("" while held back)
    logprob: Optional[float] = None
    top_logprobs: Optional[List[Tuple[int, float]]] = None


@dataclass
class Finished:
    reason: str  # "stop" (EOS or a stop string), "length", "cancelled" or "error"
    text: str  # the text held back until now
    prompt_tokens: int
    completion_tokens: int
    error: Optional[str] = None


Event = TokenEvent | Finished


def check_request(prompt: Sequence[int], settings: RequestSettings, vocab_size: int, max_model_len: Optional[int]) -> None:
    """``GenerationError`` for a request that can never run: an empty prompt, token ids outside
    the vocabulary, or more tokens than ``max_model_len`` (a model without a window: what a row
    holds; with one: the bound the server was given, where a row's window holds any length)."""
    if not prompt:
        raise GenerationError("the prompt is empty: give at least one token")
    if max_model_len is not None and len(prompt) >= max_model_len:  # no answer fits, whatever max_tokens says
        raise GenerationError(f"the prompt ({len(prompt)} tokens) leaves no room for an answer within this model's limit of "
                              f"{max_model_len} tokens per sequence (--max-model-len): shorten the prompt")  # fmt: skip
    if max_model_len is not None and len(prompt) + settings.max_tokens > max_model_len:
        raise GenerationError(
            f"the prompt ({len(prompt)} tokens) plus max_tokens={settings.max_tokens} exceeds this model's limit of "
            f"{max_model_len} tokens per sequence (--max-model-len): shorten the prompt or lower max_tokens"
        )
    if any(not 0 <= t < vocab_size for t in prompt):
        raise GenerationError(f"the prompt holds token ids outside the vocabulary [0, {vocab_size})")


@dataclass(eq=False)
class Request:
    """One sequence's state from ``submit`` to its ``Finished`` event."""

    id: int
    prompt: List[int]
    settings: RequestSettings
    sink: Callable[[Event], None]
    arrival: float
    generator: Optional[torch.Generator] = None
    row: Optional[int] = None
    fed: int = 0  # tokens of the prompt read so far
    next_token: Optional[int] = None  # sampled, not yet fed: the row is decoding
    generated: List[int] = field(default_factory=list)
    first_token_at: Optional[float] = None
    cancelled: bool = False
    done: bool = False
    answer: Optional[AnswerText] = None  # the generated tokens' text, cut at a stop string
    follows: Optional["Request"] = None  # another choice of the same prompt: its row is copied after the prompt
    reused: int = 0  # prompt tokens this request did not read (already in its row)
    pause_at: Optional[int] = None  # a prompt length where a waiting request copies this row (_waits_for_prefix)
    grammar: Optional[RowGrammar] = None  # settings.constraint, following the generated tokens
    penalties: Optional[RowPenalties] = None  # the settings' penalties and bias, and what they count
    answers: List[Answer] = field(default_factory=list)  # rows' answers the prompt holds as generated (_read_generated_answer)


class Engine:
    """The scheduler. ``step()`` runs one forward pass; ``start()`` runs steps in a thread.

    ``decode``: how a step in which every row decodes one token runs, as in ``generate``:
    ``eager`` (``Transformer.forward``), ``static`` (``decode_logits`` of the static decode
    step, op by op), ``compiled`` (that step built by ``steps.compiler``: a CUDA graph on CUDA,
    on CPU built by AOTInductor where it can be),
    ``auto`` (compiled on CUDA and CPU; on CPU, per step, the compiled step or the eager pass,
    whichever reads less: ``_static_step_is_cheaper``). All give the same tokens. Unlike
    ``generate``'s ``auto``, which decodes eagerly on CPU because a compilation there costs more
    than a short generation, a server compiles once (``warm_up``, before it serves) and serves
    faster for it (docs/performance.md, "Serving"). Where compiling fails (a CPU without a C++
    compiler), ``auto`` goes on with the uncompiled steps after a warning.

    A step that both decodes and reads prompts is one forward pass: the weights are read once.
    Where decode-only steps are static, it is the static mixed step (``steps.mixed_step``): the
    decoding rows attend in place, the prompt chunks over their rows' slots, in fixed shapes.
    ``compile_prompts`` (default: on CUDA, with ``compiled``) compiles it for a few chunk sizes
    (``mixed_chunk_sizes``; at most ``MIXED_SEGMENTS`` prompts a step), as gpt-fast compiles its
    decode step; on CUDA the eager pass is bound by the host. Off CUDA it runs op by op with its
    experts grouped: compiled, its padded chunks and every-expert-on-every-token MoE cost more on
    CPU than they save (docs/performance.md, "Serving").
    Otherwise it is ``Transformer.forward`` over the ragged batch, whose attention runs in two
    parts off CUDA, the decoding rows over their own buffers and the prompts over their own caches
    (``cache.split_mixed``).

    ``prefix_reuse``: a request continues the row that holds the start of its prompt
    (``serve.prefix_reuse``). ``slack`` (with ``prefix_reuse``): the positions each row's windowed
    layers keep after they push them out (``model.cache.SlackSlots``), so a row that has wrapped
    steps back up to that many tokens: the same request sent again, an edited last message. They
    cost ``slack`` more slots per row in each windowed layer (``sizing.plan_rows``' ``slack``), and
    a copy of the positions about to be pushed out before each pass; a chunk longer than a windowed
    buffer is read by ``Transformer.forward`` (which keeps what it pushes out itself), or, where
    prompts are read only by static steps, a prompt's last one in two (``_plan``). Off (0) by default.

    ``group``: the model is cut across processes (``serve.step_group``): this engine is rank 0's, and
    each change it makes to the model's state (``_effect``) is sent to the other ranks' engines, which
    apply it to their shares. Steps are eager there, as ``generate``'s are for a cut model.
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        rows: int,
        *,
        max_queue: int = 256,
        prefill_tokens: int = 512,
        max_model_len: Optional[int] = None,
        decode: str = "auto",
        admit_every: Optional[int] = None,
        compile_prompts: Optional[bool] = None,
        metrics=None,
        after_step: Optional[Callable[[], None]] = None,
        tuning: Optional[Tuning] = None,
        prefix_reuse: bool = True,
        slack: int = 0,
        draft: object = None,
        speculative_tokens: Optional[int] = None,
        group: Optional[StepGroup] = None,
    ):
        if rows < 1 or max_queue < 0 or prefill_tokens < 1:
            raise GenerationError(f"rows={rows} and prefill_tokens={prefill_tokens} must be >= 1, max_queue={max_queue} >= 0")
        if model.args.full_attention and max_model_len is None:
            what = "without a sliding window" if model.args.sliding_window is None else "with full-attention layers"
            raise GenerationError(f"a model {what} needs max_model_len (tokens per sequence)")
        self.model, self.tokenizer = model, tokenizer
        self.group = group
        self.lost: Optional[str] = None  # why the process group broke, once it has (the engine then stops)
        self.on_lost: Optional[Callable[[str], None]] = None  # called in the engine's thread when it does
        self.tuning = tuning if tuning is not None else tuning_of(model)  # how the static steps are built
        self.rows, self.max_queue, self.prefill_tokens = rows, max_queue, prefill_tokens
        self.max_model_len = max_model_len  # with windows only, a bound on each request alone (rows hold the windows)
        self.mode = decode_mode(decode, model)
        # auto compiles on CPU too, before serving (generate's auto builds in the background while it
        # decodes eagerly; a server compiles once, in warm_up), and off CUDA still chooses per step
        # between the static step and Transformer.forward (_static_step_is_cheaper). If compiling
        # fails (no C++ compiler), auto falls back to the uncompiled steps (_compile_failed).
        static = supports_static_decode(model)
        if decode == "auto" and static and model.device.type == "cpu":
            self.mode = "compiled"
        self.choose_per_step = decode == "auto" and static and model.device.type != "cuda"
        if group is not None and (self.mode != "eager" or draft is not None):
            raise GenerationError("a model cut across processes is served with eager steps and without speculative decoding")
        self.may_fall_back = decode == "auto" and self.mode == "compiled"
        self.metrics = metrics
        self.after_step = after_step  # called in the engine's thread after every step (it sent its events)
        # Each layer's buffer on its own: a windowed layer's window, a full-attention layer's max_model_len.
        windows = model.args.layer_windows
        longest = max_model_len if model.args.full_attention else max(w for w in windows if w is not None)
        self.cache = model.make_cache(rows, max_seqlen=longest)
        self.cache.start_sequences(rows)
        self.slots: List[Optional[Request]] = [None] * rows
        self.prefix_reuse = prefix_reuse
        self.row_states = [RowState() for _ in range(rows)]  # the ids each row holds (prefix_reuse)
        # Adapters kept apart (formats.adapters): each row's request's, every pass given its tokens' from these.
        self.adapters: List[str] = list(model.adapters.names) if getattr(model, "adapters", None) is not None else []
        self.row_adapter = [0] * rows
        # Positions each row's windowed layers pushed out last, kept so a wrapped row can step back
        # (prefix_reuse, "Cutting a row back"): a regenerated answer, an edited last message.
        # Speculative decoding (draft: "ngram", a draft model or a proposer): rows step back over rejected
        # guesses through the same slack, k at least (_speculative_step).
        self.speculation = check_speculation(draft, speculative_tokens)
        spare = self.speculation.tokens if self.speculation is not None else 0
        self.slack = SlackSlots(self.cache, max(slack if prefix_reuse else 0, spare))
        self.policy = SpeculationPolicy()
        if self.speculation is not None and self._verifies_static() and spare + 1 > min(self.cache.layer_sizes):
            raise GenerationError(f"speculative_tokens={spare}: a row checks at most {min(self.cache.layer_sizes) - 1} "
                                  f"guesses in buffers of {min(self.cache.layer_sizes)} slots")  # fmt: skip
        if self.speculation is not None:
            self.speculation.proposer.begin(model, rows, longest, spare, continuing=True)
            self._ks = [self.speculation.tokens if not self.speculation.proposer.adaptive else min(2, spare)] * rows
        # A chunk longer than the smallest windowed buffer (S) pushes out positions of its own: the eager
        # pass writes them to the slack, the static steps do not (_forward, _plan).
        windowed = [kind.size for kind in self.cache.kinds if kind.window is not None]
        self.slack_span = min(windowed) if self.slack.slack and windowed else None
        self.uses = itertools.count(1)  # RowState.last_used
        self.prefix_hits = 0  # requests that started after tokens already in a row
        self.reused_tokens = 0  # prompt tokens not read again
        self.running: List[Request] = []  # in the order they took their rows (prefill order)
        self.queue: Deque[Request] = collections.deque()
        self.lock = threading.Condition()
        self.ids = itertools.count()
        self.admitted = 0  # requests that have taken a row, ever
        self.steps = 0
        self.draining = False
        self.stopped = False
        self.thread: Optional[threading.Thread] = None
        # Builds, keeps and falls back the compiled steps; says why it fell back, as a warning.
        self.compiler = StepCompiler(model, announce=lambda message: None, tuning=self.tuning, warn=warn)
        self._steps: Dict[object, Callable[..., torch.Tensor]] = {}  # "decode" or ("mixed", size) -> its step
        self._step_calls: Dict[object, int] = collections.Counter()
        # Steps that read prompts run mixed_logits wherever decode-only steps run the static step;
        # compiled (compile_prompts), for a few padded chunk sizes; see the class docstring.
        if compile_prompts is None:
            compile_prompts = self.mode == "compiled" and model.device.type == "cuda"
        if compile_prompts and self.mode != "compiled":
            raise GenerationError("compile_prompts needs decode='compiled' (or 'auto' on CPU and CUDA)")
        self._set_prompt_steps(compile_prompts)
        self.admit_every_given = admit_every is not None
        self.admit_every = admit_every if admit_every is not None else self._default_admit_every()
        self.last_admission = 0
        self._vocab = model.args.vocab_size

    def _set_prompt_steps(self, compile_prompts: bool) -> None:
        """Whether steps that read prompts compile, and so their chunk sizes, prompts and tokens per step."""
        self.compile_prompts = compile_prompts
        moe_cap = MIXED_MOE_TOKENS if self.model.args.moe is not None else None
        self.chunk_sizes = mixed_chunk_sizes(self.prefill_tokens, moe_cap) if compile_prompts else None
        self.max_segments = min(MIXED_SEGMENTS, self.rows) if compile_prompts else self.rows
        self.step_budget = self.chunk_sizes[-1] if compile_prompts else self.prefill_tokens  # prompt tokens a step reads

    def describe_decode(self) -> str:
        """How steps run, for the server's log: ``"compiled"``, or with the per-step choice
        ``"compiled or eager, per step"`` (``"static or eager, per step"`` uncompiled)."""
        if not self.choose_per_step:
            return self.mode
        return f"{'compiled' if self.mode == 'compiled' else 'static'} or eager, per step"

    def _default_admit_every(self) -> int:
        """``admit_every``'s default: see ``_admit_now``."""
        return ADMIT_EVERY_COMPILED if self.mode == "compiled" and not self.compile_prompts else 1

    # ---- called from any thread ----------------------------------------------------------

    def submit(
        self, prompt: List[int], settings: RequestSettings, sink: Callable[[Event], None], follows: Optional[Request] = None
    ) -> Request:
        """Queue a request; ``QueueFull`` when the queue is full, ``GenerationError`` when it can never run.
        ``follows``: an earlier request with the same prompt (another choice of it, as OpenAI's ``n``):
        this one takes a copy of its row once it has read the prompt."""
        check_request(prompt, settings, self._vocab, self.max_model_len)
        if not 0 <= settings.adapter <= len(self.adapters):
            raise GenerationError(f"adapter={settings.adapter}: this engine's model has {len(self.adapters)} adapters kept apart")
        if follows is not None and follows.prompt != list(prompt):
            raise GenerationError("a request follows another only with the same prompt")
        request = Request(next(self.ids), list(prompt), settings, sink, time.perf_counter(), follows=follows)
        if settings.temperature > 0:
            seed = settings.seed if settings.seed is not None else random.randrange(2**63)
            request.generator = torch.Generator(device=self.model.device).manual_seed(seed)
        request.answer = AnswerText(self.tokenizer, settings.leading_space, settings.stop)
        if settings.constraint is not None:
            request.grammar = RowGrammar(grammar_of(settings.constraint), self.tokenizer)  # compiled once; its errors raised here
        request.penalties = RowPenalties.of(
            settings.presence_penalty, settings.frequency_penalty, settings.repetition_penalty, settings.logit_bias, prompt
        )
        with self.lock:
            if self.draining:
                raise ShuttingDown("the server is shutting down")
            free = self.slots.count(None) - sum(1 for r in self.queue if not r.cancelled)
            if free <= 0 and len(self.queue) >= self.max_queue:
                raise QueueFull.of(self.rows, len(self.queue))
            self.queue.append(request)
            self.lock.notify()
        self._gauges()
        return request

    def cancel(self, request: Request) -> None:
        """Stop a request (its client left): its row is freed at the start of the next step."""
        with self.lock:
            request.cancelled = True
            self.lock.notify()

    def stats(self) -> Dict[str, int]:
        with self.lock:
            return {
                "rows": self.rows,
                "rows_free": self.slots.count(None),
                "running": len(self.running),
                "queued": len(self.queue),
                "admitted": self.admitted,
                "steps": self.steps,
                "prefix_hits": self.prefix_hits,
                "reused_tokens": self.reused_tokens,
                # how the model is cut across processes (serve.step_group; 1 and 1 in one process)
                "tensor_parallel": self.model.parallel.tensor_parallel,
                "pipeline_ranks": self.model.parallel.num_pipeline_ranks,
                **(self._speculation_stats() if self.speculation is not None else {}),
            }

    def _speculation_stats(self) -> Dict[str, object]:
        stats = self.speculation.stats
        return {
            "speculative_steps": stats.steps, "guesses": stats.proposed, "accepted": stats.accepted,
            "acceptance_rate": round(stats.acceptance_rate, 4), "tokens_per_step": round(stats.tokens_per_step, 4),
        }  # fmt: skip

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.thread.start()

    def drain(self) -> None:
        """Take no new requests; those running and queued go on."""
        with self.lock:
            self.draining = True

    def cancel_all(self) -> None:
        """Cancel every running and queued request (each gets ``Finished("cancelled")``)."""
        with self.lock:
            for request in list(self.queue) + self.running:
                request.cancelled = True
            self.lock.notify()

    def shutdown(self, cancel: bool = True, timeout: float = 30.0) -> None:
        """Stop the thread: cancel what is left (``cancel``), or first let it finish."""
        if cancel:
            self.cancel_all()
        with self.lock:
            self.draining = True
            self.stopped = True
            self.lock.notify()
        if self.thread is not None:
            self.thread.join(timeout)

    # ---- the engine's thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self.lock:
                    while not self.running and not self.queue and not self.stopped:
                        if self.group is None:
                            self.lock.wait()
                            continue
                        self.lock.wait(self.group.heartbeat_s / 4)
                        if not self.running and not self.queue and not self.stopped:
                            self.group.heartbeat()  # idle: the other ranks' waits must not time out
                    if self.stopped and not self.running and not self.queue:
                        if self.group is not None:
                            self.group.stop()
                        return
                try:
                    self.step()
                except GroupLost:
                    raise
                except Exception as error:  # a broken step fails its requests, not the server
                    self._fail_all(f"{type(error).__name__}: {error}")
                if self.after_step is not None:
                    self.after_step()
        except GroupLost as lost:  # another rank died or hung: nothing can be computed any more
            self.lost = str(lost)
            with self.lock:
                self.draining = self.stopped = True
            self._fail_all(self.lost)
            if self.after_step is not None:
                self.after_step()
            if self.on_lost is not None:
                self.on_lost(self.lost)

    def _fail_all(self, message: str) -> None:
        with self.lock:
            failed = self.running + list(self.queue)
            self.queue.clear()
        for request in failed:
            self._finish(request, "error", error=message)
        self._clear_rows(range(self.rows))  # a step that broke off may have left anything in the cache
        self._effect("undamage")  # every sequence it held has ended: the next ones start from their first token

    # ---- the changes to the model's state: on every rank of a group (serve.step_group) ----------

    def _effect(self, name: str, *args):
        """Apply one change of the model's state (``step_group.EFFECTS``, plain arguments) here and, in a
        group, on every other rank (sent before it is applied here, where it has collectives)."""
        if self.group is None or self.lost is not None:
            return getattr(self, EFFECTS[name])(*args)
        self.group.send(name, args)
        try:
            return getattr(self, EFFECTS[name])(*args)
        except Exception as error:
            if name not in WITH_COLLECTIVES:
                raise
            raise self.group.lose(error) from None  # a pass broken off here leaves the others within its collectives

    def _clear_cache_rows(self, rows: List[int]) -> None:
        for row in rows:
            self.cache.clear_row(row)
            self.slack.forget(row)

    def _undamage(self) -> None:
        self.cache.damaged = False

    def _cut_back(self, row: int, length: int) -> None:
        self.slack.cut_back(row, length)

    def _copy_cache_row(self, source: int, row: int, length: int) -> None:
        self.slack.copy_row(source, row, length)

    def _save_slack(self, seqlens: List[int], in_pass: bool) -> None:
        self.slack.save(seqlens, in_pass=in_pass)

    def _pass(self, tokens: List[int], seqlens: List[int], logit_rows: Optional[List[int]], adapters: Optional[List[int]],
              seen: Optional[List[int]] = None) -> torch.Tensor:  # fmt: skip
        """``Transformer.forward`` over the flat batch ``tokens`` (``seqlens[row]`` of each row, in row order),
        each token's adapter ``adapters``; the logits after ``logit_rows`` (all with None). ``seen``: rank
        0's ``tokens_seen`` before it, checked on the other ranks."""
        if seen is not None and self.group is not None and self.group.rank != 0:
            check_in_step(seen, self.cache.tokens_seen, self.group)
        device = self.model.device
        input_ids = torch.tensor(tokens, dtype=torch.long, device=device)  # (T,)
        token_adapters = None if adapters is None else torch.tensor(adapters, dtype=torch.long, device=device)  # (T,)
        with selected(self.model, token_adapters):
            return self.model(input_ids, seqlens, self.cache, logit_rows=logit_rows)  # (N, V)

    def _clear_rows(self, rows: Sequence[int]) -> None:
        """Zero these rows of the cache; they hold nothing to reuse. A row's next request never sees slots
        it has not written, but the static decode step reads them under a mask, and a NaN there would
        still spoil its sums."""
        self._effect("clear_rows", list(rows))
        for row in rows:
            self.row_states[row].ids, self.row_states[row].answers = [], []

    @torch.inference_mode()
    def step(self) -> bool:
        """One forward pass over every running sequence; False when there was nothing to do."""
        with self.lock:
            cancelled = [r for r in self.running if r.cancelled] + [r for r in self.queue if r.cancelled]
            self.queue = collections.deque(r for r in self.queue if not r.cancelled)
        for request in cancelled:
            self._finish(request, "cancelled")
        if not self.running:  # idle until now: the weights may have been replaced, so the steps are looked up again
            self._steps.clear()
        with self.lock:
            if self._admit_now():
                self._admit_waiting()
        if not self.running:
            self._gauges()
            return False

        decode_only = all(r.next_token is not None for r in self.running)
        started = time.perf_counter()
        measured = decode_only and self.speculation is not None  # a plain step's cost, beside the speculative ones'
        if measured and self.policy.wanted(len(self.running)):
            rows, gained = len(self.running), self._speculative_step()
            if gained is not None:
                self.policy.record_speculative(rows, time.perf_counter() - started, gained)
                self.steps += 1
                self._gauges()
                return True
            measured = False  # no row had a guess: a plain step, which asked for guesses first
        seqlens, chunks, sampled = self._plan()
        logits = self._forward(seqlens, chunks, sampled, decode_only)
        self.steps += 1
        if sampled:
            self._choose(sampled, logits)
        if measured:
            self.policy.record_plain(len(sampled), time.perf_counter() - started)
        self._gauges()
        return True

    def _forward(
        self, seqlens: List[int], chunks: List[List[int]], sampled: List[Request], decode_only: bool
    ) -> torch.Tensor:
        """Logits ``(len(sampled), V)`` after feeding each row its first ``seqlens[row]`` tokens of ``chunks``."""
        static = self._static_step_is_cheaper(seqlens) if self.choose_per_step else self.mode != "eager"
        if static and self.choose_per_step and self.slack_span is not None and max(seqlens) > self.slack_span:
            static = False  # the eager pass keeps the positions a chunk pushes out itself (slack)
        self._effect("save", list(seqlens), not static)  # before the pass writes over them
        if decode_only and static:
            return self._decode_only(sampled)
        if static:
            return self._mixed(seqlens, chunks, sampled)
        tokens = [t for row, chunk in enumerate(chunks) if seqlens[row] for t in chunk]
        ends = list(itertools.accumulate(seqlens))  # each row's end in the flat batch
        logit_rows = [ends[r.row] - 1 for r in sampled]
        return self._effect("forward", tokens, list(seqlens), logit_rows, self._token_adapters(seqlens), self._seen())  # (N, V)

    def _seen(self) -> Optional[List[int]]:
        """``tokens_seen`` for the other ranks to check theirs against (in a group), else None."""
        return list(self.cache.tokens_seen) if self.group is not None else None

    def _token_adapters(self, seqlens: List[int]) -> Optional[List[int]]:
        """The adapter of each token of a flat pass (``seqlens[row]`` tokens of each row, in row order),
        T of them; None without adapters."""
        if not self.adapters:
            return None
        return [adapter for adapter, n in zip(self.row_adapter, seqlens) for _ in range(n)]

    def _reads_prompts_eagerly(self) -> bool:
        """Whether steps that read long prompt chunks run ``Transformer.forward`` (``_forward``), which
        writes the positions a chunk pushes out itself to the slack; the static steps do not, so there
        a prompt's last chunk longer than a windowed buffer is read in two (``_plan``)."""
        return self.mode == "eager" or self.choose_per_step

    def _admit_now(self) -> bool:
        """Whether waiting requests take free rows at this step.

        ``admit_every`` = 1: at every step (the lowest time to first token). k > 1: as TGI's
        ``max_waiting_tokens``, prompts join a running batch in groups, when the batch has
        decoded k steps since the last group or when free rows outnumber the running ones, so
        fewer steps pay for a prompt's pass. An idle engine admits at once.

        Default: ``ADMIT_EVERY_COMPILED`` where decode-only steps run compiled and the steps that
        read prompts do not (``compiled`` and ``auto`` on CPU), else 1. A step that reads prompts then runs op by
        op, so the cheaper the compiled decode steps, the more grouping saves (docs/performance.md,
        "Serving"). Where prompts are read by a compiled step too (``compile_prompts``, CUDA), such
        a step costs about what a decode step costs, and grouping would only delay first tokens.
        Below capacity free rows outnumber running ones, so prompts still join at once there.
        """
        if not self.queue or None not in self.slots:
            return False
        if not self.running or self.admit_every <= 1:
            return True
        free = self.slots.count(None)
        return self.steps - self.last_admission >= self.admit_every or free > len(self.running)

    def _admit_waiting(self) -> None:
        """Give free rows to waiting requests, first come first served, but for those that wait for a
        prompt another row is reading (``_waits_for_prefix``). Called under the lock."""
        waiting = []
        while self.queue and None in self.slots:
            request = self.queue.popleft()
            if self._waits_for_prefix(request):
                waiting.append(request)
            else:
                self._admit(request)
        self.queue.extendleft(reversed(waiting))

    def _waits_for_prefix(self, request: Request) -> bool:
        """Whether ``request`` had better wait a step or more for a row that is reading its prompt's
        beginning now: the choice it follows (its row is copied once its prompt is read), or, with
        ``prefix_reuse``, a running prompt that shares at least ``MIN_REUSED_TOKENS`` tokens with it
        and has not read them yet (a shared system prompt arriving with many users at once). That
        prompt's reading then pauses at the shared length (``pause_at``), so that the row holds
        exactly the shared tokens for a step, and a copy of it is exact however long they are."""
        leader = request.follows
        if leader is not None and not leader.done and not leader.cancelled and leader.first_token_at is None:
            return True
        if not self.prefix_reuse:
            return False
        for running in self.running:
            if running.next_token is None and running.settings.adapter == request.settings.adapter:  # still reading its prompt
                share = min(common_prefix(running.prompt, request.prompt), len(request.prompt) - 1)
                if share >= MIN_REUSED_TOKENS and running.fed < share:
                    pause = running.pause_at
                    running.pause_at = share if pause is None or pause <= running.fed else min(pause, share)
                    return True
        return False

    def _admit(self, request: Request, placement: Optional[Placement] = None) -> None:
        """Give ``request`` a row: where ``prefix_reuse.place`` says (or ``placement``), after the tokens
        of its prompt the row already holds or gets copied."""
        if placement is None:
            if self.prefix_reuse:
                self._read_generated_answer(request)
                busy = {row for row, holder in enumerate(self.slots) if holder is not None}
                placement = place(request.prompt, self.row_states, busy, self.cache.kinds, self.slack.saved, request.settings.adapter)
            else:
                placement = Placement(self.slots.index(None), 0)
        row, reused = placement.row, placement.reused
        state = self.row_states[row]
        state.answers = list(request.answers)
        if placement.source is not None:
            self._copy_row(placement.source, row, reused)
            state.ids = self.row_states[placement.source].ids[:reused]
        else:
            self._effect("cut_back", row, reused)  # the window before `reused` back in its slots, from the slack
            del state.ids[reused:]  # the row's slots past `reused` count as empty: nothing in them is visible
        state.last_used = next(self.uses)
        state.adapter = self.row_adapter[row] = request.settings.adapter  # what the row's keys and values are computed with
        request.fed = request.reused = reused
        self.last_admission = self.steps
        request.row = row
        self.slots[row] = request
        self.running.append(request)
        self.admitted += 1
        if reused:
            self.prefix_hits += 1
            self.reused_tokens += reused
        if self.metrics is not None:
            self.metrics.queue_waited(time.perf_counter() - request.arrival)
            self.metrics.prompt_read(reused, len(request.prompt) - reused)

    def _copy_row(self, source: int, row: int, length: int) -> None:
        """Put into ``row`` the state of ``source``'s first ``length`` tokens (``SlackSlots.copy_row``, in each layer)."""
        self._effect("copy_row", source, row, length)

    def _read_generated_answer(self, request: Request) -> None:
        """Where ``request``'s prompt sends back, encoded again, the answers a row generated, read the
        generated ids instead (``prefix_reuse.with_generated_answer``): the same text, and the row goes on
        at its end. The prompt must still fit ``max_model_len`` with ``max_tokens``; the usage reports
        the prompt as read. ``request.answers``: the answers it holds as generated, which its row keeps."""
        limit = None if self.max_model_len is None else self.max_model_len - request.settings.max_tokens
        tokenizer = self.tokenizer
        prompt, request.answers = with_generated_answer(
            request.prompt, self.row_states, tokenizer.decode, lambda text: tokenizer.encode(text, bos=False), limit
        )
        if prompt is request.prompt:
            return
        request.prompt = prompt
        if request.penalties is not None:  # repetition_penalty counts the prompt's tokens
            s = request.settings
            request.penalties = RowPenalties.of(
                s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.logit_bias, prompt
            )

    def _take_followers(self, sampled: List[Request], logits: torch.Tensor) -> Tuple[List[Request], torch.Tensor]:
        """The waiting choices that follow a request which has just read its prompt, each given a free
        row holding a copy of the leader's (all of its prompt), added to ``sampled`` with the leader's
        logits: they sample their first token from them with their own generators."""
        leaders = {id(r): index for index, r in enumerate(sampled) if r.first_token_at is None}
        if not leaders or not self.queue:
            return sampled, logits
        picked: List[int] = []
        with self.lock:
            for request in [r for r in self.queue if r.follows is not None and id(r.follows) in leaders]:
                if request.cancelled or None not in self.slots:
                    continue
                self.queue.remove(request)
                leader = request.follows
                request.prompt, request.answers = leader.prompt, leader.answers  # as the leader read it (_read_generated_answer)
                row = spare_rows(self.row_states, [r for r in range(self.rows) if self.slots[r] is None])[0]
                self._admit(request, Placement(row, len(leader.prompt), leader.row))
                sampled.append(request)
                picked.append(leaders[id(leader)])
        if not picked:
            return sampled, logits
        return sampled, torch.cat([logits, logits[torch.tensor(picked, device=logits.device)]])

    def _plan(self) -> Tuple[List[int], List[List[int]], List[Request]]:
        """This step's tokens per row, the tokens themselves (row order), and the requests that
        sample a token after it (in row order: the order of their rows in the flat batch)."""
        seqlens = [0] * self.rows
        chunks: List[List[int]] = [[] for _ in range(self.rows)]
        budget, segments = self.step_budget, self.max_segments
        for request in self.running:  # admission order: the oldest prompt reads first
            if request.next_token is not None:
                chunks[request.row] = [request.next_token]
            elif budget > 0 and segments > 0:
                end = request.fed + budget
                if request.pause_at is not None and request.pause_at > request.fed:  # a waiting request copies it there
                    end = min(end, request.pause_at)
                span = self.slack_span
                if span is not None and not self._reads_prompts_eagerly() and end >= len(request.prompt) > request.fed + span:
                    # the last tokens alone: the static step keeps the positions they push out
                    end = len(request.prompt) - min(self.slack.slack, span)
                chunks[request.row] = request.prompt[request.fed : end]
                budget -= len(chunks[request.row])
                segments -= 1
            seqlens[request.row] = len(chunks[request.row])
            self.row_states[request.row].ids.extend(chunks[request.row])  # fed now: the row will hold them
        sampled = []
        for row, request in enumerate(self.slots):
            if request is None or not seqlens[row]:
                continue
            if request.next_token is None:
                request.fed += seqlens[row]
            if request.fed == len(request.prompt):
                sampled.append(request)
        return seqlens, chunks, sampled

    def _speculative_step(self) -> Optional[float]:
        """A step where every row decodes and the proposer guesses (``generation.speculative``): each row
        feeds its last token and its guesses (none for a request that opted out, or with no room left),
        one pass checks them all, and each row's tokens are chosen position by position through
        ``_choose``, which applies the row's grammar, penalties and stop strings after the tokens chosen
        before; each row is then cut back to the tokens whose logits were read. The tokens a row gained
        on average; None where no row had a guess (nothing done: the caller takes a plain step)."""
        speculation, device = self.speculation, self.model.device
        running = sorted(self.running, key=lambda r: r.row)  # the flat pass is in row order
        rows = [r.row for r in running]
        texts = [self.row_states[r.row].ids + [r.next_token] for r in running]
        room = []
        for r in running:
            left = r.settings.max_tokens - len(r.generated) - 1  # the last token comes from the last checked position
            if self.max_model_len is not None:
                left = min(left, self.max_model_len - self.cache.tokens_seen[r.row] - 1)
            room.append(max(0, min(self._ks[r.row], left)) if r.settings.speculative else 0)
        settings = [RequestSettings(max_tokens=1)] * self.rows  # the proposer reads its rows' sampling settings
        generators: List[Optional[torch.Generator]] = [None] * self.rows
        for r in running:
            settings[r.row], generators[r.row] = r.settings, r.generator
        sampling = rows_sampling(settings, self._vocab, device, any(s.filtered(self._vocab) for s in settings))
        guesses, qs = speculation.proposer.propose(rows, texts, room, sampling, generators)
        if not any(guesses):
            return None  # nothing to check: the plain step reads the rows faster
        seqlens = [0] * self.rows
        fed = {}
        for r, g in zip(running, guesses):
            fed[r.row] = [r.next_token] + list(g)
            seqlens[r.row] = len(fed[r.row])
        seen = list(self.cache.tokens_seen)
        self._effect("save", list(seqlens), True)  # before the pass writes over them
        if self._verifies_static():
            pieces = [(row, seen[row], fed[row]) for row in rows]
            compiler = self.compiler if self.compile_prompts else None
            out = static_verify(self.model, self.cache, pieces, speculation.tokens, compiler, grouped_moe=compiler is None,
                                row_adapters=self._row_adapters())  # fmt: skip
        else:
            tokens = [t for row in rows for t in fed[row]]
            out = self._effect("forward", tokens, list(seqlens), None, self._token_adapters(seqlens), self._seen())  # (T, V) after every fed token
        for row in rows:
            self.row_states[row].ids.extend(fed[row])
        starts = dict(zip(rows, itertools.accumulate([seqlens[row] for row in rows], initial=0)))
        read = {row: 0 for row in rows}  # positions whose logits were read: the tokens each row keeps fed
        gained = {row: 0 for row in rows}
        accepted = {row: 0 for row in rows}
        checking, j = running, 0
        while checking:
            logits = out[torch.tensor([starts[r.row] + j for r in checking], device=out.device)]  # (N, V)
            checks = {}
            for r, g, q in zip(running, guesses, qs):
                guess = g[j] if j < len(g) else None
                checks[id(r)] = (guess, q[j] if q is not None and guess is not None else None)
            before = {r.row: len(r.generated) for r in checking}
            going = self._choose(checking, logits, checks)
            for r in checking:
                read[r.row] = j + 1
                grew = len(r.generated) > before[r.row]
                gained[r.row] += grew
                accepted[r.row] += grew and r.generated[-1] == checks[id(r)][0]
            checking, j = going, j + 1
        for r, g in zip(running, guesses):
            row = r.row
            if self.cache.tokens_seen[row] >= seen[row] + read[row]:  # not cleared (non-finite logits)
                self._effect("cut_back", row, seen[row] + read[row])  # the guesses after the last one read are forgotten
                del self.row_states[row].ids[seen[row] + read[row] :]
            if speculation.proposer.adaptive and g:
                self._ks[row] = min(speculation.tokens, self._ks[row] + 2) if accepted[row] == len(g) else max(1, self._ks[row] - 1)
        stats = SpeculativeStats(
            steps=1, row_steps=len(running), proposed=sum(len(g) for g in guesses), accepted=sum(accepted.values()),
            emitted=sum(gained.values()),
        )  # fmt: skip
        speculation.stats.add(stats)
        speculation.proposer.stats.add(stats)
        if self.metrics is not None:
            self.metrics.speculated(stats.proposed, stats.accepted, stats.emitted, stats.row_steps)
        return stats.emitted / max(1, len(running))

    def _verifies_static(self) -> bool:
        """Whether verify passes run the fixed-shape verify step (``speculative.static_verify``: where
        every step is static, compiled with the prompts' steps), else ``Transformer.forward`` (eager,
        and off CUDA where each step is chosen: the eager pass reads the few rows that speculate)."""
        return self.mode != "eager" and not self.choose_per_step

    def _decode_only(self, sampled: List[Request]) -> torch.Tensor:
        """Every running row feeds one token: the static decode step over all R rows."""
        device = self.model.device
        tokens, alive = [0] * self.rows, [False] * self.rows  # built as lists: one tensor each, not one op per row
        for request in sampled:  # every running request: each feeds the token it sampled last
            tokens[request.row], alive[request.row] = request.next_token, True
        tokens = torch.tensor(tokens, dtype=torch.long)  # (R,)
        alive = torch.tensor(alive, dtype=torch.bool)  # (R,)
        positions = torch.tensor(self.cache.tokens_seen, dtype=torch.long)
        logits = self._call_decode_step(tokens, positions, alive)  # (R, V)
        for request in sampled:
            self.cache.tokens_seen[request.row] += 1
        return logits[torch.tensor([r.row for r in sampled], device=device)]  # (N, V), a copy

    def _mixed(self, seqlens: List[int], chunks: List[List[int]], sampled: List[Request]) -> torch.Tensor:
        """A step that reads prompts: the decoding rows and the prompt chunks through ``mixed_logits``,
        the chunks padded to the next of ``chunk_sizes`` when compiled. Logits ``(N, V)``."""
        device = self.model.device
        tokens, alive = [0] * self.rows, [False] * self.rows
        pieces = []  # (row, tokens seen, chunk) of each prompt read now, in row order
        for row, request in enumerate(self.slots):
            if request is None or not seqlens[row]:
                continue
            if request.next_token is not None:
                tokens[row], alive[row] = request.next_token, True
            else:
                pieces.append((row, self.cache.tokens_seen[row], chunks[row]))
        size = None
        if self.chunk_sizes is not None:
            read = sum(len(chunk) for _, _, chunk in pieces)
            size = next(c for c in self.chunk_sizes if c >= read)
        chunk = pack_chunk(pieces, size, self.max_segments if size is not None else None, device)
        positions = torch.tensor(self.cache.tokens_seen, dtype=torch.long)  # (R,)
        logits = self._call_step(  # (R + K, V)
            ("mixed", size), torch.tensor(tokens, dtype=torch.long), positions, torch.tensor(alive, dtype=torch.bool), chunk
        )
        for row, n in enumerate(seqlens):
            self.cache.tokens_seen[row] += n
        segment = {row: index for index, (row, _, _) in enumerate(pieces)}
        picked = [r.row if r.next_token is not None else self.rows + segment[r.row] for r in sampled]
        return logits[torch.tensor(picked, dtype=torch.long, device=device)]  # (N, V), a copy

    def _call_decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
        """The decode step over all R rows, inputs ``(R,)`` on the host: logits ``(R, V)``."""
        return self._call_step("decode", tokens, positions, alive)

    def _call_step(self, key, tokens: torch.Tensor, positions: torch.Tensor, alive: torch.Tensor, chunk=None) -> torch.Tensor:
        """The decode step (key "decode") or the mixed step of a chunk size (key ("mixed", size), None
        when unpadded), made on first use; inputs on the host but the chunk, already on the device."""
        device = self.model.device
        mixed = chunk is not None
        step = self._steps.get(key)
        if step is None:
            step = self._steps[key] = self._make_step(key, mixed)
        compiled = self._compiles(mixed)
        if device.type == "cuda" and compiled:
            torch.compiler.cudagraph_mark_step_begin()
        self._step_calls[key] += 1
        cache = self.cache
        inputs = [cache.layer_keys, cache.layer_values, tokens.to(device), positions.to(device), alive.to(device)]
        adapters = [] if not self.adapters else [self._row_adapters()]  # the last input of an adapted step
        # Every call passes the same cache tensors and fresh inputs of the same shapes and dtypes:
        # after the first calls, dynamo's per-weight guards would pass (as in generate's decode loop).
        with guards_checked(not compiled or self._step_calls[key] <= GUARDED_STEPS):
            try:
                return step(*inputs, *([chunk] if chunk is not None else []), *adapters)
            except Exception as error:  # a first call builds (steps.compiler): it fails before the step writes anything
                if not (compiled and self._step_calls[key] == 1 and self.may_fall_back):
                    raise
                self._compile_failed(error)
        return self._call_step(key, tokens, positions, alive, chunk)

    def _compile_failed(self, error: Exception) -> None:
        """``decode="auto"``: compiling a step failed, after the step compiler's own fall-backs (on
        CPU, most often for want of a C++ compiler). Say so in one line and go on with the uncompiled
        steps, as ``eager`` with the per-step choice off CUDA: the same tokens, more slowly."""
        warn(f"could not compile the decode step ({one_line(error)}); serving with the uncompiled steps")
        self.mode, self.may_fall_back = "eager", False
        self._set_prompt_steps(False)
        if not self.admit_every_given:
            self.admit_every = self._default_admit_every()
        self._steps.clear()
        self._step_calls.clear()

    def _static_step_is_cheaper(self, seqlens: List[int]) -> bool:
        """Whether this step reads fewer keys through the static step (``decode_logits``, or
        ``mixed_logits`` when it reads prompts) than through ``Transformer.forward`` (``decode="auto"``
        off CUDA).

        The static step attends in place: each of the R rows over its S slots under a mask
        (``R * S``), and the K prompts read now as a batch of K lines of P queries (P the longest
        prompt chunk), each over its row's S slots and its line (``K * P * (S + P)``). The eager
        pass gathers each decoding row's keys, padded to the longest row's count L (``N * L``), and
        each prompt's cached keys and chunk (``n * (cached + n)`` for a chunk of n); a gathered key
        costs about ``GATHER_COST`` keys read in place (docs/performance.md, "The KV cache").

        Example, R = 4 rows, S = 8, 3 rows decoding: at 2, 3 and 4 tokens seen (L = 5, as the new
        token counts), 32 > 2 * 3 * 5 = 30: eager; at 2, 3 and 8 (L = 8), 32 <= 48: static. With
        row 3 also reading a fresh 4-token prompt: static 32 + 4 * (8 + 4) = 80, eager 2 * (24 +
        4 * 4) = 80: static.

        The static step reads unwritten slots under its mask, so they must hold finite numbers:
        the cache starts zeroed, and a row whose logits went non-finite is zeroed (``_choose``).
        Its experts run grouped, as in the eager pass (``decode_logits``' ``grouped_moe``): the
        static step's own MoE computes every expert on every row, which is slower on CPU
        (docs/performance.md, "The MoE decode step").
        """
        seen = self.cache.tokens_seen
        decoding = [r.row for r in self.running if r.next_token is not None and seqlens[r.row]]
        reading = [r.row for r in self.running if r.next_token is None and seqlens[r.row]]
        line = max((seqlens[row] for row in reading), default=0)
        static = gathered = 0
        for slots, layers in collections.Counter(self.cache.layer_sizes).items():  # by the size of the layers' buffers
            prompts = [(min(seen[row], slots), seqlens[row]) for row in reading]
            static += layers * (self.rows * slots + len(prompts) * line * (slots + line))
            longest = max((min(seen[row] + 1, slots) for row in decoding), default=0)
            gathered += layers * (len(decoding) * longest + sum(n * (cached + n) for cached, n in prompts))
        return static <= GATHER_COST * gathered

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile the decode step and the mixed step of every chunk size now (``compiled``), before
        requests arrive, which would otherwise wait for them: seconds each on a tiny model, more on
        large ones. Every row sits out of the decode step (``alive`` false), and the one slot the
        mixed steps' one-token chunk writes is put back, so the cache is left as it was."""
        if self.mode != "compiled":
            return
        zeros = torch.zeros(self.rows, dtype=torch.long)  # (R,) tokens, then positions
        idle = torch.zeros_like(zeros, dtype=torch.bool)
        self._call_decode_step(zeros, zeros.clone(), idle)
        if not self.compile_prompts:
            return
        buffers = (*self.cache.layer_keys, *self.cache.layer_values)  # (B_max, S_layer, H_kv, Dh) each
        held = [buffer[0, 0].clone() for buffer in buffers]
        for size in self.chunk_sizes:
            chunk = pack_chunk([(0, 0, [0])], size, self.max_segments, self.model.device)  # writes row 0's slot 0
            self._call_step(("mixed", size), zeros, zeros.clone(), idle, chunk)
        if self.speculation is not None and self._verifies_static():  # the verify step, its one token at row 0's slot 0
            seen = self.cache.tokens_seen[0]
            self.cache.tokens_seen[0] = 0
            static_verify(self.model, self.cache, [(0, 0, [0])], self.speculation.tokens, self.compiler, grouped_moe=False,
                          row_adapters=self._row_adapters())  # fmt: skip
            self.cache.tokens_seen[0] = seen
        for buffer, slot in zip(buffers, held):
            buffer[0, 0] = slot

    def _row_adapters(self) -> Optional[torch.Tensor]:
        """Each row's adapter ``(R,)`` on the device (0: none), the adapted steps' last input; None without adapters."""
        return torch.tensor(self.row_adapter, dtype=torch.long, device=self.model.device) if self.adapters else None

    def _compiles(self, mixed: bool) -> bool:
        """Whether the decode step (or, ``mixed``, the step that reads prompts) runs compiled."""
        return self.mode == "compiled" and (self.compile_prompts or not mixed)

    def _make_step(self, key, mixed: bool) -> Callable[..., torch.Tensor]:
        """The step of ``key`` (``_call_step``): the decode step's logits (``DECODE_LOGITS``) or the mixed
        step's (``MIXED``), from the step compiler where it compiles, else the plain function."""
        compiled = self._compiles(mixed)
        # Uncompiled, the experts run grouped (decode_logits' grouped_moe), as in the eager pass: every
        # expert on every token is the slower on CPU; so for decode-only steps chosen per step by auto
        # (mode eager), and for the steps that read prompts unless they compile.
        grouped_moe = self.mode == "eager" or (mixed and not compiled)
        kind = MIXED if mixed else DECODE_LOGITS
        kind = ADAPTED[kind] if self.adapters else kind
        if not compiled:
            return kind.make(self.model, self.tuning, grouped_moe)
        if not supports_static_decode(self.model):  # pragma: no cover - decode_mode refuses it first
            raise GenerationError("the static decode step needs the whole model in one process")
        shape = (self.rows, key[1], self.max_segments) if mixed else (self.rows,)  # the chunk's tokens and segments
        return self.compiler.step(kind, self.cache, (grouped_moe,), shape)

    def _choose(self, sampled: List[Request], logits: torch.Tensor, checks: Optional[Dict[int, tuple]] = None) -> List[Request]:
        """Sample every row's next token, then hand each to its request.

        A request whose logits hold NaN or inf ends with an error, and its row of the cache is
        cleared; the other rows go on (their logits do not depend on it). The grammar masks are
        computed first, on the host, while a CUDA device still runs the step.

        ``checks``: at a position a verify pass checked (``_speculative_step``), each request's
        ``(guess, q)`` (by ``id``; guess None past its last): the token is chosen as
        ``generation.speculative.choose_checked`` says. The requests whose token was their guess and
        that go on, in order (none without ``checks``)."""
        masks = {id(r): fill_bitmask([r.grammar], self.tokenizer.n_words)[0] for r in sampled if r.grammar is not None}
        finite = finite_rows(logits)  # (N,)
        if not finite.all():
            finite = finite.tolist()
            for request in [r for r, ok in zip(sampled, finite) if not ok]:
                self._clear_rows([request.row])
                self._finish(request, "error", error=NOT_FINITE)
            keep = [i for i, ok in enumerate(finite) if ok]
            sampled, logits = [sampled[i] for i in keep], logits[torch.tensor(keep, device=logits.device)]
            if not sampled:
                return []
        sampled, logits = self._take_followers(sampled, logits)
        shaped = self._shaped(sampled, logits, masks)
        hits = [False] * len(sampled)
        if checks is None:
            tokens = sample_rows(shaped, [r.settings for r in sampled], [r.generator for r in sampled])  # (N,)
        else:
            guesses, qs = zip(*(checks[id(r)] for r in sampled))
            filtered = any(r.settings.filtered(self._vocab) for r in sampled)
            row_sampling = rows_sampling([r.settings for r in sampled], self._vocab, shaped.device, filtered)
            chosen, hits = choose_checked(shaped, row_sampling, guesses, qs, [r.generator for r in sampled])
            tokens = torch.tensor(chosen, dtype=torch.long, device=logits.device)
        chosen, top = None, None
        if any(r.settings.logprobs is not None for r in sampled):  # else skip a softmax over (N, V)
            log_probs = torch.log_softmax(logits, dim=-1)  # (N, V)
            chosen = log_probs.gather(1, tokens[:, None])[:, 0].tolist()
            top_n = max((r.settings.logprobs or 0) for r in sampled)
            top = log_probs.topk(top_n, dim=-1) if top_n else None
        top_values = top.values.tolist() if top is not None else None
        top_ids = top.indices.tolist() if top is not None else None
        now = time.perf_counter()
        generated = 0
        going = []
        for index, (request, token) in enumerate(zip(sampled, tokens.tolist())):
            if request.first_token_at is None:
                request.first_token_at = now
                if self.metrics is not None:
                    self.metrics.first_token(now - request.arrival)
            if token == self.tokenizer.eos_id and not request.settings.ignore_eos:
                self._finish(request, "stop")
                continue
            if request.grammar is not None:
                request.grammar.accept(token)
            if request.penalties is not None:
                request.penalties.add(token)
            request.generated.append(token)
            text = request.answer.push(token)
            event = TokenEvent(token, text)
            if request.settings.logprobs is not None:
                n = request.settings.logprobs
                event.logprob = chosen[index]
                event.top_logprobs = list(zip(top_ids[index][:n], top_values[index][:n])) if n else []
            request.sink(event)
            generated += 1
            if request.answer.stopped or (request.grammar is not None and request.grammar.done):
                self._finish(request, "stop")
            elif len(request.generated) == request.settings.max_tokens:
                self._finish(request, "length")
            else:
                request.next_token = token
                if hits[index]:
                    going.append(request)
        if self.metrics is not None:
            self.metrics.generated_tokens(generated)
        return going

    def _shaped(self, sampled: List[Request], logits: torch.Tensor, masks: Dict[int, torch.Tensor]) -> torch.Tensor:
        """The logits the rows sample from: each row's grammar mask (``masks``, by request, computed
        for those without), penalties and bias applied, EOS held back below ``min_tokens``
        (``structured``); ``logits`` itself when no row asks for any. Logprobs are reported from
        the model's own logits."""
        grammars = [r.grammar for r in sampled]
        penalised = [i for i, r in enumerate(sampled) if r.penalties is not None]
        early = [i for i, r in enumerate(sampled) if len(r.generated) < r.settings.min_tokens and not r.settings.ignore_eos]
        if not penalised and not early and all(g is None for g in grammars):
            return logits
        logits = logits.to(torch.float32, copy=True)  # the model's logits stay, for the logprobs
        if penalised:
            rows = torch.tensor(penalised, device=logits.device)
            dense = dense_penalties([sampled[i].penalties for i in penalised], logits.shape[-1], logits.device)
            logits[rows] = apply_penalties(logits[rows], *dense)
        if early:
            logits[torch.tensor(early, device=logits.device), self.tokenizer.eos_id] = float("-inf")
        if any(g is not None for g in grammars):  # last: a token the grammar forbids stays forbidden
            bits = fill_bitmask([None] * len(sampled), self.tokenizer.n_words)  # (N, W) all allowed
            for i, r in enumerate(sampled):
                if r.grammar is not None:
                    bits[i] = masks[id(r)] if id(r) in masks else fill_bitmask([r.grammar], self.tokenizer.n_words)[0]
            logits = apply_bitmask(logits, bits)
        return logits

    def _finish(self, request: Request, reason: str, error: Optional[str] = None) -> None:
        """Free the request's row and send its last event."""
        if request.done:
            return
        with self.lock:
            request.done = True
            if request.row is not None and self.slots[request.row] is request:
                self.slots[request.row] = None
                self.running.remove(request)
                state = self.row_states[request.row]
                state.last_used = next(self.uses)
                if reason in ("stop", "length") and request.generated:  # the row holds the prompt, then the answer
                    state.answers.append(Answer(len(request.prompt), list(request.generated)))
        text = "" if reason in ("cancelled", "error") else request.answer.finish()
        if self.metrics is not None:
            self.metrics.finished(reason, time.perf_counter() - request.arrival, len(request.prompt), len(request.generated))
        request.sink(Finished(reason, text, len(request.prompt), len(request.generated), error))

    def _gauges(self) -> None:
        if self.metrics is not None:
            with self.lock:
                queued, running = len(self.queue), len(self.running)
            self.metrics.gauges(queued, running)


def mixed_chunk_sizes(prefill_tokens: int, cap: Optional[int] = None) -> List[int]:
    """The chunk sizes of a compiled engine's mixed steps: ``MIXED_CHUNKS`` below the budget, then the
    budget, ``prefill_tokens`` or ``cap`` if less. A step pads its prompt tokens to the first size that
    holds them, so a few compiled graphs cover every step. ``mixed_chunk_sizes(512) == [16, 64, 256,
    512]``, ``mixed_chunk_sizes(7) == [7]``, ``mixed_chunk_sizes(512, cap=64) == [16, 64]``.

    The cap is for a mixture of experts (``MIXED_MOE_TOKENS``): the compiled step runs every expert on
    every token, which stays bound by reading the weights only for a few dozen tokens (an estimate
    for Mixtral 8x7B: docs/performance.md, "Serving").
    """
    budget = prefill_tokens if cap is None else min(prefill_tokens, cap)
    return [size for size in MIXED_CHUNKS if size < budget] + [budget]


def sample_rows(
    logits: torch.Tensor,  # (N, V) float
    settings: Sequence[RequestSettings],
    generators: Sequence[Optional[torch.Generator]],
) -> torch.Tensor:
    """Each row's next token ``(N,)``, as ``generate`` would choose it for that row alone.

    Rows are sampled in groups of one kind (greedy; plain temperature; top-k / top-p), so a
    row's token depends only on its logits, its settings and its own generator's next
    uniform number.
    """
    vocab = logits.shape[-1]
    # The greedy rows' tokens: max's indices are argmax's (the first of equal maxima), and on CPU
    # they come faster (docs/performance.md, "On-device checks instead of syncs").
    tokens = logits.max(dim=-1).indices  # (N,)
    groups: Dict[bool, List[int]] = {False: [], True: []}  # filtered -> rows
    for index, s in enumerate(settings):
        if s.temperature > 0:
            groups[s.filtered(vocab)].append(index)
    for filtered, rows in groups.items():
        if not rows:
            continue
        device = logits.device
        sampling = rows_sampling([settings[i] for i in rows], vocab, device, filtered)
        uniform = torch.cat([torch.rand(1, generator=generators[i], device=device) for i in rows])  # (N_g,)
        index = torch.tensor(rows, device=device)
        tokens[index] = sample(logits[index], sampling, uniform)
    return tokens



def warn(message: str) -> None:
    """A warning line on the server's terminal: why a step fell back (``steps.compiler``, ``Engine._compile_failed``)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)
