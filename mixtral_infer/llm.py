"""The high-level Python API, in the shape vLLM users know: text in, text out, any batch size.

>>> from mixtral_infer import LLM, SamplingParams                      # doctest: +SKIP
>>> llm = LLM("tiny-mixtral")                                           # doctest: +SKIP
>>> [out] = llm.generate(["And God said"], SamplingParams(max_tokens=8, temperature=0))  # doctest: +SKIP
>>> out.text, out.finish_reason                                         # doctest: +SKIP
(' unto him, Thou art my son,', 'length')

``LLM`` loads a model (a shipped name, a folder, or a Hugging Face hub name already in the local
cache) and its tokenizer. ``generate`` takes strings (or token-id lists) and a ``SamplingParams``
(or its fields as keyword arguments) and returns one ``Completion`` per prompt, shaped as vLLM's
``RequestOutput``: ``.outputs``, the ``SamplingParams.n`` answers (one by default), each with
``.text``, ``.token_ids``, ``.logprobs`` (of each generated token), ``.finish_reason`` (``"stop"``:
EOS, a stop string or a complete structured answer; ``"length"``: ``max_tokens``); the
``Completion``'s own ``.text`` and the rest are its first answer's. ``chat`` takes a conversation
of ``{"role", "content"}`` dicts (or a list of conversations) in the model's instruct format.
``score`` gives a text's log-likelihood per token.

Speculative decoding: ``LLM(model, draft_model="tiny-mistral")`` (a smaller model of the same
tokenizer) or ``LLM(model, speculative_ngram=True)`` (prompt lookup), ``speculative_tokens`` guesses
a step at most (``generation.speculative``): the same answers (greedy) or the same distribution
(sampling), in fewer passes where guesses are right; each ``Completion``'s ``metrics`` says what it
gained in its batch (``speculative_steps``, ``guesses``, ``accepted``, ``acceptance_rate``, ``tokens_per_step``).

Batches of any size: prompts are run in batches as large as half the free memory holds for
their caches (at most ``max_batch``, 64 by default); no batch size is declared at load time. A
prompt's ``n`` answers share one reading of it (``generation.shared_prefix``). The layer below, for
research scripts: ``load_model``, ``generate``, ``forward``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from mixtral_infer.checkpoint.loading import load_model
from mixtral_infer.errors import GenerationError
from mixtral_infer.generation.chat_template import render_messages
from mixtral_infer.generation.generate import generate
from mixtral_infer.generation.sampling_params import SEED_LIMIT, SamplingParams, check_seed
from mixtral_infer.generation.settings import free_memory, kv_cache_bytes
from mixtral_infer.generation.speculative import DraftModel, SpeculativeStats, check_speculation
from mixtral_infer.generation.text_stream import AnswerText
from mixtral_infer.tokenizer import Tokenizer

MAX_BATCH = 64  # prompts run together at most: beyond, a prefill's activations grow for little gain
CACHE_SHARE = 0.5  # of the free memory, for one batch's cache


@dataclass
class CompletionOutput:
    """One answer to a prompt, as vLLM's ``CompletionOutput``: ``index`` among its ``n``."""

    index: int
    text: str
    token_ids: List[int]
    logprobs: List[float]  # of each generated token
    finish_reason: str  # "stop" or "length"

    @property
    def cumulative_logprob(self) -> float:
        return math.fsum(self.logprobs)


@dataclass
class Completion:
    """One prompt's answers, as vLLM's ``RequestOutput``: ``outputs``, ``SamplingParams.n`` of them.
    ``text``, ``token_ids``, ``logprobs`` and ``finish_reason`` are the first answer's."""

    prompt: Union[str, List[int], List[Dict[str, Any]]]
    outputs: List[CompletionOutput]
    prompt_token_ids: List[int] = field(default_factory=list)
    metrics: Dict[str, float] = field(default_factory=dict)  # speculative decoding's gain in the batch it ran in

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> List[int]:
        return self.outputs[0].token_ids

    @property
    def logprobs(self) -> List[float]:
        return self.outputs[0].logprobs

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason


@dataclass
class TextScore:
    """A text's log-likelihood: each token's log-probability after the first (BOS)."""

    token_ids: List[int]
    token_logprobs: List[float]

    @property
    def total(self) -> float:
        return sum(self.token_logprobs)

    @property
    def perplexity(self) -> float:
        return math.exp(-self.total / max(len(self.token_logprobs), 1))


