"""``localkv cache repair``, and how every ``cache`` command opens the store.

``opened_store`` never creates a cache that is not there (an empty one is
shown instead), opens a read-only directory read-only, and turns a damaged
or unwritable index into one line that names ``localkv cache repair``.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import click

from localkv.cli.jsonerrors import JsonErrors
from localkv.runtime.reports import printable
from localkv.storage.index.health import IndexDamaged, check_index, is_damage
from localkv.storage.paths import CacheDirError, default_root
from localkv.storage.repair import RepairReport, repair
from localkv.storage.store import MAX_RAW_BLOCK_BYTES, SnapshotStore

__all__ = ["index_problems", "opened_store", "repair_cmd"]

_SHOWN = 10


@contextmanager
def opened_store(cache_dir: str | None, create: bool = False) -> Iterator[SnapshotStore]:
    """The store at ``cache_dir`` (or the default) for one command; errors as one line."""
    root = default_root(Path(cache_dir) if cache_dir else None)
    try:
        store = SnapshotStore.open(root, create=create)
    except IndexDamaged as exc:
        raise click.ClickException(str(exc)) from None
    except (CacheDirError, OSError, sqlite3.Error) as exc:
        raise click.ClickException(f"cannot open the cache: {exc}") from None
    with store:
        try:
            _warn_unindexed(store)
            yield store
        except sqlite3.Error as exc:
            raise click.ClickException(_index_error(store, exc)) from None
        except OSError as exc:  # a disk error, a cache directory changed under us
            raise click.ClickException(f"cache error: {exc}") from None


def _warn_unindexed(store: SnapshotStore) -> None:
    """Say so when the index holds no block but block files are there (a lost index)."""
    if store.db.execute("SELECT 1 FROM blocks LIMIT 1").fetchone() is not None:
        return
    if next(store.layout.blocks.glob("*/*.lkv"), None) is not None:
        click.echo(
            "warning: the cache index holds no blocks but block files are on disk: "
            "`localkv cache repair` indexes them again (`localkv cache gc` keeps them)",
            err=True,
        )


def _index_error(store: SnapshotStore, exc: sqlite3.Error) -> str:
    if is_damage(exc):
        return str(IndexDamaged(store.layout.index, str(exc)))
    if store.read_only:
        why = store.read_only_reason or "read-only"
        return (
            f"the cache at {store.root} is read-only ({why}), "
            f"so this command cannot change it ({exc})"
        )
    return f"cache index error: {exc}"


def index_problems(cache_dir: str | None) -> list[dict[str, str]]:
    """``[{"index": path, "reason": ...}]`` if the index is not sound (``integrity_check``)."""
    path = default_root(Path(cache_dir) if cache_dir else None) / "index.db"
    problem = check_index(path)
    if problem is None:
        return []
    return [{"index": str(path), "reason": str(IndexDamaged(path, problem))}]


@click.command("repair", cls=JsonErrors)
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Cache directory (default: LOCALKV_HOME, then the user cache dir).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def repair_cmd(cache_dir: str | None, as_json: bool) -> None:
    """Rebuild the index from the block files, after it was lost or damaged.

    \b
    - index.db is checked (PRAGMA integrity_check); a damaged one is moved to
      quarantine/ with a note, never deleted, and a new one is built;
    - temp files that killed saves left are removed; a whole block file
      among them is put in place first;
    - every block file the index has no row for is read and checked (its data
      checksum, its chain hash, its tokens and positions) and its row rebuilt,
      root first; a damaged file, or one written before block files carried
      their row, is reported and skipped;
    - every snapshot whose manifest (snapshots/ID.json) names a recovered
      chain comes back with its label, source and pin.
    A new index starts hit counts, last-used times and the hit/miss statistics
    again; a sound one keeps its rows and counts and gains what it lacks (the
    rows it gains start with no hits). The last line says which.
    """
    root = default_root(Path(cache_dir) if cache_dir else None)
    if not os.path.lexists(root):
        raise click.ClickException(f"no cache at {root}")
    try:
        report = repair(root, MAX_RAW_BLOCK_BYTES)
    except (CacheDirError, OSError, sqlite3.Error) as exc:
        raise click.ClickException(f"cannot repair the cache: {exc}") from None
    if as_json:
        click.echo(json.dumps(asdict(report)))
        return
    for line in _lines(report):
        click.echo(printable(line))  # names of files found on disk, labels


def _lines(report: RepairReport) -> Iterator[str]:
    if report.index_problem is not None:
        yield f"index was damaged ({report.index_problem})"
        yield f"  moved to {report.quarantined_index}; a new index was built"
    yield (
        f"rebuilt {report.blocks_added} block row(s) from {report.block_files} block file(s); "
        f"restored {len(report.snapshots_added)} snapshot(s); {report.snapshots} in the cache"
    )
    for ident in report.snapshots_added:
        yield f"  restored snapshot {ident}"
    if report.temp_files:
        yield (
            f"removed {report.temp_files} temp file(s) that killed saves left; "
            f"{report.placed_from_temp} whole block file(s) among them were put in place"
        )
    skipped = [("block", *s) for s in report.skipped_blocks]
    skipped += [("snapshot", *s) for s in report.skipped_snapshots]
    for kind, name, reason in skipped[:_SHOWN]:
        yield f"  skipped {kind} {name}: {reason}"
    if len(skipped) > _SHOWN:
        yield f"  ... and {len(skipped) - _SHOWN} more skipped (--json lists them)"
    if report.not_recovered is None:
        yield "nothing was reset: hit counts, last-used times and statistics are as they were"
    else:
        yield f"not recovered: {report.not_recovered}"
