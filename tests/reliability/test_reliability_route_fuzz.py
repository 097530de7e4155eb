"""Every field of every route's body, each given 15 wrong values, against one real server.

For each POST route a valid body is the base (it is checked to answer 200
first); every field in it, top-level and nested (a message's role and
content, a content part's type and text, a tool's name and schema,
``tool_choice``, ``response_format``, ``cache_control.ttl``, ``options.*``,
...), is replaced in turn by each of ``WRONG`` and the body posted. No answer
may be a 5xx, nor a stream that carries an internal error; a 400 is JSON in
the route's error shape and names the field (one of the names on its path).
Generation a wrong value lets through is bounded by the base's token limit
or, where the limit itself is replaced, by the server's small context.

A prefill the disk cannot hold (``LOCALKV_MIN_FREE`` above the free space:
every save is refused for want of room) is a 507 saying it was not saved, as
``localkv prefill`` exits 1.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.server import ServerProcess
from support.tinymodels import TinyModels

CTX = 512  # a generation whose limit is taken away ends when the context is full
LONG = "long " * 4_000
DEEP: Any = "x"
for _ in range(8):
    DEEP = [DEEP]
WRONG: tuple[Any, ...] = (
    None,
    True,
    0,
    -1,
    2**64,
    1e308,
    "",
    "x",
    "a\"b'c\\",
    "\ud800",  # a lone surrogate: sent as the JSON escape \ud800
    LONG,
    [],
    DEEP,
    {},
    {"a": {}},
)
SCHEMA = {  # its answers are short: a generation under it ends, whatever its token limit
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
FUNCTION = {"name": "get_weather", "description": "The weather in a city.", "parameters": SCHEMA}
# where SCHEMA's fields are fuzzed already: its answer is "{}"
EMPTY = {"type": "object", "properties": {}, "additionalProperties": False}
PLAIN = {"name": "get_weather", "parameters": EMPTY}

CHAT_TOOLS = {
    "model": "tiny",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    ],
    "tools": [{"type": "function", "function": FUNCTION}],
    "tool_choice": "required",
    "max_tokens": 2,
    "temperature": 0,
    "top_p": 1,
    "top_k": 1,
    "seed": 1,
    "n": 1,
    "stream": False,
    "user": "u",
}
CHAT_HISTORY = {
    "model": "tiny",
    "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "A call.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "Sunny."},
    ],
    "tools": [{"type": "function", "function": PLAIN}],
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "max_completion_tokens": 2,
    "stop": ["zz"],
    "stream": True,
    "stream_options": {"include_usage": True},
}
CHAT_FORMAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Give JSON."}],
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "answer", "strict": True, "schema": SCHEMA},
    },
    "max_tokens": 2,
    "stop": "zz",
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "metadata": {"k": "v"},
}
COMPLETION = {
    "model": "tiny",
    "prompt": "Once upon a time",
    "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": EMPTY}},
    "max_tokens": 2,
    "temperature": 0,
    "stop": ["zz"],
    "seed": 1,
    "best_of": 1,
    "echo": False,
}
PREFILL = {
    "system": "You read notes.",
    "documents": [{"name": "notes.txt", "text": "Some notes."}, "More notes."],
    "label": "notes",
    "pin": False,
}
RESPONSES_TOOLS = {
    "model": "tiny",
    "instructions": "Be brief.",
    "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}
    ],
    "tools": [{"type": "function", "strict": False, **FUNCTION}],
    "tool_choice": "required",
    "max_output_tokens": 2,
    "temperature": 0,
    "top_p": 1,
    "metadata": {"k": "v"},
    "store": False,
    "parallel_tool_calls": True,
    "truncation": "disabled",
    "stream": False,
}
RESPONSES_HISTORY = {
    "model": "tiny",
    "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "A call."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny."},
    ],
    "tools": [{"type": "function", **PLAIN}],
    "tool_choice": {"type": "function", "name": "get_weather"},
    "max_output_tokens": 2,
    "stream": True,
}
RESPONSES_FORMAT = {
    "model": "tiny",
    "input": "Give JSON.",
    "text": {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}},
    "max_output_tokens": 2,
    "stop": ["zz"],
    "top_k": 1,
    "seed": 1,
    "reasoning": {"effort": "low"},
}
RESPONSES_CODEX = {  # Codex CLI's fields: a namespace of functions, a hosted tool, ids
    "model": "local",
    "input": [
        {"type": "message", "id": "msg_1", "role": "developer",
         "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "id": "msg_2", "role": "user",
         "content": [{"type": "input_text", "text": "Spawn one."}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "S"}],
         "encrypted_content": "gAAAAB"},
        {"type": "message", "id": "msg_3", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Yes.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "spawn_agent",
         "namespace": "agents", "arguments": "{}", "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": "a-1"},
    ],
    "tools": [
        {"type": "namespace", "name": "agents", "description": "Sub-agents.",
         "tools": [{"type": "function", "strict": False, "name": "spawn_agent",
                    "description": "Spawn.", "parameters": EMPTY}]},
        {"type": "web_search", "external_web_access": False},
    ],
    "tool_choice": {"type": "function", "name": "spawn_agent", "namespace": "agents"},
    "parallel_tool_calls": True,
    "reasoning": {"summary": "auto"},
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "k",
    "client_metadata": {"session_id": "s"},
    "max_output_tokens": 2,
}  # fmt: skip
EPHEMERAL = {"type": "ephemeral", "ttl": "5m"}
MESSAGES_TOOLS = {
    "model": "tiny",
    "max_tokens": 2,
    "system": [{"type": "text", "text": "Be brief.", "cache_control": EPHEMERAL}],
    "messages": [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Weather?", "cache_control": EPHEMERAL}],
        }
    ],
    "tools": [
        {
            "name": "get_weather",
            "description": "The weather.",
            "input_schema": SCHEMA,
            "cache_control": EPHEMERAL,
        }
    ],
    "tool_choice": {"type": "any"},
    "temperature": 0,
    "top_p": 1,
    "top_k": 1,
    "stop_sequences": ["zz"],
    "metadata": {"user_id": "u"},
    "stream": False,
}
MESSAGES_HISTORY = {
    "model": "tiny",
    "max_tokens": 2,
    "system": "Be brief.",
    "cache_control": EPHEMERAL,
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "A call.", "signature": "s"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "P"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [{"type": "text", "text": "Sunny."}],
                    "is_error": False,
                },
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ],
    "tools": [{"name": "get_weather", "input_schema": EMPTY}],
    "tool_choice": {"type": "tool", "name": "get_weather"},
    "stream": True,
}
COUNT = {
    "model": "tiny",
    "system": [{"type": "text", "text": "Be brief.", "cache_control": EPHEMERAL}],
    "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather?"}]}],
    "tools": [{"name": "get_weather", "input_schema": EMPTY, "cache_control": EPHEMERAL}],
    "tool_choice": {"type": "auto"},
}
OPTIONS = {"num_predict": 2, "temperature": 0, "top_p": 0.9, "top_k": 40, "seed": 1}
OLLAMA_CHAT = {
    "model": "tiny",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "thinking": "A call.",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "P"}}}],
        },
        {"role": "tool", "tool_name": "get_weather", "content": "Sunny."},
    ],
    "tools": [{"type": "function", "function": PLAIN}],
    "format": EMPTY,
    "options": {**OPTIONS, "stop": ["zz"], "num_ctx": 1024},
    "keep_alive": "5m",
    "stream": False,
}
OLLAMA_GENERATE = {
    "model": "tiny",
    "prompt": "Weather in Paris?",
    "system": "Be brief.",
    "format": SCHEMA,
    "options": OPTIONS,
    "raw": False,
    "keep_alive": "5m",
    "stream": True,
}
OLLAMA_RAW = {
    "model": "tiny",
    "prompt": "Once",
    "raw": True,
    "format": EMPTY,
    "options": OPTIONS,
    "stream": False,
}
OLLAMA_SHOW = {"model": "tiny", "verbose": False}

CASES = {
    "chat-tools": ("/v1/chat/completions", CHAT_TOOLS),
    "chat-history": ("/v1/chat/completions", CHAT_HISTORY),
    "chat-format": ("/v1/chat/completions", CHAT_FORMAT),
    "completions": ("/v1/completions", COMPLETION),
    "prefill": ("/v1/localkv/prefill", PREFILL),
    "responses-tools": ("/v1/responses", RESPONSES_TOOLS),
    "responses-history": ("/v1/responses", RESPONSES_HISTORY),
    "responses-format": ("/v1/responses", RESPONSES_FORMAT),
    "responses-codex": ("/v1/responses", RESPONSES_CODEX),
    "messages-tools": ("/v1/messages", MESSAGES_TOOLS),
    "messages-history": ("/v1/messages", MESSAGES_HISTORY),
    "count-tokens": ("/v1/messages/count_tokens", COUNT),
    "ollama-chat": ("/api/chat", OLLAMA_CHAT),
    "ollama-generate": ("/api/generate", OLLAMA_GENERATE),
    "ollama-raw": ("/api/generate", OLLAMA_RAW),
    "ollama-show": ("/api/show", OLLAMA_SHOW),
}

Path_ = tuple[str | int, ...]


def paths(value: Any, at: Path_ = ()) -> Iterator[Path_]:
    """Every field under ``value``, parents before their children."""
    if isinstance(value, dict):
        items: Iterator[tuple[str | int, Any]] = iter(value.items())
    elif isinstance(value, list):
        items = iter(enumerate(value))
    else:
        return
    for key, item in items:
        yield (*at, key)
        yield from paths(item, (*at, key))


def replaced(base: dict[str, Any], path: Path_, value: Any) -> dict[str, Any]:
    """``base`` with ``value`` at ``path`` (a copy: parts shared in ``base`` are not shared)."""
    body = json.loads(json.dumps(base))
    node: Any = body
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return body


def shown(path: Path_) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path).lstrip(".")


def error_text(route: str, body: Any) -> str | None:
    """The message (and param) of an error body in the route's shape; None: not that shape."""
    if not isinstance(body, dict):
        return None
    if route.startswith("/api/"):
        message = body.get("error")
        return message if isinstance(message, str) and set(body) == {"error"} else None
    error = body.get("error")
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return None
    if route.startswith("/v1/messages"):
        return error["message"] if body.get("type") == "error" else None
    return f"{error['message']} {error.get('param')}"


