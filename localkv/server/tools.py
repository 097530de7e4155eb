"""Tools in a request, and an answer's reasoning and tool calls on the way out.

Whatever the protocol, a request's tools are function definitions as chat
templates render them (``{"type": "function", "function": {"name",
"description", "parameters"}}``, built by ``function_tool``); its ``ToolChoice``
is ``auto`` (the default with tools), ``none`` (the tools are rendered, no call
is parsed), ``required`` or a named function (``checked_choice``). An answer is
split as it streams (``AnswerText``): its reasoning goes to ``reasoning_content``,
its content to ``content``; with tools, text that may be a tool call is held back
until the answer ends, then parsed (``localkv.prompt.toolcalls``) into ``tool_calls`` with ids.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
from localkv.runtime.callbacks import TextFn
from localkv.server.errors import bad_request
from localkv.server.requests import ToolChoice
from localkv.server.schemas import check_schema

if TYPE_CHECKING:
    from localkv.model.session import ModelSession
    from localkv.server.requests import Channel, ChatRequest, Outcome

__all__ = [
    "AnswerText",
    "answer_text",
    "chat_tool",
    "checked_choice",
    "function_tool",
    "tool_params",
    "with_answer",
]

# what a call's name may be: it is written into the call's grammar as a literal
TOOL_NAME = re.compile(r"[\w.:-]{1,64}")


FieldAt = Callable[[str], str]  # a tool's field ("name", "parameters", ...) as a protocol names it


def function_tool(
    name: object, description: object, parameters: object, at: FieldAt
) -> dict[str, Any]:
    """A function tool as templates render it, or a 400 naming the protocol's field.

    ``parameters`` None is a tool without arguments."""
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise bad_request(
            f"{at('name')} must be 1 to 64 letters, digits, '_', '-', '.' or ':'", at("name")
        )
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise bad_request(f"{at('parameters')} must be a JSON schema object", at("parameters"))
    out: dict[str, Any] = {"name": name}
    if description is not None:
        if not isinstance(description, str):
            raise bad_request(f"{at('description')} must be a string", at("description"))
        out["description"] = description
    out["parameters"] = parameters
    return {"type": "function", "function": out}


def chat_tool(raw: object, where: str) -> dict[str, Any]:
    """A tool as the chat-completions JSON writes it (``{"type": "function", "function":
    {"name", "description", "parameters"}}``: OpenAI's and Ollama's shape), checked."""
    if not isinstance(raw, dict) or raw.get("type", "function") != "function":
        raise bad_request(f"{where} must be {{'type': 'function', 'function': {{...}}}}", where)
    function = raw.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{where}.function must be an object", f"{where}.function")
    return function_tool(
        function.get("name"),
        function.get("description"),
        function.get("parameters"),
        lambda field: f"{where}.function.{field}",
    )


def checked_choice(
    tools: Sequence[dict[str, Any]],
    choice: ToolChoice,
    *,
    choice_at: str,
    parameters_at: Callable[[int], str],
) -> ToolChoice:
    """``choice`` over ``tools`` (each named once, as built by ``function_tool``), or a 400:
    a call that must be made is sampled by its schema's grammar, so that schema must
    become one."""
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        duplicate = next(n for n in names if names.count(n) > 1)
        raise bad_request(f"each tool needs a name of its own ({duplicate!r} is twice)", "tools")
    if choice.mode == "function" and choice.name not in names:
        raise bad_request(
            f"'{choice_at}' names {choice.name!r}, which is not in 'tools'", choice_at
        )
    if choice.mode in ("required", "function"):
        for i, tool in enumerate(tools):
            function = tool["function"]
            if choice.name is not None and function["name"] != choice.name:
                continue
            where = parameters_at(i)
            check_schema(function["parameters"], where, where)
            try:
                json_schema_grammar(function["parameters"])
            except GrammarError as exc:
                raise bad_request(f"{where} cannot constrain a call: {exc}", where) from None
    return choice


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


@dataclass(kw_only=True)
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
    return AnswerText(
        on_text=channel.text,
        on_reasoning=channel.reasoning,
        tools=names,
        thinking=tail.endswith("<think>"),
    )


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
