"""``localkv cache ...``: list, inspect, verify, pin, remove, forget and clean cache entries."""

from __future__ import annotations

import dataclasses
import json
import textwrap
import time
from pathlib import Path
from typing import Any

import click

from localkv.cache.budgeting import budget_warning, human_size, namespace_stats, stats_lines
from localkv.cache.naming import model_names
from localkv.cli.deepverify import deep_verify
from localkv.cli.forgetting import (
    forget_conversations,
    forget_lines,
    forget_runs,
    forgotten_document,
)
from localkv.cli.jsonerrors import JsonErrors
from localkv.cli.options import cache_dir_option, model_options, namespace_option
from localkv.cli.repair import index_problems, repair_cmd
from localkv.cli.repair import opened_store as _store  # one line, naming repair, per error
from localkv.prompt.request import path_text
from localkv.runtime.reports import printable
from localkv.storage.space import Space
from localkv.storage.store import SnapshotStore
from localkv.storage.values import SnapshotRow

__all__ = ["cache"]

_dir_option = cache_dir_option
_json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


def _snapshot(store: SnapshotStore, ident: str) -> SnapshotRow:
    try:
        return store.get_snapshot(ident)
    except KeyError as exc:
        raise click.ClickException(str(exc.args[0] if exc.args else exc)) from None


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


def _snapshot_json(store: SnapshotStore, s: SnapshotRow, model: str, frees: int) -> dict[str, Any]:
    """A snapshot as ``cache ls --json`` and ``cache show --json`` give it; ``frees``: the
    bytes ``cache rm`` of it frees now (``SnapshotStore.space``)."""
    chain = store.chain_of(s.tip)
    return {
        "id": s.id,
        "label": s.label,
        "model": model,
        "tokens": s.n_tokens,
        "blocks": len(chain),
        "frees_bytes": frees,
        "bytes_on_disk": sum(r.stored_bytes for r in chain),
        "raw_bytes": sum(r.raw_bytes for r in chain),
        "hits": s.hits,
        "created": s.created,
        "last_used": s.last_used,
        "pinned": s.pinned,
        "pinned_until": s.pinned_until if s.pinned else None,
        "namespace": s.namespace,
        "identity": s.identity,
        "source_path": s.source_path,
        "source_sha256": s.source_sha256,
    }


@click.group()
def cache() -> None:
    """Inspect and manage the on-disk KV cache.

    IDs are those `cache ls` shows, or any unique start of one. With --json,
    every command answers in JSON, errors too ({"error": ...}, same exit status).
    """


cache.command_class = JsonErrors  # --json errors are JSON


def _short_ids(store: SnapshotStore) -> int:
    """The shortest ID length (at least 8) that names every snapshot uniquely."""
    ids = [s.id for s in store.snapshots()]
    n = 8
    while n < max(map(len, ids), default=0) and len({i[:n] for i in ids}) < len(ids):
        n += 1
    return n


@cache.command("ls")
@_dir_option
@_json_option
@namespace_option()
def ls_cmd(cache_dir: str | None, as_json: bool, namespace: str | None) -> None:
    """List snapshots with their model (and warn when pinned ones hold more than the budget).

    `frees` is what `cache rm` of the row frees now: the blocks no other snapshot
    needs; `size` is its whole chain, blocks it shares with other rows included.
    The total line is every stored block (`cache stats`' stored bytes): the rows'
    own blocks, the blocks several rows share, and blocks no row names.
    Sizes are in binary units and dates in local time; --json gives bytes
    (`frees_bytes`, `bytes_on_disk`) and Unix seconds. The server's saved
    prefixes are snapshots too, labelled `server: ...`.
    """
    with _store(cache_dir) as store:
        space = store.space(namespace)  # a snapshot saved meanwhile waits for the next ls
        snaps = [s for s in store.snapshots(namespace) if s.id in space.snapshots]
        names = model_names(store, (s.identity for s in snaps))
        rows = [
            _snapshot_json(store, s, names[s.identity], space.snapshots[s.id].frees) for s in snaps
        ]
        width = _short_ids(store)
        _warn(budget_warning(store))
    if as_json:
        click.echo(json.dumps(rows))
        return
    if rows:
        _print_table(rows, width)
    else:
        click.echo("no snapshots")
    if space.stored_bytes:
        click.echo(_total_line(space))


