"""The canonical request: one form of a conversation, whatever protocol it came by.

Two steps, in this order, on every protocol's ``ChatRequest`` before it becomes
tokens (the gateway applies them, to answers and to counts alike).

**System messages before the first answer join the system prompt**
(``place_system_messages``). Each protocol parses the messages in the order the
client sent them, a system (or developer) message wherever it stands. Those
before the first assistant message become one system message at the start:
their texts in order, each a paragraph of its own (``"\n\n"`` between them),
empty ones left out (none at all if every one is empty); a breakpoint on any of
them ends at that system prompt. Later system messages stay where they are, and
the chat template renders them as it renders a system message there: a system
turn in ChatML, Llama 3 or Qwen; folded into the next user turn by llama.cpp's
``gemma`` format, which has no such turn; a Jinja template that refuses one
there refuses the request (a 500 naming the template), as for any conversation
it cannot render. The
rule follows from what a system prompt is and from what a cache needs. Until the
model's first answer nothing it said stands between a system message and the
system prompt: both are instructions given before it acts, and the system
prompt is where the template puts those. After an answer, a system message is
an instruction given at that point, and moving it earlier would change the
tokens of turns already computed, which a conversation never does as it grows.
So a coding agent's first request, ``[user: question, system: environment]``,
is ``system prompt + environment`` then the question, through every protocol; a
new session with another question shares every token up to that question; and
the session's next request (Claude Code's ``--continue``: the same system message
as a string instead of one block, the answer, a new question) begins with the
first request's tokens. This is how
a conversation renders, not a client's quirk: ``--keep-client-headers`` does
not switch it off.

**Client cache-busters taken out, by named rules** (``RULES``), after the
system messages are placed, so a rule sees the system prompt the template
will render, however many system messages the client split it into.

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
applies none (the system messages are still placed).

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

__all__ = ["RULES", "Canonical", "Rule", "drop_billing_header", "place_system_messages"]

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
    return _moved(request, kept, index)


def place_system_messages(request: ChatRequest) -> ChatRequest:
    """``request`` with its system messages before the first assistant message joined into
    one at the start (empty ones left out); the request itself where there is nothing to
    join (none, or one that already starts the conversation)."""
    messages = request.messages
    answered = next((i for i, m in enumerate(messages) if m.role == "assistant"), len(messages))
    early = [i for i in range(answered) if messages[i].role == "system"]
    if not early or (early == [0] and messages[0].content):
        return request
    joined = set(early)
    prompt = "\n\n".join(messages[i].content for i in early if messages[i].content)
    kept = [Message("system", prompt)] if prompt else []
    index: list[int] = []  # each old message's new index (-1: left out)
    for i, message in enumerate(messages):
        if i in joined:
            index.append(0 if prompt else -1)
            continue
        index.append(len(kept))
        kept.append(message)
    return _moved(request, kept, index)


def _moved(request: ChatRequest, messages: Sequence[Message], index: Sequence[int]) -> ChatRequest:
    """``request`` with ``messages``; a breakpoint on old message ``i`` is one on
    ``index[i]`` (none where that is -1); one on the tools stays."""
    points = []
    for point in request.breakpoints:
        at = point.message if point.message < 0 else index[point.message]
        if point.message < 0 or at >= 0:
            points.append(Breakpoint(message=at, ttl_s=point.ttl_s))
    return dataclasses.replace(request, messages=tuple(messages), breakpoints=tuple(points))


RULES: tuple[Rule, ...] = (
    Rule(
        name="billing-header",
        does="Claude Code's x-anthropic-billing-header block",
        apply=drop_billing_header,
    ),
)


class Canonical:
    """Makes each request canonical: its system messages placed, then ``rules`` applied,
    each rule logged the first time it applies."""

    def __init__(self, rules: Sequence[Rule] = RULES) -> None:
        self.rules = tuple(rules)
        self._told: set[str] = set()

    def __call__(self, request: ChatRequest) -> ChatRequest:
        request = place_system_messages(request)
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
