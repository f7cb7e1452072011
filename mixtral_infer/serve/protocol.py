"""OpenAI request bodies: read, check, and turn into a prompt and ``RequestSettings``.

Every check raises ``BadRequest`` naming the field (``param``) and what is expected, which
the server sends as a 400 with OpenAI's error body. A field the endpoint does not know is refused,
as OpenAI refuses it, naming the nearest known one (``unknown field 'max_token': did you mean
'max_tokens'?``): a mistyped field silently ignored gives an answer other than the one asked for.
Fields of OpenAI's API that change nothing here are accepted (``user``, ``store``, penalties of 0);
those this server cannot honour (``echo``, ``best_of`` other than ``n``, ``suffix``, the deprecated
``functions``: ``CANNOT_HONOUR``) are refused, not ignored. Extensions, as vLLM has them: ``top_k``,
``ignore_eos``, ``repetition_penalty``, ``min_tokens``, and ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar``; and ``speculative`` (false: this request decodes one token a
step where the server speculates, ``--draft-model`` / ``--speculative-ngram``).

Structured output: ``response_format`` (``json_object``; ``json_schema`` with its ``schema``, always
enforced, ``strict`` or not) or one ``guided_*`` field becomes a ``Constraint``, compiled here so
that a schema or expression that cannot be is a 400 naming the field.

Several answers: ``n`` choices of each prompt, and for ``/v1/completions`` a list of prompts
(strings or lists of token ids). Choice ``i`` of prompt ``p`` has index ``p * n + i``, as in OpenAI
and vLLM; the usage counts each prompt's tokens once and every choice's tokens.

Chat messages become the model's instruct format through ``generation.chat_template``, the one
chat renderer (the ``Conversation`` and ``LLM.chat`` use it too): ``chat_prompt``.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from mixtral_infer.errors import GenerationError
from mixtral_infer.generation.sampling_params import SEED_LIMIT, effective_temperature
from mixtral_infer.serve.engine import RequestSettings
from mixtral_infer.generation.chat_template import ChatError, render_messages
from mixtral_infer.serve.tools import ToolError, call_grammar, check_tools
from mixtral_infer.structured.grammar import Constraint, check_constraint
from mixtral_infer.tokenizer import Tokenizer

MAX_STOP_STRINGS = 4  # as OpenAI
MAX_COMPLETION_LOGPROBS = 5  # completions: logprobs in [0, 5]
MAX_CHAT_TOP_LOGPROBS = 20  # chat: top_logprobs in [0, 20]
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for completions
MAX_CHOICES = 128  # n, and prompts times n: the answers of one request

# Fields that would change the answer in ways this server cannot: (name, values that ask for
# nothing, what the field asks for). Fields that change nothing here (user, store, metadata,
# parallel_tool_calls, ...) are accepted.
CANNOT_HONOUR = (
    ("suffix", (None, ""), "text after the completion (fill in the middle)"),
    ("functions", (None, []), "function calling (the deprecated form: give tools)"),
    ("function_call", (None, "none"), "function calling (the deprecated form: give tool_choice)"),
    ("modalities", (None, ["text"]), "output other than text"),
    ("audio", (None,), "audio output"),
    ("prediction", (None,), "predicted outputs"),
    ("reasoning_effort", (None,), "reasoning effort (a model that reasons)"),
    ("verbosity", (None,), "a verbosity (a model that reasons)"),
    ("web_search_options", (None,), "web search"),
)
GUIDED = (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "lark"))

# The fields each endpoint knows; any other is refused (check_fields). Both take OpenAI's sampling
# fields and vLLM's extensions (docs/serving.md lists them).
SAMPLING_FIELDS = frozenset({
    "model", "n", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "logprobs",
    "presence_penalty", "frequency_penalty", "logit_bias", "user", "response_format", "tools", "tool_choice",
    "top_k", "ignore_eos", "repetition_penalty", "min_tokens", "speculative", *(name for name, _ in GUIDED),
})  # fmt: skip
COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt", "best_of", "echo", "suffix"}
CHAT_FIELDS = SAMPLING_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "parallel_tool_calls", "store", "metadata", "service_tier",
    "prompt_cache_key", "safety_identifier", *(name for name, _, _ in CANNOT_HONOUR if name != "suffix"),
}  # fmt: skip
STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation"})  # obfuscation pads chunks: nothing to change here
# The other endpoint's name of a field, where difflib would not find it ("min_tokens" is nearer "max_completion_tokens").
COUNTERPARTS = {"max_completion_tokens": "max_tokens", "top_logprobs": "logprobs", "messages": "prompt", "prompt": "messages"}
MAX_PENALTY = 2.0  # presence and frequency penalties in [-2, 2], as OpenAI
MAX_BIAS = 100.0  # logit_bias values in [-100, 100], as OpenAI


class BadRequest(ValueError):
    def __init__(self, message: str, param: Optional[str] = None, status: int = 400, code: Optional[str] = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def error_body(message: str, kind: str = "invalid_request_error", param: Optional[str] = None, code: Optional[str] = None):
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class ParsedRequest:
    prompts: List[List[int]]
    settings: RequestSettings
    stream: bool
    include_usage: bool
    n: int = 1  # choices of each prompt
    tools: Optional[List[Dict[str, Any]]] = None  # a chat's functions the model may call (serve.tools)
    max_tokens_field: str = "max_tokens"  # the field that gave max_tokens (a chat's may be max_completion_tokens)

    @property
    def prompt(self) -> List[int]:
        """The first prompt (a chat has one)."""
        return self.prompts[0]


def read_body(raw: bytes) -> Dict[str, Any]:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest("the request body is not valid JSON (nested too deeply)") from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, a number of over 4300 digits
        raise BadRequest(f"the request body is not valid JSON ({error})") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _get(body: Dict[str, Any], name: str, default: Any) -> Any:
    value = body.get(name, default)
    return default if value is None else value


def check_fields(given: Dict[str, Any], known: frozenset, where: str = "") -> None:
    """Refuse fields outside ``known``, each named with the nearest known one, e.g.
    ``{"prompt": "hi", "max_token": 2}`` -> ``unknown field 'max_token': did you mean 'max_tokens'?``
    (param ``max_token``). ``where``: the object's own field (``stream_options.``)."""
    unknown = [name for name in given if name not in known]
    if not unknown:
        return
    said = []
    for name in unknown:
        nearest = [COUNTERPARTS[name]] if COUNTERPARTS.get(name) in known else difflib.get_close_matches(str(name), known, n=1)
        hint = f": did you mean {where + nearest[0]!r}?" if nearest else f" (known: {', '.join(sorted(known))})"
        said.append(f"unknown field {where + str(name)!r}{hint}")
    raise BadRequest("; ".join(said), where + str(unknown[0]), code="unknown_parameter")


