"""The callbacks the runtime's calls take, named once for every face.

``TextFn`` receives an answer's text as it streams; ``ProgressFn`` hears
``(done, total)`` tokens of a prefill; ``CancelFn`` is asked between batches
whether to stop. The last two are the model session's own
(``localkv.model.session``): they are named here as well so that the chat,
the server and the TUI, which do not import the model, take all three from
one place.
"""

from __future__ import annotations

from collections.abc import Callable

from localkv.model.session import CancelFn, ProgressFn

__all__ = ["CancelFn", "ProgressFn", "TextFn"]

TextFn = Callable[[str], None]
