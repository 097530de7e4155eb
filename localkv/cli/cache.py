"""``localkv cache ...``: list, inspect, verify, pin, remove, forget and clean cache entries."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import click
import numpy as np

from localkv.cache.budgeting import budget_warning, namespace_stats, stats_lines
from localkv.cli.options import model_options, session_config
from localkv.cli.repair import index_problems, repair_cmd
from localkv.cli.repair import opened_store as _store  # one line, naming repair, per error
from localkv.model.session import ModelLoadError
from localkv.prompt.request import Document, DocumentError, read_document
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
    """List snapshots (and warn when pinned ones hold more than the budget)."""
    with _store(cache_dir) as store:
        rows = [_snapshot_json(store, s) for s in store.snapshots(namespace)]
        _warn(budget_warning(store))
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
    _set_pinned(snapshot_id, cache_dir, True)


@cache.command("unpin")
@click.argument("snapshot_id")
@_dir_option
def unpin_cmd(snapshot_id: str, cache_dir: str | None) -> None:
    """Unpin a snapshot."""
    _set_pinned(snapshot_id, cache_dir, False)


def _set_pinned(snapshot_id: str, cache_dir: str | None, pinned: bool) -> None:
    with _store(cache_dir) as store:
        s = _snapshot(store, snapshot_id)
        (store.pin if pinned else store.unpin)(s.id)
    click.echo(f"{'pinned' if pinned else 'unpinned'} {s.id}")


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
@click.option(
    "--with-conversations",
    is_flag=True,
    help="Also delete the saved conversations that hold FILE (otherwise forget refuses).",
)
@_dir_option
@_json_option
@model_options
def forget_cmd(
    file: str, with_conversations: bool, cache_dir: str | None, as_json: bool, **opts: Any
) -> None:
    """Remove every trace of FILE from the cache and, if asked, from saved chats.

    \b
    Removed:
    - the snapshots of FILE (by its content hash and by its path);
    - every block, of any model and namespace, whose tokens contain a run of 6
      of FILE's tokens (written by prefill, ask or a chat's /attach), even one
      another snapshot shares, and every block after those, with the
      snapshots on them;
    - the quarantined copies of those blocks;
    - only with --with-conversations, the saved conversations holding FILE's
      text or tokens; without it, forget refuses and removes nothing while
      any conversation holds FILE.
    Then the freed index pages (and the conversation history's) are
    overwritten and their WAL emptied.

    FILE's tokens come from the vocabulary of --model (or LOCALKV_MODEL, or the
    default model) and of each model the cache's entries were made with. If no
    vocabulary loads (a warning says so), only FILE's snapshots and the blocks
    only they need are removed; if FILE is gone already, only the snapshots
    whose path names it and the blocks only they need.
    """
    path = Path(file).expanduser()
    document = _forgotten_document(path)
    with _store(cache_dir, create=True) as store:
        runs = _forget_runs(store, document, opts.get("model"))
        chats, chats_truncated = _forget_conversations(
            store.root, document, runs, with_conversations
        )
        sha = document.sha256 if document is not None else None
        report = store.forget(str(path.resolve()), sha, runs)
    fields: dict[str, Any] = {k: getattr(report, k) for k in report.__dataclass_fields__}
    fields["wal_truncated"] = report.wal_truncated and chats_truncated
    fields["conversations"] = chats
    if as_json:
        click.echo(json.dumps(fields))
    else:
        click.echo(
            f"forgot {len(report.snapshots)} snapshot(s), {report.blocks} block(s), "
            f"{report.bytes_freed / 1e6:.1f} MB, {len(chats)} conversation(s)"
        )
    if not fields["wal_truncated"]:
        click.echo("warning: another process holds the index open; run again later", err=True)


def _forgotten_document(path: Path) -> Document | None:
    """FILE as ``prefill`` read it, or None when it is gone (match by path only)."""
    if not path.exists():
        return None
    try:
        return read_document(path)
    except DocumentError as exc:
        raise click.ClickException(str(exc)) from None


def _forget_runs(
    store: SnapshotStore, document: Document | None, model: str | None
) -> list[np.ndarray]:
    """The document's tokens under each cached model's vocabulary (warns if none loads)."""
    from localkv.cache.forgetting import document_runs, tokenizer_models
    from localkv.storage.removal.forget import RUN_LENGTH

    if document is None:
        return []
    runs = document_runs(document.text, tokenizer_models(store, model))
    if not runs:
        click.echo(
            "warning: no model vocabulary could be loaded (give --model): only the "
            "document's snapshots are forgotten, not blocks that ask or chat wrote",
            err=True,
        )
    elif all(r.shape[0] < RUN_LENGTH for r in runs):
        click.echo(
            f"warning: the document is shorter than {RUN_LENGTH} tokens: only its "
            "snapshots are forgotten",
            err=True,
        )
    return runs


def _forget_conversations(
    root: Path, document: Document | None, runs: list[np.ndarray], allowed: bool
) -> tuple[list[str], bool]:
    """Delete the saved conversations holding the document (refuse unless ``allowed``).

    Returns the ids deleted and whether the history's WAL could be emptied.
    """
    from localkv.chat.history import HISTORY_FILE, ConversationStore

    if document is None or not (root / HISTORY_FILE).is_file():
        return [], True
    try:
        history = ConversationStore.open(root)
    except (OSError, sqlite3.Error) as exc:
        raise click.ClickException(f"cannot open the saved conversations: {exc}") from None
    with history:
        held = history.holding(document.text, runs)
        if held and not allowed:
            named = "\n".join(f"  {c.id}  {c.title}" for c in held)
            raise click.ClickException(
                f"{len(held)} saved conversation(s) hold {document.name}:\n{named}\n"
                "Nothing was removed: run again with --with-conversations to delete them "
                "too, or delete them in `localkv chat` (F3)."
            )
        if not held:
            return [], True
        deleted, truncated = history.forget([c.id for c in held])
        return list(deleted), truncated


@cache.command("gc")
@_dir_option
@_json_option
def gc_cmd(cache_dir: str | None, as_json: bool) -> None:
    """Remove temp files, files without index rows and rows without files, then evict
    unpinned blocks down to the budget (LOCALKV_BUDGET), least valuable first."""
    with _store(cache_dir) as store:
        report = store.gc()
        fields = {k: getattr(report, k) for k in report.__dataclass_fields__}
        fields["evicted_bytes"] = store.evict(store.default_budget())
        _warn(budget_warning(store))
    click.echo(json.dumps(fields) if as_json else ", ".join(f"{k}: {v}" for k, v in fields.items()))


@cache.command("stats")
@_dir_option
@_json_option
@click.option("--namespace", default="default", show_default=True, help="Only this namespace.")
def stats_cmd(cache_dir: str | None, as_json: bool, namespace: str) -> None:
    """One namespace's hits, misses by reason, bytes (pinned too) and prefill seconds
    saved; and the whole cache's budget with its use (bytes stored, bytes pinned)."""
    with _store(cache_dir) as store:
        stats = namespace_stats(store, namespace)
        _warn(budget_warning(store))
    click.echo(json.dumps(stats) if as_json else "\n".join(stats_lines(stats)))


