"""The store's one compiled module, ``localkv.storage._planes`` (``storage/_planes.c``).

setup.py builds it as an optional extension. ``extension`` is None where it
was not built, and ``q6`` then decodes with numpy, more slowly.
"""

from __future__ import annotations

try:
    import localkv.storage._planes as extension
except ImportError:  # pragma: no cover - depends on the build
    extension = None  # type: ignore[assignment]

__all__ = ["extension"]
