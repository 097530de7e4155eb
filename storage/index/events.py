"""Cache events and timed prefill rates: what ``cache stats`` and the saved-time estimates read.

A ``hit`` is one verified restore: it records the tokens reused, the
prefill seconds it saved (the estimate the restore reported) and the
snapshot it is counted under (the longest snapshot the reused prefix covers,
or none); that snapshot's ``hits`` grows in the same transaction, so the
hits ``cache ls`` shows plus the hits no listed snapshot names are the
``hits`` of ``cache stats``. A ``miss`` records its reason; a miss without one is a
first run (nothing was stored for the request): ``not_cached_yet``, no miss.

``prefill_rates`` sums the timed prefill seconds and tokens per identity
and context length: one rate for every writer's blocks and every hit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..values import StoreStats
from .blockindex import BlockIndex

__all__ = ["EVENT_KINDS", "Event", "note_rate", "rate", "record", "stats"]

EVENT_KINDS = frozenset({"hit", "miss"})


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """A lookup's outcome: a hit (``seconds``: prefill time saved) or a miss (its reason)."""

    kind: str  # hit or miss
    reason: str | None
    tokens: int
    seconds: float
    namespace: str | None = None
    snapshot: str | None = None  # the snapshot a hit restored


def record(index: BlockIndex, event: Event) -> None:
    """Record ``event``; a hit counts against the snapshot it names, if that still exists."""
    if event.kind not in EVENT_KINDS:
        raise ValueError(f"event kind must be hit or miss, got {event.kind!r}")
    snapshot = event.snapshot
    with index.write() as db:
        if snapshot is not None and event.kind == "hit":
            found = db.execute("UPDATE snapshots SET hits = hits + 1 WHERE id = ?", (snapshot,))
            snapshot = snapshot if found.rowcount else None
        db.execute(
            "INSERT INTO events (kind, reason, tokens, seconds, at, namespace, snapshot) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                event.kind,
                event.reason,
                int(event.tokens),
                float(event.seconds),
                time.time(),
                event.namespace,
                snapshot,
            ),
        )


def stats(index: BlockIndex, namespace: str | None = None) -> StoreStats:
    """Hits, misses by reason, sizes, prefill seconds saved: of one namespace, or all."""
    where, params = ("", ()) if namespace is None else ("WHERE namespace = ?", (namespace,))
    also = where.replace("WHERE", "AND", 1)
    q = index.query
    blocks, stored, raw = q(
        "SELECT COUNT(*), COALESCE(SUM(stored_bytes), 0), COALESCE(SUM(raw_bytes), 0) "
        f"FROM blocks {where}",
        params,
    )[0]
    hits, saved = q(
        f"SELECT COUNT(*), COALESCE(SUM(seconds), 0.0) FROM events WHERE kind = 'hit' {also}",
        params,
    )[0]
    named = q(f"SELECT COALESCE(SUM(hits), 0) FROM snapshots {where}", params)[0][0]
    misses = {
        str(r[0]): int(r[1])
        for r in q(
            "SELECT reason, COUNT(*) FROM events WHERE kind = 'miss' AND reason IS NOT NULL "
            f"{also} GROUP BY 1 ORDER BY 2 DESC",
            params,
        )
    }
    first = q(f"SELECT COUNT(*) FROM events WHERE kind = 'miss' AND reason IS NULL {also}", params)
    return StoreStats(
        hits=int(hits),
        hits_without_snapshot=max(0, int(hits) - int(named)),
        misses=sum(misses.values()),
        misses_by_reason=misses,
        not_cached_yet=int(first[0][0]),
        blocks=int(blocks),
        snapshots=int(q(f"SELECT COUNT(*) FROM snapshots {where}", params)[0][0]),
        stored_bytes=int(stored),
        raw_bytes=int(raw),
        saved_prefill_seconds=round(float(saved), 6),
    )


def rate(index: BlockIndex, identity: str, n_ctx: int) -> tuple[float, int] | None:
    """The timed prefill ``(seconds, tokens)`` under ``identity`` at ``n_ctx``, or None."""
    rows = index.query(
        "SELECT seconds, tokens FROM prefill_rates WHERE identity = ? AND n_ctx = ?",
        (identity, int(n_ctx)),
    )
    if not rows or int(rows[0][1]) <= 0:
        return None
    return float(rows[0][0]), int(rows[0][1])


def note_rate(index: BlockIndex, identity: str, n_ctx: int, seconds: float, tokens: int) -> None:
    """Add one timed prefill (``seconds`` for ``tokens``) to the rate of its identity."""
    with index.write() as db:
        db.execute(
            "INSERT INTO prefill_rates (identity, n_ctx, seconds, tokens, updated) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT(identity, n_ctx) DO UPDATE SET "
            "seconds = seconds + excluded.seconds, tokens = tokens + excluded.tokens, "
            "updated = excluded.updated",
            (identity, int(n_ctx), float(seconds), int(tokens), time.time()),
        )