def problem(route: str, path: Path_, response: httpx.Response) -> str | None:
    """What is wrong with the answer to a wrong value (None: nothing)."""
    text = response.text
    if response.status_code >= 500:
        return f"{response.status_code}: {text[:300]}"
    if "internal error" in text or "Traceback" in text:
        return f"{response.status_code} carrying an internal error: {text[:300]}"
    if response.status_code != 400:
        return None
    try:
        message = error_text(route, response.json())
    except json.JSONDecodeError:
        return f"a 400 that is not JSON: {text[:300]}"
    if message is None:
        return f"a 400 not in the route's error shape: {text[:300]}"
    names = [k for k in path if isinstance(k, str)]
    if not any(name in message for name in names):
        return f"a 400 that names none of {names}: {message[:300]}"
    return None


def send(client: httpx.Client, route: str, body: dict[str, Any]) -> httpx.Response:
    content = json.dumps(body).encode()  # ensure_ascii: a lone surrogate goes as its escape
    return client.post(route, content=content, headers={"Content-Type": "application/json"})


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_models: TinyModels
) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("fuzz")
    args = ["--model", str(tiny_models.base), "--threads", "1", "--ctx", str(CTX)]
    env = {"LOCALKV_HOME": str(logs / "home")}
    with ServerProcess(args, logs / "server.log", env=env) as proc:
        yield proc


