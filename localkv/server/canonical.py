"""Client cache-busters taken out of a request before it becomes tokens, by named rules.

A prefix cache reuses a request's tokens up to the first one that differs
from what was computed before. Some clients put text into every request that
is not addressed to the model and changes from one session to the next, at the
very start of the prompt, so that nothing after it can ever be reused. A rule
here recognises one such text exactly and takes it out of the neutral request
(``ChatRequest``), whichever protocol it came in by; the canonical request is
then tokenized, cached and answered like any other. The cache is keyed on the
canonical tokens as always, so what a rule guarantees is that the answer read
from the cache equals the answer computed afresh for the canonical request; what
it changes is the model's input, which is why each rule is listed here, logged
(at debug level, the first time it applies) and can be switched off:
``localkv serve --keep-client-headers`` (``LOCALKV_KEEP_CLIENT_HEADERS=1``)
applies none.

The rules (``RULES``):

``billing-header``
    Claude Code starts its system prompt with a text block such as
    ``x-anthropic-billing-header: cc_version=2.1.332.34c; cc_entrypoint=sdk-cli;``
    (and, against Anthropic's own API, a per-request ``cch=<nonce>;``). It is
    metadata for Anthropic's billing, not an instruction; its last characters
    follow the session's first question, so every new session's prompt
    differed from its first few tokens. The rule removes, at the start of a
    system message's text, ``x-anthropic-billing-header:`` followed by one or
    more `` key=value;`` fields, and the spaces and one line break after them;
    a system message left empty is removed. Text that merely mentions the
    header elsewhere is kept.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from localkv.prompt.template import Message
from localkv.server.requests import Breakpoint, ChatRequest

__all__ = ["RULES", "Canonical", "Rule", "drop_billing_header"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Rule:
    """A named rewrite of a request: returns the request itself when it does not apply."""

    name: str
    does: str  # what it takes out, in a few words (the log line says it)
    apply: Callable[[ChatRequest], ChatRequest]


_BILLING = re.compile(r"x-anthropic-billing-header:(?: [A-Za-z0-9_]+=[^;\s]*;)+[ \t]*\n?")


def drop_billing_header(request: ChatRequest) -> ChatRequest:
    """``request`` without the billing header at the start of its system messages."""
    messages = list(request.messages)
    changed = False
    for i, message in enumerate(messages):
        found = _BILLING.match(message.content) if message.role == "system" else None
        if found is not None:
            messages[i] = dataclasses.replace(message, content=message.content[found.end() :])
            changed = True
    if not changed:
        return request
    return _without_empty_system(request, messages)


def _without_empty_system(request: ChatRequest, messages: Sequence[Message]) -> ChatRequest:
    """``request`` with ``messages``, less the system messages left empty; the breakpoints
    move with the messages they end (one on a removed message ends at the one before)."""
    kept: list[Message] = []
    index: list[int] = []  # each old message's new index (-1: before every message)
    for message in messages:
        if message.role == "system" and not message.content:
            index.append(len(kept) - 1)
            continue
        index.append(len(kept))
        kept.append(message)
    points = []
    for point in request.breakpoints:
        at = point.message if point.message < 0 else index[point.message]
        if point.message < 0 or at >= 0:
            points.append(Breakpoint(message=at, ttl_s=point.ttl_s))
    return dataclasses.replace(request, messages=tuple(kept), breakpoints=tuple(points))


RULES: tuple[Rule, ...] = (
    Rule(
        name="billing-header",
        does="Claude Code's x-anthropic-billing-header block",
        apply=drop_billing_header,
    ),
)


class Canonical:
    """Applies ``rules`` to each request, logging each rule the first time it applies."""

    def __init__(self, rules: Sequence[Rule] = RULES) -> None:
        self.rules = tuple(rules)
        self._told: set[str] = set()

    def __call__(self, request: ChatRequest) -> ChatRequest:
        for rule in self.rules:
            out = rule.apply(request)
            if out is request:
                continue
            if rule.name not in self._told:
                self._told.add(rule.name)
                log.debug(
                    "canonical rule %r applied: %s left out of the prompt "
                    "(--keep-client-headers keeps it; logged once)",
                    rule.name,
                    rule.does,
                )
            request = out
        return request
