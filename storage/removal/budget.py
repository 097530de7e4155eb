"""The size budget and the choice of what to evict (``evict`` carries it out).

Only leaf blocks (no children) are evicted, so a chain shrinks from its tips
and never loses its middle; a block in the chain of a pinned snapshot is never
evicted. Among the leaves, the least valuable goes first:

    value = prefill_seconds / stored_bytes / (1 + hours since last use)

When a leaf goes, its parent may become a leaf and joins the candidates.
``usage`` says how much the store holds and how much of it pinned
snapshots keep (more than the budget: eviction cannot reach it).
"""

from __future__ import annotations

import heapq
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ..index.blockindex import BlockIndex
from ..index.rows import PIN_HOLDS

__all__ = [
    "ENV_BUDGET",
    "LeafInfo",
    "Usage",
    "default_budget",
    "parse_size",
    "plan_eviction",
    "usage",
    "value",
]

ENV_BUDGET = "LOCALKV_BUDGET"
BUDGET_FRACTION = 0.10
BUDGET_CAP = 20 << 30
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``"123"``, ``"5G"``, ``"1.5GiB"``, ``"500M"`` (powers of 1024)."""
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"not a size: {text!r} (use bytes or e.g. 500M, 5G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def default_budget(root: Path) -> int:
    """``$LOCALKV_BUDGET`` if set, else 10% of the free space at ``root``, at most 20 GiB."""
    env = os.environ.get(ENV_BUDGET)
    if env:
        return parse_size(env)
    free = shutil.disk_usage(root).free
    return min(BUDGET_CAP, int(free * BUDGET_FRACTION))


@dataclass(frozen=True, slots=True)
class LeafInfo:
    """What eviction needs to know about a block."""

    hash: str
    parent: str | None
    stored_bytes: int
    prefill_seconds: float
    last_used: float


def value(block: LeafInfo, now: float) -> float:
    """Prefill seconds saved per stored byte, discounted by hours since last use."""
    age_hours = max(0.0, now - block.last_used) / 3600.0
    return block.prefill_seconds / max(1, block.stored_bytes) / (1.0 + age_hours)


def plan_eviction(
    blocks: list[LeafInfo], protected: set[str], to_free: int, now: float
) -> list[str]:
    """Hashes to delete, least valuable leaf first, until ``to_free`` bytes are freed."""
    if to_free <= 0:
        return []
    by_hash = {b.hash: b for b in blocks}
    n_children: dict[str, int] = {}
    for b in blocks:
        if b.parent is not None:
            n_children[b.parent] = n_children.get(b.parent, 0) + 1
    heap = [
        (value(b, now), b.hash)
        for b in blocks
        if n_children.get(b.hash, 0) == 0 and b.hash not in protected
    ]
    heapq.heapify(heap)
    victims: list[str] = []
    freed = 0
    while heap and freed < to_free:
        _, h = heapq.heappop(heap)
        block = by_hash[h]
        victims.append(h)
        freed += block.stored_bytes
        parent = block.parent
        if parent is None or parent not in by_hash:
            continue
        n_children[parent] -= 1
        if n_children[parent] == 0 and parent not in protected:
            heapq.heappush(heap, (value(by_hash[parent], now), parent))
    return victims


@dataclass(frozen=True, slots=True)
class Usage:
    """Bytes stored, and of those the bytes a pinned snapshot's chain needs."""

    stored_bytes: int
    pinned_bytes: int


_PINNED_BYTES = (
    "WITH RECURSIVE c(hash) AS (SELECT tip FROM snapshots WHERE {holds} {cond} UNION "
    "SELECT b.parent FROM blocks b JOIN c ON b.hash = c.hash WHERE b.parent IS NOT NULL) "
    "SELECT COALESCE(SUM(b.stored_bytes), 0) FROM c JOIN blocks b ON b.hash = c.hash"
)


def usage(index: BlockIndex, namespace: str | None = None) -> Usage:
    """What the store (or one namespace of it) holds; shared blocks count once."""
    cond, params = ("", ()) if namespace is None else ("AND namespace = ?", (namespace,))
    where = cond.replace("AND", "WHERE", 1)
    stored = index.query(f"SELECT COALESCE(SUM(stored_bytes), 0) FROM blocks {where}", params)
    sql = _PINNED_BYTES.format(holds=PIN_HOLDS, cond=cond)
    pinned = index.query(sql, (time.time(), *params))
    return Usage(int(stored[0][0]), int(pinned[0][0]))
