"""OpenAI chat and completions bodies as the neutral requests the engine runs.

Only what the server honours is accepted: ``n`` other than 1, ``functions``,
logprobs and penalties are refused with a 400 naming the field, never silently
ignored. ``tools`` and ``tool_choice`` go to the template and the answer's
parser (``server.tools``); ``response_format`` ``json_object`` and
``json_schema`` become a grammar the answer is sampled under; a schema the
converter cannot handle is a 400 naming why. Unknown fields (``user``,
``metadata``, ...) are ignored. What every body is checked for first is
``server.fields``.
"""

from __future__ import annotations

from typing import Any

from localkv.prompt.template import Message, ToolCall
from localkv.server.errors import ApiError, bad_request
from localkv.server.fields import (
    flag,
    integer,
    is_int,
    json_grammar,
    number,
    seed,
    stop_list,
    top_p,
)
from localkv.server.requests import ChatRequest, CompletionRequest, Sampling, ToolChoice
from localkv.server.tools import chat_tool, checked_choice

__all__ = ["parse_chat", "parse_completion"]

ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    _refuse_unsupported(body, ("audio",))
    tools, choice = parse_tools(body)
    raw = body.get("messages")
    if raw is None:
        raise bad_request("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty array", "messages")
    messages = tuple(_message(m, i) for i, m in enumerate(raw))
    if messages[-1].role not in ("user", "tool"):
        raise bad_request(
            "the last message must be from the user or a tool (role 'user' or 'tool')",
            f"messages[{len(raw) - 1}]",
        )
    limit = integer(body.get("max_completion_tokens"), "max_completion_tokens", 1)
    if limit is None:
        limit = integer(body.get("max_tokens"), "max_tokens", 1)
    stream, include_usage = _stream(body)
    return ChatRequest(
        messages=messages,
        sampling=_sampling(body, limit),
        stream=stream,
        include_usage=include_usage,
        tools=tools,
        tool_choice=choice,
    )


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    _refuse_unsupported(body, ("suffix",))
    if body.get("echo"):
        raise bad_request("'echo' is not supported", "echo")
    if body.get("best_of") not in (None, 1):
        raise bad_request("only best_of=1 is supported", "best_of")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' is empty", "prompt")
        parsed: str | tuple[int, ...] = prompt
    elif isinstance(prompt, list) and prompt and all(is_int(t) and t >= 0 for t in prompt):
        parsed = tuple(prompt)
    elif prompt is None:
        raise bad_request("'prompt' is required", "prompt", "missing_required_parameter")
    else:
        raise bad_request("'prompt' must be a string or an array of token ids", "prompt")
    stream, include_usage = _stream(body)
    limit = integer(body.get("max_tokens"), "max_tokens", 1)
    return CompletionRequest(
        prompt=parsed, sampling=_sampling(body, limit), stream=stream, include_usage=include_usage
    )


def _message(raw: object, i: int) -> Message:
    where = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise bad_request(f"{where} must be an object with 'role' and 'content'", where)
    role = raw.get("role")
    if role not in ROLES:
        known = ", ".join(ROLES)
        raise bad_request(
            f"{where}.role {role!r} is not supported (one of {known})", f"{where}.role"
        )
    if raw.get("function_call"):
        raise bad_request(f"{where}: 'function_call' is not supported: give 'tool_calls'", where)
    calls = _message_calls(raw.get("tool_calls"), where) if role == "assistant" else ()
    content = raw.get("content")
    text = "" if content is None and (calls or role == "assistant") else _content(content, where)
    reasoning = raw.get("reasoning_content") if role == "assistant" else None
    if reasoning is not None and not isinstance(reasoning, str):
        raise bad_request(f"{where}.reasoning_content must be a string", where)
    call_id = raw.get("tool_call_id") if role == "tool" else None
    if role == "tool" and not isinstance(call_id, str):
        raise bad_request(f"{where}: a tool message needs 'tool_call_id'", f"{where}.tool_call_id")
    name = raw.get("name") if role == "tool" and isinstance(raw.get("name"), str) else None
    return Message(
        "system" if role == "developer" else str(role),
        text,
        reasoning=reasoning or None,
        tool_calls=calls,
        tool_call_id=call_id,
        name=name,
    )


