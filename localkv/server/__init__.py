"""The HTTP face: an OpenAI-compatible server on the runtime and its verified cache.

``app`` holds the routes, ``worker`` the one thread that owns the model and its
bounded queue, ``engine`` what a request does on the runtime, ``conversation``
how OpenAI messages become the same tokens ``localkv chat`` computes, ``limits``
what a request may cost before it is refused, ``openai`` request parsing and
response shapes, ``errors`` the OpenAI-shaped errors, ``gate`` what every request
passes, ``http`` the uvicorn configuration with its deadlines.
"""
