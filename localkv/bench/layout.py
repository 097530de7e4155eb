"""The K and V rows of a KV state in one flat buffer, as the block encodings decode them.

Every layer's K, then every layer's V; each tensor's rows for all N tokens
contiguous (``codec.assemble``'s layout without the header, V token-major).
A block is a range of tokens: in each tensor, a contiguous run of rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from localkv.kv import codec

__all__ = ["Layout", "block_slices"]


@dataclass(frozen=True, slots=True)
class Layout:
    """The tensors of a state (every layer's K, then every layer's V) and their sizes."""

    n_tokens: int
    types: tuple[int, ...]
    row_bytes: tuple[int, ...]

    @classmethod
    def of(cls, state: codec.KVState) -> Layout:
        layers = state.layers
        types = tuple(x.k_type for x in layers) + tuple(x.v_type for x in layers)
        rows = tuple(x.k_row_bytes for x in layers) + tuple(x.v_row_bytes for x in layers)
        return cls(state.n_tokens, types, rows)

    @property
    def nbytes(self) -> int:
        return self.n_tokens * sum(self.row_bytes)

    def views(self, buf: np.ndarray) -> list[np.ndarray]:
        """Per tensor, its ``[n_tokens, row_bytes]`` rows in the flat uint8 ``buf``."""
        out, off = [], 0
        for row_bytes in self.row_bytes:
            size = self.n_tokens * row_bytes
            out.append(buf[off : off + size].reshape(self.n_tokens, row_bytes))
            off += size
        return out

    def assemble(self, state: codec.KVState) -> np.ndarray:
        """The state's K and V rows in this layout: what every decode must produce."""
        buf = np.empty(self.nbytes, dtype=np.uint8)
        sources = [x.k for x in state.layers] + [x.v for x in state.layers]
        for dst, src in zip(self.views(buf), sources, strict=True):
            dst[...] = src
        return buf

    def blocks(self, block_size: int) -> list[tuple[int, int]]:
        return [
            (start, min(start + block_size, self.n_tokens))
            for start in range(0, self.n_tokens, block_size)
        ]


def block_slices(views: Sequence[np.ndarray], start: int, stop: int) -> list[np.ndarray]:
    """Each tensor's rows ``start..stop-1`` as flat, contiguous uint8 views."""
    return [v[start:stop].reshape(-1) for v in views]
