"""``localkv chat``: the Textual chat app, or a line-mode chat with ``--plain``.

The app (and textual) is imported only when the command runs.
"""

from __future__ import annotations

import sqlite3
import sys
from typing import TYPE_CHECKING, Any

import click

from localkv.cli.jsonerrors import TemplateFailure
from localkv.cli.options import (
    cache_options,
    model_options,
    open_runtime,
    sampling_options,
    sampling_params,
    system_option,
    system_text,
)
from localkv.model.session import ContextFullError, ModelLoadError
from localkv.prompt.templatechoice import ChatTemplateError

if TYPE_CHECKING:
    from localkv.history.store import ConversationStore
    from localkv.prompt.request import Document
    from localkv.runtime import Runtime

__all__ = ["chat"]


@click.command()
@model_options
@sampling_options
@cache_options
@system_option("System prompt: TEXT, or @FILE to read it.")
@click.option(
    "--doc",
    "docs",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="Attach a document first (prefilled once, then restored from the cache); repeatable.",
)
@click.option(
    "--resume", is_flag=True, help="Reopen the last conversation (restored from the cache)."
)
@click.option(
    "--plain",
    is_flag=True,
    help="Line-mode chat (for ssh, pipes and scripts; the default without a TTY).",
)
def chat(plain: bool, system: str | None, docs: tuple[str, ...], resume: bool, **opts: Any) -> None:
    """Chat with the model in the terminal.

    Conversations are saved next to the cache after every message (the
    question before its answer); --resume reopens the last one, and fails
    (exit 1) when the saved conversations cannot be read, or the conversation
    needs another model or a larger --ctx (the error names it).
    `localkv history` lists, exports and deletes them.
    In the chat app, Enter sends, Ctrl+J starts a new line, Esc stops the answer,
    /help lists the commands.
    """
    plain = plain or not (sys.stdin.isatty() and sys.stdout.isatty())
    params = sampling_params(opts)
    system = system_text(system, opts["n_ctx"])
    history, history_error = _chat_history(opts)
    if resume and history_error is not None:  # both faces warn of it otherwise
        raise click.ClickException(
            f"cannot resume: the saved conversations cannot be read: {history_error}"
        )
    runtime, load_error = _chat_runtime(opts)
    if plain and runtime is None:
        if history is not None:
            history.close()
        raise click.ClickException(load_error or "the model could not be loaded")
    try:
        if resume and runtime is not None and history is not None:
            _check_resume(runtime, history)
        if plain and runtime is not None:
            from localkv.chat.plain import run_plain_chat

            documents = _read_documents(docs, opts["n_ctx"])
            code = run_plain_chat(
                runtime,
                params,
                system=system,
                documents=documents,
                history=history,
                history_error=history_error,
                resume=resume,
            )
        else:  # the chat app shows a load error itself
            from localkv.tui.app import build_app, run_app

            app = build_app(
                runtime,
                load_error=load_error,
                params=params,
                history=history,
                history_error=history_error,
                system=system,
                documents=docs,
                resume=resume,
            )
            code = run_app(app)
    finally:
        if history is not None:
            history.close()
        if runtime is not None:
            runtime.close()
    sys.exit(code)


def _check_resume(runtime: Runtime, history: ConversationStore) -> None:
    """Exit 1 before the chat opens when the last conversation cannot be resumed here."""
    from localkv.chat.controller import check_resume
    from localkv.chat.saving import ModelMismatch
    from localkv.history.store import MalformedConversation

    try:
        check_resume(runtime, history)
    except (ContextFullError, ModelMismatch, MalformedConversation, sqlite3.Error) as exc:
        raise click.ClickException(f"cannot resume: {exc}") from None


def _chat_runtime(opts: dict[str, Any]) -> tuple[Runtime | None, str | None]:
    """The runtime, or why there is none."""
    try:
        runtime = open_runtime(opts)
    except click.ClickException as exc:  # no model file (ModelNotFoundError)
        return None, exc.message
    except ModelLoadError as exc:
        return None, str(exc)
    except ChatTemplateError as exc:  # the model's own template, refused: no chat can start
        raise TemplateFailure(str(exc)) from None
    return runtime, None


def _chat_history(opts: dict[str, Any]) -> tuple[ConversationStore | None, str | None]:
    """Saved conversations, next to the cache; the chat goes on without them if needed."""
    from localkv.history.store import ConversationStore

    try:
        return ConversationStore.open(opts.get("cache_dir")), None
    except (OSError, sqlite3.Error) as exc:
        return None, str(exc)


def _read_documents(paths: tuple[str, ...], n_ctx: int) -> list[Document]:
    from localkv.prompt.request import DocumentError, byte_limit, read_document

    try:
        return [read_document(path, max_bytes=byte_limit(n_ctx)) for path in paths]
    except DocumentError as exc:
        raise click.ClickException(str(exc)) from None
