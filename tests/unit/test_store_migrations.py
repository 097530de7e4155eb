"""The schema is built by migrations recorded in ``_migrations``."""

from __future__ import annotations

import sqlite_utils
from localkv.storage.index.migrations import MIGRATIONS, m007_client_pins, migrate

EXPECTED = {
    "identities": {"digest": str, "json": str, "created": float},
    "blocks": {
        "hash": str,
        "parent": str,
        "identity": str,
        "namespace": str,
        "start": int,
        "n_tokens": int,
        "tokens": bytes,
        "tokens_sha": str,
        "file": str,
        "raw_bytes": int,
        "stored_bytes": int,
        "checksum": str,
        "probe_digest": str,
        "probe_top": bytes,
        "prefill_seconds": float,
        "created": float,
        "last_used": float,
        "hits": int,
        "ends": bytes,
        "end_state": int,
    },
    "snapshots": {
        "id": str,
        "tip": str,
        "label": str,
        "source_path": str,
        "source_sha256": str,
        "n_tokens": int,
        "identity": str,
        "namespace": str,
        "created": float,
        "last_used": float,
        "hits": int,
        "pinned": int,
        "pinned_until": float,
        "pin_owner": str,
        "system": str,
    },
    "events": {
        "kind": str,
        "reason": str,
        "tokens": int,
        "seconds": float,
        "at": float,
        "namespace": str,
        "snapshot": str,
    },
    "prefill_rates": {
        "identity": str,
        "n_ctx": int,
        "seconds": float,
        "tokens": int,
        "updated": float,
    },
    "_migrations": {"name": str, "applied_at": float},
}


def test_migrations_build_the_schema() -> None:
    db = sqlite_utils.Database(memory=True)
    applied = migrate(db)
    assert applied == [fn.__name__ for fn in MIGRATIONS]
    for table, columns in EXPECTED.items():
        assert db.table(table).columns_dict == columns, table
    assert db.table("blocks").pks == ["hash"]
    assert db.table("snapshots").pks == ["id"]
    indexed = {tuple(ix.columns) for ix in db.table("blocks").indexes}
    assert ("parent",) in indexed
    assert ("tokens_sha",) in indexed


def test_blocks_of_the_first_chain_format_are_dropped() -> None:
    """Rows named by tokens alone (before batch ends joined the hash) are never served."""
    db = sqlite_utils.Database(memory=True)
    MIGRATIONS[0](db)
    row = {c: 0 for c in EXPECTED["blocks"] if c not in ("ends", "end_state")}
    row.update(hash="sha256:" + "1" * 64, tokens=b"\0" * 4, probe_top=b"")
    db.table("blocks").insert(row)
    later = ("pinned_until", "pin_owner", "system")  # m006, m007 and m008 add them
    first = {c: 0 for c in EXPECTED["snapshots"] if c not in later}
    db.table("snapshots").insert(first | {"id": "s"})
    for fn in MIGRATIONS[1:]:
        fn(db)
    assert db.table("blocks").count == 0
    assert db.table("snapshots").count == 0


def test_migrations_run_once() -> None:
    db = sqlite_utils.Database(memory=True)
    migrate(db)
    assert migrate(db) == []
    names = [r["name"] for r in db.table("_migrations").rows]
    assert names == [fn.__name__ for fn in MIGRATIONS]


def test_pins_with_a_time_made_before_owners_were_told_apart_are_a_clients() -> None:
    """Only the server's breakpoints made pins that lapse; every other pin is the user's."""
    db = sqlite_utils.Database(memory=True)
    for fn in MIGRATIONS[: MIGRATIONS.index(m007_client_pins)]:
        fn(db)
    base = {c: 0 for c in EXPECTED["snapshots"] if c not in ("pin_owner", "system")}
    db.table("snapshots").insert_all(
        [
            base | {"id": "kept", "pinned": 1, "pinned_until": 1e12},
            base | {"id": "user", "pinned": 1, "pinned_until": None},
            base | {"id": "plain", "pinned": 0, "pinned_until": None},
        ]
    )
    m007_client_pins(db)
    owners = {r["id"]: r["pin_owner"] for r in db.table("snapshots").rows}
    assert owners == {"kept": "client", "user": None, "plain": None}
