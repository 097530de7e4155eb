"""Anthropic Messages bodies as the neutral requests the engine runs.

The body is parsed straight into a ``ChatRequest``; every error is a 400 that
names the field as Anthropic spells it (``tools[0].input_schema``,
``stop_sequences``, ``messages[2].content[0]``).

Mapped: ``system`` (a string or text blocks, joined as written) to the system
prompt; ``messages``: ``text`` blocks to the text, ``tool_use`` to the
assistant's tool calls (``input`` as JSON text), ``tool_result`` to a tool
message answering ``tool_use_id`` (its content a string or text blocks;
``is_error`` puts ``Error: `` before it), ``thinking`` to the answer's
reasoning; ``tools`` (``name``, ``description``, ``input_schema``) to function
tools (``server.tools``); ``tool_choice`` ``auto``, ``any`` (a call must be
made), ``tool`` (that one), ``none``; ``max_tokens`` (required),
``stop_sequences``, ``temperature``, ``top_p``, ``top_k``; ``output_config.format``
(or ``output_format``) ``{"type": "json_schema", "schema": ...}`` to the grammar
the answer is sampled under. ``cache_control`` on a system block, a tool, or a
message's block is a ``Breakpoint``: the prompt up to the end of that message
(the system prompt for a system block or a tool), at its last segment end
there, is kept, pinned 5 minutes, or an hour with ``"ttl": "1h"``; a
``cache_control`` on the request is one on its last turn (the last message
that is not a system message).

System messages in ``messages`` (``role: "system"``, a string or text blocks,
as Claude Code and the current SDKs send them) are system messages where they
stand, ``system`` a system message before them all; the gateway places them as
it places every protocol's (``server.canonical``: those before
the first assistant message join the system prompt, later ones stay), so the
same conversation is the same tokens through every protocol. Each text
block's ``cache_control`` is a breakpoint on its system message.

Honoured or ignored, never refused: ``thinking`` (any ``type``: the model
reasons as its template makes it, and its reasoning comes back as ``thinking``
blocks), ``output_config.effort``, ``context_management`` (nothing is edited
out of a conversation here), ``metadata``, ``service_tier``, top-level
``cache_control`` (honoured, above), a tool's ``defer_loading``, ``strict`` and
``cache_control`` (the tool is rendered with the others), ``tool_choice``'s
``disable_parallel_tool_use``; the ``anthropic-beta`` and ``anthropic-version``
headers and a query string (``?beta=true``); any other field. A tool whose
``type`` is not ``custom`` (a tool Anthropic's servers run, as
``web_search_20250305``) is left out, with a log line. Refused: image and
document blocks (the model reads text), an answer to continue (the last
message must be the user's), a content block a role does not send.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from localkv.prompt.template import Message, ToolCall
from localkv.server.errors import bad_request
from localkv.server.fields import flag, integer, json_grammar, number, stop_list
from localkv.server.requests import Breakpoint, ChatRequest, Sampling, ToolChoice
from localkv.server.tools import checked_choice, function_tool

__all__ = ["Parsed", "messages_request"]

log = logging.getLogger(__name__)

TTLS = {"5m": 300.0, "1h": 3600.0}
TOOLS = -1  # a breakpoint's message: the tools, which render into the system prompt
_left_out: set[str] = set()  # tool types logged as left out


@dataclass(frozen=True, slots=True)
class Parsed:
    """A Messages request: the chat request the engine runs, and how to answer it."""

    request: ChatRequest
    stream: bool
    model: str


@dataclass
class _Conversation:
    """What the messages become as they are read: the messages, in order (``system``
    first), and the breakpoints (on ``TOOLS`` or a message)."""

    messages: list[Message] = field(default_factory=list)
    points: list[Breakpoint] = field(default_factory=list)

    def keep(self, at: int, ttl: float | None) -> None:
        """A breakpoint on message ``at`` (``TOOLS``: the tools), if ``ttl`` asks for one."""
        if ttl is not None:
            self.points.append(Breakpoint(message=at, ttl_s=ttl))


def messages_request(body: dict[str, Any], *, counting: bool = False) -> Parsed:
    """``POST /v1/messages`` (``counting``: ``/v1/messages/count_tokens``, no ``max_tokens``)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required (any name: the loaded model answers)", "model")
    convo = _Conversation()
    if body.get("system") is not None:
        _system(body.get("system"), convo)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages: must be a non-empty array", "messages")
    for i, message in enumerate(raw):
        _message(message, i, convo)
    _check_last(convo.messages, len(raw) - 1)
    # on the request: the last turn's (system messages may follow it)
    last = max(i for i, m in enumerate(convo.messages) if m.role != "system")
    convo.keep(last, _ttl(body, ""))
    tools, choice = _tools(body, convo)
    stream = flag(body.get("stream"), "stream")
    request = ChatRequest(
        messages=tuple(convo.messages),
        sampling=_sampling(body, counting),
        stream=stream,
        tools=tools,
        tool_choice=choice,
        breakpoints=tuple(convo.points),
    )
    return Parsed(request=request, stream=stream, model=model)


