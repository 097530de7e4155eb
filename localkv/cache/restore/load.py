"""Loading a stored chain into the session: read, checked, loaded up to its last token.

``load_chain`` opens the chain's block files, reads them the way the
session's memory needs (a sliding window: ``window``; plain KV a piece at a
time: ``pieces``; otherwise straight into one state buffer), has each read
checked (``verify``: checksums as read, the chain's shape and hashes, a
partial part's positions) and loads the state of every token but the last.
The caller then decodes that token as the probe (``verify.probe_matches``).
"""

from __future__ import annotations

import struct
import threading
import time
from typing import NamedTuple

import numpy as np

from localkv.cache.restore.pieces import (
    fill_targets,
    parallel_reads,
    read_in_pieces,
    token_rows,
    transpose_v,
)
from localkv.cache.restore.verify import chain_layout, check_chain, check_partial_part
from localkv.cache.restore.window import read_window_chain
from localkv.kv import codec, partial
from localkv.kv.blocks import PARTIAL, block_partial, tensors_to_state
from localkv.model.session import ModelSession
from localkv.model.state import large_buffer
from localkv.storage.formats.readinto import OpenedBlock
from localkv.storage.store import SnapshotStore
from localkv.storage.values import Block, BlockRow

__all__ = ["load_chain"]


def load_chain(  # noqa: PLR0913 - to take a value type
    store: SnapshotStore,
    root: str,
    session: ModelSession,
    chain: list[BlockRow],
    marks: list[float],
    *,
    spent: dict[str, float] | None = None,
    whole: bool = False,
) -> tuple[np.ndarray, bool]:
    """Read, check and load the chain minus its final token; the stored tokens, and
    whether the final token's rows were loaded too (``whole`` asks for it, for a chain
    whose probe matched before: done for plain KV read in pieces). ``marks`` gets the
    times the reads ended and the state was loaded; ``spent``, where pieces load as they
    are read, their loads' seconds (``load``) and V's into columns (``columns``)."""
    opened = store.open_blocks(chain)
    tip_rows = buffer = None
    loaded = False  # read and loaded a piece at a time (``pieces``)
    try:
        found = _in_pieces(session, opened) if session.memory_kind != "swa" else None
        whole = whole and found is not None  # else read up to the probe token
        if session.memory_kind == "swa":
            blocks, window_state = read_window_chain(store, session, opened)
        elif found is not None:
            layout, v_trans = found
            blocks = read_in_pieces(
                store, session, opened, layout, v_trans, parent=root, spent=spent, whole=whole
            )
            loaded = True
        else:
            blocks, buffer, tip_rows = _read(store, session, opened)
    finally:
        for block_file in opened:
            block_file.close()
    marks.append(time.perf_counter())
    if not loaded:  # (a piece's chain hashes are checked before it goes in)
        check_chain(root, chain, blocks)
    tokens = np.concatenate([b.tokens for b in blocks])
    n = int(tokens.shape[0]) - (0 if whole else 1)
    held = [int(t) for t in tokens[:n]]
    if session.memory_kind == "swa":
        session.load_state(window_state, held)
        session.settled_at = n  # the state the writer settled to before token n
    elif session.memory_kind != "kv":
        _load_with_partial(session, blocks, buffer, held, tip_rows)
    elif loaded:
        pass
    elif buffer is not None:
        session.load_state(buffer, held)
    elif n > 0:
        pieces = [tensors_to_state(b.tensors, b.meta, b.start) for b in blocks]
        session.restore(pieces, held)
    marks.append(time.perf_counter())
    # as the writer batched them, up to the probe token (with an empty batch before it:
    # where the writer settled, ``schedule.settle_marks``)
    ends = [e for b in blocks for e in (b.start + b.ends).tolist() if e <= n]
    session.batch_ends = ends if ends[-1:] == [n] else [*ends, n]
    return tokens, whole


