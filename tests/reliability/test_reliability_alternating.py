"""Two conversations taking turns through one server: each resumes from the cache.

A coding agent and its subagent (or two agents) share one server: their
conversations, each behind its own long system prompt, alternate, so the live
context always holds the other one. Each turn after a conversation's first must
still compute only what is new since its last answer: the new message, never
its prefix again, nor its last answer (restored from disk, verified). The work
is counted in prompt tokens from the replies (``usage`` and
``localkv.cached_tokens``), never timed. The model is a tiny sliding-window one
(gemma3): a restore can end only where its session settled, so each turn's end
must be one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.server import ServerProcess, post
from support.tinyarch import build

PREFIX_TOKENS = 6000  # about: the system prompt a coding agent sends
TURNS = 10
CTX = 8192
RULE = "Rule {i} of {name}: answer briefly and kindly."  # 12 to 14 tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    return build(tmp_path_factory.mktemp("swa") / "gemma3.gguf", "gemma3", default_model_path)


def system(name: str) -> str:
    rules = " ".join(RULE.format(i=i, name=name) for i in range(PREFIX_TOKENS // 12))
    return f"You are {name}. {rules}"


def turn(server: ServerProcess, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0}
    status, reply = post(server, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, reply
    return reply


def test_alternating_conversations_prefill_only_their_new_tokens(
    model: Path, tmp_path: Path
) -> None:
    conversations = {name: [{"role": "system", "content": system(name)}] for name in "AB"}
    last: dict[str, tuple[int, int]] = {}  # each conversation's last prompt and answer
    prefilled: list[tuple[str, int, int]] = []  # (conversation, prefilled, new since its last)
    args = ["--model", str(model), "--threads", "1", "--ctx", str(CTX)]
    with ServerProcess(args, tmp_path / "server.log") as server:
        for i in range(TURNS):
            for name, messages in conversations.items():
                messages.append({"role": "user", "content": f"Question {i} for {name}?"})
                reply = turn(server, messages)
                prompt = reply["usage"]["prompt_tokens"]
                generated = reply["usage"]["completion_tokens"]
                extra = reply["localkv"]
                answer = reply["choices"][0]["message"]["content"]
                messages.append({"role": "assistant", "content": answer})
                if name in last:  # the other conversation ran in between
                    before, answered = last[name]
                    assert extra["source"] == "disk" and extra["verified"] is True, extra
                    new = prompt - before - answered  # the message, the answer's closing
                    prefilled.append((name, prompt - extra["cached_tokens"], new))
                else:
                    assert prompt >= PREFIX_TOKENS
                last[name] = (prompt, generated)
    assert len(prefilled) == 2 * (TURNS - 1)
    assert all(done <= new for _, done, new in prefilled), prefilled
    assert "could not save the snapshot" not in server.log()
