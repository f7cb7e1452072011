"""Tool calling as Mistral's instruct models do it.

A conversation with tools is rendered by ``generation.chat_template`` (mistral-common for a
tokenizer with Mistral's tool pieces: v3, and the tekken files of v3 and v7; the documented text
format otherwise); this module checks the tools a request gives and reads the calls the model
writes. With the pieces, the model calls tools by writing ``[TOOL_CALLS]`` and then a JSON list::

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]</s>

and without them (v1, ChatML) the same as text: ``[TOOL_CALLS] [...]``.

``tool_choice``: ``none`` (no tools shown), ``auto`` (the model may call; its answer is read as
calls when it starts with ``[TOOL_CALLS]``), ``required`` or a named function: enforced by a grammar
(``call_grammar``), so that even a model that knows no tools returns a call whose arguments
validate against the function's JSON schema.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from typing import Any, Dict, List, Optional, Tuple

from mixtral_infer.generation.chat_template import TOOL_CALLS, has_tool_pieces
from mixtral_infer.structured.grammar import Constraint
from mixtral_infer.tokenizer import Tokenizer

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CALL_ID_CHARS = string.ascii_letters + string.digits


class ToolError(ValueError):
    """A tool list, tool choice or tool message that cannot be used: the message says what to fix."""


def check_tools(tools: Any, tool_choice: Any) -> Tuple[List[Dict[str, Any]], Any]:
    """OpenAI's ``tools`` and ``tool_choice``, checked: the function dicts, and ``"none"``, ``"auto"``,
    ``"required"`` or the chosen function's name. ``ToolError`` names what is wrong."""
    if not isinstance(tools, list) or not tools:
        raise ToolError("tools must be a non-empty list of {type: function, function: {name, parameters}}")
    functions = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        if not isinstance(function, dict):
            raise ToolError(f"tools[{index}] must be {{type: function, function: {{name, parameters}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ToolError(f"tools[{index}].function.name={name!r} must be 1-64 letters, digits, _ or -")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ToolError(f"tools[{index}].function.parameters must be a JSON schema object")
        functions.append({"name": name, "description": function.get("description", ""), "parameters": parameters})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ToolError("tools: each function needs a name of its own")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        chosen = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if chosen not in names:
            raise ToolError(f"tool_choice names {chosen!r}, which is not among the tools {names}")
        choice = chosen
    elif choice not in ("none", "auto", "required"):
        raise ToolError(f"tool_choice={choice!r} must be none, auto, required or {{type: function, function: {{name}}}}")
    return functions, choice


def call_grammar(tokenizer: Tokenizer, functions: List[Dict[str, Any]], choice: str, parallel: bool = True) -> Optional[Constraint]:
    """The grammar of an answer that is calls of the functions (``required``) or of the named one;
    None for ``auto`` and ``none``. Each call is a JSON object whose ``name`` is a function's and
    whose ``arguments`` validate against that function's parameters; one call only unless
    ``parallel`` (OpenAI's ``parallel_tool_calls``)."""
    if choice in ("auto", "none"):
        return None
    chosen = functions if choice == "required" else [f for f in functions if f["name"] == choice]
    schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                         "required": ["name", "arguments"], "additionalProperties": False} for f in chosen],
              "x-guidance": {"whitespace_flexible": False}}  # fmt: skip
    if has_tool_pieces(tokenizer):
        (token,) = tokenizer.control_ids(TOOL_CALLS)
        start = f'<[{token}]> " ["'
    else:
        start = f'"{TOOL_CALLS} ["'
    more = ' ("," " " call)*' if parallel else ""
    lark = f'start: {start} call{more} "]"\ncall: %json {json.dumps(schema)}\n'
    return Constraint("lark", lark)


def parse_calls(tokens: List[int], text: str, tokenizer: Tokenizer, cut: bool = False) -> Optional[List[Dict[str, Any]]]:
    """The calls an answer makes (OpenAI's ``tool_calls``, with fresh ids), or None when it is not a
    list of calls after ``[TOOL_CALLS]``. ``cut``: ``max_tokens`` ended the answer, so a list cut
    short gives its complete calls (``complete_calls``)."""
    if has_tool_pieces(tokenizer):
        (token,) = tokenizer.control_ids(TOOL_CALLS)
        if not tokens or tokens[0] != token:
            return None
        body = text
    else:
        if not text.lstrip().startswith(TOOL_CALLS):
            return None
        body = text.lstrip()[len(TOOL_CALLS) :]
    try:
        calls = json.loads(body)
    except ValueError:
        calls = complete_calls(body) if cut else None
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        return None
    return [
        {"id": call_id(), "type": "function",
         "function": {"name": c["name"], "arguments": json.dumps(c.get("arguments", {}), ensure_ascii=False)}}
        for c in calls
    ]  # fmt: skip


def complete_calls(body: str) -> Optional[List[Any]]:
    """The complete calls at the start of a list that ends unfinished: what a model that keeps
    adding calls has written when ``max_tokens`` stops it. The unfinished last call is dropped;
    None when not even one call is complete, or when the text is not a list cut short.

    ``' [{"name": "a", "arguments": {}}, {"name": "b", "argu'`` gives ``[{"name": "a", "arguments": {}}]``;
    ``' [{"name": "a", "arguments": {}}] and more'`` (a whole list, then text) gives None.
    """
    decoder = json.JSONDecoder()
    start = body.lstrip()
    if not start.startswith("["):
        return None
    calls, position = [], 1
    while True:
        position = len(start) - len(start[position:].lstrip())
        try:
            call, position = decoder.raw_decode(start, position)
        except ValueError:  # the unfinished call, or none
            break
        calls.append(call)
        rest = start[position:].lstrip()
        if not rest:  # cut right after a call
            break
        if not rest.startswith(","):  # a closed list (then more text) or no list: not a cut
            return None
        position = len(start) - len(rest) + 1
    return calls or None


def call_id() -> str:
    """A call's id: 9 letters and digits, as Mistral's models write them."""
    return "".join(secrets.choice(CALL_ID_CHARS) for _ in range(9))
