"""Ollama request bodies as the OpenAI request values the engine runs.

The translation builds an OpenAI body and parses it with ``server.openai``, so
every check and default of the OpenAI path holds here as well. Mapped:
``options.temperature``, ``top_p``, ``top_k``, ``seed``, ``num_predict``
(``max_tokens``; -1 and -2 mean no limit), ``stop``; ``format`` (``"json"`` or
a JSON schema, the grammar of ``response_format``); ``tools`` and the
messages' ``tool_calls``. Unset sampling options take Ollama's documented
defaults (temperature 0.8, top_p 0.9, top_k 40). Other options (``num_ctx``,
``repeat_penalty``, ``num_thread``, ...) and ``keep_alive`` are accepted and
ignored: the model, its context and its threads are the server's.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from typing import Any

from localkv.server.errors import ApiError, bad_request
from localkv.server.protocols.openai.parse import parse_chat, parse_completion
from localkv.server.requests import ChatRequest, CompletionRequest

__all__ = ["chat_request", "generate_request", "is_stream"]

DEFAULTS = {"temperature": 0.8, "top_p": 0.9, "top_k": 40}
_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed"}
# the chat path's names of fields, as an Ollama client knows them
_NAMES = (
    (r"response_format(\.json_schema\.schema)?", "format"),
    (r"\bmax_tokens\b", "options.num_predict"),
    (r"(?<![\w.])(temperature|top_p|top_k|seed|stop)\b", r"options.\1"),
    (r"\breasoning_content\b", "thinking"),
)


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
    if not isinstance(raw, list):
        raise bad_request("'messages' must be an array", "messages")
    messages = _messages(raw)
    with _renamed():
        return parse_chat({"messages": messages, **_tools(body), **_common(body)})


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
    with _renamed():
        if raw:
            return parse_completion({"prompt": prompt, **_common(body)})
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        return parse_chat({"messages": messages, **_common(body)})


@contextlib.contextmanager
def _renamed() -> Iterator[None]:
    """Chat-path errors with Ollama's names of their fields."""
    try:
        yield
    except ApiError as exc:
        message, param = exc.message, exc.param
        for old, new in _NAMES:
            message = re.sub(old, new, message)
            param = None if param is None else re.sub(old, new, param)
        raise ApiError(exc.status, message, param=param, code=exc.code) from None


def _common(body: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI fields of ``options`` and ``format`` (``stream`` is answered apart)."""
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise bad_request("'options' must be an object", "options")
    out: dict[str, Any] = dict(DEFAULTS)
    for name, field in _OPTIONS.items():
        if options.get(name) is not None:
            out[field] = options[name]
    predict = options.get("num_predict")
    if predict is not None:
        if not isinstance(predict, int) or isinstance(predict, bool) or predict < -2:
            raise bad_request("'options.num_predict' must be an integer (-1: no limit)", "options")
        if predict > 0:
            out["max_tokens"] = predict
        elif predict == 0:
            raise bad_request("'options.num_predict' must not be 0", "options")
    if options.get("stop") is not None:
        out["stop"] = options["stop"]
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt}}
    elif fmt not in (None, ""):
        raise bad_request("'format' must be \"json\" or a JSON schema (an object)", "format")
    return out


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    tools = body.get("tools")
    return {} if not tools else {"tools": tools}


def _messages(raw: list[Any]) -> list[Any]:
    """Ollama's messages in OpenAI's shape: tool calls get ids, tool results answer them."""
    out: list[Any] = []
    calls: list[str] = []  # ids of the calls not yet answered, in order
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            out.append(message)  # parse_chat says what is wrong with it
            continue
        if message.get("images"):
            raise bad_request(f"messages[{i}]: images are not supported", f"messages[{i}]")
        thinking = message.get("thinking")
        message = {k: v for k, v in message.items() if k not in ("images", "thinking")}
        if thinking:
            message["reasoning_content"] = thinking
        if message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list):
            message["tool_calls"] = [
                _call(c, f"call_{i}_{j}", calls) for j, c in enumerate(message["tool_calls"])
            ]
        if message.get("role") == "tool" and "tool_call_id" not in message:
            message["tool_call_id"] = calls.pop(0) if calls else f"call_{i}"
            if isinstance(message.get("tool_name"), str):
                message["name"] = message["tool_name"]
        out.append(message)
    return out


def _call(call: object, call_id: str, pending: list[str]) -> object:
    """One Ollama tool call (arguments as an object) as OpenAI's (arguments as JSON text)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    pending.append(call_id)
    name = function.get("name")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
