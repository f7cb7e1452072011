"""The one chat renderer: a conversation as the token ids the model reads.

The ``Conversation`` (turn by turn, ``conversation_turn``), ``LLM.chat`` and the server's
``/v1/chat/completions`` (``render_messages``) all render here, so the same conversation gives the
same ids through each (``tests/test_chat_template.py``).

mistral-common, the library Mistral maintains, renders where it knows the tokenizer
(``Tokenizer.mistral_common()``): every conversation of a tekken file, and a conversation with
tools of a v3 sentencepiece model. Otherwise the documented text format, as mistral-common renders
it where it can (tested against it)::

    [system, user u1, assistant a1, user u2]
    v1 -> <s> [INST] system\\n\\nu1 [/INST] a1 </s> [INST] u2 [/INST]
    v3 -> <s> [INST] u1 [/INST] a1 </s> [INST] system\\n\\nu2 [/INST]
    v7 (tekken) -> <s>[SYSTEM_PROMPT]system[/SYSTEM_PROMPT][INST]u1[/INST]a1</s>[INST]u2[/INST]

``[INST]`` and ``[/INST]`` are text for a v1 tokenizer and control tokens for a v3 one. A ChatML
fine-tune's tokenizer (``Tokenizer.chat_format``) gives ChatML's text, as transformers renders the
common ChatML template::

    -> <s><|im_start|>system\\nsystem<|im_end|>\\n<|im_start|>user\\nu1<|im_end|>\\n...<|im_start|>assistant\\n

Tools (OpenAI's messages: a ``tools`` list, assistant ``tool_calls``, ``tool`` results): with
Mistral's tool pieces (``has_tool_pieces``) mistral-common renders them; other tokenizers get the
same layout as text: the tool list as ``[AVAILABLE_TOOLS] [...] [/AVAILABLE_TOOLS]`` before the last
user turn, a call as the text ``[TOOL_CALLS] [...]``, a result as
``[TOOL_RESULTS] {"content": ..., "call_id": ...} [/TOOL_RESULTS]`` in the user turn that follows.

Errors are ``ChatError`` (a ``GenerationError``), one line naming the message at fault; the server
sends them as a 400 on ``messages``.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mixtral_infer.errors import GenerationError
from mixtral_infer.structured.grammar import one_line
from mixtral_infer.tokenizer import BEGIN_INST, END_INST, IM_END, IM_START, Tokenizer

TOOL_PIECES = ("[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]")
TOOL_CALLS = "[TOOL_CALLS]"
TOOL_VERSIONS = ("v3", "v7")  # the instruct formats whose calls are [TOOL_CALLS] and a JSON list
ROLES = ("system", "user", "assistant", "tool")

Turn = Tuple[str, str]  # (role, text): role "user" or "assistant" (or "system", for ChatML)


class ChatError(GenerationError):
    """A conversation that cannot be rendered: the message names the message at fault."""


def has_tool_pieces(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer has Mistral's tool control pieces and mistral-common renders them in
    the layout read here (a v3 sentencepiece model's; a v3 or v7 tekken file's: v11 and later
    write ``[TOOL_CALLS]name[ARGS]{...}``, and are given tools in the text format)."""
    return (
        tokenizer.version in TOOL_VERSIONS
        and tokenizer.kind in ("sentencepiece", "tekken")
        and tokenizer.control_ids(*TOOL_PIECES) is not None
    )


# ---- OpenAI messages (LLM.chat, the server) ------------------------------------------------------


