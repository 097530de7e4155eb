"""Opening the model while the command line loads.

``localkv ask`` and ``localkv prefill`` spend about half a second importing
their modules (Python work, one core) before they open the model; loading the
model and creating its context is llama.cpp's work, which leaves the GIL
free. So ``start``, called as the process starts, reads the model options from
the arguments and opens that model and context in a thread
(``localkv.model.early_open.open_early``), beside the imports. The command's own
``open_model`` takes the context only when the configuration it builds from
the parsed options is the same; where the two differ (an option written in a
way read here differently), the early one is freed and the command opens its
own. ``wait`` is called before the command opens its runtime.

From the command line's first import to ``wait``, Python's cyclic garbage
collector is off (``hold_collector``): the imports make
~100,000 long-lived objects and no garbage worth a collection, yet start ~80
collections (~15 ms on the way to the first token, measured). ``wait`` turns it
back on after moving what the imports made to the collector's permanent
generation (``gc.freeze``), so later collections do not walk the modules again.

The arguments read here are the model options of ``localkv.cli.options`` with
``SessionConfig``'s defaults, which are the options' defaults (a test compares
the two for each option).
"""

from __future__ import annotations

import atexit
import gc
import os
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from localkv.model.config import SessionConfig

__all__ = [
    "COMMANDS",
    "guess_config",
    "hold_collector",
    "is_command",
    "release_collector",
    "start",
    "wait",
]

COMMANDS = ("ask", "prefill")  # the commands that open one model as their first work

# option -> SessionConfig field, for the options that take a value and shape the context
_FIELDS = {
    "--model": "model_path",
    "--ctx": "n_ctx",
    "--n-gpu-layers": "n_gpu_layers",
    "--type-k": "type_k",
    "--type-v": "type_v",
    "--flash-attn": "flash_attn",
    "--threads": "n_threads",
    "--lora": "loras",
}
_NO_EARLY = ("--help", "-h", "--version")

_thread: threading.Thread | None = None
_started = False  # ``start`` ran (it opens at most once)
_collector: list[bool] = []  # [True] while ``hold_collector`` holds the collector off


def _options(args: list[str]) -> dict[str, list[str]] | None:
    """The values of ``_FIELDS``' options in ``args``, or None where none is wanted."""
    found: dict[str, list[str]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            break
        if arg in _NO_EARLY:
            return None
        name, eq, value = arg.partition("=")
        if name in _FIELDS:
            if not eq:
                i += 1
                if i == len(args):
                    return None
                value = args[i]
            found.setdefault(name, []).append(value)
        i += 1
    return found


def guess_config(argv: list[str]) -> SessionConfig | None:
    """The configuration ``argv`` (``COMMAND ARGS...``) will open, as far as read here.

    None for another command, for global options before the command (``-v``
    changes the logging the thread would need), for ``--help``, and where the
    options do not make a configuration.
    """
    if not argv or argv[0] not in COMMANDS:
        return None
    found = _options(argv[1:])
    if found is None:
        return None
    from localkv.model.config import LoraSpec, SessionConfig
    from localkv.model.find import resolve_model

    values: dict[str, Any] = {}
    try:
        for name, given in found.items():
            field, last = _FIELDS[name], given[-1]
            if field == "loras":
                values[field] = tuple(LoraSpec.parse(x) for x in given)
            elif field in ("n_ctx", "n_gpu_layers", "n_threads"):
                values[field] = int(last)
            elif field in ("type_k", "type_v"):
                values[field] = last.lower()
            elif field != "model_path":
                values[field] = last
        model = found.get("--model", [None])[-1]
        return SessionConfig(model_path=resolve_model(model or None), **values)
    except (ValueError, OSError):  # the command reports it, in its own words
        return None


def start(argv: list[str]) -> None:
    """Open the model ``argv`` names in a thread, if the command is one of ``COMMANDS``.

    The model layer is imported here, before the thread starts (the command
    imports it anyway): imports hold the GIL, the model load does not, so the
    load runs beside the command's other imports rather than vying with them.
    """
    global _thread, _started
    if _started:
        return
    _started = True
    try:
        cfg = guess_config(argv)
        from localkv.model.early_open import open_early
    except Exception:  # a broken install, say: the command imports it again and says so
        cfg = None
    if cfg is None:
        release_collector()
        return

    _thread = threading.Thread(target=open_early, args=(cfg,), name="localkv-early", daemon=True)
    _thread.start()
    atexit.register(_finish)


def wait() -> None:
    """Wait until the thread ``start`` began has opened what it opens (if it began one).

    The garbage collector ``hold_collector`` turned off is on again after this.
    """
    if _thread is not None:
        _thread.join()
    release_collector()


def is_command(argv: list[str]) -> bool:
    """Whether this process is ``localkv COMMAND ...`` (the script or ``-m``) for ``COMMANDS``."""
    head, name = os.path.split(argv[0] if argv else "")
    ours = name == "localkv" or (name == "__main__.py" and os.path.basename(head) == "localkv")
    return ours and bool(argv[1:2]) and argv[1] in COMMANDS


def hold_collector(argv: list[str]) -> None:
    """Turn the garbage collector off if this process is ``localkv COMMAND`` for ``COMMANDS``.

    Called as the command line's package loads, before its imports; ``wait``
    (or ``start``, where it opens nothing) turns it on again.
    """
    if is_command(argv) and gc.isenabled():
        gc.disable()
        _collector[:] = [True]


def release_collector() -> None:
    """Turn back on the garbage collector ``hold_collector`` turned off (if it did)."""
    if _collector:
        _collector.clear()
        gc.freeze()  # the imports' objects: none is garbage, none needs walking again
        gc.enable()


def _finish() -> None:
    """At exit: no model load is left running, and what no command took is freed."""
    wait()
    import sys

    early_open = sys.modules.get("localkv.model.early_open")
    if early_open is not None:
        early_open.drop_early()
