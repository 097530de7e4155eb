"""The top-level fields of a Responses request: which are mapped, ignored or refused.

Mapped (to the chat path): ``input``, ``instructions``, ``tools`` (function
tools, flat), ``tool_choice``, ``text.format``, ``max_output_tokens``,
``temperature``, ``top_p``, ``stream``; localkv's extensions ``top_k``,
``seed`` and ``stop`` as on ``/v1/chat/completions``. Echoed in the response:
``metadata`` (checked as OpenAI checks it), ``parallel_tool_calls``, ``user``.
Accepted and ignored: ``model`` (the loaded model answers), ``store`` (nothing
is stored, whatever it says), ``include``, ``reasoning`` (the template decides
whether the model reasons), ``prompt_cache_key`` and ``prompt_cache_retention``
(the cache is keyed by the prompt's tokens, kept on disk), ``service_tier``,
``safety_identifier``, ``stream_options``, ``truncation: "disabled"`` and Codex
CLI's ``client_metadata``.
Refused with a 400 naming the field: ``previous_response_id`` and
``conversation`` (the server is stateless: send the whole input), ``background``,
``prompt``, ``max_tool_calls``, ``top_logprobs``, ``truncation: "auto"`` and
the rest; an unknown field is a 400 ``unknown_parameter``.
"""

from __future__ import annotations

from typing import Any

from localkv.server.errors import bad_request

__all__ = ["check_fields", "echo_tool_choice", "echo_tools", "response_format", "tools_body"]

MAPPED = {
    "model", "input", "instructions", "tools", "tool_choice", "text", "max_output_tokens",
    "temperature", "top_p", "stream", "top_k", "seed", "stop", "metadata",
    "parallel_tool_calls", "user",
}  # fmt: skip
IGNORED = {
    "store", "include", "reasoning", "prompt_cache_key", "prompt_cache_retention",
    "service_tier", "safety_identifier", "stream_options", "truncation", "client_metadata",
}  # fmt: skip
STATELESS = (
    "this server is stateless (it stores no responses): send the whole conversation in "
    "'input'; its prefix is served from the cache, so resending it is cheap"
)
REFUSED = {
    "previous_response_id": STATELESS,
    "conversation": STATELESS,
    "background": "background responses need stored responses; this server stores none",
    "prompt": "prompt templates are not supported: send 'instructions' and 'input'",
    "max_tool_calls": "'max_tool_calls' is not supported",
    "top_logprobs": "logprobs are not supported",
    "context_management": "'context_management' is not supported",
    "moderation": "'moderation' is not supported",
    "prompt_cache_options": "'prompt_cache_options' is not supported: the cache is automatic",
}
MAX_METADATA = 16


def check_fields(body: dict[str, Any]) -> None:
    """A 400 for an unknown field, a refused one, or bad ``metadata``/``truncation``."""
    for name in body:
        if name in REFUSED:
            if body[name] in (None, False, 0):
                continue  # the default, sent explicitly
            message = f"'{name}' is not supported: {REFUSED[name]}"
            raise bad_request(message, name, "unsupported_parameter")
        if name not in MAPPED and name not in IGNORED:
            raise bad_request(f"Unknown parameter: '{name}'.", name, "unknown_parameter")
    if body.get("truncation") not in (None, "disabled"):
        raise bad_request(
            "'truncation' must be 'disabled': a prompt longer than the context is refused",
            "truncation",
        )
    _check_metadata(body.get("metadata"))
    for name in ("stream", "store", "parallel_tool_calls"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise bad_request(f"'{name}' must be true or false", name)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad_request("'user' must be a string", "user")


def _check_metadata(metadata: object) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise bad_request("'metadata' must be an object of strings", "metadata")
    if len(metadata) > MAX_METADATA:
        raise bad_request(f"'metadata' holds at most {MAX_METADATA} keys", "metadata")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise bad_request(
                f"metadata[{key[:64]!r}]: keys are up to 64 characters, values strings "
                "of up to 512",
                "metadata",
            )


def tools_body(body: dict[str, Any]) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` in the chat path's shape (nested ``function``)."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    out: dict[str, Any] = {}
    if raw is not None:
        if not isinstance(raw, list):
            raise bad_request("'tools' must be an array of function tools", "tools")
        out["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(raw)]
    if isinstance(choice, dict):
        name = choice.get("name")
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request(
                "'tool_choice' is 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
                "tool_choice",
            )
        choice = {"type": "function", "function": {"name": name}}
    elif choice is not None and choice not in ("auto", "none", "required"):
        raise bad_request(
            "'tool_choice' is 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
            "tool_choice",
        )
    if choice is not None:
        out["tool_choice"] = choice
    return out


def _tool(raw: object, where: str) -> dict[str, Any]:
    kind = raw.get("type") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or kind != "function":
        raise bad_request(
            f"{where}: tools of type {kind!r} are not supported: only function tools "
            "({'type': 'function', 'name': ..., 'parameters': {...}})",
            where,
        )
    if "function" in raw:
        raise bad_request(
            f"{where}: a Responses function tool is flat ('name', 'parameters' beside "
            "'type'), not nested in 'function'",
            where,
        )
    if raw.get("strict") is not None and not isinstance(raw["strict"], bool):
        raise bad_request(f"{where}.strict must be true or false", f"{where}.strict")
    function = {k: raw[k] for k in ("name", "description", "parameters") if k in raw}
    if function.get("parameters") is None:
        function.pop("parameters", None)
    return {"type": "function", "function": function}


def echo_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's tools as a response lists them (``strict``: as given, else true)."""
    out = []
    for tool in body.get("tools") or []:
        out.append(
            {
                "type": "function",
                "name": tool["name"],
                "description": tool.get("description"),
                "parameters": tool.get("parameters"),
                "strict": tool.get("strict", True),
            }
        )
    return out


def echo_tool_choice(body: dict[str, Any]) -> object:
    choice = body.get("tool_choice")
    return "auto" if choice is None else choice


def response_format(text: object) -> dict[str, Any] | None:
    """``text.format`` as the chat path's ``response_format`` (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("'text' must be an object with 'format'", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if not isinstance(fmt, dict) or kind not in ("text", "json_object", "json_schema"):
        raise bad_request(
            "text.format must be {'type': 'text'}, {'type': 'json_object'} or "
            "{'type': 'json_schema', 'name': ..., 'schema': {...}}",
            "text.format",
        )
    if kind != "json_schema":
        return {"type": kind}
    spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}
