"""Claude Code's requests on a real ``localkv serve``: accepted as sent, and cached across sessions.

Each body has the shape Claude Code 2.1 sends (``support.claude_code``): a
billing header first in the system prompt, a system message after the first
question, ``thinking``/``output_config``/``context_management``, the betas
header and ``?beta=true``. The tests count tokens read from the cache, never time.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.claude_code import HEADERS, PATH, ClaudeCode
from support.server import ServerProcess
from support.tinymodels import TinyModels

RULE_LINE = "canonical rule 'billing-header' applied"


@pytest.fixture()
def agent(long_text: str) -> ClaudeCode:
    return ClaudeCode(
        instructions="\n" + long_text[:6000],
        environment="# Environment\n" + long_text[6000:10000],
        max_tokens=8,
    )


def args(tiny_models: TinyModels, *more: str) -> list[str]:
    return ["--model", str(tiny_models.base), "--threads", "1", "--ctx", "4096", *more]


def fixed(body: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """``body`` answered whole at temperature 0 (Claude Code streams, at the default)."""
    return {**body, "temperature": 0, "stream": False, **changes}


def send(server: ServerProcess, body: dict[str, Any], path: str = PATH) -> dict[str, Any]:
    r = httpx.post(server.base_url + path, json=body, headers=HEADERS, timeout=300)
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return reply


def read(reply: dict[str, Any]) -> tuple[int, int, str]:
    """The prompt's tokens, those read from the cache, and where they came from."""
    usage, extra = reply["usage"], reply["localkv"]
    total = usage["input_tokens"] + usage["cache_read_input_tokens"]
    return total + usage["cache_creation_input_tokens"], extra["cached_tokens"], extra["source"]


def text(reply: dict[str, Any]) -> str:
    return "".join(b["text"] for b in reply["content"] if b["type"] == "text")


def test_claude_codes_first_request_is_answered_as_it_streams_it(
    tmp_path: Path, tiny_models: TinyModels, agent: ClaudeCode
) -> None:
    body = agent.first("What is 2+2?")
    with ServerProcess(args(tiny_models), tmp_path / "server.log") as proc:
        with httpx.stream(
            "POST", proc.base_url + PATH, json=body, headers=HEADERS, timeout=300
        ) as r:
            assert r.status_code == 200, r.read()
            lines = list(r.iter_lines())
        events = [line[7:] for line in lines if line.startswith("event: ")]
        assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
        assert "error" not in events
        delta = next(
            json.loads(x[6:]) for x in lines if '"message_delta"' in x and x[:5] == "data:"
        )
        counted = send(proc, body, "/v1/messages/count_tokens?beta=true")["input_tokens"]
        usage = delta["usage"]
        parts = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
        assert sum(usage[k] for k in parts) == counted > 2000
        # the system prompt (with the environment) was kept: its breakpoints asked for it
        assert usage["cache_creation_input_tokens"] > 2000


def test_a_new_session_reads_all_but_its_question_from_disk_after_a_restart(
    tmp_path: Path, tiny_models: TinyModels, agent: ClaudeCode
) -> None:
    log = tmp_path / "server.log"
    with ServerProcess(args(tiny_models), log, global_args=("-vv",)) as proc:
        first = send(proc, fixed(agent.first("What is 2+2?", "34c")))
    with ServerProcess(args(tiny_models), log, global_args=("-vv",)) as proc:
        asked = fixed(agent.first("Name a prime number.", "57b"))
        second = send(proc, asked)
        counted = send(proc, asked, "/v1/messages/count_tokens")["input_tokens"]
        # claude --continue: the environment now a string, the answer, the next question
        resumed = fixed(agent.resumed("Name a prime number.", text(second), "Another?", "57b"))
        third = send(proc, resumed)
    total, cached, source = read(second)
    assert (total, source) == (counted, "disk") and read(first)[1] == 0
    # all but the user's message (the reminder and the question): the system prompt, the
    # tools and the environment (sent after the question: 4,000 characters) came from the disk
    assert total - cached < 64 and cached >= 0.95 * total, (total, cached)
    # the next turn found the whole first turn in the live context
    total3, cached3, source3 = read(third)
    assert source3 == "live" and third["localkv"]["diverged_at"] is None
    assert cached3 >= total and total3 > total
    # the rule was applied to each request, and said so once per server
    assert log.read_text(encoding="utf-8").count(RULE_LINE) == 2


def test_with_client_headers_kept_a_new_session_reads_next_to_nothing(
    tmp_path: Path, tiny_models: TinyModels, agent: ClaudeCode
) -> None:
    log = tmp_path / "server.log"
    with ServerProcess(
        args(tiny_models, "--keep-client-headers"), log, global_args=("-vv",)
    ) as proc:
        send(proc, fixed(agent.first("What is 2+2?", "34c")))
    env = {"LOCALKV_KEEP_CLIENT_HEADERS": "1"}  # the same switch
    with ServerProcess(args(tiny_models), log, env, global_args=("-vv",)) as proc:
        again = send(proc, fixed(agent.first("What is 2+2?", "57b")))
    total, cached, _ = read(again)
    assert cached < 64 < total  # the header's digits differ a few tokens in
    assert RULE_LINE not in log.read_text(encoding="utf-8")


