"""Index rows as values: the column lists and their decoding into ``BlockRow``/``SnapshotRow``."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..chain import ends_array
from ..values import BlockRow, Probe, SnapshotRow

__all__ = [
    "BLOCK_COLUMNS",
    "CLIENT",
    "CLIENT_PIN_HOLDS",
    "PIN_HOLDS",
    "SNAPSHOT_COLUMNS",
    "USER_PIN_HOLDS",
    "block_row",
    "readable_rows",
    "snapshot_row",
]

logger = logging.getLogger(__name__)

BLOCK_COLUMNS = (
    "hash, parent, identity, namespace, start, tokens, tokens_sha, file, raw_bytes, "
    "stored_bytes, checksum, probe_digest, probe_top, prefill_seconds, created, last_used, hits, "
    "ends, end_state"
)
SNAPSHOT_COLUMNS = (
    "id, tip, label, source_path, source_sha256, n_tokens, identity, namespace, created, "
    "last_used, hits, pinned, pinned_until, pin_owner, system"
)
# the snapshots whose pin holds at ``?`` (now): pinned for good, or until later
PIN_HOLDS = "pinned = 1 AND (pinned_until IS NULL OR pinned_until > ?)"
# ``pin_owner`` of a pin a server's client asked for (``cache_control``, ``"pin": true``)
CLIENT = "client"
# the snapshots whose pin holds at ``?`` and was asked for by the user, or by a client
USER_PIN_HOLDS = f"{PIN_HOLDS} AND pin_owner IS NULL"
CLIENT_PIN_HOLDS = f"{PIN_HOLDS} AND pin_owner = '{CLIENT}'"


def block_row(r: Sequence[Any]) -> BlockRow:
    """A ``blocks`` row (in ``BLOCK_COLUMNS`` order) as a ``BlockRow``."""
    tokens = np.frombuffer(r[5], dtype="<i4")
    ends = ends_array(np.frombuffer(r[17], dtype="<u4"), int(tokens.shape[0]))
    ends.setflags(write=False)
    return BlockRow(
        hash=r[0],
        parent=r[1],
        identity=r[2],
        namespace=r[3],
        start=int(r[4]),
        tokens=tokens,
        ends=ends,
        tokens_sha=r[6],
        file=r[7],
        raw_bytes=int(r[8]),
        stored_bytes=int(r[9]),
        checksum=r[10],
        probe=Probe.from_row(r[11], r[12]),
        prefill_seconds=float(r[13]),
        created=float(r[14]),
        last_used=float(r[15]),
        hits=int(r[16]),
        end_state=r[18] is None or bool(r[18]),
    )


def readable_rows(rows: Sequence[Sequence[Any]]) -> list[BlockRow]:
    """``block_row`` of each row, up to the first that does not decode (logged).

    A row edited or damaged outside localkv (a malformed digest, a token blob of
    odd length) is treated as not stored: a lookup stops before it, and
    ``unreadable_blocks`` reports it to ``verify``.
    """
    out: list[BlockRow] = []
    for r in rows:
        try:
            out.append(block_row(r))
        except (ValueError, TypeError) as exc:
            logger.warning("index row %r cannot be read (%s); ignoring it", r[0], exc)
            break
    return out


def snapshot_row(r: Sequence[Any]) -> SnapshotRow:
    """A ``snapshots`` row (in ``SNAPSHOT_COLUMNS`` order) as a ``SnapshotRow``; a pin
    whose time has passed reads as none."""
    until = None if r[12] is None else float(r[12])
    return SnapshotRow(
        id=r[0],
        tip=r[1],
        label=r[2],
        source_path=r[3],
        source_sha256=r[4],
        n_tokens=int(r[5]),
        identity=r[6],
        namespace=r[7],
        created=float(r[8]),
        last_used=float(r[9]),
        hits=int(r[10]),
        pinned=bool(r[11]) and (until is None or until > time.time()),
        pinned_until=until if r[11] else None,
        pin_owner=r[13],
        system=r[14],
    )
