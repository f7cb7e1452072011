"""A conversation that streams its answers and keeps its context in the rotating cache.

With a sliding-window model the cache keeps W slots however long the
conversation grows, so each turn only feeds the tokens the cache has not seen
yet (the new user turn, and the last answer token, which generation samples but
never feeds). Without a window every turn re-reads the whole history.

Instruct format (Mistral's): ``<s>[INST] question [/INST] answer</s>[INST] next [/INST]``, each
turn rendered by ``generation.chat_template`` (``conversation_turn``), the renderer ``LLM.chat``
and the server use too, so a conversation's ids are theirs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable, List, Optional

from mixtral_infer.steps.decode_loop import compile_seconds
from mixtral_infer.errors import GenerationError
from mixtral_infer.generation.chat_template import conversation_turn
from mixtral_infer.generation.generate import decode_mode, generate, sampling_params
from mixtral_infer.generation.sampling_params import SEED_LIMIT, SamplingParams, check_seed
from mixtral_infer.generation.settings import check_chunk_size
from mixtral_infer.generation.speculative import SpeculativeStats, check_speculation
from mixtral_infer.generation.text_stream import TextStream
from mixtral_infer.model.cache import RotatingBufferCache
from mixtral_infer.model.transformer import Transformer
from mixtral_infer.tokenizer import Tokenizer


CONVERSATION = SamplingParams(max_tokens=100, temperature=0.0)  # a Conversation's defaults: greedy, 100 tokens


@dataclass
class Reply:
    """One answer and how it went."""

    text: str
    tokens: int  # generated, EOS not counted
    seconds: float  # from the question to the last token
    first_token_seconds: Optional[float]  # time to the first token (None when there was none)
    hit_max_tokens: bool  # stopped by max_tokens, not by the model's EOS
    compile_seconds: float = 0.0  # of ``seconds``, spent building a compiled decode step (the first answer)
    speculation: Optional[SpeculativeStats] = None  # what speculative decoding gained in this answer

    def stats(self) -> str:
        """``12 tokens, 35.1 tokens/s, first token after 0.08 s``. The time a compiled step took to
        build (before the first token) is left out of the rate and said: 12 tokens in 40.5 s, 40.2
        of them compiling, give ``12 tokens, 40.0 tokens/s, first token after 40.30 s (40.2 s
        compiling the decode step, once)`` (the test's example)."""
        seconds = self.seconds - self.compile_seconds
        rate = self.tokens / seconds if seconds > 0 else 0.0
        first = ""
        if self.first_token_seconds is not None:
            compiling = f" ({self.compile_seconds:.1f} s compiling the decode step, once)" if self.compile_seconds else ""
            first = f", first token after {self.first_token_seconds:.2f} s{compiling}"
        gained = f"; {self.speculation.line()}" if self.speculation is not None and self.speculation.steps else ""
        return f"{self.tokens} tokens, {rate:.1f} tokens/s{first}{gained}"


class Conversation:
    """A conversation with a model: each ``reply(text)`` streams an answer and keeps the context in
    the cache, so the next turn reads only its new tokens (module docstring).

    >>> chat = Conversation(model, tokenizer, instruct=True, max_tokens=12, temperature=0)  # doctest: +SKIP
    >>> chat = Conversation(model, tokenizer, SamplingParams(max_tokens=12, temperature=0), instruct=True)  # doctest: +SKIP
    >>> chat.reply("Who made the heaven and the earth?").text                             # doctest: +SKIP

    ``params`` (or its fields as keyword arguments): how to choose tokens (``SamplingParams``; here
    greedy and 100 tokens unless given); with a seed, turn t samples with ``seed + t``.
    ``instruct``: wrap each turn in the model's instruct format (else each reply continues the text).
    ``system``: a system prompt, put before the first user turn (as v1 models and mistral-common's v1
    rendering place it: the conversation is kept in the cache, so it stays where the first turn put it).
    ``emit`` (of ``reply``): called with each piece of text as it comes. ``draft``,
    ``speculative_tokens``: speculative decoding, as ``generate`` takes them (a draft model keeps its
    own cache of the conversation; both read the earlier turns as the row's text); each ``Reply``
    says what it gained.
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        params: Optional[SamplingParams] = None,
        *,
        instruct: bool = False,
        chunk_size: Optional[int] = None,
        decode: str = "auto",
        system: Optional[str] = None,
        draft: object = None,
        speculative_tokens: Optional[int] = None,
        **sampling: Any,
    ):
        params = sampling_params(params, sampling, CONVERSATION)
        check_seed(params.seed)  # one integer: turn t draws with seed + t
        self.params = params.check()  # not at the first reply
        check_chunk_size(chunk_size)
        if system is not None and (not isinstance(system, str) or not instruct):
            raise GenerationError("system= is a text, and needs instruct=True (a system prompt is part of the instruct format)")
        self.system = system
        self.speculation = check_speculation(draft, speculative_tokens)
        decode_mode(decode, model)
        self.model, self.tokenizer, self.instruct = model, tokenizer, instruct
        self.chunk_size, self.decode = chunk_size, decode
        self.turns = 0
        self.history: List[int] = []
        self.cache: Optional[RotatingBufferCache] = None
        self.reset()

    def reset(self) -> None:
        """Forget the conversation."""
        self.history = []
        if self.model.args.full_attention:  # its cache would grow with the chat: each turn reads the history again
            self.cache = None
        elif self.cache is None:
            self.cache = self.model.make_cache(1)
        else:
            self.cache.start_sequences(1)  # the same buffers: a compiled decode step keeps writing where it was captured

    def _turn_tokens(self, text: str) -> List[int]:
        if not self.instruct:
            return self.tokenizer.encode(text, bos=True)
        return conversation_turn(self.tokenizer, text, first=not self.history, system=self.system)

    def reply(self, text: str, emit: Callable[[str], None] = lambda piece: None) -> Reply:
        """Answer ``text``, calling ``emit`` with each new piece of the answer."""
        if not self.instruct:
            self.reset()  # plain completion: every line is a new prompt
        if not isinstance(text, str):
            raise GenerationError(f"reply({text!r:.40}): give the text of the turn")
        turn = self._turn_tokens(text)
        if self.cache is not None and self.cache.damaged:  # a prompt cut short (Ctrl-C): read the history again
            self.cache.start_sequences(1)
        if self.cache is not None:
            seen = self.cache.tokens_seen[0] if self.cache.tokens_seen else 0
            cache = self.cache
        else:
            seen, cache = 0, None
        prompt = self.history[seen:] + turn
        stream = TextStream(self.tokenizer, leading_space=not self.instruct)
        seed = None if self.params.seed is None else (self.params.seed + self.turns) % SEED_LIMIT  # turn t draws with seed + t
        self.turns += 1
        ended_by_eos = False
        start, compiled_before = time.perf_counter(), compile_seconds(self.model)
        speculation = self.speculation
        if speculation is not None:
            speculation.context = [self.history[:seen]]  # what the cache holds: the proposer reads it as the text's start
        gained_before = speculation.stats.copy() if speculation is not None else None
        first_token: List[float] = []

        def on_token(_: int, token: int) -> None:
            if not first_token:
                first_token.append(time.perf_counter() - start)
            piece = stream.push(token)
            if piece:
                emit(piece)

        try:
            generated, _ = generate(
                [prompt],
                self.model,
                replace(self.params, seed=seed),
                eos_id=self.tokenizer.eos_id,
                cache=cache,
                on_token=on_token,
                prompt_logprobs=False,
                chunk_size=self.chunk_size,
                decode=self.decode,
                draft=speculation,
            )
            ended_by_eos = len(generated[0]) < self.params.max_tokens
            rest = stream.finish()
            if rest:
                emit(rest)
        finally:
            # Also on Ctrl-C: keep what was said; the cache only counts tokens it fully read.
            self.history += turn + stream.tokens + ([self.tokenizer.eos_id] if ended_by_eos else [])
        return Reply(
            text=stream.text(),
            tokens=len(stream.tokens),
            seconds=time.perf_counter() - start,
            first_token_seconds=first_token[0] if first_token else None,
            hit_max_tokens=not ended_by_eos,
            compile_seconds=compile_seconds(self.model) - compiled_before,
            speculation=speculation.stats.since(gained_before) if speculation is not None else None,
        )