class LLM:
    """A model and its tokenizer, for text in and text out (module docstring).

    ``model``: a shipped model's name (``tiny-mixtral``), a Mistral or Hugging Face folder, or a hub
    name (``mistralai/Mistral-7B-v0.1``) already in the Hugging Face cache. ``device``, ``dtype``,
    ``quantize``: as ``load_model``. ``max_batch``: prompts run together at most. ``draft_model``
    (a model as ``model``, loaded alike, unquantized) or ``speculative_ngram``: speculative decoding
    (module docstring), ``speculative_tokens`` guesses a step at most (4). ``lora``, ``lora_scale``: a LoRA
    adapter merged into the model's weights as they load, as ``load_model``.
    """

    def __init__(
        self, model: str = "tiny-mixtral", *, device: Optional[str] = None, dtype: Optional[torch.dtype] = None,
        quantize: Optional[str] = None, max_batch: int = MAX_BATCH, draft_model: Optional[str] = None,
        speculative_ngram: bool = False, speculative_tokens: Optional[int] = None,
        lora: Optional[str] = None, lora_scale: float = 1.0,
    ):  # fmt: skip
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise GenerationError(f"max_batch={max_batch!r} must be an integer >= 1")
        if not isinstance(speculative_ngram, bool):
            raise GenerationError(f"speculative_ngram={speculative_ngram!r} must be True or False")
        if draft_model is not None and speculative_ngram:
            raise GenerationError("give draft_model or speculative_ngram=True, not both")
        if draft_model is None and not speculative_ngram and speculative_tokens is not None:
            raise GenerationError("speculative_tokens needs draft_model= or speculative_ngram=True")
        self.speculation = check_speculation("ngram", speculative_tokens) if speculative_ngram or draft_model else None  # k checked before loading
        self.model = load_model(model, max_batch_size=max_batch, device=device, dtype=dtype, quantize=quantize,
                                lora=lora, lora_scale=lora_scale)  # fmt: skip
        self.tokenizer = Tokenizer.from_folder(model)
        if draft_model is not None:
            drafter = load_model(draft_model, max_batch_size=max_batch, device=device, dtype=self.model.dtype)
            if Tokenizer.from_folder(draft_model).n_words != self.tokenizer.n_words:
                raise GenerationError(f"draft_model={draft_model!r} has another tokenizer than {model!r}: a draft must share it")
            self.speculation = check_speculation(DraftModel(drafter), speculative_tokens)
            self.speculation.proposer.check_matches(self.model)
        self.max_batch = max_batch
        self._metrics: List[Dict[str, float]] = []  # per prompt of the last _run: its batch's speculation

    def generate(
        self, prompts: Union[str, Sequence[Union[str, Sequence[int]]]], sampling_params: Optional[SamplingParams] = None,
        **kwargs: Any,
    ) -> List[Completion]:  # fmt: skip
        """One ``Completion`` per prompt (a string, or token ids; a single string is a list of one).
        Settings: ``sampling_params``, or its fields as keyword arguments (which override it)."""
        params = _params(sampling_params, kwargs)
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise GenerationError("prompts must be a string or a non-empty list of strings (or of token-id lists)")
        ids = [self.tokenizer.encode(p, bos=True) if isinstance(p, str) else list(p) for p in prompts]
        answers = self._run(ids, params, leading_space=True)
        return [Completion(p, outputs, prompt_ids, m) for p, prompt_ids, outputs, m in zip(prompts, ids, answers, self._metrics)]

    def chat(
        self, messages: Union[List[Dict[str, Any]], List[List[Dict[str, Any]]]], sampling_params: Optional[SamplingParams] = None,
        **kwargs: Any,
    ) -> Union[Completion, List[Completion]]:  # fmt: skip
        """The assistant's answer to a conversation of ``{"role", "content"}`` dicts (system, then user
        and assistant turns alternating, ending with user), or a list of answers for a list of them."""
        params = _params(sampling_params, kwargs)
        single = not messages or isinstance(messages[0], dict)  # [] is one empty conversation (refused below)
        conversations = [messages] if single else list(messages)
        ids = [render_messages(self.tokenizer, conversation) for conversation in conversations]
        answers = self._run(ids, params, leading_space=False)
        out = [Completion(c, outputs, prompt_ids, m) for c, prompt_ids, outputs, m in zip(conversations, ids, answers, self._metrics)]
        return out[0] if single else out

    def score(self, text: Union[str, Sequence[int]]) -> TextScore:
        """The log-probability of each token of ``text`` after the first (read in chunks, past the
        window too): ``.total``, ``.perplexity``."""
        ids = self.tokenizer.encode(text, bos=True) if isinstance(text, str) else list(text)
        if len(ids) < 2:
            raise GenerationError("score needs a text of at least one token after BOS")
        _, logprobs = generate([ids], self.model, max_tokens=0)
        return TextScore(ids, logprobs[0])

    # ---- below ------------------------------------------------------------------------------

    def _run(self, ids: List[List[int]], params: SamplingParams, leading_space: bool) -> List[List[CompletionOutput]]:
        """The ``n`` answers of each prompt, in batches that fit: a prompt's answers are rows of one batch
        (where ``n`` fits in one), which ``generate`` reads the prompt once for. The text is the server's
        (``AnswerText``): a completion keeps the space before its first word (``leading_space``), a chat
        answer does not; cut before a stop string, found in that same text as ``generate`` found it."""
        n = params.n
        rows = [prompt for prompt in ids for _ in range(n)]  # prompt p's answer i is row p * n + i
        seeds = None if params.seed is None else [(int(params.seed) + i) % SEED_LIMIT for _ in ids for i in range(n)]
        longest = max(len(p) for p in ids) + params.max_tokens
        batch = self._batch_size(len(rows), longest)
        batch -= batch % n if n <= batch else 0
        needs_tokenizer = params.stop or params.constraint is not None
        results, metrics = [], []
        for start in range(0, len(rows), batch):
            part = rows[start : start + batch]
            row_params = replace(params, n=1, seed=None if seeds is None else seeds[start : start + batch])
            before = self.speculation.stats.copy() if self.speculation is not None else None
            generated, logprobs = generate(
                part, self.model, row_params, eos_id=self.tokenizer.eos_id, prompt_logprobs=False,
                tokenizer=self.tokenizer if needs_tokenizer else None, leading_space=leading_space, draft=self.speculation,
            )  # fmt: skip
            metrics += [speculation_metrics(self.speculation.stats.since(before)) if before is not None else {}] * len(part)
            for row, (tokens, lps) in enumerate(zip(generated, logprobs), start):
                answer = AnswerText.of(self.tokenizer, tokens, leading_space, params.stop)
                stopped = len(tokens) < params.max_tokens or answer.stopped
                results.append(CompletionOutput(row % n, answer.text, tokens, lps, "stop" if stopped else "length"))
        self._metrics = [metrics[p * n] for p in range(len(ids))]  # a prompt's answers run in one batch
        return [results[p * n : (p + 1) * n] for p in range(len(ids))]

    def _batch_size(self, prompts: int, tokens: int) -> int:
        """Prompts per batch: all of them, at most ``max_batch``, halved until a batch's cache fits in
        ``CACHE_SHARE`` of the free memory."""
        model = self.model
        batch = min(prompts, self.max_batch)
        free = free_memory(model.device)
        while batch > 1 and free is not None and kv_cache_bytes(model.args, batch, tokens, model.dtype, model.parallel) > CACHE_SHARE * free:
            batch //= 2
        return batch


def speculation_metrics(stats: SpeculativeStats) -> Dict[str, float]:
    """A ``Completion``'s ``metrics`` from what speculation gained in its batch."""
    return {
        "speculative_steps": stats.steps, "guesses": stats.proposed, "accepted": stats.accepted,
        "acceptance_rate": stats.acceptance_rate, "tokens_per_step": stats.tokens_per_step,
    }  # fmt: skip


def _params(params: Optional[SamplingParams], overrides: Dict[str, Any]) -> SamplingParams:
    """``params`` (or the defaults) with the keyword arguments over it, checked before any work."""
    params = params if params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise GenerationError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    params = params.updated(overrides)
    check_seed(params.seed)  # one integer: answer i's seed + i (before it could wrap a bad one round)
    return params.check()
