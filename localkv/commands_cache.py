"""``localkv cache ...``: list, inspect, verify, pin, remove, forget and clean cache entries."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
import numpy as np

from localkv.cliopts import model_options, session_config
from localkv.session import ModelLoadError
from localkv.storage.paths import CacheDirError
from localkv.storage.store import SnapshotStore
from localkv.storage.values import BlockCorrupt, SnapshotRow

__all__ = ["cache"]

_dir_option = click.option(
    "--cache-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Cache directory (default: LOCALKV_HOME, then the user cache dir).",
)
_json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


@contextmanager
def _store(cache_dir: str | None) -> Iterator[SnapshotStore]:
    try:
        store = SnapshotStore.open(Path(cache_dir) if cache_dir else None)
    except (CacheDirError, OSError) as exc:
        raise click.ClickException(f"cannot open the cache: {exc}") from None
    with store:
        yield store


def _snapshot(store: SnapshotStore, ident: str) -> SnapshotRow:
    try:
        return store.get_snapshot(ident)
    except KeyError as exc:
        raise click.ClickException(str(exc.args[0] if exc.args else exc)) from None


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


def _snapshot_json(store: SnapshotStore, s: SnapshotRow) -> dict[str, Any]:
    chain = store.chain_of(s.tip)
    return {
        "id": s.id,
        "label": s.label,
        "tokens": s.n_tokens,
        "blocks": len(chain),
        "bytes_on_disk": sum(r.stored_bytes for r in chain),
        "raw_bytes": sum(r.raw_bytes for r in chain),
        "hits": s.hits,
        "created": s.created,
        "last_used": s.last_used,
        "pinned": s.pinned,
        "namespace": s.namespace,
        "identity": s.identity,
        "source_path": s.source_path,
        "source_sha256": s.source_sha256,
    }


@click.group()
def cache() -> None:
    """Inspect and manage the on-disk KV cache."""


@cache.command("ls")
@_dir_option
@_json_option
@click.option("--namespace", default=None, help="Only this namespace.")
def ls_cmd(cache_dir: str | None, as_json: bool, namespace: str | None) -> None:
    """List snapshots."""
    with _store(cache_dir) as store:
        rows = [_snapshot_json(store, s) for s in store.snapshots(namespace)]
    if as_json:
        click.echo(json.dumps(rows))
        return
    if not rows:
        click.echo("no snapshots")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("id", "label", "tokens", "MB", "hits", "last used", "pinned", "namespace")
    for r in rows:
        table.add_row(
            r["id"],
            r["label"],
            f"{r['tokens']:,}",
            f"{r['bytes_on_disk'] / 1e6:.1f}",
            str(r["hits"]),
            _when(r["last_used"]),
            "yes" if r["pinned"] else "",
            r["namespace"],
        )
    Console().print(table)


@cache.command("show")
@click.argument("snapshot_id")
@_dir_option
@_json_option
def show_cmd(snapshot_id: str, cache_dir: str | None, as_json: bool) -> None:
    """Show a snapshot with every identity field."""
    with _store(cache_dir) as store:
        s = _snapshot(store, snapshot_id)
        info = _snapshot_json(store, s)
        text = store.get_identity(s.identity)
    identity = json.loads(text) if text else {}
    if as_json:
        click.echo(json.dumps({**info, "identity_fields": identity}))
        return
    for key, value in info.items():
        click.echo(f"{key:>14}: {value}")
    click.echo("      identity fields:")
    for key, value in identity.items():
        click.echo(f"  {key:>20}: {json.dumps(value)}")


@cache.command("pin")
@click.argument("snapshot_id")
@_dir_option
def pin_cmd(snapshot_id: str, cache_dir: str | None) -> None:
    """Pin a snapshot: eviction never removes its blocks."""
    with _store(cache_dir) as store:
        s = _snapshot(store, snapshot_id)
        store.pin(s.id)
    click.echo(f"pinned {s.id}")


@cache.command("unpin")
@click.argument("snapshot_id")
@_dir_option
def unpin_cmd(snapshot_id: str, cache_dir: str | None) -> None:
    """Unpin a snapshot."""
    with _store(cache_dir) as store:
        s = _snapshot(store, snapshot_id)
        store.unpin(s.id)
    click.echo(f"unpinned {s.id}")


@cache.command("rm")
@click.argument("snapshot_id")
@_dir_option
def rm_cmd(snapshot_id: str, cache_dir: str | None) -> None:
    """Remove a snapshot and every block only it needs (and scrub the index)."""
    with _store(cache_dir) as store:
        s = _snapshot(store, snapshot_id)
        freed = store.remove_snapshot(s.id)
        busy = store.scrub()
    click.echo(f"removed {s.id} ({freed / 1e6:.1f} MB freed)")
    if busy:
        click.echo("warning: another process holds the index open; run again later", err=True)


@cache.command("forget")
@click.argument("file", type=click.Path(dir_okay=False))
@_dir_option
@_json_option
def forget_cmd(file: str, cache_dir: str | None, as_json: bool) -> None:
    """Remove every trace of FILE: its snapshots and every block only it needs.

    Matches snapshots by FILE's content hash and by its path (FILE may be gone
    already). Blocks shared with other snapshots (a common system prompt) stay;
    freed index pages are overwritten and the WAL is emptied.
    """
    path = Path(file).expanduser()
    sha = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
    with _store(cache_dir) as store:
        report = store.forget(str(path.resolve()), sha)
    fields = {k: getattr(report, k) for k in report.__dataclass_fields__}
    if as_json:
        click.echo(json.dumps(fields))
    else:
        click.echo(
            f"forgot {len(report.snapshots)} snapshot(s), {report.blocks} block(s), "
            f"{report.bytes_freed / 1e6:.1f} MB"
        )
    if not report.wal_truncated:
        click.echo("warning: another process holds the index open; run again later", err=True)


@cache.command("gc")
@_dir_option
@_json_option
def gc_cmd(cache_dir: str | None, as_json: bool) -> None:
    """Remove temp files, files without index rows and rows without files."""
    with _store(cache_dir) as store:
        report = store.gc()
    fields = {k: getattr(report, k) for k in report.__dataclass_fields__}
    click.echo(json.dumps(fields) if as_json else ", ".join(f"{k}: {v}" for k, v in fields.items()))


@cache.command("stats")
@_dir_option
@_json_option
def stats_cmd(cache_dir: str | None, as_json: bool) -> None:
    """Hits, misses by reason, bytes, and prefill seconds saved."""
    with _store(cache_dir) as store:
        stats = dict(store.stats())
    if as_json:
        click.echo(json.dumps(stats))
        return
    for key, value in stats.items():
        click.echo(f"{key:>22}: {json.dumps(value)}")


@cache.command("verify")
@click.option("--deep", is_flag=True, help="Recompute snapshots uncached and compare probes.")
@_dir_option
@_json_option
@model_options
def verify_cmd(deep: bool, cache_dir: str | None, as_json: bool, **opts: Any) -> None:
    """Recheck every block file; with --deep, recompute snapshots of this model."""
    with _store(cache_dir) as store:
        problems = [{"block": h, "reason": r} for h, r in store.verify()]
        deep_results = _deep_verify(store, opts) if deep else []
    bad = problems or [r for r in deep_results if not r["ok"]]
    if as_json:
        click.echo(json.dumps({"problems": problems, "deep": deep_results, "ok": not bad}))
    else:
        for p in problems:
            click.echo(f"BAD  block {p['block']}: {p['reason']}")
        for r in deep_results:
            state = "ok  " if r["ok"] else "BAD "
            click.echo(f"{state} snapshot {r['snapshot']}: {r['detail']}")
        click.echo("all good" if not bad else f"{len(bad)} problem(s)")
    if bad:
        raise SystemExit(1)


def _deep_verify(store: SnapshotStore, opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Replay each snapshot of this model's identity and compare every block's probe."""
    from localkv.identity import identity_of
    from localkv.session import ModelSession
    from localkv.storage.filehash import FileHasher

    try:
        session = ModelSession(session_config(opts))
    except ModelLoadError as exc:
        raise click.ClickException(str(exc)) from None
    results = []
    with session:
        identity = identity_of(session, FileHasher(store.root / "filehashes.db"))
        for snap in store.snapshots():
            if snap.identity != identity.digest:
                continue
            chain = store.chain_of(snap.tip)
            try:
                blocks = store.read_blocks(chain)
            except BlockCorrupt as exc:
                results.append({"snapshot": snap.id, "ok": False, "detail": str(exc)})
                continue
            tokens = [int(t) for b in blocks for t in b.tokens]
            ends = [b.start + int(e) for b in blocks for e in b.ends]
            probes = session.replay(tokens, ends)
            worst = 0.0
            bad = []
            for row in chain:
                logits = probes.get(row.end - 1)
                if logits is None or not row.probe.matches(logits):
                    bad.append(row.hash)
                    if logits is not None:
                        worst = max(
                            worst, _top_diff(row.probe.top_ids, row.probe.top_logits, logits)
                        )
            detail = (
                f"{len(chain)} blocks, probes equal"
                if not bad
                else f"{len(bad)} of {len(chain)} probes differ (max top-64 logit diff {worst:.3g})"
            )
            results.append({"snapshot": snap.id, "ok": not bad, "detail": detail})
    return results


def _top_diff(ids: np.ndarray, stored: np.ndarray, logits: np.ndarray) -> float:
    return float(np.max(np.abs(logits[ids.astype(np.int64)] - stored))) if ids.size else 0.0
