"""Snapshots as the runtime keeps them: saving one for a prefill, the listing, and
which one a restore used."""

from __future__ import annotations

import hashlib
import logging
import sqlite3
from collections.abc import Sequence

from localkv.cache.prefix import PrefixCache, RestoreResult
from localkv.prompt.request import Document
from localkv.storage.store import SnapshotStore

__all__ = ["covering_snapshot", "save_snapshot", "snapshot_listing"]

log = logging.getLogger(__name__)


def snapshot_listing(store: SnapshotStore, namespace: str) -> list[dict[str, object]]:
    """The namespace's snapshots: id, label, tokens, bytes on disk, hits, last used, pinned."""
    out: list[dict[str, object]] = []
    for snap in store.snapshots(namespace):
        chain = store.chain_of(snap.tip)
        out.append(
            {
                "id": snap.id,
                "label": snap.label,
                "tokens": snap.n_tokens,
                "bytes_on_disk": sum(r.stored_bytes for r in chain),
                "hits": snap.hits,
                "last_used": snap.last_used,
                "pinned": snap.pinned,
            }
        )
    return out


def covering_snapshot(
    store: SnapshotStore, namespace: str, result: RestoreResult, tokens: list[int]
) -> str | None:
    """The longest snapshot of ``namespace`` that the restored prefix of ``tokens`` contains.

    None as well when the index cannot be read: naming is never worth a failure.
    """
    if not result.chain:
        return None
    try:
        return _covering(store, namespace, result, tokens)
    except (OSError, sqlite3.Error) as exc:
        log.warning("could not name the snapshot: %s", exc)
        return None


def _covering(
    store: SnapshotStore, namespace: str, result: RestoreResult, tokens: list[int]
) -> str | None:
    on_chain = set(result.chain)
    best: tuple[int, str] | None = None
    for snap in store.snapshots(namespace):
        if snap.n_tokens > result.reused or (best and snap.n_tokens <= best[0]):
            continue
        rows = store.match_chain([snap.tip])
        if not rows:
            continue
        tip = rows[0]
        parent_ok = tip.parent is None or tip.parent in on_chain
        if parent_ok and list(tip.tokens) == tokens[tip.start : tip.end]:
            best = (snap.n_tokens, snap.id)
    return best[1] if best else None


def save_snapshot(
    cache: PrefixCache,
    tip: str,
    documents: Sequence[Document],
    n_tokens: int,
    *,
    label: str | None,
    pin: bool,
) -> str | None:
    """Name the chain ending at ``tip`` after its documents; None if it cannot be saved.

    None too when the index was deleted while the chain was saved: the id would
    name a row no later process finds (its manifest lets ``cache repair`` bring
    it back).
    """
    if not cache.saving:
        return None
    try:
        snapshot = cache.store.put_snapshot(
            tip=tip,
            label=label or ", ".join(d.name for d in documents) or "(system prompt)",
            source_path=_source_path(documents),
            source_sha256=_source_sha(documents),
            n_tokens=n_tokens,
            identity=cache.identity.digest,
            namespace=cache.namespace,
            pinned=pin,
        )
    except (OSError, sqlite3.Error, ValueError) as exc:  # disk full; tip evicted
        log.warning("could not save the snapshot (%s); continuing without it", exc)
        return None
    return None if cache.index_lost() else snapshot


def _source_path(documents: Sequence[Document]) -> str | None:
    paths = [str(d.path.resolve()) for d in documents if d.path is not None]
    return paths[0] if len(paths) == 1 else ("; ".join(paths) or None)


def _source_sha(documents: Sequence[Document]) -> str | None:
    if not documents:
        return None
    if len(documents) == 1:
        return documents[0].sha256
    return hashlib.sha256("".join(d.sha256 for d in documents).encode()).hexdigest()
