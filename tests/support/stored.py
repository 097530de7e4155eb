"""A prefix stored in a runtime's cache, as a test sets one up."""

from __future__ import annotations

from localkv.runtime import Runtime


def store_prefill(rt: Runtime, tokens: list[int]) -> None:
    """Prefill ``tokens`` as one segment in ``rt``'s session and write its blocks."""
    rt.session.prefill(tokens, boundaries=[len(tokens)])
    assert rt.cache is not None
    rt.cache.write(rt.cache.prepare(rt.session, [len(tokens)], 0.001))
