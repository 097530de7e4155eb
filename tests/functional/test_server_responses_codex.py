"""What Codex CLI sends to ``/v1/responses``, answered by a real server.

The requests are Codex CLI's as captured (0.171, ``codex exec``), trimmed: the
system prompt as developer messages with item ids that change per session, a
``namespace`` tool of function tools beside plain ones, a hosted ``web_search``
tool, ``reasoning``, ``include``, ``prompt_cache_key``, ``client_metadata``,
``store: false``, a resumed turn's items as the server sent them back. Each is
answered (the hosted tool left out, with a log line), in a stream that ends as
Codex requires; the ids and keys that change per session change no token; a
call of a namespace's function names the namespace, and sent back it is the
call the model made.
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from openai import OpenAI
from openai.types.responses import Response, ResponseFunctionToolCall
from support.server import ServerProcess
from support.tinymodels import TinyModels, build_tiny_with_template

PROMPT = "You are a coding agent running in the Codex CLI. Be concise and precise."
SKILLS = "<skills_instructions>\n## Skills\nNone are installed.\n</skills_instructions>"
PERMISSIONS = "<permissions instructions>\nThe sandbox is read-only.\n</permissions instructions>"
ENVIRONMENT = (
    "<environment_context>\n  <cwd>/work</cwd>\n  <shell>bash</shell>\n</environment_context>"
)
SPAWN = {
    "type": "object",
    "properties": {"task": {"enum": ["tests", "docs"]}, "fork": {"type": "boolean"}},
    "required": ["task", "fork"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "exec_command",
        "description": "Runs a command in a PTY.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string", "description": "Shell command."}},
            "required": ["cmd"],
            "additionalProperties": False,
        },
    },
    {
        "type": "namespace",
        "name": "multi_agent_v1",
        "description": "Tools for spawning and managing sub-agents.",
        "tools": [
            {
                "type": "function",
                "name": "close_agent",
                "description": "Close an agent.",
                "strict": False,
                "parameters": {
                    "type": "object",
                    "properties": {"target": {"type": "string"}},
                    "required": ["target"],
                    "additionalProperties": False,
                },
            },
            {
                "type": "function",
                "name": "spawn_agent",
                "description": "Spawn a sub-agent for a task.",
                "strict": False,
                "parameters": SPAWN,
            },
        ],
    },
    {"type": "function", "name": "get_goal", "description": "The goal.", "strict": False,
     "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
    {"type": "web_search", "external_web_access": False},
]  # fmt: skip
# as ``codex exec --output-schema`` asks: its grammar ends the tiny model's answer
YES_NO = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {"type": "json_schema", "name": "codex_output_schema", "schema": YES_NO,
                 "strict": True}  # fmt: skip
# the tools as /v1/chat/completions gives them: the namespace's functions by flat name
CHAT_TOOLS = [
    {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
    for t in [TOOLS[0], *[{**f, "name": "multi_agent_v1." + f["name"]} for f in TOOLS[1]["tools"]],
              TOOLS[2]]
]  # fmt: skip


def tiny_args(model: Path) -> list[str]:
    return ["--model", str(model), "--threads", "1", "--ctx", "2048"]


@pytest.fixture()
def server(tmp_path: Path, tiny_models: TinyModels) -> Iterator[ServerProcess]:
    proc = ServerProcess(tiny_args(tiny_models.base), tmp_path / "server.log").start()
    yield proc
    assert proc.stop() == 0, proc.log()


def message(role: str, *texts: str) -> dict[str, Any]:
    content = [{"type": "input_text", "text": t} for t in texts]
    return {"type": "message", "id": f"msg_{uuid.uuid4()}", "role": role, "content": content}


def codex_body(question: str, history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A Codex CLI turn of a new session: new item ids, cache key and metadata."""
    session, turn = str(uuid.uuid4()), str(uuid.uuid4())
    metadata = {"session_id": session, "turn_id": turn, "sandbox": "seccomp", "model": "local"}
    return {
        "model": "local",
        "input": [
            message("developer", PROMPT),
            message("developer", SKILLS, PERMISSIONS),
            message("user", ENVIRONMENT),
            *(history or []),
            message("user", question),
        ],
        "tools": TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": session,
        "client_metadata": {
            "session_id": session,
            "turn_id": turn,
            "x-codex-turn-metadata": json.dumps(metadata),
        },
    }


