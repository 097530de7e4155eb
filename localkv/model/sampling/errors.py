"""The error a grammar or JSON schema that cannot constrain sampling raises."""

from __future__ import annotations

__all__ = ["GrammarError"]


class GrammarError(ValueError):
    """A grammar or JSON schema that cannot constrain sampling; the message says why."""
