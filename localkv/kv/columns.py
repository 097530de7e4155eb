"""A layer's V rows, token-major as a block stores them, into llama.cpp's V columns.

Without flash attention llama.cpp keeps V transposed: a layer's state is
``n_embd_v`` columns of the cells' elements (``[n_embd_v, n]``), where a block
keeps each token's row. A restore turns the rows it read into columns here,
a block at a time, so a block's rows are still in the cache when they are
moved (``cache.restore.pieces``). The compiled ``_columns`` copies in square
tiles without the GIL (the store's reader threads transpose in parallel);
where it was not built (``setup.py``: optional) numpy does, slower.
"""

from __future__ import annotations

import numpy as np

try:
    from localkv.kv import _columns
except ImportError:  # not built: numpy transposes
    _columns = None  # type: ignore[assignment]

__all__ = ["COMPILED", "to_columns"]

COMPILED = _columns is not None


def to_columns(
    rows: np.ndarray, columns: np.ndarray, at: int = 0, *, compiled: bool = COMPILED
) -> None:
    """Copy ``rows`` (``[t, n_embd_v]``, a dtype of 1, 2 or 4 bytes) into rows ``at..at+t``
    of a layer's ``columns`` (``[n_embd_v, n]``, C-contiguous)."""
    t, width = rows.shape
    if (
        columns.ndim != 2
        or columns.shape[0] != width
        or not 0 <= at <= at + t <= columns.shape[1]
        or columns.dtype.itemsize != rows.dtype.itemsize
    ):
        raise ValueError(f"rows {rows.shape} {rows.dtype} at {at} do not fit {columns.shape}")
    if not compiled or not rows.flags.c_contiguous or not columns.flags.c_contiguous:
        columns[:, at : at + t] = rows.T
        return
    if t and width:
        item = rows.dtype.itemsize
        _columns.to_columns(rows.reshape(-1).view(np.uint8).data, columns.data, at, t, width, item)
