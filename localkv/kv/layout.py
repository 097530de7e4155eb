"""A sequence state's layout without its rows: sizes, and a buffer to fill in place.

``assembly`` writes every field of a ``llama_state_seq_set_data`` buffer but the
K and V rows and hands back views of where they go, so a restore reads block
files straight into the buffer llama.cpp loads (``localkv.cache.restore``).
The format is ``localkv.kv.codec``'s; with transposed V (flash attention off)
each layer's V is ``n_embd_v`` rows of the cells' elements, which the caller
fills a block's columns at a time.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from localkv.kv.section import (
    ELEMENT_BYTES,
    EXT_CELL,
    PLAIN_CELL,
    STATE_MAGIC,
    StateFormatError,
    write_cells,
)

__all__ = ["LayerLayout", "assembly", "scratch_view", "state_size"]

# per layer: (k_type, k_row_bytes, v_type, v_row_bytes), as KVState.layout() gives
LayerLayout = tuple[int, int, int, int]


def state_size(layout: Sequence[LayerLayout], v_trans: bool, n: int, cell_ext: bool = False) -> int:
    """Bytes of a sequence state of ``n`` tokens with this layout (and cell layout)."""
    size = 4 + 4 + 4 + 4 + n * (EXT_CELL if cell_ext else PLAIN_CELL) + 8
    for _, k_row_bytes, _, v_row_bytes in layout:
        size += 4 + 8 + n * k_row_bytes
        size += (4 + 4 + 4) if v_trans else (4 + 8)
        size += n * v_row_bytes
    return size


def scratch_view(size: int, scratch: np.ndarray | None) -> np.ndarray:
    """``size`` bytes: a view into ``scratch`` when it is a large enough uint8 array."""
    if scratch is not None and scratch.dtype == np.uint8 and scratch.shape[0] >= size:
        return scratch[:size]
    return np.empty(size, dtype=np.uint8)


class Assembly(NamedTuple):
    """A ``set_data`` buffer laid out, and per layer the K and V rows left to fill in it."""

    buffer: np.ndarray
    k_rows: list[np.ndarray]
    v_rows: list[np.ndarray]


def assembly(  # noqa: PLR0913 - to take a value type
    layout: Sequence[LayerLayout],
    n: int,
    seq_id: int = 0,
    scratch: np.ndarray | None = None,
    cell_ext: bool = False,
    *,
    first: int = 0,
    header: bool = True,
    v_trans: bool = False,
) -> Assembly:
    """A ``set_data`` buffer for ``n`` tokens at positions ``first..first+n-1``, rows to fill.

    Every field but the K and V rows (and, with ``cell_ext``, the cells' tokens:
    ``section.name_cell_tokens``) is written; returns the buffer (a view into
    ``scratch`` when it is large enough) and, per layer, the K and V arrays
    that the caller fills, e.g. straight from block files: uint8 ``[n,
    row_bytes]`` views into it, but with ``v_trans`` each V is ``[n_embd_v, n]``
    of its element type (uint16 or uint32), a token's values in a column.
    ``header=False`` leaves out the leading magic and sequence id: a KV section
    to follow another (an SWA state's sliding part after its full-attention part).
    """
    if n <= 0 or not layout:
        raise ValueError(f"cannot lay out {n} tokens of {len(layout)} layers")
    skip = 0 if header else 8
    size = state_size(layout, v_trans, n, cell_ext) - skip
    out = scratch_view(size, scratch)
    if header:
        struct.pack_into("<Ii", out, 0, STATE_MAGIC, seq_id)  # type: ignore[arg-type]
    struct.pack_into("<II", out, 8 - skip, 1, n)  # type: ignore[arg-type]
    off = 16 - skip + n * (EXT_CELL if cell_ext else PLAIN_CELL)
    positions = np.arange(first, first + n, dtype=np.int32)
    write_cells(out[16 - skip : off], positions, seq_id, cell_ext, None)
    struct.pack_into("<II", out, off, int(v_trans), len(layout))  # type: ignore[arg-type]
    off += 8
    rows: list[list[np.ndarray]] = [[], []]
    for which, (type_at, bytes_at) in enumerate(((0, 1), (2, 3))):
        for layer in layout:
            row_bytes, area = layer[bytes_at], out[off + 12 : off + 12 + n * layer[bytes_at]]
            if which == 1 and v_trans:
                elem = ELEMENT_BYTES.get(layer[2])
                if elem is None or row_bytes % elem:
                    raise StateFormatError(f"V of type {layer[2]} cannot be transposed")
                struct.pack_into("<iII", out, off, layer[2], elem, row_bytes // elem)  # type: ignore[arg-type]
                rows[1].append(area.view(f"<u{elem}").reshape(row_bytes // elem, n))
            else:
                struct.pack_into("<iQ", out, off, layer[type_at], row_bytes)  # type: ignore[arg-type]
                rows[which].append(area.reshape(n, row_bytes))
            off += 12 + n * row_bytes
    if off != size:
        raise RuntimeError(f"laid out {off} of {size} bytes")
    return Assembly(out, rows[0], rows[1])
