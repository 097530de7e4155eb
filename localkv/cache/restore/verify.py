"""Every check a restore makes before a request uses a cached state.

In the order a restore meets them:

1. Checksums, as the bytes are read: each block file's data and metadata
   against the index's checksum, computed while the rows stream into the state
   buffer (``localkv.storage.formats.readinto``; ``BlockCorrupt`` after the
   bytes were written, so the caller empties the sequence).
2. The chain's shape (``chain_layout``): blocks that follow each other from
   position 0 and share one KV layout.
3. Chain hashes (``check_chain``): each block's hash recomputed from its
   parent's, its tokens and its batch ends, equal to its own and its index
   row's; a piece read a piece at a time is checked before it is loaded.
4. A partial part (``check_partial_part``): an SWA window or recurrent state
   taken with exactly the tokens the restore loads.
5. The probe (``probe_matches``): the state loaded up to the chain's last
   token minus one, that token decoded alone, and its logits compared bit for
   bit with the block's stored probe.

Only then is the sequence trimmed to the exact prefix the lookup planned
(``localkv.cache.prefix``). The other modules of ``localkv.cache.restore``
read and load bytes; they call these checks and make none of their own
beyond the geometry of what they read.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from localkv.kv import codec, partial
from localkv.kv.blocks import BlockLayout, block_layout
from localkv.kv.partial import MemoryKind
from localkv.model.session import ModelSession
from localkv.storage.chain import chain_next
from localkv.storage.formats.readinto import OpenedBlock
from localkv.storage.values import Block, BlockCorrupt, BlockRow

__all__ = ["chain_layout", "check_chain", "check_partial_part", "probe_matches"]


def chain_layout(opened: list[OpenedBlock]) -> BlockLayout:
    """The one KV layout of a chain's blocks, which must follow each other from 0."""
    layouts = set()
    at = 0
    for block_file in opened:
        if block_file.row.start != at:
            raise codec.StateFormatError(f"block at {block_file.row.start}, expected {at}")
        at = block_file.row.end
        specs = block_file.specs
        layouts.add(
            block_layout(
                block_file.metadata,
                {name: s.shape for name, s in specs.items()},
                {name: s.dtype.itemsize for name, s in specs.items()},
            )
        )
    if len(layouts) != 1:
        raise codec.StateFormatError("blocks of different KV layouts cannot be joined")
    return layouts.pop()


def check_chain(parent: str, rows: Sequence[BlockRow], blocks: Sequence[Block]) -> str:
    """Each block's chain hash, recomputed from ``parent``, its tokens and batch ends, is
    its own and its row's (``BlockCorrupt`` if not); the last block's hash."""
    for row, block in zip(rows, blocks, strict=True):
        expected = chain_next(parent, block.tokens, block.ends)
        if block.hash != expected or block.hash != row.hash:
            raise BlockCorrupt("tokens do not match the chain hash", row.hash)
        parent = block.hash
    return parent


def check_partial_part(blob: np.ndarray, kind: MemoryKind, n: int) -> None:
    """``StateFormatError`` unless ``blob`` is the partial part taken with exactly ``n``
    tokens in the sequence (its positions and sizes, ``kv.partial.check_partial``)."""
    partial.check_partial(blob, kind, n)


def probe_matches(session: ModelSession, last: BlockRow, stored_tokens: np.ndarray) -> bool:
    """Decode the chain's final stored token alone; True if its logits are the probe's bits."""
    logits = session.decode_one(int(stored_tokens[last.end - 1]), probe=True)
    return last.probe.matches(logits)
