"""Tools and reasoning through the OpenAI SDK against a real server process.

The default model (SmolLM2, whose template renders no tools) gets the tools in a
system preamble; ``tool_choice="required"`` constrains its answer by the tool's
schema, so even this small model returns a call whose arguments validate.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from openai import OpenAI
from support.server import ServerProcess
from support.tinymodels import build_tiny_with_template

FIXTURES = Path(__file__).parent.parent / "fixtures" / "templates"

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
]
MESSAGES: list[Any] = [
    {"role": "system", "content": "You are a weather assistant. " * 40},
    {"role": "user", "content": "What is the weather in Paris right now?"},
]


def _client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=600)


def _ask(client: OpenAI, messages: list[Any], **fields: Any) -> Any:
    return client.chat.completions.create(
        model="default", messages=messages, tools=TOOLS, temperature=0, max_tokens=60, **fields
    )


def _streamed(client: OpenAI, messages: list[Any], **fields: Any) -> dict[str, Any]:
    """A stream gathered as OpenAI's SDK users gather it: calls by ``index``."""
    calls: dict[int, dict[str, str]] = {}
    content, finish = "", None
    for chunk in _ask(client, messages, stream=True, **fields):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            slot = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            slot["id"] += call.id or ""
            if call.function is not None:
                slot["name"] += call.function.name or ""
                slot["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish": finish}


@pytest.mark.default_model
def test_required_tool_call_validates_answers_and_is_cached_after_restart(
    tmp_path: Path, default_model_path: Path
) -> None:
    args = ["--model", str(default_model_path), "--threads", "2", "--ctx", "4096"]
    env = {"LOCALKV_HOME": str(tmp_path / "home")}
    with ServerProcess(args, tmp_path / "server.log", env=env) as server:
        client = _client(server)
        first = _ask(client, MESSAGES, tool_choice="required")
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in ("get_weather", "get_time")
        arguments = json.loads(call.function.arguments)
        schema = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(arguments, schema["function"]["parameters"])

        streamed = _streamed(client, MESSAGES, tool_choice="required")
        assert streamed["finish"] == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == [
            (call.function.name, call.function.arguments)
        ]
        assert streamed["calls"][0]["id"].startswith("call_")

        named = _ask(
            client,
            MESSAGES,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
        (named_call,) = named.choices[0].message.tool_calls
        assert named_call.function.name == "get_weather"
        jsonschema.validate(json.loads(named_call.function.arguments), WEATHER_PARAMETERS)

        result = [
            *MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18, "sky": "clear"}'},
        ]
        answer = _ask(client, result, tool_choice="none")
        assert answer.choices[0].message.content
        assert not answer.choices[0].message.tool_calls
        assert answer.choices[0].finish_reason in ("stop", "length")
    prompt_tokens = first.usage.prompt_tokens
    with ServerProcess(args, tmp_path / "server2.log", env=env) as server:
        again = _ask(_client(server), MESSAGES, tool_choice="required")
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert again.usage.prompt_tokens == prompt_tokens
    assert cached >= 0.9 * prompt_tokens, (cached, prompt_tokens)
    print(f"prompt {prompt_tokens} tokens, {cached} cached after the restart; call {call.function}")
    (again_call,) = again.choices[0].message.tool_calls
    assert (again_call.function.name, again_call.function.arguments) == (
        call.function.name,
        call.function.arguments,
    )


@pytest.mark.default_model
def test_bad_tools_are_400s_naming_the_field(tmp_path: Path, default_model_path: Path) -> None:
    args = ["--model", str(default_model_path), "--threads", "1", "--ctx", "1024"]
    with ServerProcess(args, tmp_path / "server.log") as server:
        client = _client(server)
        cases: list[tuple[dict[str, Any], str]] = [
            ({"tools": [{"type": "function"}]}, "tools[0].function"),
            ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
             "'x', which is not in 'tools'"),
            ({"tool_choice": "required"}, "'tool_choice' needs 'tools'"),
            ({"functions": [{"name": "f"}]}, "give 'tools' instead"),
        ]  # fmt: skip
        for fields, says in cases:
            with pytest.raises(Exception) as raised:
                client.chat.completions.create(
                    model="default", messages=MESSAGES, max_tokens=1, **fields
                )
            assert getattr(raised.value, "status_code", None) == 400, raised.value
            assert says in str(raised.value)


def test_reasoning_goes_to_reasoning_content_streamed_or_not(
    tmp_path: Path, default_model_path: Path
) -> None:
    """DeepSeek-R1's template opens the answer inside ``<think>``: the answer's text is
    reasoning until the model closes it, and the next turn drops it from the history."""
    source = (FIXTURES / "deepseek-r1-distill-qwen.jinja").read_text(encoding="utf-8")
    model = build_tiny_with_template(tmp_path / "r1", default_model_path, source)
    args = ["--model", str(model), "--threads", "1", "--ctx", "2048"]
    body: dict[str, Any] = {"model": "r1", "temperature": 0, "max_tokens": 12, "seed": 3}
    with ServerProcess(args, tmp_path / "server.log") as server:
        client = _client(server)
        first = client.chat.completions.create(messages=MESSAGES, **body)
        message = first.choices[0].message
        reasoning = (message.model_extra or {})["reasoning_content"]
        assert first.usage.completion_tokens > 0 and reasoning and message.content == ""
        streamed_reasoning, streamed_content = "", ""
        for chunk in client.chat.completions.create(messages=MESSAGES, stream=True, **body):
            if chunk.choices:
                delta = chunk.choices[0].delta
                streamed_reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
                streamed_content += delta.content or ""
        assert (streamed_reasoning, streamed_content) == (reasoning, "")
        history = [
            *MESSAGES,
            {"role": "assistant", "content": "Sunny.", "reasoning_content": reasoning},
            {"role": "user", "content": "And tomorrow?"},
        ]
        second = client.chat.completions.create(messages=history, **body)
    cached = second.usage.prompt_tokens_details.cached_tokens
    diverged = (second.model_extra or {})["localkv"]["diverged_at"]
    # the template dropped the earlier reasoning: the prompt's prefix before it is reused
    assert diverged is not None and diverged < first.usage.prompt_tokens
    assert 0 < cached <= diverged
