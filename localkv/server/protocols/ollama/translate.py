"""Ollama request bodies as the neutral requests the engine runs.

``/api/chat``'s messages (``system``, ``developer``, ``user``, ``assistant``,
``tool``; ``thinking`` is an assistant's reasoning) and ``/api/generate``'s
``system`` and ``prompt`` become a ``ChatRequest``; a raw generate is a
``CompletionRequest``. Ollama's tool calls have no ids: each gets one
(``call_I_J``), and a tool message answers the oldest call not yet answered.
Mapped from ``options``: ``temperature``, ``top_p``, ``top_k``, ``seed``,
``num_predict`` (the answer's limit; -1 and -2 mean none), ``stop``; ``format``
(``"json"`` or a JSON schema) is the grammar the answer is sampled under. Each
is checked under its Ollama name (``options.num_predict``). Unset sampling
options take Ollama's documented defaults (temperature 0.8, top_p 0.9, top_k
40). Other options (``num_ctx``, ``repeat_penalty``, ``num_thread``, ...),
``think`` and ``keep_alive`` are accepted and ignored: the model, its context
and its threads are the server's.
"""

from __future__ import annotations

import json
from typing import Any

from localkv.prompt.template import Message, ToolCall
from localkv.server.errors import bad_request
from localkv.server.fields import integer, json_grammar, number, seed, stop_list, top_p
from localkv.server.requests import ChatRequest, CompletionRequest, Sampling, ToolChoice
from localkv.server.tools import chat_tool, checked_choice

__all__ = ["chat_request", "generate_request", "is_stream"]

DEFAULTS = Sampling(temperature=0.8, top_p=0.9, top_k=40)
ROLES = ("system", "developer", "user", "assistant", "tool")


def is_stream(body: dict[str, Any]) -> bool:
    """Ollama streams unless ``stream`` is false."""
    stream = body.get("stream", True)
    if stream is None:
        return True
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be true or false", "stream")
    return stream


def chat_request(body: dict[str, Any]) -> ChatRequest:
    raw = body.get("messages")
    if raw is None:
        raise bad_request("'messages' is required", "messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty array", "messages")
    messages = _messages(raw)
    if messages[-1].role not in ("user", "tool"):
        raise bad_request(
            "the last message must be from the user or a tool (role 'user' or 'tool')",
            f"messages[{len(raw) - 1}]",
        )
    tools = _tools(body.get("tools"))
    choice = None
    if tools:
        choice = checked_choice(
            tools,
            ToolChoice("auto"),
            choice_at="tools",
            parameters_at=lambda i: f"tools[{i}].function.parameters",
        )
    return ChatRequest(messages=messages, sampling=_sampling(body), tools=tools, tool_choice=choice)


def generate_request(body: dict[str, Any]) -> ChatRequest | CompletionRequest:
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise bad_request("'prompt' must be a non-empty string", "prompt")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise bad_request("'system' must be a string", "system")
    for name in ("suffix", "images", "context"):
        if body.get(name):
            raise bad_request(f"'{name}' is not supported by this server", name)
    raw = body.get("raw", False)
    if not isinstance(raw, bool):
        raise bad_request("'raw' must be true or false", "raw")
    if raw and system:
        raise bad_request("'system' has no place in a raw prompt", "system")
    if raw:
        return CompletionRequest(prompt=prompt, sampling=_sampling(body))
    messages = (Message("system", system),) if system else ()
    return ChatRequest(messages=(*messages, Message("user", prompt)), sampling=_sampling(body))


def _sampling(body: dict[str, Any]) -> Sampling:
    """``options`` and ``format`` (``stream`` is answered apart), with Ollama's defaults."""
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise bad_request("'options' must be an object", "options")
    temperature = number(options.get("temperature"), "options.temperature", 0.0, 2.0)
    nucleus = top_p(options.get("top_p"), "options.top_p")
    top_k = integer(options.get("top_k"), "options.top_k", 0)
    return Sampling(
        temperature=DEFAULTS.temperature if temperature is None else temperature,
        top_p=DEFAULTS.top_p if nucleus is None else nucleus,
        top_k=DEFAULTS.top_k if top_k is None else top_k,
        seed=seed(options.get("seed"), "options.seed"),
        max_tokens=_limit(options.get("num_predict")),
        stop=stop_list(options.get("stop"), "options.stop"),
        grammar=_format(body.get("format")),
    )


