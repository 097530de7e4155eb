"""Responses request bodies as the neutral ``ChatRequest`` the engine runs.

``instructions`` is a system message in front; ``input`` is a string (one user
message) or items: ``message`` (user, assistant, system, developer; text parts;
an assistant message sent back with ``status``, ``annotations`` or ``phase``),
``function_call`` (an assistant's tool call; calls in a row, and a message just
before them, are one assistant turn; a ``namespace`` names the call as the
template saw it, ``responses.tools``), ``function_call_output`` (a tool result)
and ``reasoning`` (its ``reasoning_text``, or this server's
``encrypted_content``, is the next assistant turn's reasoning; a summary is not
the reasoning). An item's ``id`` takes no part in the prompt: clients make new
ones per session. Top-level fields are checked in ``fields``, tools in ``tools``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from localkv.prompt.template import Message, ToolCall
from localkv.server.errors import ApiError, bad_request
from localkv.server.protocols.responses.fields import check_fields, sampling
from localkv.server.protocols.responses.reasoning import INCLUDE, unsealed
from localkv.server.protocols.responses.tools import flat_name, parse_tools
from localkv.server.requests import ChatRequest

__all__ = ["Parsed", "chat_request"]

TEXT_PARTS = ("input_text", "output_text", "text")
REFUSED_PARTS = {
    "input_image": "images",
    "input_file": "files",
    "input_audio": "audio",
}
ROLES = ("user", "assistant", "system", "developer")


@dataclass(frozen=True, slots=True)
class Parsed:
    """A Responses request: the chat request the engine runs, and how to answer it."""

    request: ChatRequest
    # a namespace's function's flat name -> (namespace, function), for the answer's calls
    names: Mapping[str, tuple[str, str]]
    sealed_reasoning: bool  # ``include`` asks for ``reasoning.encrypted_content``


def chat_request(body: dict[str, Any]) -> Parsed:
    """The ``ChatRequest`` of a Responses body, or a 400 naming the Responses field."""
    check_fields(body)
    tools = parse_tools(body)
    request = ChatRequest(
        messages=tuple(messages(body)),
        sampling=sampling(body),
        stream=bool(body.get("stream")),
        tools=tools.tools,
        tool_choice=tools.choice,
    )
    return Parsed(
        request=request, names=tools.names, sealed_reasoning=INCLUDE in (body.get("include") or ())
    )


def messages(body: dict[str, Any]) -> list[Message]:
    """The messages of ``instructions`` and ``input``."""
    out: list[Message] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string", "instructions")
        if instructions:
            out.append(Message("system", instructions))
    raw = body.get("input")
    if raw is None:
        raise bad_request("'input' is required", "input", "missing_required_parameter")
    if isinstance(raw, str):
        if not raw:
            raise bad_request("'input' is empty", "input")
        return [*out, Message("user", raw)]
    if not isinstance(raw, list) or not raw:
        raise bad_request("'input' must be a string or a non-empty array of items", "input")
    reasoning: str | None = None  # from reasoning items, for the next assistant turn
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning = (reasoning or "") + _reasoning_text(item, where)
        elif kind == "message":
            out.append(_message(item, where, reasoning))
            reasoning = None if item.get("role") == "assistant" else reasoning
        elif kind == "function_call":
            _add_call(out, _call(item, where), reasoning)
            reasoning = None
        elif kind == "function_call_output":
            out.append(_call_output(item, where))
        else:
            raise _unknown_item(kind, where)
    last = raw[-1]
    if last.get("type", "message") != "function_call_output" and last.get("role") != "user":
        raise bad_request(
            "the input must end with a user message or a 'function_call_output'",
            f"input[{len(raw) - 1}]",
        )
    return out


def _unknown_item(kind: object, where: str) -> ApiError:
    if kind == "item_reference":
        return bad_request(
            f"{where}: 'item_reference' needs stored items; this server stores none: "
            "send the item itself",
            f"{where}.type",
        )
    known = "'message', 'function_call', 'function_call_output', 'reasoning'"
    return bad_request(f"{where}.type {kind!r} is not supported (one of {known})", f"{where}.type")


def _message(item: dict[str, Any], where: str, reasoning: str | None) -> Message:
    role = item.get("role")
    if role not in ROLES:
        known = ", ".join(ROLES)
        raise bad_request(
            f"{where}.role {role!r} is not supported (one of {known})", f"{where}.role"
        )
    text = _text(item.get("content"), where)
    if role == "assistant":
        return Message("assistant", text, reasoning=reasoning or None)
    return Message("system" if role == "developer" else str(role), text)


def _text(content: object, where: str, field: str = "content") -> str:
    """A message's content: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(
            f"{where}.{field} must be a string or an array of text parts", f"{where}.{field}"
        )
    parts = []
    for j, part in enumerate(content):
        at = f"{where}.{field}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):  # not a part, or one whose kind is not a name
            raise _not_text(at)
        if kind in REFUSED_PARTS:
            raise bad_request(
                f"{at}: {REFUSED_PARTS[kind]} ({kind!r}) are not supported by this "
                "server: its models read text only",
                at,
                "unsupported_content",
            )
        text = part.get("refusal" if kind == "refusal" else "text")
        if kind not in (*TEXT_PARTS, "refusal") or not isinstance(text, str):
            raise _not_text(at)
        parts.append(text)
    return "".join(parts)


def _not_text(at: str) -> ApiError:
    return bad_request(
        f"{at} must be a text part ({{'type': 'input_text' or 'output_text', 'text': ...}})", at
    )


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its ``content``, else this server's ``encrypted_content``
    (a summary is not the reasoning)."""
    content = item.get("content") or []
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be an array of reasoning_text parts", where)
    texts = []
    for j, part in enumerate(content):
        text = part.get("text") if isinstance(part, dict) else None
        if not isinstance(text, str):
            raise bad_request(f"{where}.content[{j}] needs 'text'", f"{where}.content[{j}]")
        texts.append(text)
    if not texts:
        return unsealed(item.get("encrypted_content")) or ""
    return "".join(texts)


def _call(item: dict[str, Any], where: str) -> ToolCall:
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise bad_request(f"{where}: a function_call needs '{name}' (a string)", where)
    return ToolCall(item["call_id"], _name(item, where), item["arguments"])


def _name(item: dict[str, Any], where: str) -> str:
    """A call's function as the template saw it: under its namespace, if it has one."""
    name, namespace = item["name"], item.get("namespace")
    if namespace is None:
        return str(name)
    if not isinstance(namespace, str):
        raise bad_request(f"{where}.namespace must be a string", f"{where}.namespace")
    return flat_name(namespace, name)


def _add_call(out: list[Message], call: ToolCall, reasoning: str | None) -> None:
    """A function call, into the assistant turn just before it or a new one."""
    if out and out[-1].role == "assistant" and not reasoning:
        out[-1] = dataclasses.replace(out[-1], tool_calls=(*out[-1].tool_calls, call))
        return
    out.append(Message("assistant", "", reasoning=reasoning or None, tool_calls=(call,)))


def _call_output(item: dict[str, Any], where: str) -> Message:
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise bad_request(f"{where}: a function_call_output needs 'call_id'", f"{where}.call_id")
    output = item.get("output")
    if output is None:
        raise bad_request(f"{where}: a function_call_output needs 'output'", f"{where}.output")
    name = item.get("name") if isinstance(item.get("name"), str) else None
    if name is not None and item.get("namespace") is not None:
        name = _name(item, where)
    return Message("tool", _text(output, where, "output"), tool_call_id=call_id, name=name)
