"""Snapshots for the prefixes the server saves, so ``cache ls`` and ``GET /v1/localkv/cache``
list them and they can be pinned and removed like any other.

Each request's prefix (its prompt and answer, a conversation so far) is saved in
the background; once written, its chain is named ``server: <first words>``, the
first words of the request's first message (or prompt). One conversation keeps
one snapshot, as a chat does: a new question after the same stem, or the
conversation going on, replaces its earlier one, keeping its pin and hits
(``server.rows``; a completion's: same label, its tokens the start of the new chain).

A request may ask for prefixes to be kept (``Breakpoint``: Anthropic's
``cache_control``): each is the prompt up to the last segment end at or before
the end of a message, so a block of the saved chain ends there; where each
message ends is known from the prompt's one build, so any number of breakpoints
costs work linear in the messages, and at most ``MAX_PINS`` are kept. Once
saved, that block is named ``server: <first words> · kept`` and pinned until its
time to live has passed (``pinned_until``), so eviction leaves it until then; the
same breakpoint again extends the pin. After it the pin lapses and the snapshot
is evicted first. The pin is a client's (``ClientPin``): past the clients' share
of the budget it is not made, and ``KeptPins`` says which were, so the usage
counts only what was kept.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from localkv.cache.catalogue import ClientPin, client_pin_fits, pinned, save_snapshot
from localkv.cache.save import SaveResult
from localkv.prompt.request import Document, DocumentError
from localkv.prompt.template import Message
from localkv.runtime.chatsnapshot import ConversationSnapshot
from localkv.runtime.reports import printable
from localkv.server.errors import bad_request
from localkv.server.requests import Breakpoint

if TYPE_CHECKING:
    from localkv.cache.prefix import PrefixCache
    from localkv.runtime import Runtime
    from localkv.server.conversation import Prompt
    from localkv.server.requests import Outcome

__all__ = [
    "KEPT",
    "MAX_PINS",
    "KeptPins",
    "Pin",
    "new_tokens",
    "pin_ends",
    "pin_namer",
    "prefill_body",
    "prefix_label",
    "snapshot_namer",
    "words",
]

log = logging.getLogger(__name__)

MAX_PINS = 4  # breakpoints kept per request, as Anthropic's API takes at most

_WORDS = 6
KEPT = " · kept"  # the label's end of a breakpoint's pinned snapshot
_MAX_CHARS = 48


def prefix_label(first: str | Sequence[int] | Sequence[Message]) -> str:
    """``server: You answer questions about the…``: the first words of what the prefix
    starts with (a message's text, a prompt; ``token ids`` for a prompt of ids)."""
    if isinstance(first, str):
        text = first
    elif first and isinstance(first[0], Message):
        text = next((m.content for m in first if isinstance(m, Message) and m.content), "")
    else:
        text = "token ids" if first else ""
    head = words(text)
    return f"server: {head}" if head else "server: (empty)"


def words(text: str) -> str:
    """The first words of ``text``, printable, ``…`` where more follow (empty: none)."""
    split = text.split()
    head = printable(" ".join(split[:_WORDS]))[:_MAX_CHARS]
    more = len(split) > _WORDS or len(head) == _MAX_CHARS
    return f"{head}{'…' if more else ''}" if head else ""


def snapshot_namer(
    snapshot: ConversationSnapshot, label: str, n_tokens: int
) -> Callable[[SaveResult], None]:
    """What the save runs once the prefix is written: name it ``label``.

    The snapshot names the chain as saved: through the answer's closing tokens
    (``n_tokens``), or where it ends before them (an answer cut by a full context
    leaves its last token unread, so no block can end after it).
    """

    def name(saved: SaveResult) -> None:
        if saved.tip is not None and saved.end != n_tokens:
            log.debug("the prefix saved ends at %d of %d tokens", saved.end, n_tokens)
        snapshot.name(saved, label, saved.end or n_tokens)

    return name


@dataclass(frozen=True, slots=True)
class Pin:
    """A breakpoint as a prompt position: its first ``end`` tokens, kept ``ttl_s``."""

    end: int
    ttl_s: float


def pin_ends(
    prompt: Prompt, messages: Sequence[Message], breakpoints: Sequence[Breakpoint]
) -> list[Pin]:
    """Where ``breakpoints`` (indices into the request's ``messages``) end in the prompt:
    at the last segment end before which no later message's text comes.

    The segment ends are the conversation's own (``state.boundaries``), the same
    whatever the protocol: a breakpoint adds none, so the schedule, and with it what
    the cache holds, does not depend on breakpoints. A breakpoint on the tools is one
    on the system prompt they are rendered in. Where each message ends comes from the
    prompt's one build (``Prompt.reach``): the work is linear in the messages, however
    many are marked. Of the ends found, the last ``MAX_PINS`` are kept (the longest:
    a shorter one's full blocks are in their chains), as Anthropic keeps at most that
    many breakpoints.
    """
    ends, n_messages = sorted(prompt.state.boundaries), len(messages)
    within = _ends_within(prompt.reach, n_messages)
    has_system = bool(messages) and messages[0].role == "system"
    pins: dict[int, float] = {}
    missed = 0
    for point in breakpoints:
        if point.message >= n_messages - 1:
            end = ends[-1] if ends else 0
        else:  # the tools: the system prompt, or the preamble that is one
            at = 0 if point.message < 0 and has_system else max(point.message, -1)
            end = within[at + 1]
        if end == 0:
            missed += 1
            continue
        pins[end] = max(pins.get(end, 0.0), point.ttl_s)
    kept = sorted(pins.items())[-MAX_PINS:]
    if missed or len(pins) > len(kept):
        log.info(
            "%d cache breakpoints: %d have no segment end, %d more than %d; not kept",
            len(breakpoints),
            missed,
            len(pins) - len(kept),
            MAX_PINS,
        )
    return [Pin(end, ttl) for end, ttl in kept]


def _ends_within(reach: dict[int, int], n_messages: int) -> list[int]:
    """For each message ``i`` from -1 (none) on, at ``[i + 1]``: the last segment end
    before which no message after ``i`` comes (0: none)."""
    last = [0] * (n_messages + 1)
    for end, at in reach.items():
        if -1 <= at < n_messages:
            last[at + 1] = max(last[at + 1], end)
    for i in range(1, len(last)):
        last[i] = max(last[i], last[i - 1])
    return last


def new_tokens(end: int, outcome: Outcome) -> int:
    """The prompt tokens up to ``end`` (the last kept pin's) that were not read from the
    cache: computed by this request and written with its pins (Anthropic's cache creation)."""
    return max(0, min(end, outcome.prompt_tokens) - outcome.cached_tokens)


class KeptPins:
    """Where the pins one request's save made end (filled on the save's thread)."""

    def __init__(self) -> None:
        self.ends: list[int] = []

    @property
    def last(self) -> int:
        return max(self.ends, default=0)


def pin_namer(
    runtime: Runtime,
    namer: Callable[[SaveResult], None],
    label: str,
    pins: Sequence[Pin],
    prompt: tuple[Sequence[int], Sequence[int]],
    *,
    kept: KeptPins,
) -> Callable[[SaveResult], None]:
    """``namer``, then the stored block ending at each pin (of ``prompt``'s tokens and
    batch ends) named and pinned for the pin's time, as a client's pin, if it fits the
    clients' share of the budget (else it stays an unpinned block of the conversation's
    saved chain); ``kept`` gets the ends of those whose pin holds."""
    if not pins:
        return namer
    tokens, ends = prompt

    def name(saved: SaveResult) -> None:
        namer(saved)
        cache = runtime.cache
        if cache is None or saved.tip is None or saved.not_kept:
            return
        missing = 0
        for pin in pins:
            try:
                tip = _block_ending(cache, tokens[: pin.end], [e for e in ends if e <= pin.end])
            except (OSError, sqlite3.Error) as exc:
                log.warning("could not look up the prefix to pin: %s", exc)
                return
            if tip is None:
                missing += 1
                continue
            if not client_pin_fits(cache, tip):  # saved unpinned, with the conversation
                continue
            until = ClientPin(time.time() + pin.ttl_s)
            made = save_snapshot(cache, tip, (), pin.end, label=f"{label}{KEPT}", pin=until)
            if pinned(cache, made):
                kept.ends.append(pin.end)
        if len(kept.ends) < len(pins):
            log.info(
                "cache breakpoints: %d kept, %d without a saved block, %d past the clients' "
                "share of the cache budget (LOCALKV_CLIENT_PINS)",
                len(kept.ends),
                missing,
                len(pins) - missing - len(kept.ends),
            )

    return name


def _block_ending(cache: PrefixCache, tokens: Sequence[int], ends: Sequence[int]) -> str | None:
    """The stored block whose chain holds exactly ``tokens`` (None: none is stored).

    The lookup finds the longest chain sharing them, whose last block may go on past
    them (a longer prompt's tip after the same full blocks): then its sibling that
    ends where they end, with their tokens.
    """
    chain = cache.plan(tokens, ends).chain
    if not chain:
        return None
    last, n = chain[-1], len(tokens)
    if last.end == n:
        return last.hash
    if last.start >= n:
        return None
    own = np.asarray(tokens[last.start :], dtype=np.int32)
    for row in cache.store.children(last.parent, last.identity, last.namespace):
        if row.start == last.start and row.end == n and np.array_equal(row.tokens, own):
            return row.hash
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillBody:
    """What ``POST /v1/localkv/prefill`` asks for."""

    system: str | None
    documents: list[Document]
    label: str | None
    pin: bool


def prefill_body(body: dict[str, Any]) -> PrefillBody:
    """``POST /v1/localkv/prefill``'s body (a 400 naming the field for a bad one)."""
    system = _optional_str(body, "system")
    documents = _documents(body.get("documents", []))
    if not documents and not system:
        raise bad_request("give 'documents', a 'system' prompt, or both", "documents")
    label = _optional_str(body, "label")
    pin = body.get("pin", False)
    if not isinstance(pin, bool):
        raise bad_request("'pin' must be true or false", "pin")
    return PrefillBody(system=system, documents=documents, label=label, pin=pin)


def _optional_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string", name)
    return value


def _documents(raw: object) -> list[Document]:
    if not isinstance(raw, list):
        raise bad_request("'documents' must be an array", "documents")
    docs = []
    for i, item in enumerate(raw):
        where = f"documents[{i}]"
        if isinstance(item, str):
            text, name = item, None
        elif isinstance(item, dict) and isinstance(item.get("text"), str):
            text, name = item["text"], item.get("name")
            if name is not None and not isinstance(name, str):
                raise bad_request(f"{where}.name must be a string", f"{where}.name")
        else:
            raise bad_request("each document is a string or {'name', 'text'}", where)
        try:
            docs.append(Document.from_text(text, name or f"document {i + 1}"))
        except DocumentError as exc:
            raise bad_request(str(exc), where) from None
    return docs
