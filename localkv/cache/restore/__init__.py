"""The verified restore: a stored chain read, checked and loaded into a session.

``load`` reads a chain into the session (``window`` for a sliding window,
``pieces`` for plain KV a piece at a time), ``verify`` holds every check the
restore makes, and ``ends`` says where a restore of memory with a partial
part may end.
"""
