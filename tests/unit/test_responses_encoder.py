"""The Responses encoder: what a stream sends while the model is busy, and when an answer
cut short is ``incomplete``."""

from __future__ import annotations

import json
from typing import Any

from localkv.server.protocols.responses.replies import Answer, Encoder
from localkv.server.protocols.responses.translate import chat_request
from localkv.server.requests import Outcome


def _encoder(body: dict[str, Any]) -> Encoder:
    return Encoder(Answer.new("tiny", body, chat_request(body)))


def _events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def _cut(tokens: int) -> Outcome:
    return Outcome(
        text="x" * tokens,
        finish_reason="length",
        prompt_tokens=10,
        cached_tokens=0,
        generated=tokens,
        source="none",
        verified=None,
        restore_ms=0.0,
        miss_reason=None,
        diverged_at=None,
        ttft_s=0.0,
        total_s=0.0,
    )


def test_a_keep_alive_is_an_event_a_client_counts_as_progress() -> None:
    """A comment line resets no client's idle timer (Codex cancels a stream with no event
    for 5 minutes): the keep-alive is ``response.in_progress`` again, in sequence."""
    encoder = _encoder({"model": "tiny", "input": "Hello", "stream": True})
    opened = _events(encoder.opening())
    beats = _events(encoder.keepalive() + encoder.keepalive())
    assert [e["type"] for e in beats] == ["response.in_progress"] * 2
    assert all(e["response"]["status"] == "in_progress" for e in beats)
    numbers = [e["sequence_number"] for e in opened + beats]
    assert numbers == list(range(len(numbers)))
    assert beats[0]["response"]["id"] == opened[0]["response"]["id"]


def test_only_the_requests_own_limit_makes_an_answer_incomplete() -> None:
    asked = _encoder({"model": "tiny", "input": "Hello", "max_output_tokens": 5})
    body = asked.whole(_cut(5))
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    unasked = _encoder({"model": "tiny", "input": "Hello", "stream": True})
    assert unasked.whole(_cut(8))["status"] == "completed"
    unasked.opening()
    last = _events(unasked.closing(_cut(8)))[-1]
    assert last["type"] == "response.completed" and last["response"]["status"] == "completed"