def render_messages(tokenizer: Tokenizer, messages: Any, tools: Optional[List[Dict[str, Any]]] = None) -> List[int]:
    """Token ids of an OpenAI conversation (``{"role", "content"}`` dicts: any system messages first,
    then user and assistant alternating, ending with user; tool calls and results too) ready for the
    assistant's answer. ``tools``: the functions shown to the model (``{"name", "description",
    "parameters"}``). ``ChatError`` for a conversation that cannot be rendered."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list of {role, content} objects")
    uses_tools = tools is not None or any(
        isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls") not in (None, [])) for m in messages
    )
    if uses_tools and has_tool_pieces(tokenizer):
        try:
            return render_with_mistral_common(tokenizer, messages, tools)
        except Exception as error:  # mistral-common's validation: the conversation as it cannot render it
            raise ChatError(f"messages: {one_line(str(error))}") from None
    turns: List[Turn] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ChatError(f"messages[{index}] must be an object with role system, user, assistant or tool")
        role = message["role"]
        if role == "tool":  # the text format: results are the user's next turn
            text = result_text(_content(message.get("content"), index), message.get("tool_call_id"))
            if turns and turns[-1][0] == "user" and turns[-1][1].startswith("[TOOL_RESULTS]"):
                turns[-1] = ("user", turns[-1][1] + "\n" + text)
                continue
            role = "user"
        elif role == "assistant" and message.get("tool_calls") not in (None, []):
            text = calls_text(message["tool_calls"], index)
        else:
            text = _content(message.get("content"), index)
        turns.append((role, text))
    system = [text for role, text in turns if role == "system"]
    if any(role == "system" for role, _ in turns[len(system) :]):
        raise ChatError("system messages must come first")
    turns = turns[len(system) :]
    roles = [role for role, _ in turns]
    if roles[::2] != ["user"] * len(roles[::2]) or roles[1::2] != ["assistant"] * len(roles[1::2]) or roles[-1:] != ["user"]:
        raise ChatError("after any system messages, messages must alternate user, assistant, ... and end with user")
    if tools is not None:  # the text format: the tool list before the last user turn
        turns[-1] = ("user", tools_text(tools) + "\n\n" + turns[-1][1])
    return render_turns(tokenizer, system, turns)


def _content(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ChatError(f"messages[{index}].content must be a string or a list of text parts")


def render_with_mistral_common(tokenizer: Tokenizer, messages: List[Dict[str, Any]], tools: Optional[List[Dict[str, Any]]]) -> List[int]:
    """Token ids of an OpenAI conversation (with tool calls and results) as mistral-common renders it."""
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    openai_tools = None if tools is None else [{"type": "function", "function": f} for f in tools]
    request = ChatCompletionRequest.from_openai(messages, tools=openai_tools)
    return list(tokenizer.mistral_common().encode_chat_completion(request).tokens)


def tools_text(functions: List[Dict[str, Any]]) -> str:
    """The text format's tool list (module docstring)."""
    listed = [{"type": "function", "function": f} for f in functions]
    return f"[AVAILABLE_TOOLS] {json.dumps(listed, ensure_ascii=False)} [/AVAILABLE_TOOLS]"


def calls_text(tool_calls: List[Dict[str, Any]], index: int = 0) -> str:
    """An assistant's calls (message ``index``) in the text format:
    ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}]``."""
    calls = []
    for call in tool_calls:
        function = call.get("function") or {}
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise ChatError(f"messages[{index}]: a tool call's arguments must be JSON text, got {arguments!r:.60}") from None
        calls.append({"name": function.get("name"), "arguments": arguments, "id": call.get("id")})
    return f"{TOOL_CALLS} {json.dumps(calls, ensure_ascii=False)}"


def result_text(content: str, call: Optional[str]) -> str:
    """A tool's result in the text format."""
    return f'[TOOL_RESULTS] {json.dumps({"content": content, "call_id": call}, ensure_ascii=False)} [/TOOL_RESULTS]'


# ---- turns (every front door ends here) ----------------------------------------------------------


