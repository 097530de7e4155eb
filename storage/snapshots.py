"""The snapshot catalogue: named chain tips, pinning, and removing a snapshot.

A snapshot names the chain ending at its tip block, with the document it came
from (path and SHA-256), its token count, identity and namespace. Its id is
derived from tip, label and namespace, so saving the same one twice keeps one
row. A pinned snapshot's chain is never evicted. ``SnapshotStore`` delegates
its snapshot methods to ``SnapshotCatalogue``; ``removal/forget.py`` removes
snapshots by document instead.

Each snapshot also has a manifest file (``manifests.py``) from which
``repair`` restores it if the index is lost: written when the snapshot is
saved, pinned or unpinned, removed with it; ``prune`` removes those of
snapshots that left the index another way. A manifest that cannot be written
(a read-only or full disk) is logged, never an error of the operation.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable
from typing import Any

from . import manifests
from .index.blockindex import BlockIndex
from .index.rows import CLIENT
from .paths import CacheLayout
from .removal import budget
from .removal.deletion import bytes_of, only_theirs, remove_files
from .values import NewSnapshot, SnapshotRow

__all__ = ["SnapshotCatalogue"]

logger = logging.getLogger(__name__)

_SNAPSHOT_ID_HEX = 12


class SnapshotCatalogue:
    """The snapshots in one store's index; removing one removes the blocks only it needed."""

    def __init__(self, index: BlockIndex, layout: CacheLayout) -> None:
        self._index = index
        self._layout = layout

    def put(
        self,
        new: NewSnapshot,
        *,
        pinned: bool = False,
        pinned_until: float | None = None,
        client_share: int | None = None,
    ) -> str:
        """Name the chain ending at ``new.tip``; the same tip, label and namespace keep one id.

        ``pinned`` with ``pinned_until``: pinned until then (an existing snapshot's
        pin is extended to it, a pin for good stays one); without: pinned for good.
        ``client_share``: a server's client's pin, made only if the clients' pins then keep
        at most that many bytes (``budget.client_pin_fits``); else a new snapshot is saved
        unpinned, marked a client's refused pin (evicted first), an existing one left as it
        is. A pin of the user's is never a client's.
        """
        h = hashlib.sha256(
            "\0".join((new.tip, new.label, new.namespace)).encode("utf-8")
        ).hexdigest()
        snap_id = h[:_SNAPSHOT_ID_HEX]
        now, owner = time.time(), (None if client_share is None else CLIENT)
        with self._index.write() as db:
            fits = client_share is None or budget.client_pin_fits(db, new.tip, client_share)
            if db.execute("SELECT 1 FROM snapshots WHERE id = ?", (snap_id,)).fetchone():
                if pinned and fits:
                    _pin(db, snap_id, pinned_until, owner)
                    self.write_manifest(snap_id)
                return snap_id
            row = self._index.get_block(new.tip)
            if row is None:
                raise ValueError(f"snapshot tip {new.tip} is not stored")
            expected = (new.identity, new.namespace, new.n_tokens)
            if (row.identity, row.namespace, row.end) != expected:
                raise ValueError(
                    f"snapshot says {new.n_tokens} tokens of {new.identity}/{new.namespace!r}, "
                    f"tip block ends at {row.end} under {row.identity}/{row.namespace!r}"
                )
            snap = SnapshotRow(
                id=snap_id,
                tip=new.tip,
                label=new.label,
                source_path=new.source_path,
                source_sha256=new.source_sha256,
                n_tokens=new.n_tokens,
                identity=new.identity,
                namespace=new.namespace,
                system=new.system,
                created=now,
                last_used=now,
                hits=0,
                pinned=pinned and fits,
                pinned_until=pinned_until if pinned and fits else None,
                pin_owner=owner if pinned else None,  # a client's pin, made or refused
            )
            self._index.insert_snapshot(db, snap)
        self._write(snap)
        return snap_id

    def _write(self, snap: SnapshotRow) -> None:
        try:
            manifests.write(self._layout, snap, self._index.get_identity(snap.identity))
        except (OSError, ValueError) as exc:
            logger.warning("could not write the manifest of snapshot %s: %s", snap.id, exc)

    def write_manifest(self, snapshot_id: str) -> None:
        """Write the manifest of a snapshot as the index holds it now."""
        for snap in self._index.snapshots_by_prefix(snapshot_id):
            if snap.id == snapshot_id:
                self._write(snap)

    def prune(self, gone: Iterable[str] = ()) -> None:
        """Remove the manifests of ``gone`` and of snapshots gone from index and disk."""
        try:
            for snapshot_id in gone:  # e.g. forgotten: the manifest names the document
                manifests.remove(self._layout, snapshot_id)
            manifests.prune(self._layout, {s.id for s in self._index.snapshots()})
        except OSError as exc:
            logger.warning("could not prune snapshot manifests: %s", exc)

    def snapshots(self, namespace: str | None = None) -> list[SnapshotRow]:
        """All snapshots (of one namespace), oldest first."""
        return self._index.snapshots(namespace)

    def get(self, id_or_prefix: str) -> SnapshotRow:
        """The snapshot with this id or unique id prefix (KeyError otherwise)."""
        found = self._index.snapshots_by_prefix(id_or_prefix) if id_or_prefix else []
        exact = [s for s in found if s.id == id_or_prefix]
        if exact:
            return exact[0]
        if not found:
            raise KeyError(f"no snapshot {id_or_prefix!r}")
        if len(found) > 1:
            ids = ", ".join(s.id for s in found[:5])
            raise KeyError(f"snapshot prefix {id_or_prefix!r} is ambiguous: {ids}")
        return found[0]

    def set_pinned(self, snapshot_id: str, pinned: bool) -> None:
        """Pin for good (protect its chain from eviction) or unpin a snapshot (KeyError if
        unknown), as the user; either ends a pin's time limit and makes it the user's."""
        snap = self.get(snapshot_id)
        with self._index.write() as db:
            db.execute(
                "UPDATE snapshots SET pinned = ?, pinned_until = NULL, pin_owner = NULL "
                "WHERE id = ?",
                (int(pinned), snap.id),
            )
        self.write_manifest(snap.id)

    def remove(self, snapshot_id: str, heir: str | None = None) -> int:
        """Delete a snapshot and the blocks only it held (``deletion.only_theirs``: the
        shorter and longer tips beside its chain too); return the bytes freed.

        ``heir``, the snapshot replacing it (a conversation's newer tip), takes over
        its hits and the hit events that named it, so no restore's count is lost.
        """
        snap = self.get(snapshot_id)
        with self._index.write() as db:
            if heir is not None and heir != snap.id:
                found = db.execute(
                    "UPDATE snapshots SET hits = hits + ? WHERE id = ?", (snap.hits, heir)
                )
                if found.rowcount:
                    db.execute("UPDATE events SET snapshot = ? WHERE snapshot = ?", (heir, snap.id))
            db.execute("DELETE FROM snapshots WHERE id = ?", (snap.id,))
            needed = self._index.protected(db, pinned_only=False)
            chain = [r.hash for r in self._index.chain_of(snap.tip)]
            victims = only_theirs(self._index, db, chain, needed)
            freed = bytes_of(self._index, victims)
            files = self._index.delete_blocks(db, victims)
        try:
            manifests.remove(self._layout, snap.id)
        except OSError as exc:
            logger.warning("could not remove the manifest of snapshot %s: %s", snap.id, exc)
        remove_files(self._index, self._layout, files)
        if heir is not None:
            self.write_manifest(heir)
        logger.info("removed snapshot %s: %d block(s), %d bytes", snap.id, len(files), freed)
        return freed


def _pin(db: Any, snapshot_id: str, until: float | None, owner: str | None) -> None:
    """Pin an existing snapshot for good (``until`` None) or until ``until`` at least, as
    ``owner``'s (None: the user's); a client's pin leaves a pin of the user's as it is."""
    if until is None:
        users = " AND NOT (pinned = 1 AND pinned_until IS NULL AND pin_owner IS NULL)"
        db.execute(
            "UPDATE snapshots SET pinned = 1, pinned_until = NULL, pin_owner = ? "
            f"WHERE id = ?{users if owner is not None else ''}",
            (owner, snapshot_id),
        )
        return
    db.execute(
        "UPDATE snapshots SET pinned = 1, pinned_until = MAX(COALESCE(pinned_until, 0), ?), "
        "pin_owner = ? WHERE id = ? AND NOT (pinned = 1 AND pinned_until IS NULL)",
        (until, owner, snapshot_id),
    )
