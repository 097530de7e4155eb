"""The runtime room: the API the faces use (the CLI, the chat, the server).

``Runtime`` (``localkv.runtime.runtime``) holds one model and its verified
cache; ``localkv.runtime.reports`` holds the values it reports;
``localkv.runtime.chatsession`` is a cached chat on a runtime, and
``localkv.runtime.chatsnapshot`` the snapshot that names its saved prefix;
``localkv.runtime.info`` what a runtime tells about its model and snapshots,
and ``localkv.runtime.callbacks`` the callbacks its calls take.
The names below load on first use, so a face that only needs ``printable``
does not load llama.cpp.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from localkv.runtime.reports import Answer, CacheReport, PrefillReport, Timing, TokenCounts
    from localkv.runtime.runtime import AskCancelled, Runtime

_WHERE = {
    "Answer": "localkv.runtime.reports",
    "AskCancelled": "localkv.runtime.runtime",
    "CacheReport": "localkv.runtime.reports",
    "PrefillReport": "localkv.runtime.reports",
    "Runtime": "localkv.runtime.runtime",
    "Timing": "localkv.runtime.reports",
    "TokenCounts": "localkv.runtime.reports",
}

__all__ = [
    "Answer",
    "AskCancelled",
    "CacheReport",
    "PrefillReport",
    "Runtime",
    "Timing",
    "TokenCounts",
]


def __getattr__(name: str) -> object:
    """The room's names, imported when first used (PEP 562)."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'localkv.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
