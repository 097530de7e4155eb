"""Errors as JSON for commands given ``--json``: ``{"error": "..."}`` on stdout.

A script that asked for JSON gets JSON for a failure too, with the exit
status the text error has (1, or 2 for a usage error). Used as the command
class of every command with a ``--json`` option.
"""

from __future__ import annotations

import json
from typing import Any, NoReturn

import click

__all__ = ["JsonErrors", "TemplateFailure"]


class TemplateFailure(click.ClickException):
    """A chat template that cannot be used, or failed on this input: one line, exit 2
    (as a usage error, since another template is an option away)."""

    exit_code = 2


class JsonErrors(click.Command):
    """A click command whose errors, under ``--json``, are one JSON object on stdout."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        wanted = "--json" in args[: args.index("--") if "--" in args else len(args)]
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.ClickException as exc:
            if wanted:
                _answer(exc)
            raise

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:
            if ctx.params.get("as_json"):
                _answer(exc)
            raise


def _answer(exc: click.ClickException) -> NoReturn:
    click.echo(json.dumps({"error": exc.format_message()}))
    raise SystemExit(exc.exit_code)
