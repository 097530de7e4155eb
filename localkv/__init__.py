"""localkv: a local LLM runtime with a persistent, verified, on-disk prefix KV cache.

    import localkv

    with localkv.Runtime.open() as rt:           # default model and cache
        doc = localkv.read_document("notes.txt")
        answer = rt.ask([doc], "What is due on Friday?")
        print(answer.text, answer.cache.line(answer.tokens.prompt))

See ``localkv.runtime`` for the API and ``examples/rag_loop.py`` for a RAG loop.
"""

from __future__ import annotations

from localkv.model.sampling import (
    GrammarError,
    SamplingParams,
    json_object_grammar,
    json_schema_grammar,
)
from localkv.model.session import ContextFullError, LoraSpec, ModelSession, SessionConfig
from localkv.prompt.request import Document, DocumentError, TextError, read_document
from localkv.runtime import Answer, CacheReport, PrefillReport, Runtime

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
