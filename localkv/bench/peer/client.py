"""One streamed chat completion as a client sees it, and the JSON posts beside it.

``stream_chat`` sends an OpenAI chat completion with ``stream`` on to either server
and reads its server-sent events as they come: the time to the first content chunk,
the time to the last, the tokens generated (the ``usage`` chunk both servers send
when ``stream_options.include_usage`` asks for it), and what each server adds to its
last chunks: llama-server's ``timings`` and localkv's ``localkv`` object.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PeerHTTPError", "Reply", "get_json", "post_json", "stream_chat"]


class PeerHTTPError(RuntimeError):
    """A server answered with an error status, or its stream carried no content."""


# what a run keeps of each server's own report: llama-server's ``timings``; localkv's
# ``localkv`` object, the restore's steps and the prompt's building among it
_TIMINGS = ("cache_n", "prompt_n", "prompt_ms", "predicted_n", "predicted_per_second")
_LOCALKV = (
    "cached_tokens",
    "source",
    "verified",
    "restore_ms",
    "ttft_ms",
    "prompt_ms",
    "restore_steps",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply:
    """A streamed answer, timed from sending the request."""

    ttft_s: float  # to the first chunk with content
    last_s: float  # to the last chunk with content
    completion_tokens: int
    prompt_tokens: int
    text: str
    timings: Mapping[str, Any] = field(default_factory=dict)  # llama-server's own
    localkv: Mapping[str, Any] = field(default_factory=dict)  # localkv's cache report

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens a second after the first, as the client received them (None: too few)."""
        span = self.last_s - self.ttft_s
        if self.completion_tokens < 2 or span <= 0:
            return None
        return (self.completion_tokens - 1) / span

    def as_json(self) -> dict[str, Any]:
        """The figures a run keeps: times, token counts, what each server reused."""
        out: dict[str, Any] = {
            "ttft_s": self.ttft_s,
            "last_s": self.last_s,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens": self.prompt_tokens,
            "decode_tok_s": self.decode_tok_s,
        }
        if self.timings:  # llama-server: its own prefill and decode, and the tokens it reused
            out["server"] = {k: self.timings[k] for k in _TIMINGS if k in self.timings}
            out["server_prefill_s"] = float(self.timings.get("prompt_ms", 0.0)) / 1000
        if self.localkv:
            out["server"] = {k: self.localkv[k] for k in _LOCALKV if k in self.localkv}
            out["server_prefill_s"] = float(self.localkv.get("ttft_ms", 0.0)) / 1000
        return out


@dataclass(slots=True, kw_only=True)
class _Read:
    ttft_s: float = 0.0
    last_s: float = 0.0
    chunks: int = 0  # chunks with content
    text: str = ""
    usage: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    localkv: dict[str, Any] = field(default_factory=dict)

    def take(self, chunk: Mapping[str, Any], now: float) -> None:
        for choice in chunk.get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if content:
                self.ttft_s = self.ttft_s or now
                self.last_s = now
                self.chunks += 1
                self.text += content
        self.usage = chunk.get("usage") or self.usage
        self.timings = chunk.get("timings") or self.timings
        self.localkv = chunk.get("localkv") or self.localkv


def stream_chat(
    port: int, messages: Sequence[Mapping[str, str]], *, max_tokens: int, timeout_s: float
) -> Reply:
    """Stream one chat completion from the server on ``port`` (greedy, at most ``max_tokens``)."""
    body = {
        "model": "local",
        "messages": list(messages),
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    read = _Read()
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", json.dumps(body), _JSON)
        response = conn.getresponse()
        if response.status != 200:
            raise PeerHTTPError(f"HTTP {response.status}: {response.read()[:500]!r}")
        for raw in response:
            line = raw.decode("utf-8", "replace").strip()
            if line.startswith("data: {"):
                read.take(json.loads(line[len("data: ") :]), time.perf_counter() - t0)
    finally:
        conn.close()
    if not read.ttft_s:
        raise PeerHTTPError(f"the stream from port {port} carried no content")
    return Reply(
        ttft_s=read.ttft_s,
        last_s=read.last_s,
        completion_tokens=int(
            read.usage.get("completion_tokens") or read.timings.get("predicted_n") or read.chunks
        ),
        prompt_tokens=int(read.usage.get("prompt_tokens", 0)),
        text=read.text,
        timings=read.timings,
        localkv=read.localkv,
    )


_JSON = {"Content-Type": "application/json"}


def post_json(port: int, path: str, body: Mapping[str, Any], *, timeout_s: float) -> Any:
    """POST ``body`` to ``path``; the JSON reply, or ``PeerHTTPError`` naming the status."""
    return _call(port, "POST", path, json.dumps(body), timeout_s=timeout_s)


def get_json(port: int, path: str, *, timeout_s: float) -> Any:
    """GET ``path``; the JSON reply, or ``PeerHTTPError`` naming the status."""
    return _call(port, "GET", path, None, timeout_s=timeout_s)


def _call(port: int, method: str, path: str, body: str | None, *, timeout_s: float) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request(method, path, body, _JSON)
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    if response.status != 200:
        raise PeerHTTPError(f"{method} {path}: HTTP {response.status}: {data[:500]!r}")
    return json.loads(data)