@pytest.mark.parametrize("case", list(CASES))
def test_no_wrong_value_in_any_field_is_a_server_error(server: ServerProcess, case: str) -> None:
    route, base = CASES[case]
    problems, failed = [], 0
    logged = len(server.log())
    with httpx.Client(base_url=server.base_url, timeout=300) as client:
        first = send(client, route, base)
        assert first.status_code == 200 and problem(route, (), first) is None, first.text
        for path in paths(base):
            for value in WRONG:
                response = send(client, route, replaced(base, path, value))
                found = problem(route, path, response)
                failed += response.status_code >= 500
                if found is not None:
                    problems.append(f"{shown(path)} = {json.dumps(value)[:40]}: {found}")
        assert send(client, route, base).status_code == 200  # and the server goes on
    assert not problems, f"{failed} server errors; {len(problems)} problems:\n" + "\n".join(
        problems
    )
    assert "Traceback" not in server.log()[logged:]


def test_a_prefill_the_disk_cannot_hold_is_a_507_saying_so(
    tmp_path: Path, tiny_models: TinyModels
) -> None:
    args = ["--model", str(tiny_models.base), "--threads", "1", "--ctx", str(CTX)]
    env = {"LOCALKV_MIN_FREE": "1000T"}  # every save is refused for want of room
    with (
        ServerProcess(args, tmp_path / "server.log", env=env) as proc,
        httpx.Client(base_url=proc.base_url, timeout=300) as client,
    ):
        response = send(client, "/v1/localkv/prefill", PREFILL)
        assert response.status_code == 507, response.text
        error = response.json()["error"]
        assert error["message"].startswith("not saved: "), error
        assert error["code"] == "not_saved"
        listed = client.get("/v1/localkv/cache").json()["data"]
        assert listed == []  # nothing was kept


