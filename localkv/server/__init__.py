"""The HTTP face: protocols over one gateway, on the runtime and its verified cache.

A request goes through ``gate`` (``boundary``: only the user's own programs; the
API key), then its protocol (``protocols/``: OpenAI, Responses, Anthropic,
Ollama, localkv's own), which parses its JSON into the neutral values of
``requests`` (value checks in ``fields``, tools in ``tools``) and hands them to
the ``gateway``: submit to the model's queue (``worker``, one thread that owns
the model), answer whole or as a stream in the protocol's encoder. ``engine``
is what a request does on the runtime; ``conversation`` how messages become the
same tokens ``localkv chat`` computes; ``prefixes`` what is saved and pinned;
``limits`` what a request may cost; ``errors`` the error shapes; ``http`` the
uvicorn configuration with its deadlines; ``app`` assembles them.
"""