def render_turns(tokenizer: Tokenizer, system: Sequence[str], turns: Sequence[Turn]) -> List[int]:
    """BOS and a conversation: ``system`` texts, then ``turns`` alternating user and assistant and
    ending with a user turn, in the tokenizer's format (module docstring): by mistral-common for a
    tekken file; the system prompt joins the first user turn (v1) or the last (v3)."""
    if tokenizer.kind == "tekken":
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        messages = [{"role": "system", "content": text} for text in system]
        messages += [{"role": role, "content": text} for role, text in turns]
        return list(tokenizer.mistral_common().encode_chat_completion(ChatCompletionRequest.from_openai(messages)).tokens)
    if tokenizer.chat_format == "chatml":  # the template's text (as transformers renders and encodes it)
        return [tokenizer.bos_id] + _encode_chatml(tokenizer, chatml([("system", text) for text in system] + list(turns)))
    ids = [tokenizer.bos_id]
    with_system = 0 if tokenizer.version == "v1" else len(turns) - 1
    for index, (role, text) in enumerate(turns):
        if role == "user":
            if index == with_system and system:
                text = "\n\n".join(list(system) + [text])
            ids += user_turn(tokenizer, text)
        else:
            ids += tokenizer.encode(text, bos=False) + [tokenizer.eos_id]
    return ids


def user_turn(tokenizer: Tokenizer, text: str, follows_answer: bool = False) -> List[int]:
    """One user turn, without BOS, in the tokenizer's format (``follows_answer``: a turn after an
    answer, which ChatML starts on a new line).

    v1: the text ``[INST] {text} [/INST]``; v3: ``[INST]``, the pieces of ``text``, ``[/INST]``;
    tekken: as mistral-common renders a user message (``[INST]{text}[/INST]``: no space added);
    chatml: the text ``<|im_start|>user\\n{text}<|im_end|>\\n<|im_start|>assistant\\n``.
    """
    if tokenizer.kind == "tekken":
        from mistral_common.protocol.instruct.messages import UserMessage

        tokens, _, _ = tokenizer.mistral_common().instruct_tokenizer.encode_user_message(
            UserMessage(content=text), available_tools=None, is_last=True, is_first=not follows_answer
        )
        return list(tokens)
    if tokenizer.chat_format == "chatml":
        return _encode_chatml(tokenizer, ("\n" if follows_answer else "") + chatml([("user", text)]))
    instruct = tokenizer.control_ids(BEGIN_INST, END_INST)
    if instruct is None:
        return tokenizer.encode(f"{BEGIN_INST} {text} {END_INST}", bos=False)
    begin, end = instruct
    return [begin] + tokenizer.encode(text, bos=False) + [end]


def conversation_turn(tokenizer: Tokenizer, text: str, first: bool, system: Optional[str] = None) -> List[int]:
    """The ids a conversation kept in a cache reads for its next user turn: the first with BOS and
    the system prompt before its text (where v1 and mistral-common's v1 rendering put it: the turns
    already read stay where they are, so it cannot move to the last turn); a later one after the
    answer (and its EOS) the cache already holds."""
    if first and system:
        text = f"{system}\n\n{text}"
    return ([tokenizer.bos_id] if first else []) + user_turn(tokenizer, text, follows_answer=not first)


# ---- ChatML --------------------------------------------------------------------------------------


def chatml(messages: Sequence[Turn], generation_prompt: bool = True) -> str:
    """The ChatML text of ``(role, content)`` messages, as the common ChatML chat template renders
    it: each ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, then ``<|im_start|>assistant\\n``."""
    text = "".join(f"{IM_START}{role}\n{content}{IM_END}\n" for role, content in messages)
    return text + (f"{IM_START}assistant\n" if generation_prompt else "")


def _encode_chatml(tokenizer: Tokenizer, text: str) -> List[int]:
    """ChatML text: the markers become their ids, each stretch between is encoded on its own (as
    transformers encodes the template's text)."""
    start, end = tokenizer.chatml_ids()
    ids: List[int] = []
    for k, part in enumerate(re.split(f"({re.escape(IM_START)}|{re.escape(IM_END)})", text)):
        if k % 2:
            ids.append(start if part == IM_START else end)
        elif part:
            ids += tokenizer.encode(part, bos=False)
    return ids
