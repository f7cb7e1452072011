"""The one chat renderer (``generation.chat_template``): the three front doors, the ``Conversation``,
``LLM.chat`` and the server's chat endpoint, give the same ids for the same conversation."""

from __future__ import annotations

import pytest
import torch

from mixtral_infer import LLM, Conversation, GenerationError, Tokenizer
from mixtral_infer.generation.chat_template import ChatError, conversation_turn, render_messages, render_turns, user_turn
from mixtral_infer.serve.protocol import BadRequest, parse_chat

SYSTEM, U1, A1, U2 = "Answer briefly.", "Who made the earth?", "God made it.", "Why?"
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": U1},
            {"role": "assistant", "content": A1}, {"role": "user", "content": U2}]  # fmt: skip


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-mixtral", dtype=torch.float32, device="cpu", max_batch=2)


def server_ids(tokenizer: Tokenizer, messages) -> list:
    return parse_chat({"messages": messages, "max_tokens": 2}, tokenizer, "tiny-mixtral", lambda n: 2).prompt


def test_the_three_front_doors_render_a_conversation_alike(llm):
    tokenizer = llm.tokenizer
    enc = lambda text: tokenizer.encode(text, bos=False)  # noqa: E731
    # v1: the system prompt joins the first user turn, [INST] and [/INST] are text
    expected_first = [1] + enc(f"[INST] {SYSTEM}\n\n{U1} [/INST]")
    expected = expected_first + enc(A1) + [2] + enc(f"[INST] {U2} [/INST]")
    assert render_messages(tokenizer, MESSAGES) == expected
    for messages, ids in ((MESSAGES[:2], expected_first), (MESSAGES, expected)):
        assert llm.chat(messages, max_tokens=1, temperature=0).prompt_token_ids == ids  # LLM.chat
        assert server_ids(tokenizer, messages) == ids  # /v1/chat/completions
    chat = Conversation(llm.model, tokenizer, instruct=True, system=SYSTEM, max_tokens=1, temperature=0)
    chat.reply(U1)
    assert chat.history[: len(expected_first)] == expected_first  # the Conversation's first turn
    chat.history = expected_first + enc(A1) + [2]  # as though it had answered A1 and EOS
    assert chat.history + chat._turn_tokens(U2) == expected  # and its next turn


def test_a_conversation_kept_in_a_cache_renders_its_turns_as_the_whole():
    tokenizer = Tokenizer.from_folder("tiny-mixtral")
    first = conversation_turn(tokenizer, U1, first=True, system=SYSTEM)
    later = conversation_turn(tokenizer, U2, first=False)
    answer = tokenizer.encode(A1, bos=False) + [tokenizer.eos_id]
    assert first + answer + later == render_turns(tokenizer, [SYSTEM], [("user", U1), ("assistant", A1), ("user", U2)])
    assert later == user_turn(tokenizer, U2, follows_answer=True)


@pytest.mark.parametrize(
    "messages, message",
    [
        ([], "messages must be a non-empty list of {role, content} objects"),
        ([{"role": "bot", "content": "x"}], "messages[0] must be an object with role system, user, assistant or tool"),
        ([{"role": "user", "content": 3}], "messages[0].content must be a string or a list of text parts"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "s"}], "system messages must come first"),
        ([{"role": "assistant", "content": "a"}], "after any system messages, messages must alternate user, assistant"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
          {"role": "user", "content": "b"}], "messages[1]: a tool call's arguments must be JSON text"),
    ],
)  # fmt: skip
def test_a_conversation_that_cannot_be_rendered_is_one_line_at_each_door(llm, messages, message):
    with pytest.raises(ChatError) as renderer:
        render_messages(llm.tokenizer, messages)
    assert str(renderer.value).startswith(message) and "\n" not in str(renderer.value)
    with pytest.raises(GenerationError) as chat:
        llm.chat(messages, max_tokens=1)
    with pytest.raises(BadRequest) as server:
        server_ids(llm.tokenizer, messages)
    assert server.value.param == "messages" and server.value.message == str(chat.value) == str(renderer.value)
