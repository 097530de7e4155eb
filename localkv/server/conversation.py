"""OpenAI messages as the exact tokens ``localkv chat`` computes for the same conversation.

A chat UI resends the whole history with every turn. Each message becomes
tokens segment by segment with the template deltas the chat uses
(``ChatState``, ``ChatTemplate``), so every earlier turn of a resent history
is the same token prefix and is reused. An assistant message the server
generated itself is replayed as the token ids that were sampled (the
``AnswerMemory``), as the chat keeps them; one it does not know (another
server's, or from before a restart) is tokenized. Either way its tokens are
decoded one by one, as sampled tokens are, so the schedule depends only on
the request and a cached prefix stays exact.

The tokens of a resent user or system message are kept (``MessageMemory``)
under a digest of every message up to and including it, role and text, so a
resent history is not tokenized again and any change to a message or to one
before it is tokenized afresh.

A request's prompt also says, for each segment end, the last of its messages
whose text comes before it (``Prompt.reach``), found while the prompt is built
once: where a message's prefix ends (a cache breakpoint) costs no second build.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from localkv.prompt.template import ChatTemplate, Message
from localkv.prompt.tools import prepare_tools, renders_tools
from localkv.prompt.whole import render_whole
from localkv.runtime.chatsession import ChatState
from localkv.server.limits import Budget

__all__ = [
    "AnswerMemory",
    "MessageMemory",
    "Prompt",
    "TokenDigest",
    "build_history",
    "build_prompt",
    "common_prefix",
]


class TokenDigest:
    """A running SHA-256 of a token list, extended as the list grows (no rehashing)."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self._hash = hashlib.sha256()
        self.n = 0
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        if tokens:
            self._hash.update(array("i", tokens).tobytes())
            self.n += len(tokens)

    def key(self, text: str) -> str:
        """The digest of the tokens so far followed by ``text``."""
        h = self._hash.copy()
        h.update(self.n.to_bytes(8, "little"))
        h.update(text.encode("utf-8"))
        return h.hexdigest()


