"""The HTTP face: an OpenAI-compatible server on the runtime and its verified cache.

``app`` holds the routes, ``worker`` the one thread that owns the model and its
bounded queue, ``engine`` what a request does on the runtime, ``conversation``
how OpenAI messages become the same tokens ``localkv chat`` computes, ``openai``
request parsing and response shapes, ``errors`` the OpenAI-shaped errors.
"""
