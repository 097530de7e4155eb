"""Request bodies and headers shaped as Claude Code 2.1 sends them to ``/v1/messages``.

The shapes are those of the requests ``claude -p`` sent (version 2.1.332,
``ANTHROPIC_BASE_URL`` at a local server): a system prompt of three text
blocks, the first a billing header whose last characters follow the session's
first question; a user message of a reminder and the question, then a
``role: "system"`` message holding the environment (one text block with
``cache_control``); ``thinking``, ``context_management``, ``output_config`` and
``metadata`` at the top; tools with ``input_schema`` (one with
``defer_loading``). A ``--continue`` request resends the first two messages,
the environment now a plain string, then the answer and the next question. The
texts here are made up; only their shapes and places are Claude Code's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["HEADERS", "PATH", "ClaudeCode", "billing_header"]

PATH = "/v1/messages?beta=true"
BETAS = (
    "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
    "mid-conversation-tool-changes-2026-07-01,thinking-token-count-2026-05-13,"
    "advanced-tool-use-2025-11-20,effort-2025-11-24"
)
HEADERS = {
    "Content-Type": "application/json",
    "anthropic-version": "2023-06-01",
    "anthropic-beta": BETAS,
    "anthropic-dangerous-direct-browser-access": "true",
    "x-app": "cli",
    "x-api-key": "none",
    "User-Agent": "claude-cli/2.1.332 (external, sdk-cli)",
    "X-Stainless-Timeout": "600",
}
EPHEMERAL = {"type": "ephemeral"}
REMINDER = (
    "<system-reminder>\nWhen you commit, end the message with a line that says the change "
    "was written with the help of this tool.\n</system-reminder>\n"
)
TOOLS: list[dict[str, Any]] = [
    {
        "name": "Bash",
        "description": "Runs a shell command and returns its output.",
        "input_schema": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The command to run"},
                "timeout": {"type": "number", "description": "Milliseconds to wait"},
            },
            "required": ["command"],
            "additionalProperties": False,
        },
    },
    {
        "name": "Read",
        "description": "Reads a file.",
        "input_schema": {
            "type": "object",
            "properties": {"file_path": {"type": "string"}},
            "required": ["file_path"],
        },
    },
    {
        "name": "DeferredToolPlaceholder",
        "description": "Keeps deferred tool loading active; never call this tool.",
        "input_schema": {"type": "object", "properties": {}},
        "defer_loading": True,
    },
]


def billing_header(digits: str, nonce: str | None = None) -> str:
    """The first system block; ``nonce``: the ``cch=`` Anthropic's own API is sent."""
    tail = f" cch={nonce};" if nonce is not None else ""
    return f"x-anthropic-billing-header: cc_version=2.1.332.{digits}; cc_entrypoint=sdk-cli;{tail}"


@dataclass(frozen=True)
class ClaudeCode:
    """One project's texts: the instructions (system prompt) and the environment block."""

    instructions: str
    environment: str
    max_tokens: int = 32000

    def system(self, digits: str) -> list[dict[str, Any]]:
        return [
            {"type": "text", "text": billing_header(digits)},
            {
                "type": "text",
                "text": "You are a coding agent, built on an agent SDK.",
                "cache_control": EPHEMERAL,
            },
            {"type": "text", "text": self.instructions, "cache_control": EPHEMERAL},
        ]

    def first(self, question: str, digits: str = "34c") -> dict[str, Any]:
        """A new session's first request."""
        environment = {"type": "text", "text": self.environment, "cache_control": EPHEMERAL}
        return self._body(
            digits,
            [self._asked(question), {"role": "system", "content": [environment]}],
        )

    def resumed(self, question: str, answer: str, follow_up: str, digits: str) -> dict[str, Any]:
        """``claude --continue``: the first turn, its answer, the next question."""
        asked = {"type": "text", "text": follow_up, "cache_control": EPHEMERAL}
        messages = [
            self._asked(question),
            {"role": "system", "content": self.environment},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            {"role": "user", "content": [asked]},
        ]
        return self._body(digits, messages)

    @staticmethod
    def _asked(question: str) -> dict[str, Any]:
        blocks = [{"type": "text", "text": REMINDER}, {"type": "text", "text": question}]
        return {"role": "user", "content": blocks}

    def _body(self, digits: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
        session = {"device_id": "0" * 64, "account_uuid": "", "session_id": digits}
        return {
            "model": "local",
            "messages": messages,
            "system": self.system(digits),
            "tools": TOOLS,
            "metadata": {"user_id": json.dumps(session)},
            "max_tokens": self.max_tokens,
            "thinking": {"type": "adaptive", "display": "omitted"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"},
            "stream": True,
        }
