"""What every protocol's request becomes, and what the engine's answer is.

Each protocol (``protocols/``) parses its own JSON straight into these values;
the engine runs them and returns an ``Outcome``, which each protocol encodes
back into its own shapes. Nothing here knows a protocol: the same conversation
through any protocol is the same ``ChatRequest``, so the same prompt tokens.
While a request runs, its answer streams to a ``Channel``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from localkv.prompt.template import Message, ToolCall

__all__ = [
    "Breakpoint",
    "Channel",
    "ChatRequest",
    "CompletionRequest",
    "ModelFacts",
    "Outcome",
    "Sampling",
    "ToolChoice",
]

# ``Outcome.work``
WORK = ("state_captures", "tokenize_calls", "tokenized_chars", "renders", "rendered_chars")
# a disk restore's steps, in the order they run: the index lookup, the block files read
# (and checked) into the state, V into llama.cpp's columns (part of the read, summed over
# the reader threads; only with transposed V), the state's load into llama.cpp, the probe
RESTORE_STEPS = ("lookup", "read", "columns", "load", "probe")


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampling:
    """What the client asked of generation; ``max_tokens`` None: the server's limit."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    grammar: str | None = None  # GBNF the answer is sampled under (None: any text)


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: str  # "auto" | "none" | "required" | "function"
    name: str | None = None  # the function, for "function"


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """Keep the prompt up to the end of message ``message`` (-1: the tools, which render
    into the system prompt), at its last segment end, pinned ``ttl_s`` seconds."""

    message: int
    ttl_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatRequest:
    """A conversation to answer: its messages (the last from the user or a tool), the
    function tools the template renders (``{"type": "function", "function": {...}}``)."""

    messages: tuple[Message, ...]
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: ToolChoice | None = None  # None: no tools
    # prefixes to keep pinned for a while (Anthropic's ``cache_control``)
    breakpoints: tuple[Breakpoint, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class CompletionRequest:
    """Raw text (after the template's start tokens) or token ids to continue."""

    prompt: str | tuple[int, ...]
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """One generation: the answer and what the cache did for it."""

    text: str
    finish_reason: str  # "stop" | "length" | "tool_calls" | "cancelled"
    prompt_tokens: int
    cached_tokens: int
    generated: int
    # where the reused tokens came from: "live", "disk", "memory" (a state a restore from
    # the disk left held, ``cache.restore.held``) or "none"
    source: str
    verified: bool | None
    restore_ms: float
    miss_reason: str | None
    diverged_at: int | None
    ttft_s: float
    total_s: float
    # this request's state captures, tokenize calls (characters), template renders
    # (characters), counted
    work: tuple[int, ...] = (0,) * len(WORK)
    queued_s: float = 0.0  # from the request's arrival to the start of its work
    reasoning: str | None = None  # the answer's thinking (``reasoning_content``)
    reasoning_tokens: int = 0  # the thinking's tokens (at most ``generated``)
    tool_calls: tuple[ToolCall, ...] = ()
    stop_sequence: str | None = None  # the one that ended the answer
    # prompt tokens up to the request's last kept breakpoint not read from the cache
    pinned_new: int = 0
    breakpoints: tuple[int, int] = (0, 0)  # the request's cache breakpoints, and those kept
    # the disk restore's seconds by step (``RESTORE_STEPS``); empty when nothing came from disk
    restore_steps: tuple[tuple[str, float], ...] = ()
    prompt_s: float = 0.0  # building the prompt: the template's render and the tokenizing

    def localkv(self) -> dict[str, object]:
        """The ``localkv`` object of a response."""
        return {
            "cached_tokens": self.cached_tokens,
            "source": self.source,
            "verified": self.verified,
            "restore_ms": round(self.restore_ms, 3),
            "miss_reason": self.miss_reason,
            "diverged_at": self.diverged_at,
            "ttft_ms": round(self.ttft_s * 1000, 3),
            # the first token as the client sees it: from the request's arrival
            "arrival_ttft_ms": round((self.queued_s + self.ttft_s) * 1000, 3)
            if self.generated
            else None,
            "work": dict(zip(WORK, self.work, strict=True)),
            "prompt_ms": round(self.prompt_s * 1000, 3),
            **self._restore_steps(),
            **self._breakpoints(),
        }

    def _restore_steps(self) -> dict[str, object]:
        if self.source not in ("disk", "memory") or not self.restore_steps:
            return {}
        return {"restore_steps": {k: round(v * 1000, 3) for k, v in self.restore_steps}}

    def _breakpoints(self) -> dict[str, object]:
        asked, kept = self.breakpoints
        return {"breakpoints": {"asked": asked, "kept": kept}} if asked else {}


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelFacts:
    """What a protocol may say of the loaded model (Ollama's ``/api/tags`` and ``show``)."""

    model_id: str  # the file's stem: the name every answer gives
    path: str
    size: int
    modified: float  # the file's mtime
    digest: str  # its SHA-256 as the cache identity has it ("" without a cache)
    n_params: int
    n_ctx: int
    template: str  # the chat template's text, or a llama.cpp built-in format's name
    metadata: Mapping[str, str] = field(default_factory=dict)  # GGUF keys llama.cpp reports


class Channel(Protocol):
    """Where a running request's progress and answer go (``worker.Ticket``)."""

    arrived: float  # when the request arrived (``time.perf_counter``)

    def started(self) -> None: ...
    def text(self, piece: str) -> None: ...
    def reasoning(self, piece: str) -> None: ...
    def cancelled(self) -> bool: ...
