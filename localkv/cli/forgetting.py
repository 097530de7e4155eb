"""What ``localkv cache forget`` reads: the document, its tokens, the conversations holding it."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import click
import numpy as np

from localkv.cache.budgeting import human_size
from localkv.prompt.request import Document, DocumentError, read_document
from localkv.storage.store import ForgetReport, SnapshotStore

__all__ = ["forget_conversations", "forget_lines", "forget_runs", "forgotten_document"]


def forgotten_document(path: Path) -> Document | None:
    """FILE as ``prefill`` read it, or None when it is gone (match by path only)."""
    if not path.exists():
        return None
    try:
        return read_document(path)
    except DocumentError as exc:
        raise click.ClickException(str(exc)) from None


def forget_runs(
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


def forget_conversations(
    root: Path, document: Document | None, runs: list[np.ndarray], allowed: bool
) -> tuple[list[str], bool]:
    """Delete the saved conversations holding the document (refuse unless ``allowed``).

    Returns the ids deleted and whether the history's WAL could be emptied.
    """
    from localkv.history.store import HISTORY_FILE, ConversationStore

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


def forget_lines(report: ForgetReport, chats: list[str], name: str) -> list[str]:
    """What ``cache forget`` says it removed: the counts, then each snapshot by id and
    label, pinned ones marked, with why it went."""
    unindexed = f", {report.unindexed_files} unindexed file(s)" * bool(report.unindexed_files)
    lines = [
        f"forgot {len(report.snapshots)} snapshot(s), {report.blocks} block(s){unindexed}, "
        f"{human_size(report.bytes_freed)}, {len(chats)} conversation(s)"
    ]
    for snap in report.removed:
        pinned = " (pinned)" if snap.pinned else ""
        why = f"saved from {name}" if snap.why == "source" else f"its blocks quote {name}"
        lines.append(f"  removed {snap.id[:12]}  {snap.label}{pinned}: {why}")
    return lines
