"""One server conversation, one snapshot row, as a chat keeps one snapshot per chat.

A client of a stateless API resends the conversation with every request: the
system prompt (a document, instructions), the turns so far, and a new user
message. Requests whose prompts are the same up to their last user message
(the conversation's stem: at least its first message) are one conversation: a
new question after the stem replaces the row the last one saved. A
conversation that goes on (the earlier row's tokens begin the new chain) replaces
its row too. Another stem is another row: another system prompt or document,
other earlier turns, another first question where there is no system prompt.

A row is labelled by its stem (``conversation_label``): the first words of the
first message, then, when earlier turns are part of it, the first words of the
first user message (after a system prompt) and the number of user turns, so the
rows ``cache ls`` lists say what differs. Replacing a row removes only the blocks
that no other snapshot needs (the stem's stay, for the next question's hit); its
hits and its pin go to the new row (``ConversationSnapshot``). A breakpoint's
``· kept`` snapshot is never replaced.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from localkv.cache.prefix import PrefixCache
from localkv.prompt.template import Message
from localkv.runtime import Runtime
from localkv.runtime.chatsnapshot import ConversationSnapshot, chain_tokens
from localkv.server.prefixes import KEPT, prefix_label, words

__all__ = ["ServerConversation", "conversation_label", "stem_end"]

ROW = "server: "


def _last_user(messages: Sequence[Message]) -> int:
    return next((i for i in reversed(range(len(messages))) if messages[i].role == "user"), 0)


def stem_end(reach: dict[int, int], messages: Sequence[Message]) -> int:
    """Where the conversation's stem ends in the prompt: the last segment end before
    the last user message, or after the first message when nothing comes before it.

    ``reach``: for each segment end, the last of ``messages`` before it (``Prompt.reach``).
    """
    before = max(_last_user(messages), 1)
    return max((end for end, at in reach.items() if at < before), default=0)


def conversation_label(messages: Sequence[Message]) -> str:
    """``server: <first words>``, then ``· <first user words> · N turns`` when user turns
    come before the last one (the first user words only when another message came first)."""
    label = prefix_label(messages)
    users = [m for m in messages[: _last_user(messages)] if m.role == "user"]
    if not users:
        return label
    first = next((m for m in messages if m.content), None)
    parts = [label] if first is users[0] else [label, words(users[0].content)]
    return " · ".join([*parts, f"{len(users) + 1} turns"])


class ServerConversation(ConversationSnapshot):
    """The snapshot of one request's conversation: it replaces the row of the same stem
    (``stem``: the prompt's tokens up to it) or the row the conversation went on from."""

    def __init__(self, runtime: Runtime, stem: Sequence[int]) -> None:
        super().__init__(runtime, resumed=True)
        self.stem = np.asarray(stem, dtype=np.int32)

    def earlier(self, cache: PrefixCache, tip: str, label: str) -> str | None:
        """The newest row of this conversation: of the same label and stem, or whose
        tokens begin the chain ending at ``tip``."""
        store = cache.store
        tokens = chain_tokens(store.chain_of(tip))
        n_stem = self.stem.shape[0]
        for snap in reversed(store.snapshots(cache.namespace)):
            if snap.tip == tip or snap.identity != cache.identity.digest:
                continue
            if not snap.label.startswith(ROW) or snap.label.endswith(KEPT):
                continue
            old = chain_tokens(store.chain_of(snap.tip))
            n = old.shape[0]
            went_on = n <= tokens.shape[0] and np.array_equal(old, tokens[:n])
            same_stem = (
                snap.label == label and n >= n_stem and np.array_equal(old[:n_stem], self.stem)
            )
            if went_on or same_stem:
                return snap.id
        return None
