"""The Anthropic Messages API on ``localkv serve``: a thin translation to the OpenAI requests.

``/v1/messages`` becomes the same ``ChatRequest`` as ``/v1/chat/completions``
builds, run by the same engine through the same queue, so the protocols share
the cache and give the same tokens; ``cache_control`` breakpoints keep their
prefixes pinned for their time (``server.prefixes``). Errors are
Anthropic-shaped: ``{"type": "error", "error": {"type", "message"}}``.
"""

from localkv.server.protocols.anthropic.routes import AnthropicRoutes

__all__ = ["AnthropicRoutes"]
