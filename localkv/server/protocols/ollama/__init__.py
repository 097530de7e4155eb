"""The Ollama API on ``localkv serve``: a thin translation to the OpenAI requests.

``/api/chat`` and ``/api/generate`` become the same ``ChatRequest`` (or, for a
raw generate, ``CompletionRequest``) as ``/v1/chat/completions`` builds, run by
the same engine through the same queue, so the two protocols share the cache
and give the same tokens. Errors are Ollama-shaped: ``{"error": "message"}``.
"""

from localkv.server.protocols.ollama.routes import OllamaRoutes

__all__ = ["OllamaRoutes"]
