"""The OpenAI Responses API of ``localkv serve``, through the ``openai`` SDK, on a real server.

``/v1/responses`` is the chat request of ``/v1/chat/completions`` in another shape:
the same conversation is the same prompt tokens and reuses the same cache, a
stream joins to the whole response, and a long prompt is served from the disk
cache after a restart, its count in ``input_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from openai import OpenAI
from support.server import ServerProcess
from support.tinymodels import TinyModels, build_tiny_with_template

SYSTEM = "You answer questions about the notes. Keep it short."
FIXED: dict[str, Any] = {"temperature": 0, "extra_body": {"seed": 7}}
FIXTURES = Path(__file__).parent.parent / "fixtures" / "templates"
# a schema whose every answer is short: the grammar ends it, so the response completes
YES_NO = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": WEATHER,
        "strict": True,
    },
    {
        "type": "function",
        "name": "get_time",
        "description": "The local time in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
]
CHAT_TOOLS = [
    {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
    for t in TOOLS
]


def tiny_args(model: Path) -> list[str]:
    return ["--model", str(model), "--threads", "1", "--ctx", "2048"]


def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture()
def server(tmp_path: Path, tiny_models: TinyModels) -> Iterator[ServerProcess]:
    proc = ServerProcess(tiny_args(tiny_models.base), tmp_path / "server.log").start()
    yield proc
    assert proc.stop() == 0, proc.log()


def streamed(c: OpenAI, **fields: Any) -> list[Any]:
    """The events of a streamed ``create``, in order, numbered from 0 one by one."""
    events = list(c.responses.create(model="tiny", stream=True, **fields))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    return events


def deltas(events: list[Any], kind: str) -> str:
    return "".join(e.delta for e in events if e.type == kind)


def post(server: ServerProcess, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        server.base_url + "/v1/responses",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_stream_joins_to_the_whole_response_with_the_same_usage(server: ServerProcess) -> None:
    c = client(server)
    ask: dict[str, Any] = {
        "instructions": SYSTEM,
        "input": "Is a note short?",
        "text": {"format": {"type": "json_schema", "name": "yes_no", "schema": YES_NO}},
        "max_output_tokens": 60,
        **FIXED,
    }
    whole = c.responses.create(model="tiny", **ask)
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.status == "completed" and whole.incomplete_details is None
    assert whole.model == "tiny-base" and whole.created_at > 0
    (message,) = whole.output
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "completed" and message.id.startswith("msg_")
    assert [p.type for p in message.content] == ["output_text"]
    jsonschema.validate(json.loads(whole.output_text), YES_NO)
    usage = whole.usage
    assert usage is not None and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0

    events = streamed(c, **ask)
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert deltas(events, "response.output_text.delta") == whole.output_text
    final = events[-1].response
    assert events[-4].text == whole.output_text and events[-4].item_id == final.output[0].id
    assert final.output_text == whole.output_text and final.id == events[0].response.id
    assert final.usage is not None
    # the same prompt again: all but the last token reused from the live context
    assert final.usage.input_tokens == usage.input_tokens
    assert final.usage.output_tokens == usage.output_tokens
    assert final.usage.input_tokens_details.cached_tokens >= usage.input_tokens - 1
    with c.responses.stream(model="tiny", **ask) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        helper = stream.get_final_response()
    assert text == helper.output_text == whole.output_text
    assert helper.usage is not None and helper.usage.output_tokens == usage.output_tokens


def test_a_cut_answer_is_incomplete_streamed_or_not(server: ServerProcess) -> None:
    c = client(server)
    ask: dict[str, Any] = {"input": "Tell me about the notes.", "max_output_tokens": 9, **FIXED}
    whole = c.responses.create(model="tiny", **ask)
    assert whole.status == "incomplete" and whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage is not None and whole.usage.output_tokens == 9
    assert whole.output[0].status == "incomplete" and whole.max_output_tokens == 9
    events = streamed(c, **ask)
    assert events[-1].type == "response.incomplete"
    assert deltas(events, "response.output_text.delta") == whole.output_text
    final = events[-1].response
    assert final.status == "incomplete" and final.output_text == whole.output_text
    assert final.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        whole.usage.input_tokens,
        whole.usage.output_tokens,
    )


def test_a_restart_serves_long_instructions_from_the_disk_cache(
    tmp_path: Path, tiny_models: TinyModels, long_text: str
) -> None:
    ask: dict[str, Any] = {
        "instructions": long_text[:6000],
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Summarize."}]}],
        "max_output_tokens": 12,
        **FIXED,
    }
    answers = []
    for _ in range(2):
        with ServerProcess(tiny_args(tiny_models.base), tmp_path / "server.log") as proc:
            answers.append(client(proc).responses.create(model="tiny", **ask))
    first, second = answers
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens == first.usage.input_tokens > 1000
    assert first.usage.input_tokens_details.cached_tokens == 0
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= 0.9 * second.usage.input_tokens, (cached, second.usage.input_tokens)
    localkv = (second.model_extra or {})["localkv"]
    assert localkv["source"] == "disk" and localkv["verified"] is True
    assert localkv["cached_tokens"] == cached
    assert second.output_text == first.output_text and first.output_text


def test_the_same_conversation_is_the_same_tokens_as_chat_completions(
    server: ServerProcess, long_text: str
) -> None:
    notes = long_text[:3000]
    chat = [
        {"role": "system", "content": notes},
        {"role": "user", "content": "Who is by the bank?"},
        {"role": "assistant", "content": "Alice is."},
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": "And her sister?"},
    ]
    items: list[Any] = [
        {"role": "user", "content": "Who is by the bank?"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Alice is."}],
        },
        {"role": "developer", "content": "Answer in one word."},
        {"type": "message", "role": "user", "content": "And her sister?"},
    ]
    c = client(server)
    completion = c.chat.completions.create(
        model="tiny", messages=chat, max_tokens=8, temperature=0, seed=7
    )  # type: ignore[call-overload]
    response = c.responses.create(
        model="tiny", instructions=notes, input=items, max_output_tokens=8, **FIXED
    )
    assert completion.usage is not None and response.usage is not None
    assert response.usage.input_tokens == completion.usage.prompt_tokens > 600
    assert response.output_text == completion.choices[0].message.content
    # one engine: the Responses request reuses the chat request's blocks
    cached = response.usage.input_tokens_details.cached_tokens
    assert cached >= response.usage.input_tokens - 1
    assert (response.model_extra or {})["localkv"]["source"] == "live"
    # the instructions are in the prompt, not dropped
    without = c.responses.create(model="tiny", input=items, max_output_tokens=1, **FIXED)
    assert without.usage is not None and without.usage.input_tokens + 600 < cached


def test_a_function_call_round_trip(server: ServerProcess) -> None:
    c = client(server)
    ask: dict[str, Any] = {"tools": TOOLS, "max_output_tokens": 60, **FIXED}
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = c.responses.create(model="tiny", input=question, tool_choice="required", **ask)
    assert first.status == "completed"
    calls = [item for item in first.output if item.type == "function_call"]
    assert [i.type for i in first.output] == ["function_call"]  # no text beside the call
    (call,) = calls
    assert call.call_id.startswith("call_") and call.id == "fc_" + call.call_id[5:]
    assert call.status == "completed" and call.name in ("get_weather", "get_time")
    tool = next(t for t in TOOLS if t["name"] == call.name)
    jsonschema.validate(json.loads(call.arguments), tool["parameters"])

    events = streamed(c, input=question, tool_choice="required", **ask)
    assert [e.type for e in events[2:]] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[2].item.status == "in_progress" and events[2].item.arguments == ""
    assert events[-2].item.arguments == call.arguments and events[-2].item.status == "completed"
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, e.arguments) for e in done] == [(call.name, call.arguments)]
    assert deltas(events, "response.function_call_arguments.delta") == call.arguments
    assert events[-1].type == "response.completed"

    named = c.responses.create(
        model="tiny", input=question, tool_choice={"type": "function", "name": "get_weather"}, **ask
    )
    (named_call,) = [i for i in named.output if i.type == "function_call"]
    assert named_call.name == "get_weather"
    jsonschema.validate(json.loads(named_call.arguments), WEATHER)

    result = '{"temp_c": 18, "sky": "clear"}'
    history = [
        *question,
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": result},
    ]
    answer = c.responses.create(model="tiny", input=history, tool_choice="none", **ask)
    assert answer.output_text and [i.type for i in answer.output] == ["message"]
    # the same round trip through /v1/chat/completions: the same prompt tokens and answer
    chat_call = {
        "id": call.call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    messages = [
        *question,
        {"role": "assistant", "content": None, "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result},
    ]
    completion = c.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        tools=CHAT_TOOLS,  # type: ignore[arg-type]
        tool_choice="none",
        max_tokens=60,
        temperature=0,
        seed=7,
    )
    assert completion.usage is not None and answer.usage is not None
    assert answer.usage.input_tokens == completion.usage.prompt_tokens
    assert answer.output_text == completion.choices[0].message.content
    # the call and its output are in the prompt, not dropped
    assert first.usage is not None and first.usage.input_tokens + 10 < answer.usage.input_tokens
    # a message before the call is the same assistant turn, as chat's content beside tool_calls
    said = {"type": "message", "role": "assistant", "content": "Let me look."}
    turn = c.responses.create(
        model="tiny",
        input=[*history[:1], said, *history[1:]],
        tools=TOOLS,
        max_output_tokens=1,
        **FIXED,
    )
    one = [*messages[:1], {**messages[1], "content": "Let me look."}, *messages[2:]]
    chat_turn = c.chat.completions.create(
        model="tiny",
        messages=one,
        tools=CHAT_TOOLS,
        max_tokens=1,  # type: ignore[arg-type]
    )
    assert turn.usage is not None and chat_turn.usage is not None
    assert turn.usage.input_tokens == chat_turn.usage.prompt_tokens > answer.usage.input_tokens


def test_json_object_and_schema_formats_hold(server: ServerProcess) -> None:
    c = client(server)
    schema = {"type": "json_schema", "name": "yes_no", "schema": YES_NO, "strict": True}
    r = c.responses.create(
        model="tiny", input="Yes or no?", text={"format": schema}, max_output_tokens=60, **FIXED
    )
    assert r.status == "completed" and r.text is not None and r.text.format is not None
    assert r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), YES_NO)
    anything = c.responses.create(
        model="tiny",
        input="Some JSON?",
        text={"format": {"type": "json_object"}},
        max_output_tokens=24,
        **FIXED,
    )
    assert anything.output_text.lstrip().startswith("{")


def test_reasoning_is_a_reasoning_item_streamed_or_not(
    tmp_path: Path, default_model_path: Path
) -> None:
    """DeepSeek-R1's template opens the answer inside ``<think>``: its text is reasoning."""
    source = (FIXTURES / "deepseek-r1-distill-qwen.jinja").read_text(encoding="utf-8")
    model = build_tiny_with_template(tmp_path / "r1", default_model_path, source)
    ask: dict[str, Any] = {"input": "Why is the sky blue?", "max_output_tokens": 12, **FIXED}
    with ServerProcess(tiny_args(model), tmp_path / "server.log") as proc:
        c = client(proc)
        whole = c.responses.create(model="r1", **ask)
        events = streamed(c, **ask)
    reasoning = whole.output[0]
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.content is not None
    text = "".join(part.text for part in reasoning.content)
    assert text and whole.usage is not None
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens <= whole.usage.output_tokens
    assert deltas(events, "response.reasoning_text.delta") == text
    final = events[-1].response
    assert [i.type for i in final.output] == [i.type for i in whole.output]
    assert final.usage is not None
    assert final.usage.output_tokens_details.reasoning_tokens == (
        whole.usage.output_tokens_details.reasoning_tokens
    )


