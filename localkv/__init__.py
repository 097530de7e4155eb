"""localkv: a local LLM runtime with a persistent, verified, on-disk prefix KV cache.

    import localkv

    with localkv.Runtime.open() as rt:           # default model and cache
        doc = localkv.read_document("notes.txt")
        answer = rt.ask([doc], "What is due on Friday?")
        print(answer.text, answer.cache.line(answer.tokens.prompt))

See ``localkv.runtime`` for the API and ``examples/rag_loop.py`` for a RAG loop.
The names load on first use, so a command line that only shows ``--help``
does not load llama.cpp.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from localkv.model.sampling import (
        GrammarError,
        SamplingParams,
        json_object_grammar,
        json_schema_grammar,
    )
    from localkv.model.session import ContextFullError, LoraSpec, ModelSession, SessionConfig
    from localkv.prompt.request import Document, DocumentError, TextError, read_document
    from localkv.runtime import Answer, CacheReport, PrefillReport, Runtime

_WHERE = {
    "Answer": "localkv.runtime",
    "CacheReport": "localkv.runtime",
    "ContextFullError": "localkv.model.session",
    "Document": "localkv.prompt.request",
    "DocumentError": "localkv.prompt.request",
    "GrammarError": "localkv.model.sampling",
    "LoraSpec": "localkv.model.session",
    "ModelSession": "localkv.model.session",
    "PrefillReport": "localkv.runtime",
    "Runtime": "localkv.runtime",
    "SamplingParams": "localkv.model.sampling",
    "SessionConfig": "localkv.model.session",
    "TextError": "localkv.prompt.request",
    "json_object_grammar": "localkv.model.sampling",
    "json_schema_grammar": "localkv.model.sampling",
    "read_document": "localkv.prompt.request",
}

__all__ = [
    "Answer",
    "CacheReport",
    "ContextFullError",
    "Document",
    "DocumentError",
    "GrammarError",
    "LoraSpec",
    "ModelSession",
    "PrefillReport",
    "Runtime",
    "SamplingParams",
    "SessionConfig",
    "TextError",
    "json_object_grammar",
    "json_schema_grammar",
    "read_document",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """The API's names, imported when first used (PEP 562)."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'localkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