def _total_line(space: Space) -> str:
    """The stored bytes (``cache stats``' ``stored_bytes``) and how they split."""
    parts = [f"{human_size(space.own_bytes)} the rows free"]
    if space.shared_bytes:
        parts.append(f"{human_size(space.shared_bytes)} shared by rows")
    if space.unnamed_bytes:
        parts.append(f"{human_size(space.unnamed_bytes)} in no row's chain")
    line = f"total {human_size(space.stored_bytes)} on disk: " + ", ".join(parts)
    return textwrap.fill(line, 80, subsequent_indent="  ")


def _print_table(rows: list[dict[str, Any]], width: int) -> None:
    """The snapshots as a table; the model and namespace columns only when they tell
    rows apart (one model is named on the line above, whole: it is what --model takes)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    spaces = len({r["namespace"] for r in rows}) > 1
    models = {r["model"] for r in rows}
    if len(models) == 1:
        click.echo(f"snapshots of {printable(models.pop())}")
    table = Table(box=None, pad_edge=False)
    table.add_column("id", no_wrap=True, min_width=width)  # a unique start: paste it back
    table.add_column("label", overflow="fold", min_width=12)
    if models:
        table.add_column("model", overflow="fold", min_width=12)
    for name in ("tokens", "frees", "size", "hits", "used", "pin"):
        table.add_column(name, no_wrap=True)
    if spaces:
        table.add_column("namespace", overflow="fold", min_width=9)
    for r in rows:
        cells = [r["id"][:width], r["label"], *([r["model"]] if models else []), f"{r['tokens']:,}"]
        cells += [human_size(r["frees_bytes"]), human_size(r["bytes_on_disk"])]
        cells += [str(r["hits"]), _when(r["last_used"])[5:], _pin_cell(r)]
        cells += [r["namespace"]] if spaces else []
        table.add_row(*(escape(printable(c)) for c in cells))  # no markup either
    Console().print(table)


def _pin_cell(row: dict[str, Any]) -> str:
    """``yes`` for a pin for good, ``to MM-DD HH:MM`` for one that lapses then."""
    if not row["pinned"]:
        return ""
    until = row.get("pinned_until")
    return "yes" if until is None else f"to {_when(until)[5:]}"


@cache.command("show")
@click.argument("snapshot_id")
@_dir_option
@_json_option
def show_cmd(snapshot_id: str, cache_dir: str | None, as_json: bool) -> None:
    """Show a snapshot with every identity field.

    Sizes and dates print as `cache ls` prints them; --json keeps raw numbers.
    """
    with _store(cache_dir) as store:
        s = _snapshot(store, snapshot_id)
        frees = store.space(s.namespace).snapshots[s.id].frees
        info = _snapshot_json(store, s, model_names(store, [s.identity])[s.identity], frees)
        text = store.get_identity(s.identity)
    identity = json.loads(text) if text else {}
    if identity.get("memory_kind", "kv") != "kv":
        with _store(cache_dir) as store:
            info["partial_state"] = _partial_state(store, store.chain_of(s.tip))
    if as_json:
        click.echo(json.dumps({**info, "identity_fields": identity}))
        return
    parts = info.pop("partial_state", None)
    for key, value in info.items():
        click.echo(f"{key:>14}: {printable(_shown(key, value))}")
    if parts is not None:  # the window / recurrent state kept with each block
        n = len(parts["blocks"])
        click.echo(f" partial state: {human_size(parts['bytes'])} in {n} blocks")
        for b in parts["blocks"]:
            click.echo(f"{'':>16}tokens {b['start']}+{b['tokens']}: {human_size(b['bytes'])}")
    click.echo("      identity fields:")
    for key, value in identity.items():
        click.echo(f"  {key:>20}: {printable(json.dumps(value))}")


_SIZES = ("frees_bytes", "bytes_on_disk", "raw_bytes")
_DATES = ("created", "last_used")


def _shown(key: str, value: Any) -> str:
    """A field as ``cache ls`` shows it: sizes in binary units, dates in local time."""
    if key in _SIZES:
        return f"{human_size(value)} ({value:,} bytes)"
    if key in _DATES:
        return _when(value)
    if key == "tokens":
        return f"{value:,}"
    return str(value)


def _partial_state(store: SnapshotStore, chain: list[Any]) -> dict[str, Any]:
    """The bytes each block keeps for a restore to end at it: its sliding rows (SWA) or
    its recurrent state (``kv.blocks.end_state_bytes``)."""
    from localkv.kv.blocks import end_state_bytes

    blocks = []
    for opened in store.open_blocks(chain):
        try:
            sizes = {name: spec.nbytes for name, spec in opened.specs.items()}
            size = end_state_bytes(opened.metadata, sizes)
        finally:
            opened.close()
        row = opened.row
        blocks.append({"start": row.start, "tokens": row.n_tokens, "bytes": size})
    return {"bytes": sum(b["bytes"] for b in blocks), "blocks": blocks}


@cache.command("pin")
@click.argument("snapshot_id")
@_dir_option
@_json_option
def pin_cmd(snapshot_id: str, cache_dir: str | None, as_json: bool) -> None:
    """Pin a snapshot: eviction never removes its blocks."""
    _set_pinned(snapshot_id, cache_dir, True, as_json)


@cache.command("unpin")
@click.argument("snapshot_id")
@_dir_option
@_json_option
def unpin_cmd(snapshot_id: str, cache_dir: str | None, as_json: bool) -> None:
    """Unpin a snapshot."""
    _set_pinned(snapshot_id, cache_dir, False, as_json)


def _set_pinned(snapshot_id: str, cache_dir: str | None, pinned: bool, as_json: bool) -> None:
    with _store(cache_dir) as store:
        s = _snapshot(store, snapshot_id)
        (store.pin if pinned else store.unpin)(s.id)
    word = "pinned" if pinned else "unpinned"
    click.echo(json.dumps({"id": s.id, "pinned": pinned}) if as_json else f"{word} {s.id}")


@cache.command("rm")
@click.argument("snapshot_id")
@_dir_option
@_json_option
def rm_cmd(snapshot_id: str, cache_dir: str | None, as_json: bool) -> None:
    """Remove a snapshot and every block only it holds (and scrub the index).

    Those are its chain's blocks no other snapshot needs and the tips saved beside
    them (a server request's prompt, an earlier turn's end), unless another
    snapshot's chain holds their tokens too.
    """
    with _store(cache_dir) as store:
        s = _snapshot(store, snapshot_id)
        freed = store.remove_snapshot(s.id)
        busy = store.scrub()
    out = {"id": s.id, "bytes_freed": freed}
    click.echo(json.dumps(out) if as_json else f"removed {s.id} ({human_size(freed)} freed)")
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
    - files no index row names: every temp file a killed save left, and
      block files holding FILE's tokens whose row was never written;
    - only with --with-conversations, the saved conversations holding FILE's
      text or tokens; without it, forget refuses and removes nothing while
      any conversation holds FILE.
    Each snapshot removed is named, pinned ones marked, with why: saved from
    FILE, or it quotes FILE (another document's snapshot that holds a run of
    FILE's tokens goes too: the text is forgotten wherever it is).
    Then the freed index pages (and the conversation history's) are
    overwritten and their WAL emptied.

    FILE's tokens come from the vocabulary of --model (or LOCALKV_MODEL, or the
    default model) and of each model the cache's entries were made with. If no
    vocabulary loads (a warning says so), only FILE's snapshots and the blocks
    only they need are removed; if FILE is gone already, only the snapshots
    whose path names it and the blocks only they need (none: an error, exit 1).
    """
    path = Path(file).expanduser()
    document = forgotten_document(path)
    with _store(cache_dir, create=True) as store:
        runs = forget_runs(store, document, opts.get("model"))
        chats, chats_truncated = forget_conversations(
            store.root, document, runs, with_conversations
        )
        sha = document.sha256 if document is not None else None
        report = store.forget(path_text(path.resolve()), sha, runs)
    if document is None and not (report.snapshots or report.blocks):
        raise click.ClickException(
            f"{path_text(file)}: no such file, and no snapshot was saved from it: nothing to forget"
        )
    fields: dict[str, Any] = {k: getattr(report, k) for k in report.__dataclass_fields__}
    fields["removed"] = [dataclasses.asdict(r) for r in report.removed]
    fields["wal_truncated"] = report.wal_truncated and chats_truncated
    fields["conversations"] = chats
    if as_json:
        click.echo(json.dumps(fields))
    else:
        for line in forget_lines(report, chats, path_text(path.name)):
            click.echo(printable(line))  # labels are the user's
    if not fields["wal_truncated"]:
        click.echo("warning: another process holds the index open; run again later", err=True)


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
@namespace_option("default")
def stats_cmd(cache_dir: str | None, as_json: bool, namespace: str) -> None:
    """One namespace's hits, misses by reason, bytes (pinned too) and prefill seconds
    saved; and the whole cache's budget with its use (bytes stored, bytes pinned).

    A first run with nothing stored for it counts as not_cached_yet, not as a miss.
    Sizes print in binary units; --json keeps raw numbers.
    """
    with _store(cache_dir) as store:
        stats = namespace_stats(store, namespace)
        _warn(budget_warning(store))
    click.echo(json.dumps(stats) if as_json else "\n".join(map(printable, stats_lines(stats))))


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
    --deep, recompute the snapshots of this model and settings (the others are
    counted as skipped, by model: verify them with their --model and options)."""
    problems = index_problems(cache_dir)
    deep_results: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    if not problems:  # a damaged index is the problem: `localkv cache repair`
        with _store(cache_dir) as store:
            problems = [{"block": h, "reason": r} for h, r in store.verify()]
            deep_results, skipped = deep_verify(store, opts) if deep else ([], [])
    bad = problems or [r for r in deep_results if not r["ok"]]
    if as_json:
        out = {"problems": problems, "deep": deep_results, "ok": not bad}
        click.echo(json.dumps(out | ({"skipped": skipped} if deep else {})))
    else:
        for p in problems:
            click.echo(f"BAD  {'block ' + p['block'] if 'block' in p else 'index'}: {p['reason']}")
        for r in deep_results:
            state = "ok  " if r["ok"] else "BAD "
            click.echo(f"{state} snapshot {r['snapshot']}: {r['detail']}")
        if skipped:
            click.echo(printable(_skipped_line(skipped)))
        left = f" ({len(skipped)} skipped)" * bool(skipped)
        click.echo(f"all good{left}" if not bad else f"{len(bad)} problem(s){left}")
    if bad:
        raise SystemExit(1)


def _skipped_line(skipped: list[dict[str, str]]) -> str:
    """How many snapshots ``verify --deep`` did not recompute, by model."""
    by_model: dict[str, int] = {}
    for s in skipped:
        by_model[s["model"]] = by_model.get(s["model"], 0) + 1
    models = ", ".join(f"{n} of {m}" for m, n in by_model.items())
    return (
        f"skipped {len(skipped)} snapshot(s) made with another model or settings "
        f"({models}): not recomputed; verify them with that --model and its options"
    )


cache.add_command(repair_cmd)
