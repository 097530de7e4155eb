"""The Responses response object, built from an ``Outcome``, and its stream events.

``output`` is a ``reasoning`` item (when the answer had reasoning; with its
``encrypted_content`` when ``include`` asks for it, ``responses.reasoning``), a
``message`` item with one ``output_text`` part (unless the answer is only tool
calls), then one ``function_call`` item per call (a namespace's function named
as the namespace's, with ``namespace``). Item ids derive from the response's id
and the calls' ids, so a stream names each item as the final response does.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from localkv.prompt.template import ToolCall
from localkv.server.errors import ApiError
from localkv.server.protocols.responses.reasoning import sealed
from localkv.server.protocols.responses.tools import echo_tools
from localkv.server.protocols.responses.translate import Parsed
from localkv.server.requests import Outcome

__all__ = ["Answer", "Encoder", "Events"]


def event(kind: str, data: dict[str, Any]) -> str:
    """One Server-Sent Event, named as its ``type``."""
    text = json.dumps({"type": kind, **data}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {text}\n\n"


@dataclass(frozen=True, slots=True, kw_only=True)
class Answer:
    """The fixed parts of one response: its id, model, time and the request's echoes,
    and what the request says of its items (namespaces, sealed reasoning)."""

    id: str
    model: str
    created_at: int
    echo: dict[str, Any]
    names: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    sealed_reasoning: bool = False

    @classmethod
    def new(cls, model: str, body: dict[str, Any], parsed: Parsed) -> Answer:
        sampling = parsed.request.sampling
        text = body.get("text") if isinstance(body.get("text"), dict) else {}
        echo = {
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata") or {},
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_output_tokens": sampling.max_tokens,
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": echo_tools(body),
            "text": {"format": (text or {}).get("format") or {"type": "text"}},
            "truncation": "disabled",
            "previous_response_id": None,
            "reasoning": None,
            "store": False,  # nothing is stored, whatever the request said
            "user": body.get("user"),
        }
        return cls(
            id="resp_" + secrets.token_hex(12),
            model=model,
            created_at=int(time.time()),
            echo=echo,
            names=parsed.names,
            sealed_reasoning=parsed.sealed_reasoning,
        )

    @property
    def message_id(self) -> str:
        return "msg_" + self.id[len("resp_") :]

    @property
    def reasoning_id(self) -> str:
        return "rs_" + self.id[len("resp_") :]

    def head(self, state: str) -> dict[str, Any]:
        """The response before its output: ``in_progress`` while a stream runs."""
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": state,
            "error": None,
            "incomplete_details": None,
            "model": self.model,
            "output": [],
            **self.echo,
            "usage": None,
        }

    def status(self, outcome: Outcome) -> str:
        """``incomplete`` only for an answer cut at the request's own ``max_output_tokens``:
        one cut at the server's limit (``serve --max-tokens``) or the context's, for a
        request that set none, is ``completed`` (a client that retries an incomplete
        response, as Codex does, would otherwise run the same turn again)."""
        if outcome.finish_reason == "cancelled":
            return "cancelled"
        limited = self.echo.get("max_output_tokens") is not None
        return "incomplete" if outcome.finish_reason == "length" and limited else "completed"

    def body(self, outcome: Outcome, reasoning_tokens: int) -> dict[str, Any]:
        """The whole response, as ``create`` returns it and ``response.completed`` carries it."""
        state = self.status(outcome)
        out = self.head(state)
        if state == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        output: list[dict[str, Any]] = []
        if outcome.reasoning:
            output.append(self.reasoning_item(outcome.reasoning, "completed"))
        if outcome.text or not outcome.tool_calls:
            output.append(self.message_item(outcome.text, _item_status(state)))
        output.extend(self.call_item(c, "completed") for c in outcome.tool_calls)
        out["output"] = output
        out["usage"] = usage(outcome, reasoning_tokens)
        out["localkv"] = outcome.localkv()
        return out

    def message_item(self, text: str | None, state: str) -> dict[str, Any]:
        content = [] if text is None else [text_part(text)]
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "status": state,
            "content": content,
        }

    def reasoning_item(self, text: str | None, state: str) -> dict[str, Any]:
        content = [] if text is None else [{"type": "reasoning_text", "text": text}]
        item: dict[str, Any] = {
            "id": self.reasoning_id,
            "type": "reasoning",
            "summary": [],
            "content": content,
            "status": state,
        }
        if self.sealed_reasoning and text is not None:
            item["encrypted_content"] = sealed(text)
        return item

    def call_item(self, call: ToolCall, state: str, arguments: str | None = None) -> dict[str, Any]:
        """A call's item: a namespace's function by its own name, with the namespace."""
        namespace, name = self.names.get(call.name, (None, call.name))
        item = {
            "id": "fc_" + call.id.removeprefix("call_"),
            "type": "function_call",
            "call_id": call.id,
            "name": name,
            "arguments": call.arguments if arguments is None else arguments,
            "status": state,
        }
        if namespace is not None:
            item["namespace"] = namespace
        return item


def _item_status(state: str) -> str:
    return "incomplete" if state in ("incomplete", "cancelled") else "completed"


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage(outcome: Outcome, reasoning_tokens: int) -> dict[str, Any]:
    """Tokens as OpenAI counts them. ``cached_tokens``: restored from the live context or
    the disk cache; ``cache_write_tokens`` is 0, as the prompt's new blocks are saved after
    the answer, in the background."""
    return {
        "input_tokens": outcome.prompt_tokens,
        "input_tokens_details": {"cached_tokens": outcome.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": outcome.generated,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": outcome.prompt_tokens + outcome.generated,
    }


@dataclass(kw_only=True)
class Events:
    """A response's stream: the events for each piece of text, then the end."""

    answer: Answer
    seq: int = 0
    opened: list[str] = field(default_factory=list)  # the items' ids, in output order
    current: str | None = None  # "reasoning" | "message": the item open now
    text: str = ""
    reasoning: str = ""
    item_status: str = "completed"  # the message's, once the answer has ended

    def emit(self, kind: str, **data: Any) -> str:
        out = event(kind, {**data, "sequence_number": self.seq})
        self.seq += 1
        return out

    def start(self) -> list[str]:
        head = self.answer.head("in_progress")
        return [self.emit("response.created", response=head),
                self.emit("response.in_progress", response=head)]  # fmt: skip

    def piece(self, kind: str, text: str) -> list[str]:
        """Events for a piece of text (``kind``: ``text`` or ``reasoning``)."""
        item = "message" if kind == "text" else "reasoning"
        out = [] if self.current == item else [*self._close(), *self._open(item)]
        where = self._where(item)
        if item == "message":
            self.text += text
            out.append(self.emit("response.output_text.delta", **where, delta=text, logprobs=[]))
        else:
            self.reasoning += text
            out.append(self.emit("response.reasoning_text.delta", **where, delta=text))
        return out

    def finish(self, outcome: Outcome, reasoning_tokens: int) -> list[str]:
        """The open item closed, the calls, then ``response.completed`` (or
        ``response.incomplete``) with the whole response."""
        out = []
        needs_message = bool(outcome.text) or not outcome.tool_calls
        if needs_message and self.answer.message_id not in self.opened:
            out += [*self._close(), *self._open("message")]
        self.text, self.item_status = outcome.text, _item_status(self.answer.status(outcome))
        out += self._close()
        for call in outcome.tool_calls:
            index = len(self.opened)
            item = self.answer.call_item(call, "completed")
            self.opened.append(item["id"])
            at = {"item_id": item["id"], "output_index": index}
            out.append(self.emit("response.output_item.added", output_index=index,
                                 item=self.answer.call_item(call, "in_progress", "")))  # fmt: skip
            out.append(self.emit("response.function_call_arguments.delta", **at,
                                 delta=call.arguments))  # fmt: skip
            out.append(self.emit("response.function_call_arguments.done", **at,
                                 name=item["name"], arguments=call.arguments))  # fmt: skip
            out.append(self.emit("response.output_item.done", output_index=index, item=item))
        body = self.answer.body(outcome, reasoning_tokens)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        out.append(self.emit(kind, response=body))
        return out

    def error(self, exc: ApiError) -> str:
        return self.emit("error", code=exc.code, message=exc.message, param=exc.param)

    def _where(self, item: str) -> dict[str, Any]:
        item_id = self.answer.message_id if item == "message" else self.answer.reasoning_id
        return {"item_id": item_id, "output_index": self.opened.index(item_id), "content_index": 0}

    def _open(self, item: str) -> list[str]:
        answer = self.answer
        if item == "message":
            added, part = answer.message_item(None, "in_progress"), text_part("")
        else:
            added = answer.reasoning_item(None, "in_progress")
            part = {"type": "reasoning_text", "text": ""}
        self.opened.append(added["id"])
        self.current = item
        where = self._where(item)
        return [
            self.emit("response.output_item.added", output_index=where["output_index"],
                      item=added),
            self.emit("response.content_part.added", **where, part=part),
        ]  # fmt: skip

    def _close(self) -> list[str]:
        item, self.current = self.current, None
        if item is None:
            return []
        where = self._where(item)
        if item == "message":
            part = text_part(self.text)
            done = self.emit("response.output_text.done", **where, text=self.text, logprobs=[])
            whole = self.answer.message_item(self.text, self.item_status)
        else:
            part = {"type": "reasoning_text", "text": self.reasoning}
            done = self.emit("response.reasoning_text.done", **where, text=self.reasoning)
            whole = self.answer.reasoning_item(self.reasoning, "completed")
        index = where["output_index"]
        return [
            done,
            self.emit("response.content_part.done", **where, part=part),
            self.emit("response.output_item.done", output_index=index, item=whole),
        ]


class Encoder:
    """The gateway's encoder of one response: the body, or ``Events`` as a stream (comment
    lines as keep-alives)."""

    media_type: ClassVar[str] = "text/event-stream"

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.events = Events(answer=answer)

    def whole(self, outcome: Outcome) -> dict[str, Any]:
        return self.answer.body(outcome, outcome.reasoning_tokens)

    def opening(self) -> str:
        return "".join(self.events.start())

    def keepalive(self) -> str:
        """``response.in_progress`` again: an event, where a comment line would not reset a
        client's idle timer (Codex cancels a stream with no event for 5 minutes, and a
        long prompt's prefill on a CPU takes longer)."""
        return self.events.emit("response.in_progress", response=self.answer.head("in_progress"))

    def piece(self, kind: str, text: str) -> str:
        return "".join(self.events.piece(kind, text))

    def closing(self, outcome: Outcome) -> str:
        return "".join(self.events.finish(outcome, outcome.reasoning_tokens))

    def failure(self, error: ApiError) -> str:
        return self.events.error(error)
