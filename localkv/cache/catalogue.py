"""Snapshots as the runtime shows them: the listing, and which one a restore used.

Read-only views over the store's catalogue for one namespace.
"""

from __future__ import annotations

from localkv.cache.prefix import RestoreResult
from localkv.storage.store import SnapshotStore

__all__ = ["covering_snapshot", "snapshot_listing"]


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
    """The longest snapshot of ``namespace`` that the restored prefix of ``tokens`` contains."""
    if not result.chain:
        return None
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
