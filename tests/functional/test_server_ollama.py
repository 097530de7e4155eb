"""The Ollama API of ``localkv serve``, through the ``ollama`` client, on a real server.

The same engine as the OpenAI routes: the same conversation through ``/api/chat``
and ``/v1/chat/completions`` is the same answer, and a long prompt is served from
the disk cache after a restart with its cached count in Ollama's field.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ollama
import pytest
from openai import OpenAI
from support.server import ServerProcess, post
from support.tinymodels import TinyModels

SYSTEM = "You answer questions about the notes. Keep it short."
OPTIONS = {"temperature": 0, "seed": 7, "num_predict": 12}


def tiny_args(tiny_models: TinyModels) -> list[str]:
    return ["--model", str(tiny_models.base), "--threads", "1", "--ctx", "2048"]


def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=300)


def post_lines(server: ServerProcess, body: dict[str, Any]) -> list[dict[str, Any]]:
    """``/api/chat`` streamed: its NDJSON lines, each a JSON object."""
    request = urllib.request.Request(
        server.base_url + "/api/chat",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as r:
        assert r.headers["Content-Type"].startswith("application/x-ndjson")
        return [json.loads(line) for line in r.read().splitlines()]


def get(server: ServerProcess, path: str) -> tuple[int, dict[str, Any]]:
    with urllib.request.urlopen(server.base_url + path, timeout=60) as r:
        return r.status, json.loads(r.read())


@pytest.fixture()
def server(tmp_path: Path, tiny_models: TinyModels) -> Iterator[ServerProcess]:
    proc = ServerProcess(tiny_args(tiny_models), tmp_path / "server.log").start()
    yield proc
    assert proc.stop() == 0, proc.log()


def ollama_client(server: ServerProcess) -> ollama.Client:
    return ollama.Client(host=server.base_url, timeout=300)


def messages(user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def test_list_show_version_and_ps_describe_the_loaded_model(server: ServerProcess) -> None:
    c = ollama_client(server)
    models = c.list().models
    assert [m.model for m in models] == ["tiny-base"]
    card = models[0]
    assert card.size is not None and card.size > 0
    assert card.details is not None and card.details.format == "gguf"
    assert card.details.family  # the GGUF's architecture
    shown = c.show("any-name-is-the-loaded-model")
    assert shown.details is not None and shown.details.format == "gguf"
    assert shown.modelinfo is not None and shown.modelinfo["general.architecture"]
    assert shown.modelinfo["general.parameter_count"] > 0
    assert [m.model for m in c.ps().models] == ["tiny-base"]
    status, version = get(server, "/api/version")
    assert status == 200 and isinstance(version["version"], str)


def test_show_gives_a_built_in_formats_name_as_text(
    tmp_path: Path, tiny_models: TinyModels
) -> None:
    args = [*tiny_args(tiny_models), "--chat-template", "chatml"]
    with ServerProcess(args, tmp_path / "chatml.log") as proc:
        shown = ollama_client(proc).show("tiny")
    assert shown.template == "chatml"


def test_chat_streamed_equals_chat_whole_and_the_openai_route(server: ServerProcess) -> None:
    c = ollama_client(server)
    whole = c.chat(
        model="tiny", messages=messages("What is a note?"), options=OPTIONS, stream=False
    )
    pieces = list(
        c.chat(model="tiny", messages=messages("What is a note?"), options=OPTIONS, stream=True)
    )
    assert whole.done and whole.message.role == "assistant" and whole.message.content
    assert "".join(p.message.content or "" for p in pieces) == whole.message.content
    assert [p.done for p in pieces] == [False] * (len(pieces) - 1) + [True]
    last = pieces[-1]
    assert last.done_reason in ("stop", "length")
    assert last.prompt_eval_count == whole.prompt_eval_count and whole.prompt_eval_count
    assert last.eval_count == whole.eval_count and whole.eval_count
    assert whole.total_duration and whole.eval_duration is not None
    # the client keeps no unknown fields: the raw lines carry the cached count
    lines = post_lines(server, {"messages": messages("What is a note?"), "options": OPTIONS})
    assert [line["done"] for line in lines] == [p.done for p in pieces]
    assert set(lines[0]) == {"model", "created_at", "message", "done"}
    assert lines[-1]["prompt_eval_cached_count"] >= lines[-1]["prompt_eval_count"] - 1
    assert lines[-1]["prompt_eval_count"] == whole.prompt_eval_count
    openai = client(server).chat.completions.create(
        model="tiny", messages=messages("What is a note?"), temperature=0, seed=7, max_tokens=12
    )  # type: ignore[call-overload]
    assert openai.choices[0].message.content == whole.message.content
    # one request to one engine: the same prompt tokens, reused from the Ollama turn
    assert openai.usage is not None and openai.usage.prompt_tokens == whole.prompt_eval_count
    details = openai.usage.prompt_tokens_details
    assert details is not None and (details.cached_tokens or 0) >= openai.usage.prompt_tokens - 1


def test_generate_is_the_chat_of_one_user_message_and_raw_is_a_completion(
    server: ServerProcess,
) -> None:
    c = ollama_client(server)
    generated = c.generate(model="tiny", prompt="What is a note?", system=SYSTEM, options=OPTIONS)
    chat = c.chat(model="tiny", messages=messages("What is a note?"), options=OPTIONS)
    assert generated.done and generated.response == chat.message.content
    streamed = list(
        c.generate(
            model="tiny", prompt="What is a note?", system=SYSTEM, options=OPTIONS, stream=True
        )
    )
    assert "".join(p.response for p in streamed) == generated.response
    raw = c.generate(model="tiny", prompt="The notes say", raw=True, options=OPTIONS)
    completion = client(server).completions.create(
        model="tiny", prompt="The notes say", temperature=0, seed=7, max_tokens=12
    )
    assert raw.response == completion.choices[0].text


def test_format_json_is_an_object(server: ServerProcess) -> None:
    c = ollama_client(server)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = c.chat(
        model="tiny",
        messages=messages("A number?"),
        options={"temperature": 0, "num_predict": 40},
        format=schema,
    )
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.message.content or "")["n"], int)
    assert (r.message.content or "").lstrip().startswith("{")


def test_a_restart_serves_a_long_prompt_from_the_cache_with_its_count(
    tmp_path: Path, tiny_models: TinyModels, long_text: str
) -> None:
    convo = [
        {"role": "system", "content": long_text[:6000]},
        {"role": "user", "content": "Summarize."},
    ]
    body = json.dumps({"model": "any", "messages": convo, "options": OPTIONS, "stream": False})
    answers = []
    for _ in range(2):
        with ServerProcess(tiny_args(tiny_models), tmp_path / "server.log") as proc:
            status, answer = post(proc, "/api/chat", body.encode())
            assert status == 200, answer
            answers.append(answer)
    first, second = answers
    assert second["prompt_eval_count"] > 1000 and first["prompt_eval_cached_count"] == 0
    assert second["prompt_eval_cached_count"] >= 0.9 * second["prompt_eval_count"]
    assert second["localkv"]["source"] == "disk" and second["localkv"]["verified"] is True
    assert second["message"]["content"] == first["message"]["content"]
    # a prompt that differs from its first message on reuses nothing of it
    changed = [{"role": "system", "content": "X" + long_text[1:6000]}, convo[1]]
    with ServerProcess(tiny_args(tiny_models), tmp_path / "server.log") as proc:
        body = {"messages": changed, "options": OPTIONS, "stream": False}
        status, other = post(proc, "/api/chat", json.dumps(body).encode())
    assert status == 200 and other["prompt_eval_count"] > 1000
    assert other["prompt_eval_cached_count"] < 0.1 * other["prompt_eval_count"]


BAD_CHATS = [
    (b'{"messages": [', "not valid JSON"),
    (b'{"model": "tiny"}', "'messages'"),
    (b'{"messages": [{"role": "wizard", "content": "hi"}]}', "wizard"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "format": 3}', "'format'"),
    (
        b'{"messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": "x"}}',
        "num_predict",
    ),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', "'stream'"),
    (  # a schema's own names are its own: this one is not renamed as a field of the request
        b'{"messages": [{"role": "user", "content": "hi"}], "format": {"type": "object", '
        b'"properties": {"max_tokens": {"const": "say \\"hi\\""}}}}',
        "format.properties.max_tokens.const",
    ),
    (b'{"prompt": 5}', "'prompt'"),
    (b'{"prompt": "hi", "images": ["aGk="]}', "'images'"),
]


def test_bad_bodies_get_ollama_shaped_errors_and_the_server_goes_on(server: ServerProcess) -> None:
    ignored = {"keep_alive": "5m", "think": False}  # accepted, as num_ctx is
    options = {**OPTIONS, "num_ctx": 8192, "repeat_penalty": 1.1}
    good = json.dumps({"messages": messages("Hi"), "stream": False, "options": options, **ignored})
    for body, says in BAD_CHATS:
        path = "/api/generate" if b"prompt" in body else "/api/chat"
        status, error = post(server, path, body)
        assert status == 400 and set(error) == {"error"} and says in str(error["error"]), error
        assert post(server, "/api/chat", good.encode())[0] == 200  # still answering
    for path, empty in (("/api/chat", {"messages": []}), ("/api/generate", {"prompt": ""})):
        status, loaded = post(server, path, json.dumps({"model": "m", **empty}).encode())
        assert (status, loaded["done"], loaded["done_reason"]) == (200, True, "load")
    status, error = post(server, "/api/nothing", b"{}")
    assert status == 404 and set(error) == {"error"}
    with pytest.raises(ollama.ResponseError) as raised:
        ollama_client(server).chat(model="tiny", messages=[{"role": "wizard", "content": "x"}])
    assert raised.value.status_code == 400 and "wizard" in raised.value.error


def test_a_missing_key_is_an_ollama_shaped_401(tmp_path: Path, tiny_models: TinyModels) -> None:
    args = [*tiny_args(tiny_models), "--api-key", "s3cret"]
    with ServerProcess(args, tmp_path / "server.log") as proc:
        status, error = post(proc, "/api/chat", b"{}")
        assert status == 401 and set(error) == {"error"} and error["error"]
        keyed = ollama.Client(host=proc.base_url, headers={"Authorization": "Bearer s3cret"})
        assert [m.model for m in keyed.list().models] == ["tiny-base"]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def test_a_tool_history_is_the_openai_request_with_the_calls_ids(server: ServerProcess) -> None:
    """Ollama's calls have no ids: each gets one, and the tool's result answers it."""
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    history = [
        {"role": "user", "content": "The weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"},
    ]
    body = {"messages": history, "tools": TOOLS, "options": OPTIONS, "stream": False}
    status, answer = post(server, "/api/chat", json.dumps(body).encode())
    assert status == 200, answer
    arguments = json.dumps({"city": "Paris"})
    openai_call = {
        "id": "call_1_0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    openai_history = [
        history[0],
        {"role": "assistant", "content": "", "tool_calls": [openai_call]},
        {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1_0"},
    ]
    openai = client(server).chat.completions.create(
        model="tiny",
        messages=openai_history,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        temperature=0,
        seed=7,
        max_tokens=12,
    )
    assert openai.usage is not None and openai.usage.prompt_tokens == answer["prompt_eval_count"]
    assert openai.choices[0].message.content == answer["message"]["content"]
    # the call and its result are in the prompt, not dropped
    body["messages"] = history[:1]
    shorter = post(server, "/api/chat", json.dumps(body).encode())[1]
    assert shorter["prompt_eval_count"] + 10 < answer["prompt_eval_count"]