def _warn(warning: str | None) -> None:
    if warning:
        click.echo(f"warning: {warning}", err=True)


@cache.command("verify")
@click.option("--deep", is_flag=True, help="Recompute snapshots uncached and compare probes.")
@_dir_option
@_json_option
@model_options
def verify_cmd(deep: bool, cache_dir: str | None, as_json: bool, **opts: Any) -> None:
    """Check the index (PRAGMA integrity_check) and recheck every block file; with
    --deep, recompute snapshots of this model."""
    problems, deep_results = index_problems(cache_dir), []
    if not problems:  # a damaged index is the problem: `localkv cache repair`
        with _store(cache_dir) as store:
            problems = [{"block": h, "reason": r} for h, r in store.verify()]
            deep_results = _deep_verify(store, opts) if deep else []
    bad = problems or [r for r in deep_results if not r["ok"]]
    if as_json:
        click.echo(json.dumps({"problems": problems, "deep": deep_results, "ok": not bad}))
    else:
        for p in problems:
            click.echo(f"BAD  {'block ' + p['block'] if 'block' in p else 'index'}: {p['reason']}")
        for r in deep_results:
            state = "ok  " if r["ok"] else "BAD "
            click.echo(f"{state} snapshot {r['snapshot']}: {r['detail']}")
        click.echo("all good" if not bad else f"{len(bad)} problem(s)")
    if bad:
        raise SystemExit(1)


def _deep_verify(store: SnapshotStore, opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Replay each snapshot of this model's identity and compare every block's probe."""
    from localkv.cache.identity import identity_of
    from localkv.model.session import ModelSession
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
            session.reset()
            probes = session.prefill(tokens, ends=ends).probes
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


cache.add_command(repair_cmd)
