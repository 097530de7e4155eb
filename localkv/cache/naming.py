"""Which snapshot a restore is counted under: the longest one its reused prefix covers;
and which model a snapshot is of (``model_names``).

The CLI's reports (``cache.snapshot``), the hit recorded in the index and the
hits ``cache ls`` shows all use this one rule, so they name the same snapshot.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Iterable, Sequence

from localkv.storage.filehash import recorded_paths
from localkv.storage.store import SnapshotStore

__all__ = ["covering", "model_names"]

log = logging.getLogger(__name__)


def covering(
    store: SnapshotStore,
    namespace: str,
    chain: Sequence[str],
    reused: int,
    tokens: Sequence[int],
) -> str | None:
    """The longest snapshot of ``namespace`` inside the ``reused`` tokens restored from ``chain``.

    Of equally long ones, the oldest. None as well when the index cannot be
    read: naming is never worth a failure.
    """
    if not chain or reused <= 0:
        return None
    try:
        return _covering(store, namespace, set(chain), reused, tokens)
    except (OSError, sqlite3.Error) as exc:
        log.warning("could not name the snapshot: %s", exc)
        return None


def _covering(
    store: SnapshotStore, namespace: str, on_chain: set[str], reused: int, tokens: Sequence[int]
) -> str | None:
    best: tuple[int, str] | None = None
    for snap in store.snapshots(namespace):
        if snap.n_tokens > reused or (best and snap.n_tokens <= best[0]):
            continue
        rows = store.match_chain([snap.tip])
        if not rows:
            continue
        tip = rows[0]
        parent_ok = tip.parent is None or tip.parent in on_chain
        if parent_ok and list(tip.tokens) == list(tokens[tip.start : tip.end]):
            best = (snap.n_tokens, snap.id)
    return best[1] if best else None


def model_names(store: SnapshotStore, identities: Iterable[str]) -> dict[str, str]:
    """Each identity digest's model, named as ``localkv models`` and ``--model`` name it:
    the stem of the GGUF file the cache hashed with that content (``filehashes.db``),
    else the architecture and the first 12 hex digits of the model's SHA-256."""
    out: dict[str, str] = {}
    for digest in dict.fromkeys(identities):
        try:
            fields = json.loads(store.get_identity(digest) or "{}")
        except (ValueError, OSError, sqlite3.Error):
            fields = {}
        sha = str(fields.get("model_sha256") or "")
        paths = recorded_paths(store.root / "filehashes.db", [sha]) if sha else []
        arch = str(fields.get("architecture") or "?")
        out[digest] = paths[-1].stem if paths else f"{arch} {sha[:12] or '?'}"
    return out
