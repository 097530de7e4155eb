"""Where the stored bytes are: what removing each snapshot frees, what is shared, the rest.

Removing a snapshot frees the blocks ``deletion.only_theirs`` names: its chain's
blocks no other snapshot needs, the tips saved beside them and every block below
those. ``space`` finds that set for every snapshot without removing anything,
so a listing can say what each removal frees (the bytes ``remove`` then
returns), and splits the stored bytes three ways that add up to them:

- ``own_bytes``: blocks that removing one snapshot frees;
- ``shared_bytes``: blocks in the chains of two snapshots or more, which only
  removing all of them frees;
- ``unnamed_bytes``: the rest, blocks no snapshot's chain holds and no one
  removal takes (a prompt saved beside a shared block, what eviction left of a
  chain whose tip it took); eviction and ``forget`` still reach them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .index.blockindex import BlockIndex
from .removal.deletion import only_theirs

__all__ = ["SnapshotSpace", "Space", "space"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotSpace:
    """One snapshot's bytes: what removing it frees now, and its whole chain's."""

    frees: int
    chain: int  # shared blocks included


@dataclass(frozen=True, slots=True, kw_only=True)
class Space:
    """The stored bytes of the store (or of one namespace), three ways (see the module)."""

    snapshots: dict[str, SnapshotSpace]  # by snapshot id
    stored_bytes: int  # every block's, as ``stats()`` counts them
    own_bytes: int
    shared_bytes: int
    unnamed_bytes: int


def space(index: BlockIndex, namespace: str | None = None) -> Space:
    """Each snapshot's ``SnapshotSpace`` and the stored bytes split (of ``namespace``: its
    snapshots and blocks only; a chain never leaves its namespace)."""
    where, params = ("", ()) if namespace is None else ("WHERE namespace = ?", (namespace,))
    sizes = {
        str(h): int(n)
        for h, n in index.query(f"SELECT hash, stored_bytes FROM blocks {where}", params)
    }
    snaps = index.snapshots()  # what a removal keeps is every namespace's
    chains = {s.id: [r.hash for r in index.chain_of(s.tip)] for s in snaps}
    holders = Counter(h for chain in chains.values() for h in set(chain))
    needed = set(holders)
    found: dict[str, SnapshotSpace] = {}
    own: set[str] = set()
    for snap in snaps:
        if namespace is not None and snap.namespace != namespace:
            continue
        chain = chains[snap.id]
        others = needed - {h for h in chain if holders[h] == 1}
        victims = only_theirs(index, index.db, chain, others)
        own |= victims
        found[snap.id] = SnapshotSpace(
            frees=sum(sizes.get(h, 0) for h in victims),
            chain=sum(sizes.get(h, 0) for h in chain),
        )
    stored = sum(sizes.values())
    own_bytes = sum(sizes.get(h, 0) for h in own)
    shared = sum(n for h, n in sizes.items() if holders[h] > 1)
    return Space(
        snapshots=found,
        stored_bytes=stored,
        own_bytes=own_bytes,
        shared_bytes=shared,
        unnamed_bytes=stored - own_bytes - shared,
    )
