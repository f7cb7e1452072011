"""Tool calling: conversations rendered as mistral-common renders them, calls enforced by a grammar
and parsed back, the text format for tokenizers without Mistral's tool pieces."""

from __future__ import annotations

import dataclasses
import inspect
import json

import jsonschema
import pytest
import torch
from conftest import random_model, tiny_args

from mixtral_infer import Tokenizer
from mixtral_infer.serve.engine import Engine, RequestSettings, TokenEvent
from mixtral_infer.serve.protocol import BadRequest, chat_prompt, parse_chat
from mixtral_infer.generation.chat_template import TOOL_PIECES, has_tool_pieces
from mixtral_infer.serve.tools import call_grammar, check_tools, parse_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                       "required": ["city", "days"], "additionalProperties": False},  # fmt: skip
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                            "additionalProperties": False}}}  # fmt: skip

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "More."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "More."}],  # fmt: skip
]
WITH_A_CALL = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "abcdefghi", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},  # fmt: skip
    {"role": "tool", "tool_call_id": "abcdefghi", "content": '{"temp": 20}'},
    {"role": "assistant", "content": "It is 20."},
    {"role": "user", "content": "Thanks"},
]


@pytest.fixture(scope="session")
def tool_tokenizer_path(tmp_path_factory):
    """A v3 tokenizer with Mistral's control pieces in their order: [INST] 3, [/INST] 4, [TOOL_CALLS] 5,
    [AVAILABLE_TOOLS] 6, [/AVAILABLE_TOOLS] 7, [TOOL_RESULTS] 8, [/TOOL_RESULTS] 9 (as Mistral 7B v0.3's)."""
    import sentencepiece as spm
    import torch.nn.modules.module as text_source

    lines = [line.strip() for line in inspect.getsource(text_source).splitlines() if line.strip()]
    folder = tmp_path_factory.mktemp("v3-tools")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(folder / "tok"), vocab_size=500, model_type="bpe",
        bos_id=1, eos_id=2, unk_id=0, pad_id=-1, byte_fallback=True, minloglevel=2,
        control_symbols=["[INST]", "[/INST]", *TOOL_PIECES[:1], *TOOL_PIECES[1:]], normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True, character_coverage=1.0,
    )  # fmt: skip
    path = folder / "tokenizer.model.v3"
    (folder / "tok.model").rename(path)
    return path


@pytest.fixture(scope="session")
def tool_tokenizer(tool_tokenizer_path):
    tokenizer = Tokenizer(tool_tokenizer_path)
    assert tokenizer.version == "v3" and has_tool_pieces(tokenizer)
    assert tokenizer.control_ids(*TOOL_PIECES) == [5, 6, 7, 8, 9]
    return tokenizer


def mistral_common_ids(path, messages, tools=None):
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    request = ChatCompletionRequest.from_openai(messages, tools=tools)
    return MistralTokenizer.from_file(str(path)).encode_chat_completion(request).tokens


@pytest.mark.parametrize("version", ["v1", "v3"])
def test_our_chat_template_equals_mistral_common(version, tool_tokenizer_path):
    """Plain chats, with and without a system prompt (v1 puts it in the first user turn, v3 in the last)."""
    from mixtral_infer.shipped import resolve_model_folder

    path = resolve_model_folder("tiny-mixtral") / "tokenizer.model" if version == "v1" else tool_tokenizer_path
    tokenizer = Tokenizer(path)
    for messages in CONVERSATIONS:
        assert chat_prompt(tokenizer, messages) == mistral_common_ids(path, messages)


def test_a_conversation_with_tools_is_mistral_common_s_for_a_v3_tokenizer(tool_tokenizer, tool_tokenizer_path):
    ids = chat_prompt(tool_tokenizer, WITH_A_CALL, [WEATHER["function"]])
    assert ids == mistral_common_ids(tool_tokenizer_path, WITH_A_CALL, [WEATHER])
    assert {5, 6, 7, 8, 9} <= set(ids)  # calls, the tool list and the result in their control pieces


def test_the_text_format_for_a_v1_tokenizer():
    tokenizer = Tokenizer.from_folder("tiny-mixtral")
    text = tokenizer.decode(chat_prompt(tokenizer, WITH_A_CALL, [WEATHER["function"]]))
    assert '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}, "id": "abcdefghi"}]' in text
    assert '[TOOL_RESULTS] {"content": "{\\"temp\\": 20}", "call_id": "abcdefghi"} [/TOOL_RESULTS]' in text
    assert text.index("[AVAILABLE_TOOLS]") > text.index("It is 20.")  # before the last user turn


@pytest.mark.parametrize(
    "tools, choice, message",
    [
        ([{"type": "function", "function": {"description": "no name"}}], None, "tools[0].function.name=None must be 1-64"),
        ([WEATHER, WEATHER], None, "each function needs a name of its own"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice names 'nope'"),
        ([WEATHER], "sometimes", "tool_choice='sometimes' must be none, auto, required"),
        ("get_weather", None, "tools must be a non-empty list"),
    ],
)
def test_bad_tools_are_one_400_line(tools, choice, message):
    tokenizer = Tokenizer.from_folder("tiny-mixtral")
    body = {"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": choice}
    with pytest.raises(BadRequest) as error:
        parse_chat(body, tokenizer, "m", lambda n: 8)
    assert message in error.value.message and "\n" not in error.value.message


@pytest.mark.parametrize("kind", ["v3", "v1"])
@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_required_calls_validate_even_from_a_model_that_knows_no_tools(kind, choice, tool_tokenizer):
    """A random model, sampling: 10 answers under tool_choice required or named are calls whose
    arguments validate against the function's schema (v3: after the [TOOL_CALLS] piece; v1: text).
    One call each (parallel_tool_calls false): a random model never stops calling."""
    tokenizer = tool_tokenizer if kind == "v3" else Tokenizer.from_folder("tiny-mixtral")
    if kind == "v3":
        model = random_model(dataclasses.replace(tiny_args(moe=False), vocab_size=500), seed=3)
    else:
        from mixtral_infer import load_model

        model = load_model("tiny-mixtral", dtype=torch.float32, device="cpu")
    functions, choice = check_tools([WEATHER, TIME], {"type": "function", "function": {"name": choice}} if choice != "required" else "required")
    prompt = chat_prompt(tokenizer, [{"role": "user", "content": "Weather?"}], functions)
    engine = Engine(model, tokenizer, rows=4, decode="eager")
    events = [[] for _ in range(10)]
    for seed, sink in enumerate(events):
        settings = RequestSettings(max_tokens=300, temperature=1.0, seed=seed, constraint=call_grammar(tokenizer, functions, choice, parallel=False))
        engine.submit(prompt, settings, sink.append)
    while engine.step():
        pass
    for sink in events:
        tokens = [e.token for e in sink if isinstance(e, TokenEvent)]
        text = "".join(e.text for e in sink)
        calls = parse_calls(tokens, text, tokenizer)
        assert calls and len(calls) == 1, text
        for call in calls:
            name = call["function"]["name"]
            assert name in ("get_weather", "get_time") and (choice == "required" or name == "get_weather")
            schema = (WEATHER if name == "get_weather" else TIME)["function"]["parameters"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
            assert len(call["id"]) == 9