def codex_post(server: ServerProcess, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of a streamed answer, as Codex reads them: each ``data`` line's JSON,
    its ``type`` the ``event`` line's name."""
    session = body["prompt_cache_key"]
    request = urllib.request.Request(
        server.base_url + "/v1/responses",
        data=json.dumps(body).encode(),
        headers={
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            "originator": "codex_exec",
            "User-Agent": "codex_exec/0.171.0 (Debian 12.0.0; x86_64) unknown",
            "session-id": session,
            "x-client-request-id": session,
            "x-codex-turn-metadata": body["client_metadata"]["x-codex-turn-metadata"],
        },
    )
    with urllib.request.urlopen(request, timeout=300) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        text = r.read().decode()
    events = []
    for block in text.split("\n\n"):
        lines = [line for line in block.splitlines() if not line.startswith(":")]
        if not lines:
            continue  # a keep-alive
        name, data = lines[0].removeprefix("event: "), lines[1].removeprefix("data: ")
        event = json.loads(data)
        assert event["type"] == name, block
        events.append(event)
    return events


def completed(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The response of a stream that ends as Codex requires (else it retries the turn):
    ``response.created`` first, ``response.completed`` last, with its id and usage."""
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] == "response.completed", events[-1]
    response = events[-1]["response"]
    assert response["id"] == events[0]["response"]["id"]
    usage = response["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens_details"]["cached_tokens"] >= 0
    assert usage["output_tokens_details"]["reasoning_tokens"] >= 0
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == response["output"]
    return dict(response)


def test_a_codex_turn_is_answered_in_a_stream_codex_reads(server: ServerProcess) -> None:
    body = {**codex_body("Is the sandbox read-only?"), "text": {"format": SCHEMA_FORMAT}}
    response = completed(codex_post(server, body))
    (item,) = response["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["status"] == "completed" and item["id"].startswith("msg_")
    (part,) = item["content"]
    assert part["type"] == "output_text" and part["annotations"] == []
    jsonschema.validate(json.loads(part["text"]), YES_NO)
    assert response["store"] is False and response["tools"] == TOOLS
    # the answer as Codex sends it back on resume, then a new question
    kept = {k: item[k] for k in ("type", "status", "id", "role")}
    said = {**kept, "content": [{"type": "output_text", "text": part["text"], "annotations": []}]}
    asked = message("user", "Is the sandbox read-only?")
    resumed = {**codex_body("And the network?", [asked, said]), "text": {"format": SCHEMA_FORMAT}}
    again = completed(codex_post(server, resumed))
    usage = again["usage"]
    assert usage["input_tokens"] > response["usage"]["input_tokens"] + 5
    # the earlier turn is the live context's prefix: none of it prefilled again
    assert usage["input_tokens_details"]["cached_tokens"] >= response["usage"]["input_tokens"] - 1
    left_out = [line for line in server.log().splitlines() if "tools left out" in line]
    assert len(left_out) == 1 and "web_search" in left_out[0], server.log()


def test_ids_and_keys_that_change_per_session_change_no_token(server: ServerProcess) -> None:
    """Two sessions with the same turns: new item ids, prompt_cache_key, metadata, and a
    reasoning item's summary and another server's encrypted content, which add nothing."""
    thought = {
        "type": "reasoning",
        "summary": [{"type": "summary_text", "text": "**Checking the sandbox**"}],
        "encrypted_content": "gAAAAABoRh3xY0uFhPz1Q2s4d0tG8dHc",
    }
    said = {"type": "message", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": "It is.", "annotations": []}]}  # fmt: skip
    usages = []
    for _ in range(2):
        history = [
            {**thought, "id": f"rs_{uuid.uuid4().hex}"},
            {**said, "id": f"msg_{uuid.uuid4().hex}"},
        ]
        body = {**codex_body("Is it?", history), "max_output_tokens": 1}
        events = codex_post(server, body)
        assert events[-1]["type"] == "response.incomplete"  # cut at max_output_tokens
        usages.append(events[-1]["response"]["usage"])
    first, second = usages
    assert second["input_tokens"] == first["input_tokens"]
    # the same tokens: all but the last read from the live context
    assert second["input_tokens_details"]["cached_tokens"] >= second["input_tokens"] - 1


def post(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        server.base_url + "/v1/responses",
        data=json.dumps({**body, "stream": False}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as r:
        assert r.status == 200
        return dict(json.loads(r.read()))


def test_a_namespace_call_names_its_namespace_and_goes_back_as_made(
    server: ServerProcess,
) -> None:
    body = codex_body("Spawn an agent for the tests.")
    choice = {"type": "function", "name": "spawn_agent", "namespace": "multi_agent_v1"}
    fixed = {"temperature": 0, "max_output_tokens": 60, "tool_choice": choice}
    first = Response.model_validate(post(server, {**body, **fixed}))
    assert first.status == "completed" and first.usage is not None
    (call,) = first.output
    assert isinstance(call, ResponseFunctionToolCall) and call.status == "completed"
    assert (call.name, call.namespace) == ("spawn_agent", "multi_agent_v1")
    jsonschema.validate(json.loads(call.arguments), SPAWN)
    # streamed, as Codex reads it: the item names the namespace when added and when done
    events = codex_post(server, {**body, **fixed})
    response = completed(events)
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [(i["name"], i["namespace"]) for i in added] == [("spawn_agent", "multi_agent_v1")]
    assert response["output"][0]["arguments"] == call.arguments
    # by its flat name too
    flat = {**fixed, "tool_choice": {"type": "function", "name": "multi_agent_v1.spawn_agent"}}
    named = completed(codex_post(server, {**body, **flat}))["output"][0]
    assert (named["name"], named["namespace"]) == ("spawn_agent", "multi_agent_v1")

    # sent back as Codex sends it, with the agent's answer: the call as the model made it
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "agent-7"}
    back = {**body, "input": [*body["input"], call.model_dump(exclude_none=True), output]}
    back.update(tool_choice="none", max_output_tokens=4, temperature=0)
    answer = post(server, back)
    messages: list[Any] = [
        {"role": "system", "content": PROMPT},
        {"role": "system", "content": SKILLS + PERMISSIONS},
        {"role": "user", "content": ENVIRONMENT},
        {"role": "user", "content": "Spawn an agent for the tests."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "multi_agent_v1.spawn_agent", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "agent-7"},
    ]
    c = OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=300)
    chat = c.chat.completions.create(
        model="local",
        messages=messages,
        tools=CHAT_TOOLS,  # type: ignore[arg-type]
        tool_choice="none",
        max_tokens=4,
        temperature=0,
    )
    assert chat.usage is not None
    assert answer["usage"]["input_tokens"] == chat.usage.prompt_tokens
    assert answer["usage"]["input_tokens"] > first.usage.input_tokens + 10


# renders each assistant turn's reasoning, and opens the answer in it
THINKING_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n"
    "{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif -%}"
    "{{ m.content }}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>{% endif -%}"
)


def test_reasoning_sent_back_as_encrypted_content_is_the_reasoning(
    tmp_path: Path, default_model_path: Path
) -> None:
    """With ``include: ["reasoning.encrypted_content"]`` a reasoning item carries its
    reasoning in ``encrypted_content``; sent back without ``content`` (as a client that
    keeps only the opaque part does), it renders as the reasoning did."""
    model = build_tiny_with_template(tmp_path / "m", default_model_path, THINKING_TEMPLATE)
    with ServerProcess(tiny_args(model), tmp_path / "server.log") as proc:
        c = OpenAI(base_url=proc.base_url + "/v1", api_key="none", max_retries=0, timeout=300)
        question = [{"role": "user", "content": "Why?"}]
        fixed: dict[str, Any] = {"model": "m", "max_output_tokens": 6, "temperature": 0}
        first = c.responses.create(input=question, include=["reasoning.encrypted_content"], **fixed)
        thought = first.output[0]
        assert thought.type == "reasoning" and thought.content and thought.encrypted_content
        assert "".join(p.text for p in thought.content)
        plain = c.responses.create(input=question, **fixed).output[0]
        assert plain.type == "reasoning" and plain.encrypted_content is None  # not asked
        item = thought.model_dump(exclude_none=True)
        sealed = {k: v for k, v in item.items() if k != "content"}
        said = {"type": "message", "role": "assistant", "content": "Because."}
        later = [{"role": "user", "content": "Sure?"}]
        counts = []
        for items in ([item], [sealed], [{**sealed, "encrypted_content": "gAAAAB"}], []):
            r = c.responses.create(input=[*question, *items, said, *later], **fixed)
            assert r.usage is not None
            counts.append(r.usage.input_tokens)
        with_content, with_sealed, foreign, without = counts
        assert with_sealed == with_content > without + 2 and foreign == without
