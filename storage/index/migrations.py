"""Schema migrations as data: registered in order, recorded once applied.

Each migration is a function of a ``sqlite_utils.Database`` registered with
``@migration``; ``migrate`` applies those not yet named in ``_migrations``.
Never edit a migration that has shipped: add a new one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported by the index's first write (BlockIndex.db), not here
    import sqlite_utils

__all__ = ["MIGRATIONS", "Migration", "Migrations", "migrate", "migration"]

logger = logging.getLogger(__name__)

Migration = Callable[["sqlite_utils.Database"], None]


class Migrations:
    """An ordered list of migrations for one database; use the instance as a decorator."""

    def __init__(self) -> None:
        self.functions: list[Migration] = []

    def __call__(self, fn: Migration) -> Migration:
        """Register ``fn`` as the next migration."""
        self.functions.append(fn)
        return fn

    def pending(self, db: sqlite_utils.Database) -> list[str]:
        """The names of the migrations not yet applied, read without writing anything."""
        if not db.table("_migrations").exists():
            return [fn.__name__ for fn in self.functions]
        applied = {row["name"] for row in db.table("_migrations").rows}
        return [fn.__name__ for fn in self.functions if fn.__name__ not in applied]

    def apply(self, db: sqlite_utils.Database) -> list[str]:
        """Apply pending migrations, each in its own transaction; return their names.

        The caller may already hold a write transaction (the store opens one with
        ``BEGIN IMMEDIATE`` so two processes cannot migrate at once); otherwise
        each migration runs in ``db.atomic()``.
        """
        db.table("_migrations").create(
            {"name": str, "applied_at": float}, pk="name", if_not_exists=True
        )
        applied = {row["name"] for row in db.table("_migrations").rows}
        done: list[str] = []
        for fn in self.functions:
            name = fn.__name__
            if name in applied:
                continue
            with db.atomic():
                fn(db)
                db.table("_migrations").insert({"name": name, "applied_at": time.time()})
            logger.info("applied migration %s", name)
            done.append(name)
        return done


# the snapshot store's own schema
migration = Migrations()
MIGRATIONS = migration.functions


def migrate(db: sqlite_utils.Database) -> list[str]:
    """Apply the store's pending migrations; return their names."""
    return migration.apply(db)


@migration
def m001_initial(db: sqlite_utils.Database) -> None:
    db.table("identities").create(
        {"digest": str, "json": str, "created": float},
        pk="digest",
        not_null={"json", "created"},
    )
    db.table("blocks").create(
        {
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
        },
        pk="hash",
        not_null={
            "identity",
            "namespace",
            "start",
            "n_tokens",
            "tokens",
            "tokens_sha",
            "file",
            "raw_bytes",
            "stored_bytes",
            "checksum",
            "probe_digest",
            "probe_top",
            "prefill_seconds",
            "created",
            "last_used",
            "hits",
        },
        defaults={"hits": 0},
    )
    db.table("blocks").create_index(["parent"])
    db.table("blocks").create_index(["tokens_sha"])
    db.table("snapshots").create(
        {
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
        },
        pk="id",
        not_null={
            "tip",
            "label",
            "n_tokens",
            "identity",
            "namespace",
            "created",
            "last_used",
            "hits",
            "pinned",
        },
        defaults={"hits": 0, "pinned": 0},
    )
    db.table("snapshots").create_index(["tip"])
    db.table("events").create(
        {"kind": str, "reason": str, "tokens": int, "seconds": float, "at": float},
        not_null={"kind", "tokens", "seconds", "at"},
    )


@migration
def m002_batch_ends(db: sqlite_utils.Database) -> None:
    """Blocks record the batch ends they were computed in; chain hashes cover them.

    A block written before this migration is named by its tokens alone
    (``lkv-chain1``) and may hold K/V computed on another batch schedule than
    any request would use now, so it can never be proven to be a request's
    uncached state: its row goes (with the snapshots on it), and ``gc``
    removes its file as one without a row.
    """
    db.execute("DELETE FROM snapshots")
    db.execute("DELETE FROM blocks")
    db.table("blocks").add_column("ends", bytes)


@migration
def m003_event_namespace(db: sqlite_utils.Database) -> None:
    """Hits and misses record their namespace, so ``stats`` of one names no other.

    Events recorded before this migration have none: they count only in the
    statistics of the whole store.
    """
    db.table("events").add_column("namespace", str)


@migration
def m004_hits_name_a_snapshot(db: sqlite_utils.Database) -> None:
    """A hit records the snapshot it is counted under; prefill rates are kept once.

    A snapshot's ``hits`` now counts the restores that named it (the longest
    snapshot the reused prefix covers), not every restore that passed its tip,
    so the counts before this migration are reset; their hit events name no
    snapshot. ``prefill_rates`` holds the timed prefill seconds and tokens
    per identity and context length, the one rate every writer and every hit's
    saved-time estimate uses.
    """
    db.table("events").add_column("snapshot", str)
    db.execute("UPDATE snapshots SET hits = 0")
    db.table("prefill_rates").create(
        {"identity": str, "n_ctx": int, "seconds": float, "tokens": int, "updated": float},
        pk=("identity", "n_ctx"),
        not_null={"seconds", "tokens", "updated"},
    )


@migration
def m005_end_states(db: sqlite_utils.Database) -> None:
    """A block records whether a restore may end at it (``end_state``).

    A block of a sliding-window or recurrent model holds the state a restore
    needs to end there only where one was kept; the others are restored
    through. Blocks written before this migration are kept (plain attention
    blocks can always end a restore); those of other memory kinds were written
    in a format this version no longer reads, under an identity it no longer
    computes, so they are never matched and the budget evicts them.
    """
    db.table("blocks").add_column("end_state", int)


@migration
def m006_pins_that_lapse(db: sqlite_utils.Database) -> None:
    """A pin may hold until a time (``pinned_until``, seconds since the epoch).

    ``pinned = 1`` with ``pinned_until`` NULL is a pin for good (``cache pin``);
    with a time, the pin protects the snapshot's chain until then and lapses
    after it (the server's ``cache_control`` breakpoints, 5 minutes or 1 hour).
    Pins made before this migration are for good.
    """
    db.table("snapshots").add_column("pinned_until", float)


@migration
def m007_client_pins(db: sqlite_utils.Database) -> None:
    """A pin records who asked for it (``pin_owner``): NULL, the user; ``client``, a server's
    client (``cache_control``, ``"pin": true`` in ``/v1/localkv/prefill``).

    A client's pins hold only within their share of the budget; past it, and once
    lapsed, its snapshot is the first evicted; the user's pins are never evicted.
    The pins with a time made before this migration were a client's (only the
    server's breakpoints lapse); every other pin is the user's.
    """
    db.table("snapshots").add_column("pin_owner", str)
    db.execute("UPDATE snapshots SET pin_owner = 'client' WHERE pinned_until IS NOT NULL")


@migration
def m008_snapshot_system(db: sqlite_utils.Database) -> None:
    """A snapshot records the system prompt it was made with (``system``: "" for none), so
    a request for the same document under another one can name it. NULL: made before
    this migration, not known."""
    db.table("snapshots").add_column("system", str)