class AnswerMemory:
    """The sampled ids of recent answers, by the tokens before them and their text."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    @staticmethod
    def _key(before: Sequence[int] | TokenDigest, text: str) -> str:
        digest = before if isinstance(before, TokenDigest) else TokenDigest(before)
        return digest.key(text)

    def remember(self, before: Sequence[int] | TokenDigest, text: str, ids: Sequence[int]) -> None:
        key = self._key(before, text)
        self._ids[key] = tuple(ids)
        self._ids.move_to_end(key)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def recall(self, before: Sequence[int] | TokenDigest, text: str) -> tuple[int, ...] | None:
        key = self._key(before, text)
        ids = self._ids.get(key)
        if ids is not None:
            self._ids.move_to_end(key)
        return ids


class MessageMemory:
    """The tokens of recent user and system messages, and the segment ends inside them
    (``ChatTemplate.message_parts``), by the messages up to each one.

    A key is a running SHA-256 over every message so far (each message's every
    field, length-prefixed): the same message after any other history is another key.
    """

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._tokens: OrderedDict[bytes, tuple[tuple[int, ...], tuple[int, ...]]] = OrderedDict()

    def tokens(
        self, template: ChatTemplate, chain: MessageChain, message: Message, history: list[Message]
    ) -> tuple[list[int], list[int]]:
        """``message``'s tokens after ``history`` and the segment ends inside them
        (``chain`` has already taken ``message``)."""
        key = chain.key()
        found = self._tokens.get(key)
        if found is not None:
            self._tokens.move_to_end(key)
            return list(found[0]), list(found[1])
        new, ends = template.message_parts(history, message)
        self._tokens[key] = (tuple(new), tuple(ends))
        while len(self._tokens) > self.capacity:
            self._tokens.popitem(last=False)
        return new, ends


class MessageChain:
    """A running digest of the messages of a conversation, in order."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256(b"localkv-messages-1")

    def add(self, message: Message) -> None:
        data = repr(message).encode("utf-8", "surrogatepass")  # every field of the value
        self._hash.update(len(data).to_bytes(8, "little"))
        self._hash.update(data)

    def key(self) -> bytes:
        return self._hash.digest()


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's chat state, and for each of its segment ends the index of the last of
    the request's messages whose text comes before it (-1: none, as after a tool
    preamble the server adds)."""

    state: ChatState
    reach: dict[int, int]


def build_prompt(
    template: ChatTemplate,
    messages: Sequence[Message],
    memory: AnswerMemory,
    budget: Budget,
    tools: Sequence[dict[str, Any]] = (),
    *,
    known: MessageMemory | None = None,
) -> Prompt:
    """The chat state of a request: its history, its last (user or tool) message, the opener.

    A Jinja template renders the whole conversation (``render_whole``); llama.cpp's
    formats are built message by message, ``known`` holding the tokens of messages
    seen before (none: every message is tokenized). Tools go to a template that
    renders them, else into a preamble (``prepare_tools``).
    """
    origins = _origins(template, messages, tools)
    messages, rendered_tools = prepare_tools(template, messages, tools)
    if len(origins) != len(messages):
        raise ValueError("the prepared messages do not match the request's")
    if template.jinja is not None:
        whole = render_whole(
            template, messages, tools=rendered_tools, recall=memory.recall, room=budget
        )
        system = messages[0].content if messages[0].role == "system" else None
        state = ChatState(
            system=system,
            messages=list(messages),
            tokens=whole.tokens,
            boundaries=whole.boundaries,
            generated=whole.generated,
        )
        return Prompt(state, _in_request(whole.reach, origins))
    *history, last = messages
    chain = MessageChain()
    reach: dict[int, int] = {}
    state = build_history(template, history, memory, budget, (known, chain), reach=reach)
    budget.before_text(len(state.tokens), last.content)
    chain.add(last)
    known = known or MessageMemory(0)
    new, inner = known.tokens(template, chain, last, state.messages)
    for end in inner:  # an earlier message's text this one's turn carries, ending inside it
        state.boundaries.append(len(state.tokens) + end)
        reach[len(state.tokens) + end] = len(history) - 1
    state.tokens.extend(new)
    state.messages.append(last)
    state.tokens.extend(template.assistant_start_tokens(state.messages))
    state.boundaries.append(len(state.tokens))
    reach[len(state.tokens)] = len(history)
    budget.after(len(state.tokens))
    return Prompt(state, _in_request(reach, origins))


def build_history(
    template: ChatTemplate,
    messages: Sequence[Message],
    memory: AnswerMemory,
    budget: Budget | None = None,
    known: tuple[MessageMemory | None, MessageChain] | None = None,
    *,
    reach: dict[int, int] | None = None,
) -> ChatState:
    """The chat state of ``messages`` (everything before the new user message).

    Tokens, segment ends and generated spans are what ``ChatSession`` records
    for the same conversation: a user message answered by the next one ends
    after the assistant's opening tokens; an answer's tokens are a span decoded
    one by one, followed by the template's closing tokens. Each message costs
    the same whatever the history's length (``ChatTemplate`` renders a bounded
    window); ``budget`` refuses a prompt that cannot fit as soon as that is
    known, and stops when the client has gone. ``known``: the tokens of
    messages seen before, and the running digest of these messages. ``reach``
    gets, for each segment end, the index of the last message before it.
    """
    budget = budget or Budget(2**62)
    seen, chain = known or (None, MessageChain())
    seen = seen or MessageMemory(0)
    reach = {} if reach is None else reach
    system = messages[0].content if messages and messages[0].role == "system" else None
    state = ChatState(system=system, tokens=template.start_tokens())
    digest = TokenDigest(state.tokens)
    before: list[int] = []  # for each segment end (moved or not), the last message before it
    for i, message in enumerate(messages):
        start, ends = len(state.tokens), len(state.boundaries)
        chain.add(message)
        if message.role == "assistant":
            _add_answer(template, state, message.content, memory, (digest, budget))
        else:
            budget.before_text(start, message.content)
            new, inner = seen.tokens(template, chain, message, state.messages)
            state.messages.append(message)
            state.boundaries.extend(start + end for end in inner)
            state.tokens.extend(new)
            state.boundaries.append(len(state.tokens))
            digest.extend(new)
        added = len(state.boundaries) - ends  # an answer's opening ends what came before it
        before.extend([i - 1] * (added - 1) + [i])
        budget.after(len(state.tokens))
    reach.update(zip(state.boundaries, before, strict=True))
    return state


def _origins(
    template: ChatTemplate, messages: Sequence[Message], tools: Sequence[dict[str, Any]]
) -> list[int]:
    """For each message ``prepare_tools`` makes of ``messages``, the index of the last of
    them it holds (-1: the tool preamble it adds as a system prompt).

    Tool results in a row are one user message, an assistant's calls are in its
    text, and the preamble joins a system prompt or comes before everything.
    """
    if renders_tools(template):
        return list(range(len(messages)))
    out: list[int] = []
    roles: list[str] = []
    joins = False  # the last message made is a user message of tool results
    for i, m in enumerate(messages):
        if m.role == "tool" and joins and out:
            out[-1] = i
            continue
        out.append(i)
        role = "user" if m.role == "tool" else "assistant" if m.tool_calls else m.role
        roles.append(role)
        joins = m.role == "tool" or (role == "user" and m.content.startswith("<tool_response>"))
    if tools and not (roles and roles[0] == "system"):
        out.insert(0, -1)
    return out


def _in_request(reach: dict[int, int], origins: Sequence[int]) -> dict[int, int]:
    """``reach`` of prepared messages as indices of the request's messages."""
    return {end: origins[at] if at >= 0 else -1 for end, at in reach.items()}


def _add_answer(
    template: ChatTemplate,
    state: ChatState,
    text: str,
    memory: AnswerMemory,
    running: tuple[TokenDigest, Budget],
) -> None:
    digest, budget = running
    opener = template.assistant_start_tokens(state.messages)
    state.tokens.extend(opener)
    digest.extend(opener)
    if state.boundaries:
        state.boundaries[-1] = len(state.tokens)
    else:
        state.boundaries.append(len(state.tokens))
    ids = memory.recall(digest, text)
    if ids is None:
        budget.before_text(len(state.tokens), text)
        ids = tuple(template.text_tokens(text))
    start = len(state.tokens)
    if ids:
        state.generated.append((start, start + len(ids)))
    closing = template.assistant_end_tokens(state.messages, text)
    state.messages.append(Message("assistant", text))
    state.tokens.extend(ids)
    state.tokens.extend(closing)
    digest.extend(ids)
    digest.extend(closing)
    state.boundaries.append(len(state.tokens))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