# a template that renders an assistant's reasoning_content, earlier turns' too
REASONING_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n"
    "{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif -%}"
    "{{ m.content }}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)


def test_reasoning_items_go_back_as_the_assistants_reasoning(
    tmp_path: Path, default_model_path: Path
) -> None:
    model = build_tiny_with_template(tmp_path / "m", default_model_path, REASONING_TEMPLATE)
    thought = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "The notes say Alice."}],
    }
    said = {"type": "message", "role": "assistant", "content": "Alice is."}
    call = {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": "{}"}
    ask = [{"role": "user", "content": "Who?"}]
    later = [{"role": "user", "content": "Sure?"}]
    output = [{"type": "function_call_output", "call_id": "call_1", "output": "noon"}]
    chat_call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_time", "arguments": "{}"},
    }
    reasoned = {"role": "assistant", "reasoning_content": "The notes say Alice."}
    pairs = [  # (Responses input, the chat messages it is)
        ([*ask, thought, said, *later], [*ask, {**reasoned, "content": "Alice is."}, *later]),
        (
            [*ask, thought, call, *output],
            [
                *ask,
                {**reasoned, "content": None, "tool_calls": [chat_call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
            ],
        ),
    ]
    with ServerProcess(tiny_args(model), tmp_path / "server.log") as proc:
        c = client(proc)
        for items, messages in pairs:
            r = c.responses.create(
                model="m", input=items, tools=TOOLS, max_output_tokens=1, **FIXED
            )
            chat = c.chat.completions.create(
                model="m",
                messages=messages,
                tools=CHAT_TOOLS,
                max_tokens=1,  # type: ignore[arg-type]
            )
            without = c.responses.create(
                model="m",
                input=[i for i in items if i is not thought],
                tools=TOOLS,
                max_output_tokens=1,
            )
            assert r.usage is not None and chat.usage is not None and without.usage is not None
            assert r.usage.input_tokens == chat.usage.prompt_tokens
            assert r.usage.input_tokens > without.usage.input_tokens + 4  # it is in the prompt


BAD: list[tuple[dict[str, Any], str, str, str | None]] = [
    # (the request's fields, the error's param, what its message says, its code)
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0]",
        "images",
        "unsupported_content",
    ),
    ({"input": "hi", "tools": [{"type": "custom", "name": "x"}]}, "tools[0]", "'custom'", None),
    ({"input": "hi", "tools": CHAT_TOOLS}, "tools[0]", "flat", None),
    (
        {"input": "hi", "tools": [{"type": "function", "name": ""}]},
        "tools[0].name",
        "1 to 64 letters",
        None,
    ),
    (
        {"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]},
        "input[0].type",
        "'computer_call_output'",
        None,
    ),
    (
        {"input": "hi", "extra_body": {"frobnicate": 1}},
        "frobnicate",
        "Unknown",
        "unknown_parameter",
    ),
    (
        {"input": "hi", "previous_response_id": "resp_1"},
        "previous_response_id",
        "stateless",
        "unsupported_parameter",
    ),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice", "needs 'tools'", None),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens", None),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format", "text.format", None),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role", "'wizard'", None),
    ({"input": [{"role": "assistant", "content": "x"}]}, "input[0]", "must end", None),
    ({"input": []}, "input", "non-empty", None),
]


