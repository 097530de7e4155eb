"""Anthropic's response shapes: a message, its usage, and its stream of events.

Usage (``usage``), for a prompt of P tokens of which R were restored from the
cache (the live context or the disk, ``localkv.cached_tokens``):
``cache_read_input_tokens`` is R; ``cache_creation_input_tokens`` is the
tokens up to the request's last ``cache_control`` breakpoint that was kept
that were not restored (computed now, written and pinned; 0 without a kept
breakpoint: none asked for, none saved, or past the clients' share of the
cache budget, see ``localkv.breakpoints``); ``input_tokens`` is P minus both;
``output_tokens`` the tokens generated. The three input figures add up to P,
which ``count_tokens`` gives.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, ClassVar

from localkv.server.errors import ApiError, anthropic_error
from localkv.server.requests import Outcome

__all__ = ["Message", "event", "stop_reason", "usage"]

PING = 'event: ping\ndata: {"type": "ping"}\n\n'


def event(kind: str, data: dict[str, Any]) -> str:
    """One Server-Sent Event of Anthropic's stream: its type as ``event:`` and in the data."""
    text = json.dumps({"type": kind, **data}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {text}\n\n"


def usage(outcome: Outcome) -> dict[str, int]:
    read, created = outcome.cached_tokens, outcome.pinned_new
    return {
        "input_tokens": outcome.prompt_tokens - read - created,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": read,
        "output_tokens": outcome.generated,
    }


def stop_reason(outcome: Outcome, asked: int | None = None) -> str:
    """Why the answer ended. ``max_tokens`` only when it reached the request's own limit
    (``asked``; None: count any cut): an answer cut short of it, at the server's
    ``--max-tokens`` or the context's end, is ``end_turn``, since a client that gets
    ``max_tokens`` below what it asked asks again for more (Claude Code, three times,
    then fails the turn)."""
    if outcome.tool_calls:
        return "tool_use"
    if outcome.finish_reason == "length" and (asked is None or outcome.generated >= asked):
        return "max_tokens"
    return "stop_sequence" if outcome.stop_sequence is not None else "end_turn"


def tool_id(call_id: str) -> str:
    """A tool call's id as Anthropic writes them (``toolu_...``)."""
    return "toolu_" + call_id.removeprefix("call_")


def _arguments(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def blocks(outcome: Outcome) -> list[dict[str, Any]]:
    """The answer's content blocks: its thinking, its text, its tool calls, in that order."""
    out: list[dict[str, Any]] = []
    if outcome.reasoning:
        out.append({"type": "thinking", "thinking": outcome.reasoning, "signature": ""})
    if outcome.text:
        out.append({"type": "text", "text": outcome.text})
    for call in outcome.tool_calls:
        args = _arguments(call.arguments)
        out.append({"type": "tool_use", "id": tool_id(call.id), "name": call.name, "input": args})
    return out


@dataclass(kw_only=True)
class Message:
    """One answer, the gateway's encoder: ``whole`` for a response body, or ``opening``,
    ``piece``s and ``closing`` for a stream (``ping`` events as keep-alives)."""

    media_type: ClassVar[str] = "text/event-stream"

    model: str
    asked: int | None = None  # the request's ``max_tokens``
    id: str = field(default_factory=lambda: "msg_" + secrets.token_hex(12))
    _open: str | None = None  # the type of the block being streamed
    _index: int = -1

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    def whole(self, outcome: Outcome) -> dict[str, Any]:
        return {
            **self._head(),
            "content": blocks(outcome),
            "stop_reason": stop_reason(outcome, self.asked),
            "stop_sequence": outcome.stop_sequence,
            "usage": usage(outcome),
            "localkv": outcome.localkv(),
        }

    def opening(self) -> str:
        """``message_start``: no content yet; the usage comes whole in ``message_delta``."""
        empty = {"input_tokens": 0, "output_tokens": 0}
        body = {**self._head(), "content": [], "stop_reason": None, "stop_sequence": None}
        return event("message_start", {"message": {**body, "usage": empty}})

    def keepalive(self) -> str:
        return PING

    def piece(self, kind: str, text: str) -> str:
        """A text (``kind`` "text") or thinking ("reasoning") delta, opening its block."""
        kind = "thinking" if kind == "reasoning" else kind
        if not text:
            return ""
        out = ""
        if self._open != kind:
            out += self._close()
            self._index += 1
            self._open = kind
            block = {"type": "text", "text": ""} if kind == "text" else {
                "type": "thinking", "thinking": "", "signature": ""
            }  # fmt: skip
            out += event("content_block_start", {"index": self._index, "content_block": block})
        delta = {"type": "text_delta", "text": text}
        if kind == "thinking":
            delta = {"type": "thinking_delta", "thinking": text}
        return out + event("content_block_delta", {"index": self._index, "delta": delta})

    def _close(self) -> str:
        if self._open is None:
            return ""
        self._open = None
        return event("content_block_stop", {"index": self._index})

    def closing(self, outcome: Outcome) -> str:
        """The tool calls, ``message_delta`` (stop reason, the whole usage), ``message_stop``."""
        out = self._close()
        for block in blocks(outcome):
            if block["type"] != "tool_use":
                continue
            self._index += 1
            start = {**block, "input": {}}
            out += event("content_block_start", {"index": self._index, "content_block": start})
            partial = json.dumps(block["input"], ensure_ascii=False)
            delta = {"type": "input_json_delta", "partial_json": partial}
            out += event("content_block_delta", {"index": self._index, "delta": delta})
            out += event("content_block_stop", {"index": self._index})
        reason = {
            "stop_reason": stop_reason(outcome, self.asked),
            "stop_sequence": outcome.stop_sequence,
        }
        out += event("message_delta", {"delta": reason, "usage": usage(outcome)})
        return out + event("message_stop", {})

    def failure(self, error: ApiError) -> str:
        return event("error", {"error": anthropic_error(error)[1]["error"]})
