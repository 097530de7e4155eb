"""OpenAI's chat and completions answers: bodies and stream chunks, from an ``Outcome``.

``Reply`` is the gateway's encoder for both routes: Server-Sent Events ending in
``data: [DONE]``, comment lines as keep-alives."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import ClassVar

from localkv.server.errors import ApiError
from localkv.server.requests import Outcome

__all__ = ["Reply", "sse"]

DONE = "data: [DONE]\n\n"
KEEP_ALIVE = ": keep-alive\n\n"


def sse(data: dict[str, object]) -> str:
    """One Server-Sent Event carrying ``data`` as JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(outcome: Outcome) -> dict[str, object]:
    return {
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": outcome.generated,
        "total_tokens": outcome.prompt_tokens + outcome.generated,
        "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
    }


def finish(outcome: Outcome) -> str:
    if outcome.finish_reason in ("length", "tool_calls"):
        return outcome.finish_reason
    return "stop"


def message(outcome: Outcome) -> dict[str, object]:
    """The assistant message of a chat response: content, reasoning, tool calls."""
    out: dict[str, object] = {"role": "assistant", "content": outcome.text}
    if outcome.reasoning is not None:
        out["reasoning_content"] = outcome.reasoning
    if outcome.tool_calls:
        out["content"] = outcome.text or None
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in outcome.tool_calls
        ]
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply:
    """The fixed parts of one response: its id, kind, model and creation time."""

    media_type: ClassVar[str] = "text/event-stream"

    id: str
    chat: bool  # chat.completion, else text_completion
    model: str
    created: int
    include_usage: bool = False

    @classmethod
    def new(cls, chat: bool, model: str, include_usage: bool = False) -> Reply:
        prefix = "chatcmpl-" if chat else "cmpl-"
        return cls(
            id=prefix + secrets.token_hex(12),
            chat=chat,
            model=model,
            created=int(time.time()),
            include_usage=include_usage,
        )

    def _head(self, stream: bool) -> dict[str, object]:
        kind = "chat.completion" if self.chat else "text_completion"
        if stream and self.chat:
            kind += ".chunk"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def body(self, outcome: Outcome) -> dict[str, object]:
        """The whole non-streamed response."""
        if self.chat:
            choice: dict[str, object] = {
                "index": 0,
                "message": message(outcome),
                "logprobs": None,
                "finish_reason": finish(outcome),
            }
        else:
            choice = {
                "index": 0,
                "text": outcome.text,
                "logprobs": None,
                "finish_reason": finish(outcome),
            }
        return {
            **self._head(False),
            "choices": [choice],
            "usage": usage(outcome),
            "localkv": outcome.localkv(),
        }

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        *,
        role: bool = False,
        reasoning: str | None = None,
        tool_calls: list[dict[str, object]] | None = None,
    ) -> str:
        """A stream chunk with new text (or reasoning, tool calls, the opening role, or
        the finish reason)."""
        if self.chat:
            delta: dict[str, object] = {}
            if role:
                delta = {"role": "assistant", "content": ""}
            elif text is not None:
                delta = {"content": text}
            elif reasoning is not None:
                delta = {"reasoning_content": reasoning}
            elif tool_calls is not None:
                delta = {"tool_calls": tool_calls}
            choice: dict[str, object] = {"index": 0, "delta": delta, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None}
        choice["finish_reason"] = finish_reason
        data = {**self._head(True), "choices": [choice]}
        if self.include_usage:
            data["usage"] = None
        return sse(data)

    def tool_call_chunks(self, outcome: Outcome) -> list[str]:
        """The tool calls as OpenAI streams them: the id and name, then the arguments."""
        out = []
        for i, call in enumerate(outcome.tool_calls):
            head = {"name": call.name, "arguments": ""}
            opening = {"index": i, "id": call.id, "type": "function", "function": head}
            out.append(self.chunk(None, tool_calls=[opening]))
            arguments = {"index": i, "function": {"arguments": call.arguments}}
            out.append(self.chunk(None, tool_calls=[arguments]))
        return out

    def finish_chunk(self, outcome: Outcome) -> str:
        """The chunk that ends the choice: its finish reason and the ``localkv`` object."""
        chunk = json.loads(self.chunk(None, finish(outcome))[len("data: ") :])
        chunk["localkv"] = outcome.localkv()
        return sse(chunk)

    def usage_chunk(self, outcome: Outcome) -> str:
        """The last chunk when the client asked for usage: no choices, the usage."""
        return sse(
            {
                **self._head(True),
                "choices": [],
                "usage": usage(outcome),
                "localkv": outcome.localkv(),
            }
        )

    # the gateway's encoder
    def whole(self, outcome: Outcome) -> dict[str, object]:
        return self.body(outcome)

    def opening(self) -> str:
        return self.chunk(None, role=True)

    def keepalive(self) -> str:
        return KEEP_ALIVE

    def piece(self, kind: str, text: str) -> str:
        return self.chunk(None, reasoning=text) if kind == "reasoning" else self.chunk(text)

    def closing(self, outcome: Outcome) -> str:
        out = "".join(self.tool_call_chunks(outcome)) + self.finish_chunk(outcome)
        if self.include_usage:
            out += self.usage_chunk(outcome)
        return out + DONE

    def failure(self, error: ApiError) -> str:
        return sse(error.body()) + DONE
