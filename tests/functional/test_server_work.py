"""A real server does no work a request does not need: counted, through HTTP.

Each response's ``localkv.work`` counts this request's whole-state captures
and tokenize calls. A live repeat of a request captures no state and
tokenizes none of its messages' text; a changed message is tokenized again,
an unchanged one after it is not (text between two special tokens is kept by
its characters alone, so its tokens are never stale).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.server import ServerProcess
from support.tinymodels import TinyModels

SYSTEM = " ".join(f"Rule {i}: answer from the notes, briefly and plainly." for i in range(40))
QUESTION = "What do the notes say about the harbour and its lights?"


@pytest.fixture()
def server(tmp_path: Path, tiny_models: TinyModels) -> Iterator[ServerProcess]:
    args = ["--model", str(tiny_models.base), "--threads", "1", "--ctx", "2048"]
    proc = ServerProcess(args, tmp_path / "server.log").start()
    yield proc
    assert proc.stop() == 0, proc.log()


def chat(server: ServerProcess, system: str, user: str) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "temperature": 0,
        "max_tokens": 6,
    }
    request = urllib.request.Request(
        server.base_url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as r:
        return json.loads(r.read())["localkv"]  # type: ignore[no-any-return]


def test_a_live_repeat_captures_nothing_and_tokenizes_no_message(server: ServerProcess) -> None:
    first = chat(server, SYSTEM, QUESTION)
    assert first["work"]["state_captures"] == 1  # its blocks are saved: one capture
    assert first["work"]["tokenized_chars"] >= len(SYSTEM) + len(QUESTION)
    # the first token as the client sees it includes the time before the engine began
    assert first["arrival_ttft_ms"] >= first["ttft_ms"] > 0

    repeat = chat(server, SYSTEM, QUESTION)
    assert repeat["source"] == "live"
    assert repeat["work"]["state_captures"] == 0  # every block is stored
    # only the template's markup around the messages is tokenized
    assert repeat["work"]["tokenized_chars"] < 100


def test_a_changed_message_is_tokenized_again(server: ServerProcess) -> None:
    chat(server, SYSTEM, QUESTION)
    other = QUESTION.replace("harbour", "lighthouse")
    asked = chat(server, SYSTEM, other)["work"]
    assert len(other) <= asked["tokenized_chars"] < len(other) + 100  # the system prompt is known

    changed = SYSTEM.replace("Rule 7", "Rule 8")  # the same question after another system prompt
    again = chat(server, changed, other)["work"]
    # the changed text is tokenized again; the question's text, unchanged, is not
    assert len(changed) <= again["tokenized_chars"] < len(changed) + 100
