"""The Anthropic Messages API on ``localkv serve``, parsed straight into the neutral request.

``/v1/messages`` becomes a ``ChatRequest`` (``translate``), the same one
``/v1/chat/completions`` builds for the same conversation, run by the same
engine through the same gateway, so the protocols share the cache and give the
same tokens; ``cache_control`` breakpoints keep their
prefixes pinned for their time (``server.prefixes``). Errors are
Anthropic-shaped: ``{"type": "error", "error": {"type", "message"}}``.
"""

from localkv.server.protocols.anthropic.routes import AnthropicRoutes

__all__ = ["AnthropicRoutes"]
