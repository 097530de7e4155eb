"""The size budget and the choice of what to evict (``evict`` carries it out).

Only leaf blocks (no children) are evicted, so a chain shrinks from its tips
and never loses its middle; a block in the chain of a pinned snapshot is never
evicted. Among the leaves, the least valuable goes first:

    value = prefill_seconds / stored_bytes / (1 + hours since last use)

When a leaf goes, its parent may become a leaf and joins the candidates.
``usage`` says how much the store holds and how much of it pinned
snapshots keep (more than the budget: eviction cannot reach it).

Pins have two owners. The user's (``cache pin``, ``prefill --pin``) are never
evicted. A server's clients' (``cache_control``, ``"pin": true``) keep at most
their share of the budget (``LOCALKV_CLIENT_PINS``, a fraction): a pin that
would take them past it is not made (``client_pin_fits``: the snapshot is saved
unpinned), and eviction keeps them only within it (``client_protected``). A
snapshot whose client pin was refused or has lapsed is evicted before anything
else (``plan_eviction``'s ``first``), so what a client asks to keep never
pushes out the user's own cache.
"""

from __future__ import annotations

import heapq
import os
import re
import shutil
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..index.blockindex import BlockIndex
from ..index.rows import CLIENT_PIN_HOLDS, PIN_HOLDS, USER_PIN_HOLDS

if TYPE_CHECKING:
    import sqlite_utils

__all__ = [
    "CLIENT_PIN_SHARE",
    "ENV_BUDGET",
    "ENV_CLIENT_PINS",
    "LeafInfo",
    "Usage",
    "client_pin_fits",
    "client_protected",
    "client_share",
    "default_budget",
    "parse_share",
    "parse_size",
    "plan_eviction",
    "usage",
    "value",
]

ENV_BUDGET = "LOCALKV_BUDGET"
BUDGET_FRACTION = 0.10
BUDGET_CAP = 20 << 30
ENV_CLIENT_PINS = "LOCALKV_CLIENT_PINS"
# the share of the budget a server's clients may keep pinned, unless set: room for
# a few pinned system prompts and tool definitions, the rest the user's
CLIENT_PIN_SHARE = 0.25
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``"123"``, ``"5G"``, ``"1.5GiB"``, ``"500M"`` (powers of 1024)."""
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"not a size: {text!r} (use bytes or e.g. 500M, 5G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def parse_share(text: str) -> float:
    """A share of the budget from ``"0.25"`` or ``"25%"``: from 0 (no client pins) to 1."""
    raw = text.strip()
    percent = raw.endswith("%")
    try:
        share = float(raw.removesuffix("%")) / (100 if percent else 1)
    except ValueError:
        share = -1.0
    if not 0 <= share <= 1:  # NaN too
        raise ValueError(f"not a share: {text!r} (use a fraction such as 0.25, or 25%)")
    return share


def client_share(budget_bytes: int) -> int:
    """The bytes a server's clients may keep pinned: ``$LOCALKV_CLIENT_PINS`` (else
    ``CLIENT_PIN_SHARE``) of ``budget_bytes``."""
    env = os.environ.get(ENV_CLIENT_PINS)
    share = parse_share(env) if env else CLIENT_PIN_SHARE
    return int(budget_bytes * share)


def default_budget(root: Path) -> int:
    """``$LOCALKV_BUDGET`` if set, else 10% of the free space at ``root``, at most 20 GiB."""
    env = os.environ.get(ENV_BUDGET)
    if env:
        return parse_size(env)
    free = shutil.disk_usage(root).free
    return min(BUDGET_CAP, int(free * BUDGET_FRACTION))


@dataclass(frozen=True, slots=True, kw_only=True)
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
    blocks: list[LeafInfo],
    protected: set[str],
    to_free: int,
    now: float,
    first: Collection[str] = (),
) -> list[str]:
    """Hashes to delete, least valuable leaf first, until ``to_free`` bytes are freed;
    the leaves in ``first`` before every other, and a chain of them, once begun, whole
    (its snapshot goes with its tip: what stayed would be evicted like any other)."""
    if to_free <= 0:
        return []
    by_hash = {b.hash: b for b in blocks}
    n_children: dict[str, int] = {}
    for b in blocks:
        if b.parent is not None:
            n_children[b.parent] = n_children.get(b.parent, 0) + 1
    heap = [
        (_TIER_FIRST if b.hash in first else _TIER_ANY, value(b, now), b.hash)
        for b in blocks
        if n_children.get(b.hash, 0) == 0 and b.hash not in protected
    ]
    heapq.heapify(heap)
    victims: list[str] = []
    freed = 0
    while heap and (freed < to_free or heap[0][0] == _TIER_BEGUN):
        tier, _, h = heapq.heappop(heap)
        block = by_hash[h]
        victims.append(h)
        freed += block.stored_bytes
        parent = block.parent
        if parent is None or parent not in by_hash:
            continue
        n_children[parent] -= 1
        if n_children[parent] == 0 and parent not in protected:
            up = _TIER_ANY
            if parent in first:
                up = _TIER_BEGUN if tier != _TIER_ANY else _TIER_FIRST
            heapq.heappush(heap, (up, value(by_hash[parent], now), parent))
    return victims


# the order of eviction: a ``first`` chain begun, other ``first`` leaves, the rest
_TIER_BEGUN, _TIER_FIRST, _TIER_ANY = 0, 1, 2


def client_protected(
    blocks: list[LeafInfo], protected: set[str], tips: Sequence[str], share: int
) -> set[str]:
    """The blocks the clients' pins on ``tips`` keep (oldest pin first): each pin's chain
    while what they keep beside ``protected`` (the user's pins) fits in ``share`` bytes;
    a pin past it keeps nothing (the budget was lowered since it was made)."""
    by_hash = {b.hash: b for b in blocks}
    kept: set[str] = set()
    used = 0
    for tip in tips:
        chain: list[str] = []
        at: str | None = tip
        while at is not None and at in by_hash and at not in protected and at not in kept:
            chain.append(at)
            at = by_hash[at].parent
        cost = sum(by_hash[h].stored_bytes for h in chain)
        if used + cost <= share:
            kept.update(chain)
            used += cost
    return kept


_CLIENT_PINNED = (
    "WITH RECURSIVE u(hash) AS (SELECT tip FROM snapshots WHERE {user} UNION "
    "SELECT b.parent FROM blocks b JOIN u ON b.hash = u.hash WHERE b.parent IS NOT NULL), "
    "c(hash) AS (SELECT tip FROM snapshots WHERE {client} UNION SELECT ? UNION "
    "SELECT b.parent FROM blocks b JOIN c ON b.hash = c.hash WHERE b.parent IS NOT NULL) "
    "SELECT COALESCE(SUM(b.stored_bytes), 0) FROM c JOIN blocks b ON b.hash = c.hash "
    "WHERE c.hash NOT IN (SELECT hash FROM u)"
)


def client_pin_fits(db: sqlite_utils.Database, tip: str, share: int) -> bool:
    """Whether a client's pin on the chain ending at ``tip`` keeps the bytes the clients'
    pins hold beside the user's within ``share`` (inside a write transaction)."""
    sql = _CLIENT_PINNED.format(user=USER_PIN_HOLDS, client=CLIENT_PIN_HOLDS)
    now = time.time()
    before = int(db.execute(sql, (now, now, "")).fetchone()[0])
    after = int(db.execute(sql, (now, now, tip)).fetchone()[0])
    return after == before or after <= share


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