def test_a_schema_the_grammar_would_betray_is_a_400_naming_where(server: ServerProcess) -> None:
    """An ``allOf`` of a string and an integer was sampled as ``{ }``; a quote in a ``const``
    made a grammar llama.cpp refuses. Both are refused, where they are; an ``allOf`` of
    objects is held to."""
    conflicting = {"allOf": [{"type": "string"}, {"type": "integer"}]}
    twice = {
        "allOf": [
            {"properties": {"a": {"type": "string"}}},
            {"properties": {"a": {"type": "integer"}}},
        ]
    }
    quoted = {"type": "object", "properties": {"a": {"const": 'say "hi"'}}}
    merged = {
        "allOf": [
            {"properties": {"a": {"type": "string", "maxLength": 3}}, "required": ["a"]},
            {"properties": {"b": {"type": "boolean"}}, "required": ["b"]},
        ]
    }
    ask = [{"role": "user", "content": "Give JSON."}]

    def schema(value: Any) -> dict[str, Any]:
        return {"type": "json_schema", "json_schema": {"name": "a", "schema": value}}

    def tool(value: Any) -> dict[str, Any]:
        return {
            "messages": ask,
            "tools": [{"type": "function", "function": {**PLAIN, "parameters": value}}],
            "tool_choice": "required",
        }

    responses = {"type": "json_schema", "name": "a", "schema": conflicting}
    messages = {
        "model": "tiny",
        "max_tokens": 2,
        "messages": ask,
        "tools": [{"name": "f", "input_schema": quoted}],
        "tool_choice": {"type": "any"},
    }
    refused = [
        (
            "/v1/chat/completions",
            {"messages": ask, "response_format": schema(conflicting)},
            "response_format.json_schema.schema.allOf[0]",
        ),
        ("/v1/chat/completions", tool(twice), "tools[0].function.parameters.allOf[1].properties.a"),
        ("/v1/chat/completions", tool(quoted), "tools[0].function.parameters.properties.a.const"),
        (
            "/v1/responses",
            {"input": "Hi", "text": {"format": responses}},
            "text.format.schema.allOf[0]",
        ),
        ("/v1/messages", messages, "tools[0].input_schema.properties.a.const"),
        ("/api/chat", {"messages": ask, "format": conflicting, "stream": False}, "format.allOf[0]"),
    ]
    with httpx.Client(base_url=server.base_url, timeout=300) as client:
        for route, body, where in refused:
            response = send(client, route, body)
            assert response.status_code == 400, (route, response.text)
            assert where in (error_text(route, response.json()) or ""), response.text
        body = {"messages": ask, "temperature": 0, "response_format": schema(merged)}
        answer = send(client, "/v1/chat/completions", body)
        assert answer.status_code == 200, answer.text
        content = json.loads(answer.json()["choices"][0]["message"]["content"])
        assert set(content) == {"a", "b"} and isinstance(content["b"], bool), content
