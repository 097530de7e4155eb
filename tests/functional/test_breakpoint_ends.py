"""Where a cache breakpoint ends, found from the prompt's one build, is where the prompt of
the messages up to it ends (the definition: each built on its own), on real templates.

The tiny model with its own (Jinja, SmolLM2) template, one that renders tools
(Qwen2.5's), and llama.cpp's built-in ChatML (built message by message); with
and without a system prompt, tools, calls and their results in a row, answers
this server gave (their sampled ids recalled) and answers it did not.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.tinymodels import TinyModels, build_tiny_with_template, tiny_config

from localkv.model.session import ModelSession
from localkv.prompt.template import ChatTemplate, Message, ToolCall
from localkv.server.conversation import AnswerMemory, build_prompt
from localkv.server.limits import Budget
from localkv.server.prefixes import Breakpoint, pin_ends

FIXTURES = Path(__file__).parent.parent / "fixtures" / "templates"
TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = ToolCall("call_1", "weather", '{"city": "Paris"}')
CONVERSATIONS = {
    "plain": [
        Message("system", "You answer briefly."),
        Message("user", "What is a note?"),
        Message("assistant", "A short text."),
        Message("user", "And a list?"),
        Message("user", "Say more."),
    ],
    "no system": [
        Message("user", "What is a note?"),
        Message("assistant", "A short text."),
        Message("user", "And a list?"),
    ],
    "tools": [
        Message("system", "You answer briefly."),
        Message("user", "Weather in Paris and Rome?"),
        Message("assistant", "", tool_calls=(CALL,)),
        Message("tool", "Sunny.", tool_call_id="call_1", name="weather"),
        Message("tool", "Rainy.", tool_call_id="call_1", name="weather"),
        Message("user", "Thanks. Tomorrow?"),
    ],
    "tools, no system": [
        Message("user", "Weather in Paris?"),
        Message("assistant", "", tool_calls=(CALL,)),
        Message("tool", "Sunny.", tool_call_id="call_1", name="weather"),
        Message("user", "Thanks."),
    ],
}


@pytest.fixture(scope="module", params=["model", "chatml", "qwen2.5-tools"])
def template(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_models: TinyModels,
) -> Iterator[ChatTemplate]:
    path, override = tiny_models.base, None
    if request.param == "chatml":
        override = "chatml"
    elif request.param != "model":
        source = (FIXTURES / f"{request.param}.jinja").read_text(encoding="utf-8")
        folder = tmp_path_factory.mktemp("templates")
        path = build_tiny_with_template(folder / "tiny.gguf", tiny_models.base, source)
    with ModelSession(tiny_config(path)) as session:
        yield ChatTemplate(session, override)


def _defined_end(
    template: ChatTemplate,
    memory: AnswerMemory,
    messages: list[Message],
    at: int,
    tools: list[dict[str, Any]],
) -> int:
    """The last segment end of the whole prompt within the prompt of ``messages[:at + 1]``."""
    ends = build_prompt(template, messages, memory, Budget(2**20), tools).state.boundaries
    limit = len(
        build_prompt(template, messages[: at + 1], memory, Budget(2**20), tools).state.tokens
    )
    return max((e for e in ends if e <= limit), default=0)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("recalled", [False, True])
def test_each_messages_end_is_that_of_its_own_prompt(
    template: ChatTemplate, name: str, recalled: bool
) -> None:
    messages = CONVERSATIONS[name]
    tools: list[dict[str, Any]] = [TOOL] if "tools" in name else []
    memory = AnswerMemory()
    if recalled:  # this server's answers: their ids as if sampled
        for k, m in enumerate(messages):
            if m.role == "assistant" and m.content:
                before = build_prompt(template, messages[:k], memory, Budget(2**20), tools)
                memory.remember(before.state.tokens, m.content, template.text_tokens(m.content))
    built = build_prompt(template, messages, memory, Budget(2**20), tools)
    for at in range(len(messages) - 1):
        found = pin_ends(built, messages, [Breakpoint(at, 300.0)])
        expected = _defined_end(template, memory, messages, at, tools)
        assert [p.end for p in found] == ([expected] if expected else []), (at, name)
