"""A conversation that streams its answers and keeps its context in the rotating cache.

With a sliding-window model the cache keeps W slots however long the
conversation grows, so each turn only feeds the tokens the cache has not seen
yet (the new user turn, and the last answer token, which generation samples but
never feeds). Without a window every turn re-reads the whole history.

Instruct format (Mistral's): ``<s>[INST] question [/INST] answer</s>[INST] next [/INST]``,
where ``[INST]`` and ``[/INST]`` are text for a v1 tokenizer and single control tokens
for a v3 one (``Tokenizer.encode_instruct``).
"""

from __future__ import annotations

from typing import Callable, List, Optional

from mixtral_infer.generation.generate import generate
from mixtral_infer.model.cache import RotatingBufferCache
from mixtral_infer.model.transformer import Transformer
from mixtral_infer.tokenizer import Tokenizer

REPLACEMENT_CHARACTER = "\ufffd"  # what an incomplete UTF-8 byte sequence decodes to


class TextStream:
    """Turns tokens into printable text pieces as they arrive.

    Decoding token by token loses sentencepiece's spaces and splits multi-byte
    characters, so the whole answer is decoded each time and only the new suffix
    is emitted (held back while it ends in half a character).
    """

    def __init__(self, tokenizer: Tokenizer, emit: Callable[[str], None], leading_space: bool):
        self.tokenizer, self.emit, self.leading_space = tokenizer, emit, leading_space
        self.tokens: List[int] = []
        self.shown = 0

    def text(self) -> str:
        text = self.tokenizer.decode(self.tokens)
        if self.leading_space and self.tokens and self.tokenizer.id_to_piece(self.tokens[0]).startswith("\u2581"):
            text = " " + text
        return text

    def push(self, token: int) -> None:
        self.tokens.append(token)
        text = self.text()
        if not text.endswith(REPLACEMENT_CHARACTER):
            self._show(text)

    def finish(self) -> None:
        """Emit whatever was held back (an answer may end in half a character)."""
        self._show(self.text())

    def _show(self, text: str) -> None:
        if len(text) > self.shown:
            self.emit(text[self.shown :])
            self.shown = len(text)


class Conversation:
    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        *,
        instruct: bool = False,
        max_tokens: int = 100,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: Optional[int] = None,
        chunk_size: Optional[int] = None,
        seed: Optional[int] = None,
        decode: str = "auto",
    ):
        self.model, self.tokenizer, self.instruct = model, tokenizer, instruct
        self.settings = dict(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, chunk_size=chunk_size, decode=decode
        )
        self.seed = seed
        self.turns = 0
        self.history: List[int] = []
        self.cache: Optional[RotatingBufferCache] = None
        self.reset()

    def reset(self) -> None:
        """Forget the conversation."""
        self.history = []
        if self.model.args.sliding_window is None:
            self.cache = None
        elif self.cache is None:
            self.cache = self.model.make_cache(1)
        else:
            self.cache.start_sequences(1)  # the same buffers: a compiled decode step keeps writing where it was captured

    def _turn_tokens(self, text: str) -> List[int]:
        if not self.instruct:
            return self.tokenizer.encode(text, bos=True)
        tokens = self.tokenizer.encode_instruct(text)
        return ([self.tokenizer.bos_id] if not self.history else []) + tokens

    def reply(self, text: str, emit: Callable[[str], None] = lambda piece: None) -> str:
        """Answer ``text``, calling ``emit`` with each new piece of the answer; returns the answer."""
        if not self.instruct:
            self.reset()  # plain completion: every line is a new prompt
        turn = self._turn_tokens(text)
        if self.cache is not None:
            seen = self.cache.tokens_seen[0] if self.cache.tokens_seen else 0
            cache = self.cache
        else:
            seen, cache = 0, None
        prompt = self.history[seen:] + turn
        stream = TextStream(self.tokenizer, emit, leading_space=not self.instruct)
        seed = None if self.seed is None else self.seed + self.turns
        self.turns += 1
        ended_by_eos = False
        try:
            generated, _ = generate(
                [prompt],
                self.model,
                eos_id=self.tokenizer.eos_id,
                seed=seed,
                cache=cache,
                on_token=lambda _, token: stream.push(token),
                prompt_logprobs=False,
                **self.settings,
            )
            ended_by_eos = len(generated[0]) < self.settings["max_tokens"]
            stream.finish()
        finally:
            # Also on Ctrl-C: keep what was said; the cache only counts tokens it fully read.
            self.history += turn + stream.tokens + ([self.tokenizer.eos_id] if ended_by_eos else [])
        return stream.text()