def _check_last(messages: list[Message], last: int) -> None:
    """The conversation must end with the user's turn (system messages may follow it)."""
    roles = [m.role for m in messages if m.role != "system"]
    if not roles or roles[-1] not in ("user", "tool"):
        raise bad_request(
            "messages: the last message must have role 'user' (a conversation of system "
            "messages alone, or an answer to continue, is not supported)",
            f"messages[{last}]",
        )


def _sampling(body: dict[str, Any], counting: bool) -> Sampling:
    limit = body.get("max_tokens")
    if limit is None and not counting:
        raise bad_request("max_tokens: Field required", "max_tokens")
    if counting:
        limit = None
    elif isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise bad_request("max_tokens: must be an integer of at least 1", "max_tokens")
    stops = body.get("stop_sequences")
    if stops is not None and not (
        isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)
    ):
        raise bad_request("stop_sequences: must be an array of non-empty strings", "stop_sequences")
    temperature = number(body.get("temperature"), "temperature", 0.0, 2.0)
    top_p = number(body.get("top_p"), "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise bad_request("'top_p' must be above 0", "top_p")
    return Sampling(
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=integer(body.get("top_k"), "top_k", 0) or 0,
        max_tokens=limit,
        stop=stop_list(stops or None, "stop_sequences"),
        grammar=_grammar(body),
    )


def _grammar(body: dict[str, Any]) -> str | None:
    """The grammar ``output_config.format`` (or the older ``output_format``) asks for."""
    config = body.get("output_config")
    fmt, where = body.get("output_format"), "output_format"
    if isinstance(config, dict) and config.get("format") is not None:
        fmt, where = config["format"], "output_config.format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad_request(f"{where}: must be {{'type': 'json_schema', 'schema': {{...}}}}", where)
    return json_grammar(fmt.get("schema"), f"{where}.schema", where)


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


def _system(raw: object, convo: _Conversation, where: str = "system") -> None:
    """A system text (a string or text blocks, joined as written) as a system message;
    each block's ``cache_control`` a breakpoint on it."""
    if isinstance(raw, str):
        convo.messages.append(Message("system", raw))
        return
    if not isinstance(raw, list):
        raise bad_request(f"{where}: must be a string or an array of text blocks", where)
    texts, ttls = [], []
    for i, block in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(block, dict) or block.get("type") != "text":
            raise bad_request(f"{at}: only text blocks are supported", at)
        texts.append(_text(block, at))
        ttls.append(_ttl(block, at))
    convo.messages.append(Message("system", "".join(texts)))
    for ttl in ttls:
        convo.keep(len(convo.messages) - 1, ttl)


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}.text: must be a string", where)
    return text


def _message(raw: object, i: int, convo: _Conversation) -> None:
    """Message ``i`` as one neutral message, or (tool results) several, in ``convo``."""
    where = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise bad_request(f"{where}: must be an object with 'role' and 'content'", where)
    role = raw.get("role")
    if role not in ("user", "assistant", "system"):
        raise bad_request(
            f"{where}.role: must be 'user', 'assistant' or 'system', not {role!r}", where
        )
    content = raw.get("content")
    if role == "system":
        if not isinstance(content, str | list):
            raise bad_request(
                f"{where}.content: must be a string or an array of text blocks", where
            )
        _system(content, convo, f"{where}.content")
        return
    if isinstance(content, str):
        convo.messages.append(Message(str(role), content))
        return
    if not isinstance(content, list):
        raise bad_request(f"{where}.content: must be a string or an array of blocks", where)
    if role == "assistant":
        _assistant(content, where, convo)
    else:
        _user(content, where, convo)


def _blocks(content: list[Any], where: str) -> list[tuple[str, dict[str, Any]]]:
    """Each block of ``content`` with where it is (a 400 for one that is not an object)."""
    out = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(block, dict):
            raise bad_request(f"{at}: must be a content block (an object with 'type')", at)
        if block.get("type") in ("image", "document"):
            raise bad_request(f"{at}: {block['type']} blocks are not supported by this server", at)
        out.append((at, block))
    return out


