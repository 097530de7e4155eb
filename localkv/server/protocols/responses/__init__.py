"""The OpenAI Responses API on ``localkv serve``.

``POST /v1/responses`` is parsed straight into the neutral ``ChatRequest``
(``translate``; top-level fields in ``fields``, tools, namespaces of them and
hosted tools in ``tools``), run by the same engine through the same queue as
every protocol, so the same conversation is the same prompt tokens and shares
the cache; the outcome comes back as a Responses object or its event stream
(``replies``). The server is stateless: ``previous_response_id`` is refused and
nothing is stored (a reasoning item's ``encrypted_content`` carries the
reasoning back, ``reasoning``). Errors are OpenAI-shaped, as on the other
``/v1`` routes.
"""

from localkv.server.protocols.responses.routes import ResponsesRoutes

__all__ = ["ResponsesRoutes"]
