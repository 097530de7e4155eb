"""OpenAI request bodies as validated values, and the response shapes built from results.

Only what the server honours is accepted: ``n`` other than 1, ``functions``,
logprobs and penalties are refused with a 400 naming the field, never silently
ignored. ``tools`` and ``tool_choice`` go to the template and the answer's
parser (``server.tools``); ``response_format`` ``json_object`` and
``json_schema`` become a grammar the answer is sampled under; a schema the
converter cannot handle is a 400 naming why. Unknown fields (``user``,
``metadata``, ...) are ignored.
Every string of a body, wherever it is, is checked first: a NUL character or
a lone surrogate (``\ud800``, not Unicode) is a 400 naming where it is, never
cut or passed on; so is a body nested deeper than ``MAX_DEPTH``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from localkv.model.sampling import GrammarError, json_object_grammar, json_schema_grammar
from localkv.prompt.template import Message
from localkv.server.errors import ApiError, bad_request
from localkv.server.prefixes import Breakpoint
from localkv.server.schemas import check_schema
from localkv.server.tools import ToolChoice, parse_message_calls, parse_tools

__all__ = ["ChatRequest", "CompletionRequest", "Sampling", "parse_chat", "parse_completion"]

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOPS = 4
MAX_DEPTH = 32  # a request body needs 5 levels
_REFUSED_CHARS = re.compile("[\x00\ud800-\udfff]")


@dataclass(frozen=True, slots=True)
class Sampling:
    """What the client asked of generation; ``max_tokens`` None: until the context is full."""

    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    max_tokens: int | None
    stop: tuple[str, ...]
    grammar: str | None = None  # GBNF from ``response_format`` (None: any text)


@dataclass(frozen=True, slots=True)
class ChatRequest:
    messages: tuple[Message, ...]
    sampling: Sampling
    stream: bool
    include_usage: bool
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: ToolChoice | None = None  # None: no tools
    # prefixes to keep pinned for a while (Anthropic's ``cache_control``)
    breakpoints: tuple[Breakpoint, ...] = ()


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    prompt: str | tuple[int, ...]
    sampling: Sampling
    stream: bool
    include_usage: bool


def decode_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body (400 when it is not one, or holds refused text)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad_request(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError; an int too long
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _check_values(body)
    return body


def _check_values(body: dict[str, Any]) -> None:
    """Refuse a body nested deeper than ``MAX_DEPTH``, or with NUL or surrogates in a string."""
    stack: list[tuple[object, str, int]] = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise bad_request(f"the request body nests deeper than {MAX_DEPTH} levels", path)
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path or None)
                stack.append((item, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))


def _check_text(text: str, path: str | None) -> None:
    found = _REFUSED_CHARS.search(text)
    if found is None:
        return
    where = f"{path}, character {found.start()}" if path else f"character {found.start()}"
    if found.group() == "\x00":
        raise bad_request(f"NUL characters are not allowed in text ({where})", path)
    raise bad_request(
        f"a lone surrogate (U+{ord(found.group()):04X}) is not valid Unicode ({where})", path
    )


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
    limit = _opt_int(body, "max_completion_tokens", 1)
    if limit is None:
        limit = _opt_int(body, "max_tokens", 1)
    stream, include_usage = _stream(body)
    return ChatRequest(messages, _sampling(body, limit), stream, include_usage, tools, choice)


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
    elif isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        parsed = tuple(prompt)
    elif prompt is None:
        raise bad_request("'prompt' is required", "prompt", "missing_required_parameter")
    else:
        raise bad_request("'prompt' must be a string or an array of token ids", "prompt")
    stream, include_usage = _stream(body)
    return CompletionRequest(
        parsed, _sampling(body, _opt_int(body, "max_tokens", 1)), stream, include_usage
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
    calls = parse_message_calls(raw.get("tool_calls"), where) if role == "assistant" else ()
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
        reasoning or None,
        calls,
        call_id,
        name,
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
    if body.get("n", 1) != 1 or not _is_int(body.get("n", 1)):
        raise bad_request("only n=1 is supported", "n")
    for name in ("frequency_penalty", "presence_penalty"):
        if _opt_float(body, name, -2.0, 2.0) not in (None, 0.0):
            raise bad_request(f"'{name}' is not supported (only 0)", name)
    if body.get("logprobs") or body.get("top_logprobs"):
        raise bad_request("logprobs are not supported", "logprobs")
    if body.get("logit_bias"):
        raise bad_request("'logit_bias' is not supported", "logit_bias")
    grammar = _response_format(body.get("response_format"))
    temperature = _opt_float(body, "temperature", 0.0, 2.0)
    top_p = _opt_float(body, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise bad_request("'top_p' must be above 0", "top_p")
    seed = _opt_int(body, "seed", None)
    return Sampling(
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=_opt_int(body, "top_k", 0) or 0,
        seed=None if seed is None else seed & (2**63 - 1),
        max_tokens=max_tokens,
        stop=_stops(body.get("stop")),
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
        return json_object_grammar()
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
    schema = spec.get("schema")
    if schema is None:  # OpenAI's schema is optional: then any JSON object
        return json_object_grammar()
    check_schema(schema, "response_format.json_schema.schema", "response_format")
    try:  # strict or not, the answer is held to the schema
        return json_schema_grammar(schema)
    except GrammarError as exc:
        raise bad_request(f"response_format.json_schema.schema: {exc}", "response_format") from None


def _stops(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("'stop' must be a non-empty string or an array of them", "stop")
    if len(stops) > MAX_STOPS:
        raise bad_request(f"'stop' takes at most {MAX_STOPS} sequences", "stop")
    return tuple(stops)


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise bad_request("'stream' must be true or false", "stream")
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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _opt_int(body: dict[str, Any], name: str, minimum: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or (minimum is not None and value < minimum):
        floor = "" if minimum is None else f" of at least {minimum}"
        raise bad_request(f"'{name}' must be an integer{floor}", name)
    return int(value)


def _opt_float(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a number", name)
    if not low <= value <= high:
        raise bad_request(f"'{name}' must be between {low:g} and {high:g}", name)
    return float(value)


def _refuse_unsupported(body: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        if body.get(name):
            raise ApiError(400, f"'{name}' is not supported by this server", param=name)
