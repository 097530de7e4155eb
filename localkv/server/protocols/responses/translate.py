"""Responses request bodies as the chat request the engine runs.

The translation builds a ``/v1/chat/completions`` body and parses it with
``server.openai``, so every check and default of the chat path holds here and
the same conversation is the same prompt tokens. ``instructions`` is a system
message in front; ``input`` is a string (one user message) or items:
``message`` (user, assistant, system, developer; text parts), ``function_call``
(an assistant's tool call; calls in a row, and a message just before them, are
one assistant turn), ``function_call_output`` (a tool result) and
``reasoning`` (its ``reasoning_text``, the next assistant turn's reasoning).
Fields of the request that are not the model's work are checked here
(``fields``); the rest goes through as the chat path's.
"""

from __future__ import annotations

from typing import Any

from localkv.server.errors import ApiError, bad_request
from localkv.server.protocols.openai.parse import parse_chat
from localkv.server.protocols.responses.fields import check_fields, response_format, tools_body
from localkv.server.requests import ChatRequest

__all__ = ["chat_messages", "chat_request"]

TEXT_PARTS = ("input_text", "output_text", "text")
REFUSED_PARTS = {
    "input_image": "images",
    "input_file": "files",
    "input_audio": "audio",
}
ROLES = ("user", "assistant", "system", "developer")
# the chat path's names of fields, as a Responses client knows them
_PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text.format"}


def chat_request(body: dict[str, Any]) -> ChatRequest:
    """The ``ChatRequest`` of a Responses body, or a 400 naming the Responses field."""
    check_fields(body)
    chat: dict[str, Any] = {"messages": chat_messages(body), **tools_body(body)}
    for name in ("temperature", "top_p", "top_k", "seed", "stop", "stream"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    fmt = response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    try:
        return parse_chat(chat)
    except ApiError as exc:
        raise _renamed(exc) from None


def _renamed(exc: ApiError) -> ApiError:
    """A chat-path error with the Responses names of its fields."""
    message, param = exc.message, exc.param
    for old, new in _PARAMS.items():
        message = message.replace(old, new)
        if param is not None and param.startswith(old):
            param = new + param[len(old) :]
    if param is not None and param.startswith("tools["):
        param = param.replace(".function", "")
        message = message.replace(".function.", ".")
    return ApiError(exc.status, message, param=param, code=exc.code, headers=exc.headers)


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of ``instructions`` and ``input``."""
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string", "instructions")
        if instructions:
            out.append({"role": "system", "content": instructions})
    raw = body.get("input")
    if raw is None:
        raise bad_request("'input' is required", "input", "missing_required_parameter")
    if isinstance(raw, str):
        if not raw:
            raise bad_request("'input' is empty", "input")
        return [*out, {"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad_request("'input' must be a string or a non-empty array of items", "input")
    reasoning: str | None = None  # from a reasoning item, for the next assistant turn
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
            _add_call(out, item, where, reasoning)
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


def _message(item: dict[str, Any], where: str, reasoning: str | None) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        known = ", ".join(ROLES)
        raise bad_request(
            f"{where}.role {role!r} is not supported (one of {known})", f"{where}.role"
        )
    out: dict[str, Any] = {"role": role, "content": _text(item.get("content"), where)}
    if role == "assistant" and reasoning:
        out["reasoning_content"] = reasoning
    return out


def _text(content: object, where: str, field: str = "content") -> str:
    """A message's content: a string, or text parts joined (as the chat path joins them)."""
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
    """A reasoning item's text (its ``content``; a summary is not the reasoning)."""
    content = item.get("content") or []
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be an array of reasoning_text parts", where)
    texts = []
    for j, part in enumerate(content):
        text = part.get("text") if isinstance(part, dict) else None
        if not isinstance(text, str):
            raise bad_request(f"{where}.content[{j}] needs 'text'", f"{where}.content[{j}]")
        texts.append(text)
    return "".join(texts)


def _add_call(
    out: list[dict[str, Any]], item: dict[str, Any], where: str, reasoning: str | None
) -> None:
    """A function call, into the assistant turn just before it or a new one."""
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise bad_request(f"{where}: a function_call needs '{name}' (a string)", where)
    call = {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }
    if out and out[-1]["role"] == "assistant" and not reasoning:
        out[-1].setdefault("tool_calls", []).append(call)
        return
    turn: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
    if reasoning:
        turn["reasoning_content"] = reasoning
    out.append(turn)


def _call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise bad_request(f"{where}: a function_call_output needs 'call_id'", f"{where}.call_id")
    output = item.get("output")
    if output is None:
        raise bad_request(f"{where}: a function_call_output needs 'output'", f"{where}.output")
    message: dict[str, Any] = {
        "role": "tool",
        "tool_call_id": call_id,
        "content": _text(output, where, "output"),
    }
    if isinstance(item.get("name"), str):
        message["name"] = item["name"]
    return message
