"""The ``localkv`` command line: the root group; each command's module loads when it runs.

``localkv --help`` lists the commands from ``COMMANDS`` without importing them
(their one-line help is kept here), so neither the benchmark nor the chat app
is loaded for ``--help``, ``ask`` or ``prefill``.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
from collections.abc import Callable

import click

__all__ = ["BLAS_THREADS", "COMMANDS", "SETTINGS", "cli", "main", "process_age", "start_up"]

# numpy's OpenBLAS starts a thread for each further core as numpy loads; localkv
# does no BLAS work (no matrix products in numpy), so the command line asks for
# one, and numpy loads sooner (`python -X importtime -c "import numpy"` with and
# without it shows by how much). A user's own setting wins; `import localkv` sets nothing.
BLAS_THREADS = "OPENBLAS_NUM_THREADS"

_LOADED = time.monotonic()  # the command line's first module: as early as it can record


def _configure_logging(verbose: int) -> None:
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if verbose < 2:  # localkv says what failed in its own words; -vv shows llama.cpp's
        logging.getLogger("localkv.llama").setLevel(logging.CRITICAL)


# name -> (module:attribute, the first line of its help, shown by ``localkv --help``;
# a test checks they agree)
COMMANDS: dict[str, tuple[str, str]] = {
    "chat": ("localkv.cli.chat:chat", "Chat with the model in the terminal."),
    "prefill": (
        "localkv.cli.documents:prefill",
        "Prefill documents once and save their KV state to the cache.",
    ),
    "ask": (
        "localkv.cli.documents:ask",
        "Ask a question about documents; the answer streams to stdout.",
    ),
    "cache": ("localkv.cli.cache:cache", "Inspect and manage the on-disk KV cache."),
    "models": (
        "localkv.cli.models:models",
        "List the GGUF models found on this machine (LM Studio, Ollama, Hugging Face cache).",
    ),
    "history": ("localkv.cli.history:history", "List, export and delete saved chat conversations."),
    "serve": (
        "localkv.cli.serve:serve",
        "Serve the model over the OpenAI, Responses, Anthropic and Ollama HTTP APIs, cached.",
    ),
    "bench": (
        "localkv.cli.bench:bench",
        "Measure time to first token: cold prefill against a verified restore from disk.",
    ),
}


# commands that need an optional dependency group of pyproject.toml
EXTRAS = {"bench": "bench", "serve": "serve"}


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, _, attr = COMMANDS[name][0].partition(":")
        try:
            command = getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.startswith("localkv"):
                raise
            extra = EXTRAS.get(name)
            hint = f": pip install 'localkv[{extra}]' (`make {extra}` does)" if extra else ""
            raise click.ClickException(f"`localkv {name}` needs {exc.name}{hint}") from None
        if not isinstance(command, click.Command):  # pragma: no cover - a wiring error
            raise TypeError(f"{COMMANDS[name][0]} is not a click command")
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, short) for name, (_, short) in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup)
@click.version_option(package_name="localkv")
@click.option("-v", "--verbose", count=True, help="More log output (-vv: llama.cpp's too).")
def cli(verbose: int) -> None:
    """localkv: a local LLM runtime whose prefix KV cache persists on disk, verified.

    A system prompt or long document is prefilled once; later runs restore its
    attention state from disk instead of recomputing it, after checking that a
    probe token reproduces the stored logits exactly.
    """
    _check_environment()
    _configure_logging(verbose)


# the settings ``_settings`` checks (a test keeps them equal): none set, nothing is loaded
SETTINGS = ("LOCALKV_BUDGET", "LOCALKV_CLIENT_PINS", "LOCALKV_MIN_FREE", "LOCALKV_FAULT")


def _check_environment() -> None:
    """Refuse a malformed ``LOCALKV_*`` setting before any work, as a usage error (exit 2)."""
    import os

    if not any(os.environ.get(name) for name in SETTINGS):
        return  # the store's modules (sqlite-utils, numpy) load only when a command needs them
    for name, check in _settings().items():
        value = os.environ.get(name)
        if value:
            try:
                check(value)
            except ValueError as exc:
                raise click.UsageError(f"{name}: {exc}") from None


def _settings() -> dict[str, Callable[[str], object]]:
    """The settings read from the environment that must parse, and how each is read."""
    from localkv.storage import disk, faults
    from localkv.storage.removal.budget import ENV_BUDGET, ENV_CLIENT_PINS, parse_share, parse_size

    def min_free(value: str) -> int:
        return disk.min_free_bytes()  # reads the variable itself, with its floor

    return {
        ENV_BUDGET: parse_size,
        ENV_CLIENT_PINS: parse_share,
        disk.ENV_MIN_FREE: min_free,
        faults.ENV_FAULT: faults.parse,
    }


def main() -> None:
    start_up()
    cli(prog_name="localkv")


def start_up() -> None:
    """What the command line does first, before a command's modules load.

    It samples the machine's load (``threads.note_start``: the OpenMP wait that
    llama.cpp takes when it loads is chosen from it) and asks numpy's OpenBLAS
    for one thread (``BLAS_THREADS``).
    """
    from localkv.model import threads

    threads.note_start()
    if "numpy" not in sys.modules and not os.environ.get(BLAS_THREADS):
        os.environ[BLAS_THREADS] = "1"


def process_age() -> float:
    """Seconds since this process started (the interpreter's start, not the CLI's).

    Linux: the kernel's start time of the process (``/proc/self/stat``, in clock
    ticks since boot, ``SC_CLK_TCK`` a second) against ``CLOCK_BOOTTIME``; elsewhere, or where that
    is not plausible, the time since this module was loaded.
    """
    loaded = time.monotonic() - _LOADED
    try:
        import os

        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22: starttime
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return loaded
    return age if loaded <= age < loaded + 60 else loaded
