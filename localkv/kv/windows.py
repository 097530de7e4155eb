"""The sliding-layer rows a block will store, collected from the windows a session sees.

A sliding-window (iSWA) model's state holds the full-attention layers' rows of
every token but the sliding layers' rows of the last ``W`` tokens only (the
window). A token's K/V rows do not depend on the window, only the mask does,
so a block stores each of its tokens' sliding rows once, and a restore that
ends at a block assembles the window from the blocks that cover it.

A block ``[s, e)`` keeps the sliding rows of positions ``[max(s, f), e)``,
where ``f`` is the first position of the window held before its last token
(``e - 1``): exactly the rows a restore ending at ``e`` or later can need.
They are collected while the session runs: where it settles before a block's
last token (``model.partial_state``), the window it wrote holds every row but that last
one, which a later window brings (the next settle, the save's capture, or —
when the window is narrower than a block — a capture right after that token).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from localkv.kv import codec

__all__ = ["PendingRows", "WindowLog"]


@dataclass(slots=True, kw_only=True)
class PendingRows:
    """One block's sliding rows, as far as collected."""

    first: int  # first position kept
    end: int  # the block's end (exclusive)
    window_first: int  # first position of the window before token ``end - 1``
    v_trans: bool
    layout: tuple[codec.LayerLayout, ...]
    k: list[np.ndarray]  # per sliding layer, uint8 rows of positions first..end-1
    v: list[np.ndarray]
    elems: list[int]  # V element sizes
    filled: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))

    @property
    def complete(self) -> bool:
        return bool(self.filled.all())

    def take_from(self, window: codec.KVState) -> None:
        """Copy the rows of ``window`` (a parsed sliding section) this block still lacks."""
        pos = window.positions
        if pos.shape[0] == 0:
            return
        lo, hi = max(self.first, int(pos[0])), min(self.end, int(pos[-1]) + 1)
        if lo >= hi:
            return
        rows = slice(lo - self.first, hi - self.first)
        if self.filled[rows].all():
            return
        src = slice(lo - int(pos[0]), hi - int(pos[0]))
        for i, layer in enumerate(window.layers):
            self.k[i][rows] = layer.k[src]
            self.v[i][rows] = layer.v[src]
        self.filled[rows] = True

    def state(self) -> codec.KVState:
        """The rows as a parsed state of positions ``first..end-1``."""
        layers = tuple(
            codec.KVLayer(k_type=kt, v_type=vt, k=k, v=v, v_elem_bytes=elem)
            for (kt, _, vt, _), k, v, elem in zip(
                self.layout, self.k, self.v, self.elems, strict=True
            )
        )
        positions = np.arange(self.first, self.end, dtype=np.int32)
        return codec.KVState(positions=positions, v_trans=self.v_trans, layers=layers)


class WindowLog:
    """Per block end, the sliding rows being collected (see the module docstring)."""

    def __init__(self) -> None:
        self.pending: dict[int, PendingRows] = {}

    def open(self, end: int, block_start: int, window: codec.KVState) -> None:
        """Start collecting block ``[block_start, end)``'s rows; ``window`` is the one held
        before token ``end - 1`` (positions ``f..end-2``, or empty)."""
        pos = window.positions
        window_first = int(pos[0]) if pos.shape[0] else end - 1
        first = max(block_start, window_first)
        n = end - first
        self.pending[end] = PendingRows(
            first=first,
            end=end,
            window_first=window_first,
            v_trans=window.v_trans,
            layout=window.layout(),
            k=[np.zeros((n, x.k_row_bytes), dtype=np.uint8) for x in window.layers],
            v=[np.zeros((n, x.v_row_bytes), dtype=np.uint8) for x in window.layers],
            elems=[x.v_elem_bytes for x in window.layers],
            filled=np.zeros(n, dtype=bool),
        )
        self.harvest(window)

    def copy(self) -> WindowLog:
        """Another log holding copies of the rows collected so far."""
        other = WindowLog()
        other.pending = {end: copy.deepcopy(rows) for end, rows in self.pending.items()}
        return other

    @property
    def nbytes(self) -> int:
        """The rows it holds."""
        return sum(a.nbytes for rows in self.pending.values() for a in (*rows.k, *rows.v))

    def harvest(self, window: codec.KVState) -> None:
        """Give every block still collecting the rows ``window`` holds."""
        for rows in self.pending.values():
            if not rows.complete:
                rows.take_from(window)

    def missing_last(self) -> bool:
        """Whether some block still lacks rows (its last one: see the module docstring)."""
        return any(not rows.complete for rows in self.pending.values())

    def take(self, end: int) -> PendingRows | None:
        """The rows of the block ending at ``end`` (removed), if all were collected."""
        rows = self.pending.pop(end, None)
        return rows if rows is not None and rows.complete else None

    def keep_below(self, n: int) -> None:
        """Forget blocks that end past ``n`` tokens (the sequence was cut)."""
        self.pending = {e: r for e, r in self.pending.items() if e <= n}

    def clear(self) -> None:
        self.pending = {}