@pytest.mark.default_model
def test_the_canonical_requests_cached_answer_is_its_uncached_answer(
    tmp_path: Path, default_model_path: Path, long_text: str
) -> None:
    """On the real default model, whose answer says something: the rule changes no answer."""
    agent = ClaudeCode(
        instructions="\n" + long_text[:2500],
        environment="# Environment\n" + long_text[2500:4500],
        max_tokens=24,
    )
    one = fixed(agent.first("What is 2+2?", "34c"))
    other = fixed(agent.first("What is 2+2?", "e01"))
    bare = {**other, "system": other["system"][1:]}  # the canonical request itself
    model = ["--model", str(default_model_path), "--threads", "2", "--ctx", "4096"]
    log = tmp_path / "server.log"
    with ServerProcess(model, log) as proc:
        cold = send(proc, one)
    with ServerProcess(model, log) as proc:
        from_disk = send(proc, other)
        live = send(proc, other)
    with ServerProcess([*model, "--no-cache"], log) as proc:
        uncached = send(proc, other)
    with ServerProcess([*model, "--no-cache", "--keep-client-headers"], log) as proc:
        canonical = send(proc, bare)
        with_header = send(proc, {**other, "max_tokens": 1})
    total = read(cold)[0]
    assert read(cold)[1] == 0 and read(uncached)[1] == 0 and read(canonical)[1] == 0
    assert read(from_disk)[2] == "disk" and read(from_disk)[1] >= 0.9 * total
    assert read(live)[1:] == (total - 1, "live")
    answers = [cold, from_disk, live, uncached, canonical]
    assert [read(a)[0] for a in answers] == [total] * 5
    assert len({text(a) for a in answers}) == 1 and "4" in text(cold)
    assert read(with_header)[0] > total  # kept, the header is tokens


def test_a_prompt_past_the_context_is_anthropics_prompt_is_too_long(
    tmp_path: Path, tiny_models: TinyModels, agent: ClaudeCode
) -> None:
    small = ["--model", str(tiny_models.base), "--threads", "1", "--ctx", "1024"]
    body = agent.first("What is 2+2?")
    with ServerProcess(small, tmp_path / "server.log") as proc:
        for path, sent in ((PATH, body), ("/v1/messages/count_tokens", body)):
            r = httpx.post(proc.base_url + path, json=sent, headers=HEADERS, timeout=300)
            error = r.json()
            assert r.status_code == 413 and error["error"]["type"] == "invalid_request_error"
            said = re.fullmatch(
                r"prompt is too long: (\d+) tokens > (\d+) maximum", error["error"]["message"]
            )
            assert said is not None, error
            assert int(said[1]) > int(said[2]) == 1023


def test_what_claude_code_sends_by_default_is_never_refused(
    tmp_path: Path, tiny_models: TinyModels, agent: ClaudeCode
) -> None:
    body = fixed(agent.first("What is 2+2?"))
    variants = {
        "thinking enabled": {"thinking": {"type": "enabled", "budget_tokens": 1024}},
        "thinking disabled": {"thinking": {"type": "disabled"}},
        "cache_control on the request": {"cache_control": {"type": "ephemeral"}},
        "service tier": {"service_tier": "auto"},
        "a hosted tool": {
            "tools": [*body["tools"], {"type": "web_search_20250305", "name": "web_search"}]
        },
        "a custom tool by type": {"tools": [{**body["tools"][0], "type": "custom"}]},
    }
    with ServerProcess(args(tiny_models), tmp_path / "server.log") as proc:
        plain = read(send(proc, body))[0]
        for name, change in variants.items():
            reply = send(proc, {**body, **change})
            assert reply["type"] == "message", name
            if name == "a hosted tool":  # left out: the same prompt
                assert read(reply)[0] == plain
        log = proc.log()
    assert "tools of type 'web_search_20250305' are left out" in log


def test_a_system_message_after_an_answer_is_a_turn_of_its_own(
    tmp_path: Path, tiny_models: TinyModels, agent: ClaudeCode
) -> None:
    body = fixed(agent.resumed("What is 2+2?", "4.", "And 3+3?", "34c"))
    late = {"role": "system", "content": "Answer in French."}
    later = {**body, "messages": [*body["messages"][:3], late, body["messages"][3]]}
    with ServerProcess(args(tiny_models), tmp_path / "server.log") as proc:
        before = send(proc, body)
        after = send(proc, later)
    # the turns before it are the same tokens, read from the live context: all of the
    # earlier request's prompt but its last turn (had the message joined the system
    # prompt, the reuse would end there, before the first question and its answer)
    total = read(before)[0]
    assert total - 16 <= read(after)[1] < total < read(after)[0]