def _kept(blocks: list[tuple[str, dict[str, Any]]]) -> float | None:
    """The longest ``cache_control`` among a message's blocks (None: none has one)."""
    ttls = [t for at, block in blocks if (t := _ttl(block, at)) is not None]
    return max(ttls) if ttls else None


def _assistant(content: list[Any], where: str, convo: _Conversation) -> None:
    blocks = _blocks(content, where)
    texts: list[str] = []
    calls: list[ToolCall] = []
    reasoning: list[str] = []
    for at, block in blocks:
        kind = block.get("type")
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            calls.append(_call(block, at))
        elif kind in ("thinking", "redacted_thinking"):
            thought = block.get("thinking")
            if isinstance(thought, str):
                reasoning.append(thought)
        else:
            raise bad_request(
                f"{at}.type: {kind!r} is not a content block an assistant message has", at
            )
    thought = "".join(reasoning)
    convo.messages.append(
        Message(
            "assistant",
            "".join(texts),
            reasoning=thought or None,
            tool_calls=tuple(calls),
            tool_call_id=None,
            name=None,
        )
    )
    convo.keep(len(convo.messages) - 1, _kept(blocks))


def _user(content: list[Any], where: str, convo: _Conversation) -> None:
    """A user message: its tool results (tool messages), then its text (a user message)."""
    blocks = _blocks(content, where)
    texts: list[str] = []
    results = 0
    for at, block in blocks:
        kind = block.get("type")
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_result":
            if texts:
                raise bad_request(f"{at}: tool_result blocks must come before text", at)
            convo.messages.append(_result(block, at))
            results += 1
        else:
            raise bad_request(f"{at}.type: {kind!r} is not a content block a user message has", at)
    previous = convo.messages[-1].role if convo.messages else None
    if texts or (not results and previous != "tool"):
        convo.messages.append(Message("user", "".join(texts)))
    convo.keep(len(convo.messages) - 1, _kept(blocks))


def _call(block: dict[str, Any], at: str) -> ToolCall:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"{at}.id: a tool_use block needs an id", at)
    if not isinstance(name, str) or not name:
        raise bad_request(f"{at}.name: a tool_use block needs a name", at)
    if not isinstance(arguments, dict):
        raise bad_request(f"{at}.input: must be an object", at)
    return ToolCall(call_id, name, json.dumps(arguments, ensure_ascii=False))


def _result(block: dict[str, Any], at: str) -> Message:
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
    return Message("tool", content, reasoning=None, tool_calls=(), tool_call_id=call_id, name=None)


def _tools(
    body: dict[str, Any], convo: _Conversation
) -> tuple[tuple[dict[str, Any], ...], ToolChoice | None]:
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is not None and not isinstance(raw, list):
        raise bad_request("tools: must be an array of tools", "tools")
    tools, places = [], []
    for i, tool in enumerate(raw or ()):
        built = _tool(tool, f"tools[{i}]", convo)
        if built is not None:
            tools.append(built)
            places.append(i)
    if not tools:
        if choice is not None and _choice(choice).mode not in ("auto", "none"):
            raise bad_request("tool_choice: needs 'tools'", "tool_choice")
        return (), None
    return tuple(tools), checked_choice(
        tools,
        _choice(choice),
        choice_at="tool_choice",
        parameters_at=lambda k: f"tools[{places[k]}].input_schema",
    )


def _tool(tool: object, where: str, convo: _Conversation) -> dict[str, Any] | None:
    """A custom tool as a function tool; None for a tool of a type this server cannot run."""
    if not isinstance(tool, dict):
        raise bad_request(f"{where}: must be a tool (name, input_schema)", where)
    kind = tool.get("type", "custom")
    if kind is not None and not isinstance(kind, str):
        raise bad_request(f"{where}.type: must be a string ('custom')", where)
    if kind not in (None, "custom"):
        if kind not in _left_out:
            _left_out.add(kind)
            log.info("tools of type %r are left out: this server runs no such tool", kind)
        return None
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise bad_request(f"{where}.input_schema: must be a JSON schema object", where)
    built = function_tool(
        tool.get("name"),
        tool.get("description"),
        schema,
        lambda name: f"{where}.{'input_schema' if name == 'parameters' else name}",
    )
    convo.keep(TOOLS, _ttl(tool, where))
    return built


def _choice(choice: object) -> ToolChoice:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if choice is None or kind == "auto":
        return ToolChoice("auto")
    if kind == "none":
        return ToolChoice("none")
    if kind == "any":
        return ToolChoice("required")
    if isinstance(choice, dict) and kind == "tool" and isinstance(choice.get("name"), str):
        return ToolChoice("function", choice["name"])
    raise bad_request(
        "tool_choice: must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}",
        "tool_choice",
    )
