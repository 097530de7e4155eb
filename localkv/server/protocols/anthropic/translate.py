"""Anthropic Messages bodies as the OpenAI request values the engine runs.

The translation builds an OpenAI chat body and parses it with ``server.openai``,
so every check and default of the OpenAI path holds here too. Mapped:
``system`` (a string or text blocks) to the system message; ``messages``
(``user``/``assistant``, content a string or blocks): ``text`` to content,
``tool_use`` to the assistant's ``tool_calls`` (``input`` as JSON text),
``tool_result`` to a tool message answering ``tool_use_id`` (its content a
string or text blocks; ``is_error`` puts ``Error: `` before it), ``thinking`` to
the answer's ``reasoning_content``; ``tools`` (``name``, ``description``,
``input_schema``) to function tools; ``tool_choice`` ``auto``, ``any``
(``required``), ``tool`` (the named function), ``none``; ``max_tokens``
(required), ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``.
``cache_control`` on a system block, a tool or a message's block is a
``Breakpoint``: the prompt up to the end of that message (the system prompt
for a system block or a tool), at the last segment end there, is kept,
pinned 5 minutes, or an hour with ``"ttl": "1h"``; a ``cache_control`` on
the request is one on its last message. Images and documents are refused;
``metadata``, ``thinking``, ``service_tier`` and other fields are accepted
and ignored.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from localkv.server.errors import ApiError, bad_request
from localkv.server.protocols.openai.parse import parse_chat
from localkv.server.requests import Breakpoint, ChatRequest

__all__ = ["Parsed", "messages_request"]

TTLS = {"5m": 300.0, "1h": 3600.0}
# the chat path's names of fields, as a Messages client knows them
_NAMES = (
    (r"\bstop\b", "stop_sequences"),
    (r"(tools\[\d+\])\.function\.parameters", r"\1.input_schema"),
    (r"(tools\[\d+\])\.function\.", r"\1."),
)
_SAMPLING = ("temperature", "top_p", "top_k")


@dataclass(frozen=True, slots=True)
class Parsed:
    """A Messages request: the chat request the engine runs, and how to answer it."""

    request: ChatRequest
    stream: bool
    model: str


def messages_request(body: dict[str, Any], *, counting: bool = False) -> Parsed:
    """``POST /v1/messages`` (``counting``: ``/v1/messages/count_tokens``, no ``max_tokens``)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required (any name: the loaded model answers)", "model")
    points: list[Breakpoint] = []
    out: list[dict[str, Any]] = []
    system = _system(body.get("system"), points)
    if system is not None:
        out.append({"role": "system", "content": system})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty array", "messages")
    for i, message in enumerate(raw):
        _message(message, i, out, points)
    ttl = _ttl(body, "")  # on the request: the last message's last block
    if ttl is not None:
        points.append(Breakpoint(len(out) - 1, ttl))
    openai: dict[str, Any] = {"messages": out, **_tools(body, points)}
    openai.update(_limits(body, counting))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be true or false", "stream")
    try:
        request = parse_chat(openai)
    except ApiError as exc:
        raise _renamed(exc) from None
    return Parsed(replace(request, breakpoints=tuple(points), stream=stream), stream, model)


def _renamed(exc: ApiError) -> ApiError:
    """A chat-path error with the Messages names of its fields."""
    message, param = exc.message, exc.param
    for old, new in _NAMES:
        message = re.sub(old, new, message)
        param = None if param is None else re.sub(old, new, param)
    return ApiError(exc.status, message, param=param, code=exc.code, headers=exc.headers)


def _limits(body: dict[str, Any], counting: bool) -> dict[str, Any]:
    out: dict[str, Any] = {name: body[name] for name in _SAMPLING if body.get(name) is not None}
    limit = body.get("max_tokens")
    if limit is None and not counting:
        raise bad_request("max_tokens: Field required", "max_tokens")
    if limit is not None and not counting:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise bad_request("max_tokens: must be an integer of at least 1", "max_tokens")
        out["max_tokens"] = limit
    stops = body.get("stop_sequences")
    if stops is not None and stops != []:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise bad_request(
                "stop_sequences: must be an array of non-empty strings", "stop_sequences"
            )
        out["stop"] = stops
    return out


def _ttl(block: dict[str, Any], where: str) -> float | None:
    """A block's ``cache_control`` as seconds to keep (None: it has none)."""
    control = block.get("cache_control")
    if control is None:
        return None
    at = f"{where}.cache_control" if where else "cache_control"
    if not isinstance(control, dict) or control.get("type") != "ephemeral":
        raise bad_request(f"{at}: must be {{'type': 'ephemeral'}}", at)
    ttl = control.get("ttl", "5m")
    if not isinstance(ttl, str) or ttl not in TTLS:
        raise bad_request(f"{at}.ttl: must be '5m' or '1h'", at)
    return TTLS[ttl]


