"""Recent states of memory that cannot be cut back, held in memory for the next restore.

A sliding window, a recurrent or a hybrid state cannot be cut back to a shorter
prefix: a request that keeps only part of the live context (a new question after
the same system prompt, a document asked in turn with another) restores its
prefix from the disk, and decodes its probe, every time. So a restore from the
disk of such memory, once its probe has matched, leaves a checkpoint of the
session (``model.checkpoint``) here under its chain's tip block; the next
restore of that chain in this process resumes it instead, with no read and no
probe: the cells, logits and bookkeeping the verified restore left, bit for bit.

The key is the tip block's hash, which names the model, the cache's settings
and every token before it, so a held state is reached only by a request for
exactly those tokens, and only through the index (a chain removed from the
store is not looked up, so its held state is never used again). Bounded: the
``KEEP`` most recently used, ``max_bytes`` together at most (a cache holds
``1/HELD_SHARE`` of the memory available when it opens).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from localkv.model.checkpoint import Checkpoint

__all__ = ["HELD_SHARE", "KEEP", "UNCUT", "HeldStates"]

KEEP = 4  # states held, the most recently used
HELD_SHARE = 8  # together at most this fraction (1/HELD_SHARE) of the memory available
UNCUT = ("swa", "hybrid", "recurrent")  # memory kinds that cannot be cut back


class HeldStates:
    """Checkpoints by their chain's tip block hash (thread-safe), bounded."""

    def __init__(self, max_bytes: int, keep: int = KEEP) -> None:
        self.max_bytes, self.keep = max_bytes, keep
        self._held: OrderedDict[str, Checkpoint] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, tip: str) -> Checkpoint | None:
        """The checkpoint held for ``tip``, now the most recently used; or None."""
        with self._lock:
            found = self._held.get(tip)
            if found is not None:
                self._held.move_to_end(tip)
            return found

    def fits(self, nbytes: int) -> bool:
        """Whether a checkpoint of a state of ``nbytes`` could be held (so worth taking)."""
        return nbytes <= self.max_bytes

    def put(self, tip: str, checkpoint: Checkpoint) -> bool:
        """Hold ``checkpoint`` for ``tip``, dropping the least recently used beyond the
        bounds; whether it is held (not when it alone is over ``max_bytes``)."""
        if checkpoint.nbytes > self.max_bytes:
            return False
        with self._lock:
            self._held[tip] = checkpoint
            self._held.move_to_end(tip)
            while len(self._held) > self.keep or self.nbytes > self.max_bytes:
                self._held.popitem(last=False)
        return True

    def drop(self, tip: str) -> None:
        with self._lock:
            self._held.pop(tip, None)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._held.values())

    def __len__(self) -> int:
        return len(self._held)
