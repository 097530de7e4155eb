"""Anthropic's Messages API on ``localkv serve``, through the ``anthropic`` SDK, on a real server.

The same engine as the OpenAI and Ollama routes: the same conversation is the
same prompt tokens on all three; ``cache_control`` keeps a prefix pinned for
its time, restored after a restart, with the usage saying how much was read.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import ollama
import pytest
from openai import OpenAI
from support.server import ServerProcess, post
from support.tinymodels import TinyModels

SYSTEM = "You answer questions about the notes. Keep it short."
USER = [{"role": "user", "content": "What is a note?"}]


def tiny_args(tiny_models: TinyModels) -> list[str]:
    return ["--model", str(tiny_models.base), "--threads", "1", "--ctx", "4096"]


def sdk(server: ServerProcess, **kwargs: Any) -> anthropic.Anthropic:
    kwargs.setdefault("api_key", "none")
    return anthropic.Anthropic(base_url=server.base_url, max_retries=0, timeout=300, **kwargs)


def snapshots(server: ServerProcess) -> list[dict[str, Any]]:
    with urllib.request.urlopen(server.base_url + "/v1/localkv/cache", timeout=60) as r:
        data: list[dict[str, Any]] = json.loads(r.read())["data"]
        return data


@pytest.fixture()
def server(tmp_path: Path, tiny_models: TinyModels) -> Iterator[ServerProcess]:
    proc = ServerProcess(tiny_args(tiny_models), tmp_path / "server.log").start()
    yield proc
    assert proc.stop() == 0, proc.log()


def localkv(message: Any) -> dict[str, Any]:
    """The ``localkv`` object the server adds to a message (kept by the SDK as an extra)."""
    extra: dict[str, Any] = message.model_extra["localkv"]
    return extra


def text_of(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_a_cached_system_prompt_is_pinned_and_read_after_a_restart(
    tmp_path: Path, tiny_models: TinyModels, long_text: str
) -> None:
    system = [
        {"type": "text", "text": long_text[:4000]},
        {"type": "text", "text": long_text[4000:9500], "cache_control": {"type": "ephemeral"}},
    ]
    question = [
        {"type": "text", "text": "Summarize.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    ]
    request: dict[str, Any] = {
        "model": "claude-any",
        "max_tokens": 12,
        "extra_body": {"temperature": 0},  # the SDK has no argument for it
        "system": system,
        "messages": [{"role": "user", "content": question}],
    }
    answers, kept = [], []
    for _ in range(2):
        with ServerProcess(tiny_args(tiny_models), tmp_path / "server.log") as proc:
            before = time.time()
            answers.append(sdk(proc).messages.create(**request))
            counted = sdk(proc).messages.count_tokens(
                model="x", system=system, messages=request["messages"]
            )
            kept.append([s for s in snapshots(proc) if s["label"].endswith("· kept")])
    first, second = answers
    assert first.model == "claude-any" and first.type == "message" and first.role == "assistant"
    u1, u2 = first.usage, second.usage
    total = (
        u1.input_tokens + (u1.cache_read_input_tokens or 0) + (u1.cache_creation_input_tokens or 0)
    )
    assert total == counted.input_tokens > 1800
    # nothing to read the first time; everything up to the last breakpoint (the whole
    # prompt: the question has one) is computed and written
    assert (u1.cache_read_input_tokens, u1.cache_creation_input_tokens) == (0, total)
    assert u1.input_tokens == 0 and localkv(first)["cached_tokens"] == 0
    # both breakpoints are pinned snapshots: the system prompt for 5 minutes, the whole
    # prompt for an hour
    pins = sorted((s["tokens"], s["pinned"], s["pinned_until"] - before) for s in kept[0])
    assert [p[:2] for p in pins] == [(pins[0][0], True), (total, True)]
    assert 1800 < pins[0][0] < total
    assert 300 - 60 < pins[0][2] <= 300 + 1 and 3600 - 60 < pins[1][2] <= 3600 + 1
    # after the restart: read from the disk, the rest computed; the same answer
    read = u2.cache_read_input_tokens or 0
    assert read >= 0.9 * total and localkv(second)["source"] == "disk"
    assert u2.cache_creation_input_tokens == total - read and u2.input_tokens == 0
    assert text_of(second) == text_of(first) and second.stop_reason == first.stop_reason
    # the same two snapshots again, their pins extended from the second request on
    again = sorted((s["tokens"], s["pinned_until"]) for s in kept[1])
    assert [t for t, _ in again] == [p[0] for p in pins]
    assert all(u > p[2] + before for (_, u), p in zip(again, pins, strict=True))


def test_streamed_equals_whole_with_each_stop_reason(server: ServerProcess) -> None:
    c = sdk(server)
    base: dict[str, Any] = {"model": "m", "system": SYSTEM, "messages": USER}
    base["extra_body"] = {"temperature": 0}
    whole = c.messages.create(max_tokens=24, **base)
    text = text_of(whole)
    assert whole.stop_reason in ("end_turn", "max_tokens") and text
    assert len(text) >= 3, text
    stop = text[-3:]  # it occurs: the answer ends before its first occurrence
    cases = [
        ({"max_tokens": 24}, whole.stop_reason, None, text),
        ({"max_tokens": 3}, "max_tokens", None, None),
        (
            {"max_tokens": 24, "stop_sequences": [stop]},
            "stop_sequence",
            stop,
            text[: text.index(stop)],
        ),
    ]
    for extra, reason, sequence, expected in cases:
        one = c.messages.create(**base, **extra)
        with c.messages.stream(**base, **extra) as stream:
            deltas = "".join(stream.text_stream)
            streamed = stream.get_final_message()
        assert (one.stop_reason, one.stop_sequence) == (reason, sequence)
        assert (streamed.stop_reason, streamed.stop_sequence) == (reason, sequence)
        assert text_of(streamed) == deltas == text_of(one)
        if expected is not None:
            assert text_of(one) == expected
        assert streamed.usage.output_tokens == one.usage.output_tokens > 0
        assert streamed.usage.cache_read_input_tokens == one.usage.cache_read_input_tokens
        assert streamed.usage.input_tokens == one.usage.input_tokens
    # the raw stream: Anthropic's event types, in order
    raw = {"model": "m", "system": SYSTEM, "messages": USER, "temperature": 0}
    body = json.dumps({**raw, "max_tokens": 5, "stream": True}).encode()
    request = urllib.request.Request(
        server.base_url + "/v1/messages", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        names = [line[7:] for line in r.read().decode().splitlines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "content_block_start"]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_count_tokens_is_the_requests_three_input_figures(server: ServerProcess) -> None:
    c = sdk(server)
    convo = [
        *USER,
        {"role": "assistant", "content": "A short text."},
        {"role": "user", "content": "More?"},
    ]
    counted = c.messages.count_tokens(model="m", system=SYSTEM, messages=convo)
    for _ in range(2):  # the second reads most of the prompt from the live context
        answer = c.messages.create(model="m", max_tokens=4, system=SYSTEM, messages=convo)
        u = answer.usage
        parts = (u.input_tokens, u.cache_read_input_tokens or 0, u.cache_creation_input_tokens)
        assert (
            sum(parts) == counted.input_tokens == localkv(answer)["cached_tokens"] + u.input_tokens
        )
    assert u.cache_read_input_tokens == counted.input_tokens - 1 and u.input_tokens == 1


WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        # bounded values: a tiny random model's call fits in a few tokens
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome"]},
            "days": {"type": "integer", "enum": [1, 2, 3]},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}


def test_a_tool_round_trip_through_the_sdk(server: ServerProcess) -> None:
    c = sdk(server)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    common: dict[str, Any] = {"model": "m", "max_tokens": 48, "tools": [WEATHER]}
    common["extra_body"] = {"temperature": 0}
    called = c.messages.create(messages=ask, tool_choice={"type": "any"}, **common)
    assert called.stop_reason == "tool_use"
    uses = [b for b in called.content if b.type == "tool_use"]
    assert len(uses) >= 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    with c.messages.stream(messages=ask, tool_choice={"type": "any"}, **common) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [
        (b.name, b.input) for b in uses
    ]
    named = c.messages.create(
        messages=ask, tool_choice={"type": "tool", "name": "get_weather"}, **common
    )
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_weather"] * len(
        [b for b in named.content if b.type == "tool_use"]
    ) and named.stop_reason == "tool_use"
    result = {
        "type": "tool_result",
        "tool_use_id": uses[0].id,
        "content": [{"type": "text", "text": "Sunny, 21 degrees."}],
    }
    history = [
        *ask,
        {"role": "assistant", "content": called.content},
        {"role": "user", "content": [result]},
    ]
    answered = c.messages.create(messages=history, tool_choice={"type": "none"}, **common)
    assert answered.stop_reason in ("end_turn", "max_tokens") and text_of(answered)
    assert not [b for b in answered.content if b.type == "tool_use"]
    # the tool call came back as its sampled tokens: the history is read from the live context
    assert localkv(answered)["cached_tokens"] > localkv(called)["cached_tokens"]
    failed = {**result, "content": "the city is unknown", "is_error": True}
    again = c.messages.create(
        messages=[*history[:2], {"role": "user", "content": [failed]}], max_tokens=4, model="m"
    )
    assert again.usage.output_tokens > 0


def test_one_conversation_is_the_same_prompt_tokens_on_three_protocols(
    server: ServerProcess,
) -> None:
    convo = [
        {"role": "user", "content": "What is a note?"},
        {"role": "assistant", "content": "A short text you keep."},
        {"role": "user", "content": "And a list?"},
    ]
    openai = OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=300)
    first = openai.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": SYSTEM}, *convo],  # type: ignore[list-item]
        temperature=0,
        max_tokens=12,
    )
    assert first.usage is not None
    n = first.usage.prompt_tokens
    second = sdk(server).messages.create(
        model="tiny",
        system=SYSTEM,
        messages=convo,  # type: ignore[arg-type]
        max_tokens=12,
        extra_body={"temperature": 0},
    )
    third = ollama.Client(host=server.base_url, timeout=300).chat(
        model="tiny",
        messages=[{"role": "system", "content": SYSTEM}, *convo],
        options={"temperature": 0, "num_predict": 12},
        stream=False,
    )
    u = second.usage
    assert u.input_tokens + (u.cache_read_input_tokens or 0) == n == third.prompt_eval_count
    # each request after the first found its whole prompt at the start of the live
    # context (no divergence: the same token ids) and read all of it but the last token
    assert (localkv(second)["diverged_at"], u.cache_read_input_tokens) == (None, n - 1)
    raw = post(
        server,
        "/api/chat",
        json.dumps(
            {
                "messages": [{"role": "system", "content": SYSTEM}, *convo],
                "options": {"temperature": 0, "num_predict": 12},
                "stream": False,
            }
        ).encode(),
    )[1]
    assert (raw["localkv"]["diverged_at"], raw["prompt_eval_cached_count"]) == (None, n - 1)
    assert text_of(second) == first.choices[0].message.content == third.message.content


def test_bad_requests_get_anthropics_errors_and_the_server_goes_on(server: ServerProcess) -> None:
    c = sdk(server)
    good: dict[str, Any] = {"model": "m", "max_tokens": 4, "messages": USER}
    bad = [
        ({"model": "m", "messages": USER}, "max_tokens"),
        ({**good, "messages": [{"role": "system", "content": "hi"}]}, "role"),
        ({**good, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, "video"),
        (
            {**good, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "image",
        ),
        ({**good, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
        (
            {**good, "system": [{"type": "text", "text": "x", "cache_control": {"type": "long"}}]},
            "cache_control",
        ),
    ]
    for body, says in bad:
        with pytest.raises(anthropic.BadRequestError) as raised:
            # the SDK's own request path (``create`` refuses a body without max_tokens itself)
            c.post("/v1/messages", cast_to=anthropic.types.Message, body=body)
        assert raised.value.status_code == 400 and says in raised.value.message
        assert raised.value.body == {
            "type": "error",
            "error": {
                "type": "invalid_request_error",
                "message": raised.value.body["error"]["message"],
            },
        }
        assert c.messages.create(**good).usage.output_tokens > 0  # still answering
    status, error = post(server, "/v1/messages/nothing", b"{}")
    assert (
        status == 404 and error["type"] == "error" and error["error"]["type"] == "not_found_error"
    )
    status, error = post(server, "/v1/messages", b'{"model": ')
    assert status == 400 and error["error"]["type"] == "invalid_request_error"


def kept(server: ServerProcess) -> list[tuple[int, bool]]:
    found = [s for s in snapshots(server) if s["label"].endswith("· kept")]
    return sorted((s["tokens"], s["pinned"]) for s in found)


def test_a_breakpoint_on_an_earlier_message_keeps_the_prompt_to_its_segment_end(
    server: ServerProcess,
) -> None:
    c = sdk(server)
    marked = {"type": "text", "text": "What is a note?", "cache_control": {"type": "ephemeral"}}
    # the prompt of the first message alone: it ends with the assistant's opening
    first = c.messages.count_tokens(model="m", system=SYSTEM, messages=USER).input_tokens
    answer = text_of(c.messages.create(model="m", max_tokens=4, system=SYSTEM, messages=USER))
    convo = [
        {"role": "user", "content": [marked]},
        {"role": "assistant", "content": answer},  # this server's answer: its sampled tokens
        {"role": "user", "content": "More?"},
    ]
    r = c.messages.create(model="m", max_tokens=4, system=SYSTEM, messages=convo)
    assert kept(server) == [(first, True)]  # the segment of that message ends there
    total = c.messages.count_tokens(model="m", system=SYSTEM, messages=convo).input_tokens
    u = r.usage
    assert (u.cache_creation_input_tokens, u.cache_read_input_tokens) == (
        0,
        localkv(r)["cached_tokens"],
    )  # read: the first turn is in the live context
    assert u.input_tokens == total - localkv(r)["cached_tokens"] > 0
    # an answer this server did not give joins its question's segment: the breakpoint
    # on that question is rounded down to the segment end before it, the system prompt's
    other = "You answer questions about the lists."
    foreign = [convo[0], {"role": "assistant", "content": "A short text."}, convo[2]]
    r = c.messages.create(model="m", max_tokens=4, system=other, messages=foreign)
    system_end = [t for t, _ in kept(server) if t != first]
    assert len(system_end) == 1 and 0 < system_end[0] < first
    created = system_end[0] - localkv(r)["cached_tokens"]
    assert r.usage.cache_creation_input_tokens == created > 0


def test_the_key_is_taken_as_x_api_key_or_a_bearer_token(
    tmp_path: Path, tiny_models: TinyModels
) -> None:
    args = [*tiny_args(tiny_models), "--api-key", "s3cret"]
    good: dict[str, Any] = {"model": "m", "max_tokens": 3, "messages": USER}
    with ServerProcess(args, tmp_path / "server.log") as proc:
        with pytest.raises(anthropic.AuthenticationError) as raised:
            sdk(proc, api_key="wrong").messages.create(**good)
        assert raised.value.status_code == 401
        assert raised.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        status, error = post(proc, "/v1/messages", json.dumps(good).encode())
        assert (status, error["error"]["type"]) == (401, "authentication_error")
        assert sdk(proc, api_key="s3cret").messages.create(**good).usage.output_tokens > 0
        bearer = sdk(proc, api_key=None, auth_token="s3cret")  # Authorization: Bearer
        assert bearer.messages.create(**good).usage.output_tokens > 0
        counted = bearer.messages.count_tokens(model="m", messages=USER)
        assert counted.input_tokens > 0


def test_a_body_over_the_limit_is_request_too_large(
    tmp_path: Path, tiny_models: TinyModels
) -> None:
    args = [*tiny_args(tiny_models), "--max-body", "4096"]
    with ServerProcess(args, tmp_path / "server.log") as proc:
        c = sdk(proc)
        big = [{"role": "user", "content": "x " * 4000}]
        with pytest.raises(anthropic.APIStatusError) as raised:
            c.messages.create(model="m", max_tokens=3, messages=big)
        assert raised.value.status_code == 413
        assert raised.value.body["error"]["type"] == "request_too_large"  # type: ignore[index]
        assert c.messages.create(model="m", max_tokens=3, messages=USER).usage.output_tokens > 0
