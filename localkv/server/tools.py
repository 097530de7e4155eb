"""OpenAI tools in a request, and an answer's reasoning and tool calls on the way out.

``tools`` are function definitions (``{"type": "function", "function": {"name",
"description", "parameters"}}``); ``tool_choice`` is ``auto`` (the default with
tools), ``none`` (the tools are rendered, no call is parsed), ``required`` or a
named function. An answer is split as it streams (``AnswerText``): its reasoning
goes to ``reasoning_content``, its content to ``content``; with tools, text
that may be a tool call is held back until the answer ends, then parsed
(``localkv.prompt.toolcalls``) into ``tool_calls`` with ids.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from localkv.model.sampling import (
    GrammarError,
    SamplingParams,
    check_grammar,
    json_schema_grammar,
)
from localkv.prompt.reasoning import ReasoningSplit
from localkv.prompt.template import ChatTemplate, ToolCall
from localkv.prompt.toolcalls import CALL_OPENERS, call_grammar, call_style, parse_tool_calls
from localkv.prompt.tools import renders_tools
from localkv.server.errors import bad_request
from localkv.server.schemas import check_schema

if TYPE_CHECKING:
    from localkv.model.session import ModelSession
    from localkv.server.engine import Outcome
    from localkv.server.openai import ChatRequest

__all__ = [
    "AnswerText",
    "ToolChoice",
    "answer_text",
    "parse_message_calls",
    "parse_tools",
    "tool_params",
    "with_answer",
]

TextFn = Callable[[str], None]
# what a call's name may be: it is written into the call's grammar as a literal
TOOL_NAME = re.compile(r"[\w.:-]{1,64}")


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: str  # "auto" | "none" | "required" | "function"
    name: str | None = None  # the function, for "function"


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
    tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(raw))
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("each tool needs a name of its own", "tools")
    if choice is None or choice in ("auto", "none", "required"):
        if choice == "required":
            _check_schemas(tools, None)
        return tools, ToolChoice(str(choice or "auto"))
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
    if name not in names:
        raise bad_request(f"'tool_choice' names {name!r}, which is not in 'tools'", "tool_choice")
    _check_schemas(tools, name)
    return tools, ToolChoice("function", name)


def _check_schemas(tools: tuple[dict[str, Any], ...], name: str | None) -> None:
    """A call that must be made is sampled by its schema's grammar: one that cannot
    become a grammar is a 400 naming the tool and the reason."""
    for i, tool in enumerate(tools):
        function = tool["function"]
        if name is not None and function["name"] != name:
            continue
        where = f"tools[{i}].function.parameters"
        check_schema(function["parameters"], where, where)
        try:
            json_schema_grammar(function["parameters"])
        except GrammarError as exc:
            raise bad_request(f"{where} cannot constrain a call: {exc}", where) from None


def tool_params(
    params: SamplingParams, request: ChatRequest, template: ChatTemplate
) -> SamplingParams:
    """``params`` with the grammar of the call ``tool_choice`` requires (``required``: one
    of the tools, or the named one), in the call format the template asks for."""
    choice = request.tool_choice
    if choice is None or choice.mode not in ("required", "function"):
        return params
    source = template.jinja.source if template.jinja is not None else None
    style = call_style(source if renders_tools(template) else None)
    grammar = call_grammar(request.tools, choice.name, style)
    try:  # the schemas were checked with the request: this is a last guard
        check_grammar(template.session.vocab, grammar)
    except GrammarError as exc:
        raise bad_request(f"tools cannot constrain a call: {exc}", "tools") from None
    return dataclasses.replace(params, grammar=grammar)


def _tool(raw: object, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict) or raw.get("type", "function") != "function":
        raise bad_request(f"{where} must be {{'type': 'function', 'function': {{...}}}}", where)
    function = raw.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{where}.function must be an object", f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise bad_request(
            f"{where}.function.name must be 1 to 64 letters, digits, '_', '-', '.' or ':'",
            f"{where}.function.name",
        )
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON schema object", where)
    out: dict[str, Any] = {"name": name}
    description = function.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise bad_request(f"{where}.function.description must be a string", where)
        out["description"] = description
    out["parameters"] = parameters
    return {"type": "function", "function": out}


def parse_message_calls(raw: object, where: str) -> tuple[ToolCall, ...]:
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


@dataclass
class AnswerText:
    """An answer split into reasoning and content as it streams, its tool calls at the end."""

    on_text: TextFn
    on_reasoning: TextFn
    tools: tuple[str, ...] = ()  # the function names a call may name (none: no parsing)
    thinking: bool = False
    content: str = ""
    reasoning: str | None = None
    calls: list[ToolCall] = field(default_factory=list)
    _held: str = ""
    _sent: int = 0
    _split: ReasoningSplit = field(init=False)

    def __post_init__(self) -> None:
        self._split = ReasoningSplit(thinking=self.thinking)
        if self.thinking:
            self.reasoning = ""

    def push(self, piece: str) -> None:
        for kind, text in self._split.push(piece):
            self._part(kind, text)

    def finish(self) -> None:
        """Send what was held back; parse the tool calls."""
        for kind, text in self._split.flush():
            self._part(kind, text)
        if not self.tools:
            return
        content, parsed = parse_tool_calls(self.content, self.tools)
        if parsed:
            self.calls = [
                ToolCall("call_" + secrets.token_hex(12), c.name, c.arguments) for c in parsed
            ]
            self.content = content
        if self.content[self._sent :] and not parsed:
            self.on_text(self.content[self._sent :])
        elif parsed and content.startswith(self.content[: self._sent]):
            rest = content[self._sent :]
            if rest:
                self.on_text(rest)

    def _part(self, kind: str, text: str) -> None:
        if kind == "reasoning":
            self.reasoning = (self.reasoning or "") + text
            self.on_reasoning(text)
            return
        self.content += text
        if not self.tools:
            self.on_text(text)
            return
        pending = self.content[self._sent :]
        hold = _hold_from(pending)
        if hold > 0:
            self.on_text(pending[:hold])
            self._sent += hold
        elif hold < 0:
            self.on_text(pending)
            self._sent = len(self.content)


def _hold_from(pending: str) -> int:
    """Where text that may be a tool call begins in ``pending`` (-1: nowhere; send all)."""
    stripped = pending.lstrip()
    if not stripped or any(o.startswith(stripped) or stripped.startswith(o) for o in CALL_OPENERS):
        return 0
    at = pending.find("<")
    if at >= 0 and ("<tool_call>".startswith(pending[at:]) or "<tool_call>" in pending[at:]):
        return at
    return -1


class Channel(Protocol):
    def text(self, piece: str) -> None: ...
    def reasoning(self, piece: str) -> None: ...


def answer_text(
    request: ChatRequest, session: ModelSession, prompt: Sequence[int], channel: Channel
) -> AnswerText:
    """The splitter of a request's answer: its tools, and whether its prompt opened the
    reasoning (an assistant opening that ends with ``<think>``)."""
    choice = request.tool_choice
    names = (
        ()
        if choice is None or choice.mode == "none"
        else tuple(t["function"]["name"] for t in request.tools)
    )
    tail = session.detokenize(list(prompt[-8:]), special=True).rstrip()
    return AnswerText(channel.text, channel.reasoning, names, tail.endswith("<think>"))


def with_answer(outcome: Outcome, answer: AnswerText) -> Outcome:
    """``outcome`` with the answer's content, reasoning and tool calls."""
    finish = outcome.finish_reason
    if answer.calls and finish != "cancelled":
        finish = "tool_calls"
    return dataclasses.replace(
        outcome,
        text=answer.content,
        reasoning=answer.reasoning,
        tool_calls=tuple(answer.calls),
        finish_reason=finish,
    )
