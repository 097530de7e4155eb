"""The Ollama API on ``localkv serve``.

``/api/chat`` and ``/api/generate`` are parsed straight into the neutral
``ChatRequest`` (or, for a raw generate, ``CompletionRequest``) every protocol
builds (``translate``), run by the same engine through the same queue, so the
same conversation through any protocol shares the cache and gives the same
tokens. Errors are Ollama-shaped: ``{"error": "message"}``.
"""

from localkv.server.protocols.ollama.routes import OllamaRoutes

__all__ = ["OllamaRoutes"]
