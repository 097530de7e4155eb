"""The ``localkv`` command line."""

from __future__ import annotations

import logging
import sys
from typing import Any

import click

from localkv.cliopts import model_options, sampling_options, sampling_params, session_config
from localkv.session import ModelLoadError, ModelSession

__all__ = ["cli", "main"]


@click.group()
@click.version_option(package_name="localkv")
@click.option("-v", "--verbose", count=True, help="More log output (-vv: llama.cpp's too).")
def cli(verbose: int) -> None:
    """localkv: a local LLM runtime whose prefix KV cache persists on disk, verified.

    A system prompt or long document is prefilled once; later runs restore its
    attention state from disk instead of recomputing it, after checking that a
    probe token reproduces the stored logits exactly.
    """
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if verbose < 2:
        logging.getLogger("localkv.llama").setLevel(logging.ERROR)


@cli.command()
@model_options
@sampling_options
@click.option("--system", default=None, help="System prompt.")
@click.option("--plain", is_flag=True, help="Line-mode chat (for ssh, pipes and scripts).")
def chat(plain: bool, system: str | None, **opts: Any) -> None:
    """Chat with the model in the terminal."""
    from localkv.plainchat import run_plain_chat

    config = session_config(opts)
    params = sampling_params(opts)
    try:
        session = ModelSession(config)
    except ModelLoadError as exc:
        raise click.ClickException(str(exc)) from None
    with session:
        code = run_plain_chat(session, params, system=system)
    sys.exit(code)


def _register() -> None:
    from localkv.commands_cache import cache
    from localkv.commands_docs import ask, prefill

    cli.add_command(prefill)
    cli.add_command(ask)
    cli.add_command(cache)


_register()


def main() -> None:
    cli(prog_name="localkv")
