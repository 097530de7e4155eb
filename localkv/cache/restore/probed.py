"""Chains whose probe has matched in this process, so a restore may skip the probe.

A restore loads a chain but its final token and decodes that token alone: its
logits equal to the stored probe's, bit for bit, show that the state loaded is
the one the writer computed (``verify``). Loading the same bytes into the same
build gives the same state again: the probe of a later restore of that chain
would decode the same logits. So once a chain's probe has matched, a restore of
that chain, or of a prefix of it ending at one of its blocks, loads the final
token's rows as well and decodes nothing; every block is still read through its
checksum, which must be the one the probed read saw (a block written again with
other bytes is probed again). Each restore in a new process probes once.
The record is bounded (``MAX_BLOCKS`` blocks, the oldest forgotten first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

__all__ = ["MAX_BLOCKS", "ProbedChains", "Row"]

MAX_BLOCKS = 1 << 16


class Row(Protocol):
    """What the record needs of a block's index row (``BlockRow``)."""

    @property
    def hash(self) -> str: ...
    @property
    def checksum(self) -> str: ...


class ProbedChains:
    """Blocks (hash -> the checksum their file had) of chains whose probe matched."""

    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        self._blocks: OrderedDict[str, str] = OrderedDict()
        self._max = max_blocks

    def matched(self, chain: Sequence[Row]) -> bool:
        """Whether every block of ``chain`` was in a chain whose probe matched, each file
        with the checksum it has now (so the chain is a probed one or a prefix of one)."""
        return bool(chain) and all(self._blocks.get(r.hash) == r.checksum for r in chain)

    def add(self, chain: Sequence[Row]) -> None:
        """Record ``chain``, whose probe has just matched (or that was probed before)."""
        for row in chain:
            self._blocks[row.hash] = row.checksum
            self._blocks.move_to_end(row.hash)
        while len(self._blocks) > self._max:
            self._blocks.popitem(last=False)
