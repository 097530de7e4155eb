"""The snapshot a chat keeps for its conversation, so the cache screen lists what it saved.

After every turn (and attach) the chat saves its prefix; the chain's tip is
then named as a snapshot labelled with the conversation's title, like the
snapshots ``localkv prefill`` names after its documents. One snapshot per
conversation: the newer tip replaces the older one (its pin and hits carry over),
also the one an earlier process named before ``--resume`` (the same title,
its tokens the start of the new chain's), and removing it on the cache screen frees the
blocks only it needs. Naming runs on the save's worker thread, after the blocks
are written, possibly after the chat has moved on to a new conversation: each
conversation has its own ``ConversationSnapshot``, which the save names, so a
late save of the last conversation never touches the next one's snapshot.
"""

from __future__ import annotations

import logging
import sqlite3

import numpy as np

from localkv.cache.catalogue import save_snapshot
from localkv.cache.prefix import PrefixCache
from localkv.cache.save import SaveResult
from localkv.runtime.runtime import Runtime
from localkv.storage.values import BlockRow

__all__ = ["ConversationSnapshot", "chain_tokens"]

log = logging.getLogger(__name__)


class ConversationSnapshot:
    """The id of the snapshot naming one conversation's saved prefix (None: not yet).

    ``resumed``: the conversation was saved by an earlier chat, whose snapshot
    (found by label and tokens) the first save replaces; a fresh conversation
    has no earlier snapshot and replaces none.
    """

    def __init__(self, runtime: Runtime, *, resumed: bool = False) -> None:
        self.runtime = runtime
        self.resumed = resumed
        self.id: str | None = None

    def name(self, result: SaveResult, label: str, n_tokens: int) -> None:
        """Name the chain ``result`` saved; drop the conversation's previous snapshot."""
        cache = self.runtime.cache
        if cache is None or result.tip is None or result.not_kept:
            return
        try:
            previous = self.id
            if previous is None and self.resumed:
                previous = self.earlier(cache, result.tip, label)
            pinned = previous is not None and cache.store.get_snapshot(previous).pinned
        except (KeyError, OSError, sqlite3.Error):  # removed on the cache screen
            previous, pinned = None, False
        snapshot = save_snapshot(cache, result.tip, (), n_tokens, label=label, pin=pinned)
        if snapshot is None:
            return
        self.id = snapshot
        if previous is not None and previous != snapshot:
            try:
                cache.store.remove_snapshot(previous, heir=snapshot)  # its hits carry over
            except (KeyError, OSError, sqlite3.Error) as exc:
                log.warning("could not drop the conversation's older snapshot: %s", exc)

    def earlier(self, cache: PrefixCache, tip: str, label: str) -> str | None:
        """The earlier snapshot of this conversation the first save replaces (``_earlier``)."""
        return _earlier(cache, tip, label)


def _earlier(cache: PrefixCache, tip: str, label: str) -> str | None:
    """The newest snapshot with this label whose tokens begin the chain ending at ``tip``.

    A resumed conversation's snapshot from an earlier process: the new chain
    holds its tokens and more, so the new snapshot replaces it.
    """
    store = cache.store
    tokens = chain_tokens(store.chain_of(tip))
    for snap in reversed(store.snapshots(cache.namespace)):
        if snap.label != label or snap.tip == tip:
            continue
        old = chain_tokens(store.chain_of(snap.tip))
        if old.shape[0] <= tokens.shape[0] and np.array_equal(old, tokens[: old.shape[0]]):
            return snap.id
    return None


def chain_tokens(chain: list[BlockRow]) -> np.ndarray:
    """The tokens of a stored chain, from its first block to its tip."""
    return np.concatenate([row.tokens for row in chain]) if chain else np.zeros(0, np.int32)