def _system(raw: object, points: list[Breakpoint]) -> str | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        return raw or None
    if not isinstance(raw, list):
        raise bad_request("system: must be a string or an array of text blocks", "system")
    texts = []
    for i, block in enumerate(raw):
        where = f"system[{i}]"
        if not isinstance(block, dict) or block.get("type") != "text":
            raise bad_request(f"{where}: only text blocks are supported", where)
        texts.append(_text(block, where))
        ttl = _ttl(block, where)
        if ttl is not None:
            points.append(Breakpoint(0, ttl))
    return "".join(texts) or None


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}.text: must be a string", where)
    return text


def _message(raw: object, i: int, out: list[dict[str, Any]], points: list[Breakpoint]) -> None:
    """Message ``i`` as one OpenAI message, or (tool results) several, appended to ``out``."""
    where = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise bad_request(f"{where}: must be an object with 'role' and 'content'", where)
    role = raw.get("role")
    if role not in ("user", "assistant"):
        raise bad_request(f"{where}.role: must be 'user' or 'assistant', not {role!r}", where)
    content = raw.get("content")
    if isinstance(content, str):
        out.append({"role": role, "content": content})
        return
    if not isinstance(content, list):
        raise bad_request(f"{where}.content: must be a string or an array of blocks", where)
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    kept: float | None = None
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(block, dict):
            raise bad_request(f"{at}: must be a content block (an object with 'type')", at)
        _block(block, at, str(role), (texts, calls, reasoning), out)
        ttl = _ttl(block, at)
        kept = ttl if kept is None or (ttl is not None and ttl > kept) else kept
    if role == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if calls:
            message["tool_calls"] = calls
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
        out.append(message)
    elif texts or not out or out[-1]["role"] != "tool":
        out.append({"role": "user", "content": "".join(texts)})
    if kept is not None:
        points.append(Breakpoint(len(out) - 1, kept))


def _block(
    block: dict[str, Any],
    at: str,
    role: str,
    parts: tuple[list[str], list[dict[str, Any]], list[str]],
    out: list[dict[str, Any]],
) -> None:
    texts, calls, reasoning = parts
    kind = block.get("type")
    if kind == "text":
        texts.append(_text(block, at))
    elif kind in ("image", "document"):
        raise bad_request(f"{at}: {kind} blocks are not supported by this server", at)
    elif kind == "tool_use" and role == "assistant":
        calls.append(_call(block, at))
    elif kind == "tool_result" and role == "user":
        if texts:
            raise bad_request(f"{at}: tool_result blocks must come before text", at)
        out.append(_result(block, at))
    elif kind in ("thinking", "redacted_thinking") and role == "assistant":
        thought = block.get("thinking")
        if isinstance(thought, str):
            reasoning.append(thought)
    else:
        raise bad_request(f"{at}.type: {kind!r} is not a content block a {role} message has", at)


def _call(block: dict[str, Any], at: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"{at}.id: a tool_use block needs an id", at)
    if not isinstance(name, str) or not name:
        raise bad_request(f"{at}.name: a tool_use block needs a name", at)
    if not isinstance(arguments, dict):
        raise bad_request(f"{at}.input: must be an object", at)
    text = json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def _result(block: dict[str, Any], at: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"{at}.tool_use_id: a tool_result block needs one", at)
    content = block.get("content", "")
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_request(f"{at}.content[{k}]: only text blocks are supported", at)
            texts.append(_text(part, f"{at}.content[{k}]"))
        content = "".join(texts)
    if not isinstance(content, str):
        raise bad_request(f"{at}.content: must be a string or an array of text blocks", at)
    if block.get("is_error") is True:
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _tools(body: dict[str, Any], points: list[Breakpoint]) -> dict[str, Any]:
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is None or raw == []:
        return {} if choice is None else {"tool_choice": _choice(choice)}
    if not isinstance(raw, list):
        raise bad_request("tools: must be an array of tools", "tools")
    tools = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            raise bad_request(
                f"{where}: only custom tools (name, input_schema) are supported", where
            )
        function: dict[str, Any] = {"name": tool.get("name")}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise bad_request(f"{where}.input_schema: must be a JSON schema object", where)
        function["parameters"] = schema
        tools.append({"type": "function", "function": function})
        ttl = _ttl(tool, where)
        if ttl is not None:
            points.append(Breakpoint(-1, ttl))
    out: dict[str, Any] = {"tools": tools}
    if choice is not None:
        out["tool_choice"] = _choice(choice)
    return out


def _choice(choice: object) -> object:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if isinstance(choice, dict) and kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    raise bad_request(
        "tool_choice: must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}",
        "tool_choice",
    )
