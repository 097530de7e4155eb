"""The OpenAI Responses API on ``localkv serve``: a thin translation to the chat request.

``POST /v1/responses`` becomes the same ``ChatRequest`` as
``/v1/chat/completions`` builds (``translate``), run by the same engine through
the same queue, so the same conversation is the same prompt tokens and shares
the cache; the outcome comes back as a Responses object or its event stream
(``replies``). The server is stateless: ``previous_response_id`` is refused and
nothing is stored. Errors are OpenAI-shaped, as on the other ``/v1`` routes.
"""

from localkv.server.protocols.responses.routes import ResponsesRoutes

__all__ = ["ResponsesRoutes"]
