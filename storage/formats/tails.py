"""Tail tensors: a block's last rows, checked group by group so a read may take a suffix.

A block of a sliding-window model keeps, per sliding layer, the K and V rows of
its last tokens (those a later window can hold): its *tail tensors*
(``values.TAIL_PREFIX``), the same number of rows each. A restore needs only
the rows inside its window, often a suffix of one block's, so the tails are
left out of the index's checksum and carry one xxh3-128 per group of
``TAIL_GROUP`` rows instead (``TAIL_XXH3`` in the metadata, comma-separated,
group 0 first). Group ``g``'s digest is the xxh3-128 of the concatenated
xxh3-128 digests of rows ``[g*G, (g+1)*G)`` of each tail tensor, by tensor
name: independent of where the tensors lie in the file. The header, which
holds the digests, stays under the index's checksum, so a reader that checks
the groups it read has checked every byte it uses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import xxhash

from ..values import TAIL_GROUP, TAIL_XXH3, BlockCorrupt, is_tail

__all__ = ["TailHashes", "group_digests", "tail_digests", "tail_names"]


class _Spec(Protocol):
    @property
    def begin(self) -> int: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


def tail_names(specs: Mapping[str, _Spec]) -> list[str]:
    """The tail tensors of a block file, in the order of its data section."""
    return sorted((n for n in specs if is_tail(n)), key=lambda n: specs[n].begin)


def _combine(parts: list[bytes]) -> str:
    return xxhash.xxh3_128_hexdigest(b"".join(parts))


def group_digests(tails: Mapping[str, np.ndarray]) -> list[str]:
    """The group digests of a block's tail tensors (each ``[rows, ...]``)."""
    if not tails:
        return []
    names = sorted(tails)
    rows = tails[names[0]].shape[0]
    return [
        _combine(
            [
                xxhash.xxh3_128_digest(np.ascontiguousarray(tails[n][g : g + TAIL_GROUP]).data)
                for n in names
            ]
        )
        for g in range(0, rows, TAIL_GROUP)
    ]


def tail_digests(metadata: Mapping[str, str], rows: int) -> list[str]:
    """The digests a file's metadata gives for ``rows`` tail rows (``BlockCorrupt`` if off)."""
    text = metadata.get(TAIL_XXH3)
    digests = text.split(",") if text else []
    if len(digests) != -(-rows // TAIL_GROUP):
        raise BlockCorrupt(f"metadata holds {len(digests)} tail digests for {rows} rows")
    return digests


class TailHashes:
    """Hashes tail rows as a read delivers them, and checks the groups it was given.

    ``first_group``: the first group read; every tail tensor is read from that
    group's first row to its end.
    """

    def __init__(self, names: Sequence[str], digests: list[str], first_group: int) -> None:
        self.names = sorted(names)
        self.digests = digests
        self.first = first_group
        self.hashers = {n: [xxhash.xxh3_128() for _ in digests[first_group:]] for n in self.names}

    def update(self, name: str, view: memoryview, first_row: int, row_bytes: int) -> None:
        """Add ``view``, rows ``first_row..`` of tail tensor ``name``, to their groups."""
        at, row = 0, first_row
        hashers = self.hashers[name]
        while at < len(view):
            group = row // TAIL_GROUP
            take = min((group + 1) * TAIL_GROUP - row, (len(view) - at) // row_bytes)
            if take <= 0 or group < self.first:
                raise ValueError("a tail view that is not whole rows of the groups read")
            hashers[group - self.first].update(view[at : at + take * row_bytes])
            at, row = at + take * row_bytes, row + take

    def check(self) -> None:
        """``BlockCorrupt`` unless every group read equals its digest."""
        for i, want in enumerate(self.digests[self.first :]):
            if _combine([self.hashers[n][i].digest() for n in self.names]) != want:
                raise BlockCorrupt(f"tail rows {(self.first + i) * TAIL_GROUP}.. differ")
