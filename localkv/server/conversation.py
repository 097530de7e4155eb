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
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from localkv.chat.session import ChatState
from localkv.prompt.template import ChatTemplate, Message

__all__ = ["AnswerMemory", "build_history", "common_prefix"]


class AnswerMemory:
    """The sampled ids of recent answers, by the tokens before them and their text."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    @staticmethod
    def _key(before: Sequence[int], text: str) -> str:
        h = hashlib.sha256()
        h.update(len(before).to_bytes(8, "little"))
        h.update(b"".join(t.to_bytes(4, "little") for t in before))
        h.update(text.encode("utf-8"))
        return h.hexdigest()

    def remember(self, before: Sequence[int], text: str, ids: Sequence[int]) -> None:
        key = self._key(before, text)
        self._ids[key] = tuple(ids)
        self._ids.move_to_end(key)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def recall(self, before: Sequence[int], text: str) -> tuple[int, ...] | None:
        key = self._key(before, text)
        ids = self._ids.get(key)
        if ids is not None:
            self._ids.move_to_end(key)
        return ids


def build_history(
    template: ChatTemplate, messages: Sequence[Message], memory: AnswerMemory
) -> ChatState:
    """The chat state of ``messages`` (everything before the new user message).

    Tokens, segment ends and generated spans are what ``ChatSession`` records
    for the same conversation: a user message answered by the next one ends
    after the assistant's opening tokens; an answer's tokens are a span decoded
    one by one, followed by the template's closing tokens.
    """
    system = messages[0].content if messages and messages[0].role == "system" else None
    state = ChatState(system=system, tokens=template.start_tokens())
    for message in messages:
        if message.role == "assistant":
            _add_answer(template, state, message.content, memory)
        else:
            new = template.message_tokens(state.messages, message)
            state.messages.append(message)
            state.tokens.extend(new)
            state.boundaries.append(len(state.tokens))
    return state


def _add_answer(template: ChatTemplate, state: ChatState, text: str, memory: AnswerMemory) -> None:
    state.tokens.extend(template.assistant_start_tokens(state.messages))
    if state.boundaries:
        state.boundaries[-1] = len(state.tokens)
    else:
        state.boundaries.append(len(state.tokens))
    ids = memory.recall(state.tokens, text)
    if ids is None:
        ids = tuple(template.session.tokenize(text, parse_special=False))
    start = len(state.tokens)
    if ids:
        state.generated.append((start, start + len(ids)))
    state.tokens.extend(ids)
    history = list(state.messages)
    state.messages.append(Message("assistant", text))
    state.tokens.extend(template.assistant_end_tokens(history, text))
    state.boundaries.append(len(state.tokens))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
