"""Tools in a conversation: given to a template that renders them, or in a preamble.

A template that renders ``tools`` (Qwen's, Llama 3.1's, Hermes') gets them as
OpenAI sends them, and renders tool calls and tool results its own way. A
template that does not (SmolLM2's, llama.cpp's built-in formats) gets the tools
as a system-prompt preamble in the Hermes format — function signatures in
``<tools>``, calls asked for in ``<tool_call>`` — the tool calls of earlier
assistant messages as those blocks in their text, and tool results as a user
message of ``<tool_response>`` blocks. The preamble is a message's text, so it
is text: never special tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from localkv.prompt.template import ChatTemplate, Message, ToolCall

__all__ = ["prepare_tools", "renders_tools", "tool_preamble"]


def renders_tools(template: ChatTemplate) -> bool:
    """Whether ``template`` renders tool definitions itself (a Jinja template reading
    ``tools``)."""
    return template.jinja is not None and "tools" in template.jinja.source


def tool_preamble(tools: Sequence[dict[str, Any]]) -> str:
    """The tools as a system-prompt section (Hermes' wording, as Qwen2.5 writes it)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def prepare_tools(
    template: ChatTemplate, messages: Sequence[Message], tools: Sequence[dict[str, Any]]
) -> tuple[list[Message], list[dict[str, Any]] | None]:
    """The messages and tools to render: unchanged for a template that renders tools,
    else the preamble, calls and results written as text (see the module docstring)."""
    if renders_tools(template):
        return list(messages), list(tools) or None
    out: list[Message] = []
    for m in messages:
        if m.role == "tool":
            block = f"<tool_response>\n{m.content}\n</tool_response>"
            if out and out[-1].role == "user" and out[-1].content.startswith("<tool_response>"):
                out[-1] = Message("user", f"{out[-1].content}\n{block}")
            else:
                out.append(Message("user", block))
        elif m.tool_calls:
            calls = "\n".join(_call_block(c) for c in m.tool_calls)
            text = f"{m.content}\n{calls}" if m.content else calls
            out.append(Message("assistant", text, reasoning=m.reasoning))
        else:
            out.append(m)
    if tools:
        preamble = tool_preamble(tools)
        if out and out[0].role == "system":
            out[0] = Message("system", f"{out[0].content}\n\n{preamble}")
        else:
            out.insert(0, Message("system", preamble))
    return out, None


def _call_block(call: ToolCall) -> str:
    arguments = call.as_template()["function"]["arguments"]
    body = json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"