def _check_model(body: Dict[str, Any], served: str | Sequence[str]) -> int:
    """The served model ``body`` names: 0 for the model itself (or no name), i for ``served[i]``, its i-th
    adapter kept apart (``serve --lora NAME=PATH``); a 404 for another name."""
    names = [served] if isinstance(served, str) else list(served)
    model = body.get("model")
    if model is None:
        return 0
    if model not in names:
        listed = names[0] if len(names) == 1 else ", ".join(names)
        raise BadRequest(f"the model {model!r} does not exist: this server serves {listed!r}", "model", 404, "model_not_found")
    return names.index(model)


def _check_unsupported(body: Dict[str, Any]) -> None:
    """What asks for something this server does not do is refused; what asks for nothing passes. By
    type too: ``true`` equals 1 in Python, and ``n: true`` or ``logit_bias: false`` is no request."""
    n = _get(body, "n", 1)
    if not _is_int(n) or not 1 <= n <= MAX_CHOICES:
        raise BadRequest(f"n={n!r} must be an integer in [1, {MAX_CHOICES}]", "n")
    if not _is_int(_get(body, "best_of", n)) or _get(body, "best_of", n) != n:
        raise BadRequest(f"best_of={body['best_of']!r} is not supported (leave it out, or give n's value)", "best_of")
    if _get(body, "echo", False) is not False:
        raise BadRequest("echo is not supported", "echo")
    for name, means_nothing, what in CANNOT_HONOUR:
        if body.get(name) not in means_nothing:
            raise BadRequest(f"{name}={body[name]!r}: {what} is not supported by this server", name)