def _load_with_partial(
    session: ModelSession,
    blocks: list[Block],
    buffer: np.ndarray | None,
    held: list[int],
    tip_rows: np.ndarray | None,
) -> None:
    """Attention rows ``[0, n)`` of the blocks + the last block's partial part, loaded.

    The partial part must be the one taken with exactly ``n`` tokens in the
    sequence (its positions are checked), so the state is the one the writer
    held before decoding the chain's final token.
    """
    kind = session.memory_kind
    if kind is None or kind in ("kv", "swa"):
        raise codec.StateFormatError("this memory has no partial part")
    n = len(held)
    tensors = blocks[-1].tensors if tip_rows is None else {PARTIAL: tip_rows}
    blob = block_partial(tensors, blocks[-1].meta)
    check_partial_part(blob, kind, n)
    if kind == "recurrent":
        head = np.frombuffer(struct.pack("<Ii", codec.STATE_MAGIC, 0), dtype=np.uint8)
        state = partial.join(head, blob)
    elif buffer is not None:  # the attention part, with room for the partial part after it
        state = partial.join_into(buffer, blob)
    else:
        pieces = [tensors_to_state(b.tensors, b.meta, b.start) for b in blocks]
        attention = codec.assemble(pieces, n_tokens=n, cell_ext=session.cell_ext)
        state = partial.join(attention, blob)
    session.load_state(state, held)
    # the state before token n is now the one captured there: no capture, no settling again
    session.partials[n] = blob


def _in_pieces(
    session: ModelSession, opened: list[OpenedBlock]
) -> tuple[tuple[codec.LayerLayout, ...], bool] | None:
    """The layout and V transposition of a chain to load a piece at a time, or None:
    plain KV memory in a context with a second sequence, and more than one token."""
    if session.memory_kind != "kv" or not session.in_pieces:
        return None
    found = chain_layout(opened)
    if opened[-1].row.end - 1 <= 0 or not found.layers or PARTIAL in opened[-1].specs:
        return None
    return tuple(found.layers), found.v_trans


class _Read(NamedTuple):
    """A chain's blocks read, and where their rows went."""

    blocks: list[Block]
    buffer: np.ndarray | None  # the state buffer their K/V rows were read into
    tip_rows: np.ndarray | None  # the array the last block's partial rows were read into


def _read(store: SnapshotStore, session: ModelSession, opened: list[OpenedBlock]) -> _Read:
    """The blocks, and (where it can) the state buffer their K/V rows were read into
    and the array the last block's partial rows were read into.

    Every block file is read straight into its rows of llama.cpp's state
    buffer, minus the chain's final token, the buffer leaving room after them
    for the last block's partial part (if any). A transposed V (flash attention
    off) is read token-major into its own area of the buffer, then transposed
    in place a layer at a time through one layer's reused staging rows. An
    empty chain or layout comes back as arrays to assemble.
    """
    # a partial part is used from the chain's last block only: the others' are not read
    drops = [{PARTIAL} if PARTIAL in o.specs else set() for o in opened[:-1]] + [set()]
    found = chain_layout(opened)
    v_trans, layout = found.v_trans, found.layers
    n = opened[-1].row.end - 1  # chain_layout refused an empty chain
    if n <= 0 or not layout:
        return _Read(store.fill_blocks(opened, [None] * len(opened), drops), None, None)
    tail = int(opened[-1].metadata.get("partial_bytes", partial.HEADER)) - partial.HEADER
    buffer, k_rows, v_rows = session.restore_buffer(layout, n, max(0, tail), v_trans)
    # a transposed V is read token-major into its own area, then transposed a layer at a time
    v_places = [token_rows(v, n) for v in v_rows] if v_trans else v_rows
    tip = opened[-1].specs.get(PARTIAL)
    tip_rows = _tip_rows(session, tip.shape, tip.nbytes) if tip is not None else None
    # the chain's final token is read (the checksum covers it) but not loaded:
    # its rows go to a spill area, one row per tensor
    spill = np.empty(sum(x[1] + x[3] for x in layout), dtype=np.uint8)
    targets = fill_targets(opened, layout, k_rows, v_places, n, spill=spill)
    if tip_rows is not None:  # pages reused from the last restore: no page faults
        targets[-1][PARTIAL] = [tip_rows]
    blocks = store.fill_blocks(opened, targets, drops, parallel=parallel_reads(session))
    if v_trans:  # each layer's V rows, token-major as stored, go in as llama.cpp's columns
        transpose_v(v_places, v_rows)
    return _Read(blocks, buffer, tip_rows)


class _Rows(threading.local):
    buffer: np.ndarray | None = None


_ROWS = _Rows()


def _tip_rows(session: ModelSession, shape: tuple[int, ...], nbytes: int) -> np.ndarray:
    """This thread's reused array for the last block's partial rows.

    A restore's partial part stays in ``session.partials`` while the session
    holds that state; it is dropped here before the next restore overwrites it.
    """
    buf = _ROWS.buffer
    for pos in [
        p for p, a in session.partials.items() if buf is not None and np.may_share_memory(a, buf)
    ]:
        del session.partials[pos]
    if buf is None or buf.shape[0] < nbytes:
        buf = _ROWS.buffer = large_buffer(nbytes)
    return buf[:nbytes].reshape(shape)