def _content(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_request(
                    f"{where}.content: only text parts are supported", f"{where}.content"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"{where}.content: a text part needs 'text'", f"{where}.content")
            parts.append(text)
        return "".join(parts)
    raise bad_request(
        f"{where}.content must be a string or an array of text parts", f"{where}.content"
    )


def _sampling(body: dict[str, Any], max_tokens: int | None) -> Sampling:
    if body.get("n", 1) != 1 or not is_int(body.get("n", 1)):
        raise bad_request("only n=1 is supported", "n")
    for name in ("frequency_penalty", "presence_penalty"):
        if number(body.get(name), name, -2.0, 2.0) not in (None, 0.0):
            raise bad_request(f"'{name}' is not supported (only 0)", name)
    if body.get("logprobs") or body.get("top_logprobs"):
        raise bad_request("logprobs are not supported", "logprobs")
    if body.get("logit_bias"):
        raise bad_request("'logit_bias' is not supported", "logit_bias")
    grammar = _response_format(body.get("response_format"))
    temperature = number(body.get("temperature"), "temperature", 0.0, 2.0)
    nucleus = top_p(body.get("top_p"), "top_p")
    return Sampling(
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if nucleus is None else nucleus,
        top_k=integer(body.get("top_k"), "top_k", 0) or 0,
        seed=seed(body.get("seed"), "seed"),
        max_tokens=max_tokens,
        stop=stop_list(body.get("stop"), "stop"),
        grammar=grammar,
    )


def _response_format(fmt: object) -> str | None:
    """The grammar a ``response_format`` asks for: None for text, else JSON's (GBNF)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if not isinstance(fmt, dict) or kind not in ("text", "json_object", "json_schema"):
        raise bad_request(
            "response_format must be {'type': 'text'}, {'type': 'json_object'} or "
            "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}",
            "response_format",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return json_grammar(None, "response_format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request(
            "response_format.json_schema must be an object with 'name' and 'schema'",
            "response_format",
        )
    for name, kinds in (("name", str), ("description", str), ("strict", bool)):
        if spec.get(name) is not None and not isinstance(spec[name], kinds):
            raise bad_request(
                f"response_format.json_schema.{name} must be a {kinds.__name__}",
                "response_format",
            )
    # OpenAI's schema is optional (then any JSON object); strict or not, the answer is
    # held to it
    return json_grammar(spec.get("schema"), "response_format.json_schema.schema", "response_format")


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = flag(body.get("stream"), "stream")
    options = body.get("stream_options")
    if options is None:
        return bool(stream), False
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    if not stream:
        raise bad_request("'stream_options' is only allowed with stream=true", "stream_options")
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise bad_request("'include_usage' must be true or false", "stream_options.include_usage")
    return True, usage


def _refuse_unsupported(body: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        if body.get(name):
            raise ApiError(400, f"'{name}' is not supported by this server", param=name)


def parse_tools(body: dict[str, Any]) -> tuple[tuple[dict[str, Any], ...], ToolChoice | None]:
    """The request's tools and tool choice (None: no tools), or a 400 naming the field."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise bad_request(f"'{legacy}' is not supported: give 'tools' instead", legacy)
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return (), None
    if not isinstance(raw, list):
        raise bad_request("'tools' must be an array of function tools", "tools")
    tools = tuple(chat_tool(t, f"tools[{i}]") for i, t in enumerate(raw))
    return tools, checked_choice(
        tools,
        _choice(choice),
        choice_at="tool_choice",
        parameters_at=lambda i: f"tools[{i}].function.parameters",
    )


def _choice(choice: object) -> ToolChoice:
    if choice is None or choice in ("auto", "none", "required"):
        return ToolChoice(str(choice or "auto"))
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise bad_request(
            "'tool_choice' is 'auto', 'none', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    return ToolChoice("function", name)


def _message_calls(raw: object, where: str) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls`` sent back."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise bad_request(f"{where}.tool_calls must be an array", f"{where}.tool_calls")
    calls = []
    for i, call in enumerate(raw):
        at = f"{where}.tool_calls[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"{at} needs 'function' with a 'name'", at)
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise bad_request(f"{at}.function.arguments must be JSON text", at)
        call_id = call.get("id") if isinstance(call.get("id"), str) else f"call_{i}"
        calls.append(ToolCall(call_id, function["name"], arguments))
    return tuple(calls)
