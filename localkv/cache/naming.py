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
    """The longest snapshot of ``namespace`` that the ``reused`` tokens restored from
    ``chain`` reach into the last block of (or cover whole).

    A restore may end inside a snapshot's last block: at a segment end before
    it (memory restored only where a snapshot point is), or one token before
    the end when the request is the snapshot's own tokens. It used that
    snapshot all the same. Of equally long ones, the oldest. None as well when
    the index cannot be read: naming is never worth a failure.
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
    used = store.match_chain([next(iter(on_chain))])
    if not used:
        return None
    best: tuple[int, str] | None = None
    for snap in store.snapshots(namespace):
        if (best and snap.n_tokens <= best[0]) or snap.identity != used[0].identity:
            continue
        rows = store.match_chain([snap.tip])
        if not rows or rows[0].start >= reused:
            continue
        tip = rows[0]
        end = min(tip.end, reused)  # the restore reaches into the tip block up to here
        parent_ok = tip.parent is None or tip.parent in on_chain
        if parent_ok and list(tip.tokens[: end - tip.start]) == list(tokens[tip.start : end]):
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
