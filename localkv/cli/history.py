"""``localkv history ...``: list, export and delete the saved chat conversations.

Reading (``ls``, ``export``) creates nothing: without a ``conversations.db``
there is nothing to list. A conversation is named by its id as ``ls`` shows
it, or by the start of it when only one id starts so.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from localkv.cli.options import cache_dir_option
from localkv.history.rows import parts_of
from localkv.history.store import (
    ConversationInfo,
    ConversationNotFound,
    ConversationStore,
    MalformedConversation,
)
from localkv.runtime.chatsession import ChatState
from localkv.runtime.reports import printable

__all__ = ["history"]

_dir_option = cache_dir_option


@contextmanager
def _store(cache_dir: str | None, read_only: bool = True) -> Iterator[ConversationStore | None]:
    """The saved conversations, or None when there are none (nothing is created).

    ``read_only``: a listing never waits for a chat writing in another process.
    """
    try:
        store = ConversationStore.open_existing(cache_dir, read_only=read_only)
    except OSError as exc:
        raise click.ClickException(f"cannot open the saved conversations: {exc}") from None
    if store is None:
        yield None
        return
    with store:
        yield store


def _resolve(store: ConversationStore | None, ident: str) -> tuple[ConversationStore, str]:
    """The store and the full id ``ident`` names; a one-line error when none does."""
    try:
        if store is None:
            raise ConversationNotFound(ident)
        return store, store.resolve(ident)
    except ConversationNotFound as exc:
        raise click.ClickException(f"{exc}; `localkv history ls` lists them") from None


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


def _info_json(info: ConversationInfo) -> dict[str, Any]:
    model = info.model
    return {
        "id": info.id,
        "title": info.title,
        "model": None
        if model is None
        else {"file": model.file, "sha256": model.sha256, "identity": model.identity},
        "messages": info.messages,
        "tokens": info.tokens,
        "created": info.created,
        "updated": info.updated,
        "pending": info.pending,
        "forked_from": info.forked_from,
    }


@click.group()
def history() -> None:
    """List, export and delete saved chat conversations."""


@history.command("ls")
@_dir_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (a JSON list).")
def ls_cmd(cache_dir: str | None, as_json: bool) -> None:
    """List saved conversations, most recent first (damaged ones are named on stderr)."""
    with _store(cache_dir) as store:
        found, skipped = store.scan() if store is not None else ([], [])
    for row in skipped:
        click.echo(f"warning: {printable(row.line())}", err=True)
    if as_json:
        click.echo(json.dumps([_info_json(info) for info in found]))
        return
    if not found:
        click.echo("no saved conversations")
        return
    # one line each, the id whole and first: what ``ls`` shows, ``export`` and ``rm`` take
    click.echo(f"{'id':<16}  {'updated':<16}  {'messages':>8}  {'tokens':>7}  model / title")
    for info in found:
        model = info.model.file if info.model is not None else "(model not recorded)"
        notes = " (last message unanswered)" if info.pending else ""
        notes += f" (forked from {info.forked_from})" if info.forked_from else ""
        click.echo(
            f"{printable(info.id):<16}  {_when(info.updated):<16}  {info.messages:>8}  "
            f"{info.tokens:>7,}  {printable(model)} · {printable(info.title)}{notes}"
        )


@history.command("export")
@click.argument("conversation_id")
@_dir_option
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["json", "markdown"]),
    default="json",
    show_default=True,
    help="JSON (every field) or Markdown (for reading).",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, allow_dash=True),
    default="-",
    help="Write to this file (created 0600) instead of stdout.",
)
def export_cmd(conversation_id: str, cache_dir: str | None, fmt: str, output: str) -> None:
    """Export one conversation: its messages, documents, model and times."""
    with _store(cache_dir) as store:
        found, ident = _resolve(store, conversation_id)
        try:
            info = found.info(ident)
            state = found.load(ident)
        except MalformedConversation as exc:
            raise click.ClickException(str(exc)) from None
    text = _markdown(info, state) if fmt == "markdown" else _json(info, state)
    if output == "-":
        click.echo(text)
        return
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
        with os.fdopen(os.open(output, flags, 0o600), "w", encoding="utf-8") as f:
            f.write(text + "\n")
    except OSError as exc:
        raise click.ClickException(f"cannot write {output}: {exc.strerror or exc}") from None
    click.echo(f"exported {info.id} to {output}", err=True)


def _json(info: ConversationInfo, state: ChatState) -> str:
    return json.dumps(
        {
            **_info_json(info),
            "system": state.system,
            "messages": [
                {
                    "role": m.role,
                    "content": m.content,
                    **({"document": name} if kind == "document" else {}),
                }
                for m, (kind, name, _) in zip(state.messages, parts_of(state), strict=True)
            ],
            "documents": [{"name": name, "tokens": n} for name, n in state.documents],
        },
        ensure_ascii=False,
        indent=2,
    )


def _markdown(info: ConversationInfo, state: ChatState) -> str:
    lines = [f"# {info.title}", "", f"- id: `{info.id}`"]
    if info.model is not None:
        lines.append(f"- model: {info.model.describe()}")
    lines.append(f"- created {_when(info.created)}, updated {_when(info.updated)}")
    if info.forked_from:
        lines.append(f"- forked from `{info.forked_from}`")
    headings = {"system": "System", "user": "User", "assistant": "Assistant"}
    for kind, name, text in parts_of(state):
        heading = f"Document: {name}" if kind == "document" else headings[kind]
        lines += ["", f"## {heading}", "", text]
    if info.pending:
        lines += ["", "## User (not answered)", "", info.pending]
    return "\n".join(lines)


@history.command("rm")
@click.argument("conversation_id")
@_dir_option
def rm_cmd(conversation_id: str, cache_dir: str | None) -> None:
    """Delete a conversation; its pages in the file are overwritten too."""
    with _store(cache_dir, read_only=False) as store:
        found, ident = _resolve(store, conversation_id)
        _, truncated = found.forget([ident])
    click.echo(f"deleted {ident}")
    if not truncated:
        click.echo("warning: another process holds the history open; run again later", err=True)
