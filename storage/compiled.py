"""The store's one compiled module, ``_planes`` (``_planes.c``, built by setup.py).

Optional: ``extension`` is None where it was not built, and ``planes`` and
``q6`` do the same work with numpy, more slowly.
"""

from __future__ import annotations

try:
    from . import _planes as extension
except ImportError:  # pragma: no cover - depends on the build
    extension = None  # type: ignore[assignment]

__all__ = ["extension"]