def _limit(predict: object) -> int | None:
    """``num_predict``: a count of tokens, or -1 or -2 for no limit (None)."""
    if predict is None:
        return None
    if not isinstance(predict, int) or isinstance(predict, bool) or predict < -2:
        raise bad_request(
            "'options.num_predict' must be an integer (-1: no limit)", "options.num_predict"
        )
    if predict == 0:
        raise bad_request("'options.num_predict' must not be 0", "options.num_predict")
    return predict if predict > 0 else None


def _format(fmt: object) -> str | None:
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return json_grammar(None, "format")
    if isinstance(fmt, dict):
        return json_grammar(fmt, "format")
    raise bad_request("'format' must be \"json\" or a JSON schema (an object)", "format")


def _tools(raw: object) -> tuple[dict[str, Any], ...]:
    """Ollama's tools: OpenAI's function tools (``{"type": "function", "function": ...}``)."""
    if raw is None or raw == []:
        return ()
    if not isinstance(raw, list):
        raise bad_request("'tools' must be an array of function tools", "tools")
    return tuple(chat_tool(tool, f"tools[{i}]") for i, tool in enumerate(raw))


def _messages(raw: list[Any]) -> tuple[Message, ...]:
    """Ollama's messages: tool calls get ids, tool results answer them in order."""
    out: list[Message] = []
    pending: list[str] = []  # ids of the calls not yet answered, in order
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object with 'role' and 'content'", where)
        role = message.get("role")
        if role not in ROLES:
            known = ", ".join(ROLES)
            raise bad_request(
                f"{where}.role {role!r} is not supported (one of {known})", f"{where}.role"
            )
        if message.get("images"):
            raise bad_request(f"{where}: images are not supported", where)
        calls = _calls(message.get("tool_calls"), i, pending) if role == "assistant" else ()
        content = message.get("content")
        text = "" if content is None and role == "assistant" else _content(content, where)
        if role == "tool":
            out.append(_tool_result(message, text, i, pending))
        elif role == "assistant":
            out.append(
                Message("assistant", text, reasoning=_thinking(message, where), tool_calls=calls)
            )
        else:
            out.append(Message("system" if role == "developer" else str(role), text))
    return tuple(out)


def _content(content: object, where: str) -> str:
    """A message's text: a string (or, as OpenAI's, an array of text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise bad_request(f"{where}.content must be a string", f"{where}.content")


def _thinking(message: dict[str, Any], where: str) -> str | None:
    thinking = message.get("thinking")
    if thinking is not None and not isinstance(thinking, str):
        raise bad_request(f"{where}.thinking must be a string", f"{where}.thinking")
    return thinking or None


def _tool_result(message: dict[str, Any], text: str, i: int, pending: list[str]) -> Message:
    """A tool's result: it answers its ``tool_call_id``, else the oldest unanswered call."""
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str):
        call_id = pending.pop(0) if pending else f"call_{i}"
    elif call_id in pending:
        pending.remove(call_id)
    names = [message[k] for k in ("tool_name", "name") if isinstance(message.get(k), str)]
    name = names[0] if names else None
    return Message("tool", text, tool_call_id=call_id, name=name)


def _calls(raw: object, i: int, pending: list[str]) -> tuple[ToolCall, ...]:
    """An assistant's tool calls (arguments an object, or JSON text), each given an id."""
    if raw is None:
        return ()
    where = f"messages[{i}].tool_calls"
    if not isinstance(raw, list):
        raise bad_request(f"{where} must be an array", where)
    calls = []
    for j, call in enumerate(raw):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"{where}[{j}] needs 'function' with a 'name'", f"{where}[{j}]")
        arguments = function.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(f"call_{i}_{j}", function["name"], arguments))
        pending.append(calls[-1].id)
    return tuple(calls)
