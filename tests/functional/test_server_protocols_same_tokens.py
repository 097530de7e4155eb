"""One conversation through all four protocols of ``localkv serve``: the same tokens.

Each protocol parses its own JSON into the one neutral request, so a system
prompt, turns, a tool, a call and its result, spelled each protocol's way, are
the same prompt tokens (counted by each protocol's own usage field, and by
Anthropic's ``count_tokens``), and at temperature 0 the same answer. System
messages inside the conversation are placed alike by every protocol: one after
the question (Claude Code's environment) joins the system prompt, one after the
first answer stays where it is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import ollama
from openai import OpenAI
from support.server import ServerProcess
from support.tinymodels import TinyModels

SYSTEM = "You answer questions about the weather. Keep it short."
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
DESCRIPTION = "The weather in a city."
ARGUMENTS = {"city": "Paris"}
RESULT = "sunny, 21 C"
ASKED, SAID = "Hello!", "Hello. Ask me about the weather."
PARTS = ("And in Paris? ", "Or Rome?")  # one message of two text parts (Ollama's: one string)
LIMIT = 8


def openai_chat(c: OpenAI) -> tuple[int, str]:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(ARGUMENTS)}}  # fmt: skip
    messages: Any = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": ASKED},
        {"role": "assistant", "content": SAID},
        {"role": "user", "content": [{"type": "text", "text": t} for t in PARTS]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": RESULT},
    ]
    tool: Any = {"type": "function", "function": {"name": "get_weather",
                 "description": DESCRIPTION, "parameters": WEATHER}}  # fmt: skip
    r = c.chat.completions.create(
        model="any", messages=messages, tools=[tool], max_tokens=LIMIT, temperature=0
    )
    assert r.usage is not None
    return r.usage.prompt_tokens, r.choices[0].message.content or ""


def responses(c: OpenAI) -> tuple[int, str]:
    items: Any = [
        {"role": "user", "content": ASKED},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": SAID}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": t} for t in PARTS]},
        {"type": "function_call", "call_id": "call_9", "name": "get_weather",
         "arguments": json.dumps(ARGUMENTS)},
        {"type": "function_call_output", "call_id": "call_9", "output": RESULT},
    ]  # fmt: skip
    tool: Any = {"type": "function", "name": "get_weather", "description": DESCRIPTION,
                 "parameters": WEATHER}  # fmt: skip
    r = c.responses.create(
        model="any",
        instructions=SYSTEM,
        input=items,
        tools=[tool],
        max_output_tokens=LIMIT,
        temperature=0,
    )
    assert r.usage is not None
    return r.usage.input_tokens, r.output_text


def anthropic_messages(c: anthropic.Anthropic) -> tuple[int, int, str]:
    """The prompt's tokens as ``count_tokens`` says and as the answer's usage says."""
    ask: dict[str, Any] = {
        "model": "any",
        "system": SYSTEM,
        "messages": [
            {"role": "user", "content": ASKED},
            {"role": "assistant", "content": [{"type": "text", "text": SAID}]},
            {"role": "user", "content": [{"type": "text", "text": t} for t in PARTS]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": ARGUMENTS},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": RESULT},
            ]},
        ],
        "tools": [{"name": "get_weather", "description": DESCRIPTION, "input_schema": WEATHER}],
    }  # fmt: skip
    counted = c.messages.count_tokens(**ask).input_tokens
    r = c.messages.create(**ask, max_tokens=LIMIT, extra_body={"temperature": 0})
    usage = r.usage
    prompt = (
        usage.input_tokens
        + (usage.cache_read_input_tokens or 0)
        + (usage.cache_creation_input_tokens or 0)
    )
    return counted, prompt, "".join(b.text for b in r.content if b.type == "text")


def ollama_chat(c: ollama.Client) -> tuple[int, str]:
    call = {"function": {"name": "get_weather", "arguments": ARGUMENTS}}
    messages: Any = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": ASKED},
        {"role": "assistant", "content": SAID},
        {"role": "user", "content": "".join(PARTS)},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": RESULT, "tool_name": "get_weather"},
    ]
    tool: Any = {"type": "function", "function": {"name": "get_weather",
                 "description": DESCRIPTION, "parameters": WEATHER}}  # fmt: skip
    r = c.chat(
        model="any",
        messages=messages,
        tools=[tool],
        options={"temperature": 0, "num_predict": LIMIT},
    )
    assert r.prompt_eval_count is not None
    return r.prompt_eval_count, r.message.content or ""


def test_one_conversation_is_the_same_tokens_and_answer_through_every_protocol(
    tmp_path: Path, tiny_models: TinyModels
) -> None:
    args = ["--model", str(tiny_models.base), "--threads", "1", "--ctx", "2048"]
    with ServerProcess(args, tmp_path / "server.log") as proc:
        openai = OpenAI(base_url=proc.base_url + "/v1", api_key="none", max_retries=0)
        claude = anthropic.Anthropic(base_url=proc.base_url, api_key="none", max_retries=0)
        chat = openai_chat(openai)
        response = responses(openai)
        counted, used, said = anthropic_messages(claude)
        local = ollama_chat(ollama.Client(host=proc.base_url, timeout=300))
    tokens, answer = chat
    assert tokens > 100 and answer  # the system prompt, the tool and the turns
    assert response == (tokens, answer)
    assert (counted, used, said) == (tokens, tokens, answer)
    assert local == (tokens, answer)


# Claude Code's shape: the question, then the environment as a system message; and a
# system message after the first answer
ENVIRONMENT = "# Environment\nWorking directory: /home/me/project\nPlatform: linux"
LATE = "From now on, answer in French."
TURNS = (
    ("user", ASKED),
    ("system", ENVIRONMENT),
    ("assistant", SAID),
    ("system", LATE),
    ("user", "".join(PARTS)),
)


def item(role: str, text: str) -> dict[str, Any]:
    """A Responses message item (a system message as a ``developer`` one)."""
    kind = "output_text" if role == "assistant" else "input_text"
    role = "developer" if role == "system" else role
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


def block(role: str, text: str) -> dict[str, Any]:
    """An Anthropic message (a system message's content a string, as Claude Code sends)."""
    return {"role": role, "content": text if role == "system" else [{"type": "text", "text": text}]}


def turns_through_every_protocol(base_url: str) -> dict[str, tuple[int, str]]:
    """``SYSTEM`` and ``TURNS`` through each protocol, and (``placed``) spelled out as the
    system messages are placed: the environment in the system prompt."""
    openai = OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
    plain: Any = [{"role": r, "content": t} for r, t in (("system", SYSTEM), *TURNS)]
    placed: Any = [{"role": "system", "content": SYSTEM + "\n\n" + ENVIRONMENT}, plain[1]]
    placed += plain[3:]
    out = {}
    for name, messages in (("openai", plain), ("placed", placed)):
        r = openai.chat.completions.create(
            model="any", messages=messages, max_tokens=LIMIT, temperature=0
        )
        assert r.usage is not None
        out[name] = (r.usage.prompt_tokens, r.choices[0].message.content or "")
    items: Any = [item(r, t) for r, t in TURNS]
    response = openai.responses.create(
        model="any", instructions=SYSTEM, input=items, max_output_tokens=LIMIT, temperature=0
    )
    assert response.usage is not None
    out["responses"] = (response.usage.input_tokens, response.output_text)
    claude = anthropic.Anthropic(base_url=base_url, api_key="none", max_retries=0)
    ask: dict[str, Any] = {"model": "any", "system": SYSTEM, "messages": [block(*t) for t in TURNS]}
    counted = claude.messages.count_tokens(**ask).input_tokens
    m = claude.messages.create(**ask, max_tokens=LIMIT, extra_body={"temperature": 0})
    usage, said = m.usage, "".join(b.text for b in m.content if b.type == "text")
    used = (
        usage.input_tokens
        + (usage.cache_read_input_tokens or 0)
        + (usage.cache_creation_input_tokens or 0)
    )
    out["anthropic"], out["anthropic count_tokens"] = (used, said), (counted, said)
    local = ollama.Client(host=base_url, timeout=300).chat(
        model="any", messages=plain, options={"temperature": 0, "num_predict": LIMIT}
    )
    assert local.prompt_eval_count is not None
    out["ollama"] = (local.prompt_eval_count, local.message.content or "")
    return out


def test_system_messages_inside_the_conversation_are_placed_alike_by_every_protocol(
    tmp_path: Path, tiny_models: TinyModels
) -> None:
    args = ["--model", str(tiny_models.base), "--threads", "1", "--ctx", "2048"]
    with ServerProcess(args, tmp_path / "server.log") as proc:
        seen = turns_through_every_protocol(proc.base_url)
    # the environment joined the system prompt, the later message stayed in place, in
    # every protocol: the same tokens as the conversation spelled out so
    tokens, answer = seen.pop("placed")
    assert tokens > 40 and answer
    assert seen == dict.fromkeys(seen, (tokens, answer)), seen
