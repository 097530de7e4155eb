"""OpenAI's chat completions, completions and models list: ``parse`` reads the bodies
into neutral requests, ``replies`` encodes the answers, ``routes`` joins them on the
gateway."""

from localkv.server.protocols.openai.routes import OpenAIRoutes

__all__ = ["OpenAIRoutes"]