def _settings(body: Dict[str, Any], max_tokens: Optional[int], logprobs: Optional[int], leading_space: bool) -> RequestSettings:
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise BadRequest(f"max_tokens={max_tokens!r} must be an integer >= 1", "max_tokens")
    temperature = _get(body, "temperature", 1.0)
    if not _is_number(temperature) or not 0 <= temperature <= 2:
        raise BadRequest(f"temperature={temperature!r} must be a number in [0, 2] (0 is greedy)", "temperature")
    top_p = _get(body, "top_p", 1.0)
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise BadRequest(f"top_p={top_p!r} must be a number in (0, 1]", "top_p")
    top_k = body.get("top_k")
    if top_k is not None and top_k != -1 and (not _is_int(top_k) or top_k < 1):
        raise BadRequest(f"top_k={top_k!r} must be an integer >= 1 (or -1 / null for no limit)", "top_k")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < SEED_LIMIT):
        raise BadRequest(f"seed={seed!r} must be an integer in [0, 2**63)", "seed")
    stop = _get(body, "stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"stop={body.get('stop')!r} must be a non-empty string or a list of up to 4 of them", "stop")
    ignore_eos = _get(body, "ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest(f"ignore_eos={ignore_eos!r} must be true or false", "ignore_eos")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = _get(body, name, 0.0)
        if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise BadRequest(f"{name}={value!r} must be a number in [-2, 2]", name)
        penalties[name] = float(value)
    repetition = _get(body, "repetition_penalty", 1.0)
    if not _is_number(repetition) or not 0 < repetition <= 10:
        raise BadRequest(f"repetition_penalty={repetition!r} must be a number in (0, 10] (1: none)", "repetition_penalty")
    min_tokens = _get(body, "min_tokens", 0)
    if not _is_int(min_tokens) or min_tokens < 0 or (max_tokens is not None and min_tokens > max_tokens):
        raise BadRequest(f"min_tokens={min_tokens!r} must be an integer in [0, max_tokens]", "min_tokens")
    speculative = _get(body, "speculative", True)
    if not isinstance(speculative, bool):
        raise BadRequest(f"speculative={speculative!r} must be true or false", "speculative")
    return RequestSettings(
        speculative=speculative,
        max_tokens=max_tokens or 0,
        temperature=effective_temperature(float(temperature)),
        top_p=float(top_p),
        top_k=None if top_k in (None, -1) else top_k,
        seed=seed,
        stop=stop,
        logprobs=logprobs,
        ignore_eos=ignore_eos,
        leading_space=leading_space,
        repetition_penalty=float(repetition),
        min_tokens=min_tokens,
        **penalties,
    )


def _logit_bias(body: Dict[str, Any], vocab: int) -> Optional[Dict[int, float]]:
    """OpenAI's ``logit_bias``: token ids (as strings) to a bias in [-100, 100]."""
    bias = _get(body, "logit_bias", {})
    if not isinstance(bias, dict):
        raise BadRequest("logit_bias must be an object of token ids to numbers", "logit_bias")
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else None
        if token is None or not 0 <= token < vocab:
            raise BadRequest(f"logit_bias: {key!r} is not a token id in [0, {vocab})", "logit_bias")
        if not _is_number(value) or not -MAX_BIAS <= value <= MAX_BIAS:
            raise BadRequest(f"logit_bias[{key!r}]={value!r} must be a number in [-100, 100]", "logit_bias")
        out[token] = float(value)
    return out or None


def _constraint(body: Dict[str, Any], tokenizer: Tokenizer) -> Optional[Constraint]:
    """What the answer's text must be: OpenAI's ``response_format`` (``json_object``, ``json_schema``)
    or one of vLLM's ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` (Lark);
    compiled here, so that one that cannot be is a 400 before any row is taken."""
    given = []
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        if not isinstance(response_format, dict):
            raise BadRequest("response_format must be an object with a type", "response_format")
        kind = response_format.get("type")
        if kind == "json_object":
            given.append(("response_format", Constraint("json_object")))
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise BadRequest("response_format.json_schema must be an object with a schema object", "response_format")
            given.append(("response_format", Constraint("json_schema", spec["schema"])))
        elif kind != "text":
            raise BadRequest(f"response_format.type={kind!r} must be text, json_object or json_schema", "response_format")
    for field, kind in GUIDED:
        if body.get(field) is not None:
            given.append((field, Constraint(kind, body[field])))
    if len(given) > 1:
        raise BadRequest(f"give one of {', '.join(name for name, _ in given)}: each sets what the answer must be", given[1][0])
    if not given:
        return None
    field, constraint = given[0]
    try:
        check_constraint(constraint, tokenizer)
    except GenerationError as error:
        raise BadRequest(f"{field}: {error}", field) from None
    return constraint


def _stream_options(body: Dict[str, Any]) -> tuple[bool, bool]:
    stream = _get(body, "stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream={stream!r} must be true or false", "stream")
    options = _get(body, "stream_options", {})
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    check_fields(options, STREAM_OPTIONS, "stream_options.")
    include_usage = _get(options, "include_usage", False)
    if not isinstance(include_usage, bool):
        raise BadRequest(f"stream_options.include_usage={include_usage!r} must be true or false", "stream_options")
    if options and not stream:  # as OpenAI answers it
        raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
    return stream, include_usage


def _prompt_ids(prompt: Any, tokenizer: Tokenizer, where: str) -> List[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, bos=True)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if not all(0 <= t < tokenizer.n_words for t in prompt):
            raise BadRequest(f"{where} holds token ids outside the vocabulary [0, {tokenizer.n_words})", "prompt")
        return list(prompt)
    raise BadRequest(f"{where} must be a string or a non-empty list of token ids", "prompt")


def parse_completion(body: Dict[str, Any], tokenizer: Tokenizer, served: str | Sequence[str]) -> ParsedRequest:
    """``/v1/completions``: the prompt is a string or token ids, or a list of them (one answer each).
    ``served``: the model's name, then its adapters' (``_check_model``)."""
    check_fields(body, COMPLETION_FIELDS)
    adapter = _check_model(body, served)
    _check_unsupported(body)
    for name in ("tools", "tool_choice"):
        if body.get(name) not in (None, [], "none"):
            raise BadRequest(f"{name}: tool calling is for /v1/chat/completions", name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = [_prompt_ids(p, tokenizer, f"prompt[{i}]") for i, p in enumerate(prompt)]
    else:
        prompts = [_prompt_ids(prompt, tokenizer, "prompt")]
    n = _get(body, "n", 1)
    if len(prompts) * n > MAX_CHOICES:
        raise BadRequest(f"{len(prompts)} prompts times n={n} asks for more than {MAX_CHOICES} answers", "prompt")
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS):
        raise BadRequest(f"logprobs={logprobs!r} must be an integer in [0, {MAX_COMPLETION_LOGPROBS}]", "logprobs")
    max_tokens = _get(body, "max_tokens", DEFAULT_COMPLETION_TOKENS)
    stream, include_usage = _stream_options(body)
    settings = _settings(body, max_tokens, logprobs, leading_space=True)
    settings.constraint, settings.logit_bias = _constraint(body, tokenizer), _logit_bias(body, tokenizer.n_words)
    settings.adapter = adapter
    return ParsedRequest(prompts, settings, stream, include_usage, n)


def chat_prompt(tokenizer: Tokenizer, messages: Any, tools: Optional[List[Dict[str, Any]]] = None) -> List[int]:
    """Token ids of a conversation (``generation.chat_template.render_messages``); what cannot be
    rendered is a 400 on ``messages``. ``tools``: the functions shown to the model (``serve.tools``)."""
    try:
        return render_messages(tokenizer, messages, tools)
    except ChatError as error:
        raise BadRequest(str(error), "messages") from None


def _chat_max_tokens(body: Dict[str, Any]) -> Optional[int]:
    """A chat's ``max_completion_tokens`` (OpenAI's name now) or ``max_tokens`` (its old one), each
    checked; null is absent (a null max_completion_tokens hid max_tokens: the answer ran to the
    default); both given must agree."""
    given = {name: body[name] for name in ("max_completion_tokens", "max_tokens") if body.get(name) is not None}
    for name, value in given.items():
        if not _is_int(value) or value < 1:
            raise BadRequest(f"{name}={value!r} must be an integer >= 1", name)
    if len(set(given.values())) > 1:
        raise BadRequest(f"max_completion_tokens={given['max_completion_tokens']} and max_tokens={given['max_tokens']} "
                         "disagree: give one", "max_completion_tokens")  # fmt: skip
    return next(iter(given.values()), None)


def parse_chat(
    body: Dict[str, Any], tokenizer: Tokenizer, served: str | Sequence[str], default_max_tokens: Callable[[int], int]
) -> ParsedRequest:
    """``/v1/chat/completions``; without max_tokens, an answer runs to EOS or to
    ``default_max_tokens(prompt length)`` tokens."""
    check_fields(body, CHAT_FIELDS)
    adapter = _check_model(body, served)
    _check_unsupported(body)
    tools, choice = None, "none"
    if body.get("tools") not in (None, []):
        try:
            tools, choice = check_tools(body["tools"], body.get("tool_choice"))
        except ToolError as error:
            raise BadRequest(str(error), "tools" if "tool_choice" not in str(error) else "tool_choice") from None
    elif body.get("tool_choice") not in (None, "none"):
        raise BadRequest(f"tool_choice={body['tool_choice']!r} needs tools", "tool_choice")
    ids = chat_prompt(tokenizer, body.get("messages"), tools if choice != "none" else None)
    logprobs = _get(body, "logprobs", False)
    if not isinstance(logprobs, bool):
        raise BadRequest(f"logprobs={logprobs!r} must be true or false", "logprobs")
    top = _get(body, "top_logprobs", 0)
    if not _is_int(top) or not 0 <= top <= MAX_CHAT_TOP_LOGPROBS:
        raise BadRequest(f"top_logprobs={top!r} must be an integer in [0, {MAX_CHAT_TOP_LOGPROBS}]", "top_logprobs")
    if top and not logprobs:
        raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
    max_tokens = _chat_max_tokens(body)
    stream, include_usage = _stream_options(body)
    settings = _settings(body, max_tokens, top if logprobs else None, leading_space=False)
    settings.constraint, settings.logit_bias = _constraint(body, tokenizer), _logit_bias(body, tokenizer.n_words)
    parallel = _get(body, "parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise BadRequest(f"parallel_tool_calls={parallel!r} must be true or false", "parallel_tool_calls")
    calls = call_grammar(tokenizer, tools, choice, parallel) if tools is not None else None
    if calls is not None:
        if settings.constraint is not None:
            raise BadRequest(f"tool_choice={choice!r} sets what the answer must be: leave out response_format", "tool_choice")
        settings.constraint = calls
    if max_tokens is None:
        settings.max_tokens = max(1, default_max_tokens(len(ids)))
    settings.adapter = adapter
    parsed = ParsedRequest([ids], settings, stream, include_usage, _get(body, "n", 1))
    parsed.tools = tools if choice != "none" else None
    parsed.max_tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return parsed