def test_bad_requests_get_openai_errors_and_the_server_goes_on(server: ServerProcess) -> None:
    c = client(server)
    for fields, param, says, code in BAD:
        with pytest.raises(openai.BadRequestError) as raised:
            c.responses.create(model="tiny", **fields)
        error = raised.value
        assert error.status_code == 400 and error.param == param, error
        assert isinstance(error.body, dict), error
        assert set(error.body) == {"message", "type", "param", "code"}
        assert says in error.body["message"] and error.code == code, error
        assert error.type == "invalid_request_error"
        after = c.responses.create(model="tiny", input="Hi", max_output_tokens=1)
        assert after.usage is not None and after.usage.output_tokens == 1  # still answering
    status, body = post(server, {"input": "hi", "store": True, "metadata": {"k": 5}})
    assert status == 400 and body["error"]["param"] == "metadata"
    accepted = {"store": True, "metadata": {"k": "v"}, "reasoning": {"effort": "low"}}
    status, body = post(server, {"input": "hi", "max_output_tokens": 1, **accepted})
    assert status == 200 and body["metadata"] == {"k": "v"} and body["store"] is False
    with pytest.raises(openai.APIStatusError) as too_long:
        c.responses.create(model="tiny", input="word " * 40000, stream=True)
    assert too_long.value.status_code == 413
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve("resp_1")


def test_a_missing_key_is_a_401(tmp_path: Path, tiny_models: TinyModels) -> None:
    args = [*tiny_args(tiny_models.base), "--api-key", "s3cret"]
    with ServerProcess(args, tmp_path / "server.log") as proc:
        with pytest.raises(openai.AuthenticationError):
            client(proc).responses.create(model="tiny", input="hi")
        keyed = OpenAI(base_url=proc.base_url + "/v1", api_key="s3cret", max_retries=0)
        r = keyed.responses.create(model="tiny", input="hi", max_output_tokens=2)
        assert r.usage is not None and r.usage.output_tokens == 2
