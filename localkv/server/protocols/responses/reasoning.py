"""A reasoning item's ``encrypted_content``: the reasoning, for a client to send back.

A client that stores nothing on the server (``store: false``) asks for
``include: ["reasoning.encrypted_content"]`` and sends each reasoning item back
in the next request's ``input``, keeping ``encrypted_content`` (it may drop the
readable ``content``). Here it is the reasoning's text under a marked encoding,
not a secret: the server stores nothing, and the text is the client's own
answer. Sent back, it is the next assistant turn's reasoning, so a template
that renders the reasoning of the turns since the last user message sees the
tokens the model made. Another server's encrypted content cannot be read and
adds nothing.
"""

from __future__ import annotations

import base64
import binascii

__all__ = ["INCLUDE", "sealed", "unsealed"]

INCLUDE = "reasoning.encrypted_content"
MARK = "localkv.reasoning.v1:"


def sealed(text: str) -> str:
    return MARK + base64.b64encode(text.encode()).decode("ascii")


def unsealed(value: object) -> str | None:
    """The reasoning in ``value`` (None: not this server's)."""
    if not isinstance(value, str) or not value.startswith(MARK):
        return None
    try:
        return base64.b64decode(value[len(MARK) :], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
