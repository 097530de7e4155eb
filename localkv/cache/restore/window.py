"""A sliding-window chain read into the state llama.cpp holds before its last token.

An iSWA state is two KV sections: the full-attention layers' rows of every
token, then the sliding layers' rows of the window. A block stores its own
tokens' rows of both kinds (``kv.blocks``, ``kv.windows``); a restore that
ends at the chain's last block ``[s, e)`` lays out the state of ``n = e - 1``
tokens: full-attention rows ``0..n-1`` from every block, and the window
``f..n-1`` (``f`` is the last block's ``window_first``, where the writer's
window began when it settled before token ``n``) from the blocks that cover
it. Each block's sliding rows are read from the first one the window needs
(the store's ``tail_from``): nothing before the window is read. The cells are
laid out in position order, as a settled live state holds them. The chain's
final token's rows are read (the checksums cover them) into a spill area, not
loaded: the probe decodes that token.
"""

from __future__ import annotations

import numpy as np

from localkv.cache.restore.verify import chain_layout
from localkv.kv import codec, partial
from localkv.kv.blocks import WINDOW, BlockLayout, tensors_to_state, window_state
from localkv.model.session import ModelSession
from localkv.storage.formats.readinto import OpenedBlock
from localkv.storage.store import SnapshotStore
from localkv.storage.values import Block

__all__ = ["read_window_chain"]

_Targets = dict[str, list[np.ndarray]]


def _layout(opened: list[OpenedBlock]) -> BlockLayout:
    layout = chain_layout(opened)
    if not layout.window or not layout.layers:
        raise codec.StateFormatError("the blocks hold no sliding-window rows")
    return layout


def _window_start(opened: list[OpenedBlock]) -> tuple[int, int]:
    """(f, n): the window's first position and the tokens the state holds."""
    last = opened[-1]
    n = last.row.end - 1
    try:
        first = int(last.metadata["window_first"])
    except (KeyError, ValueError):
        raise codec.StateFormatError("the last block holds no window start") from None
    if not 0 <= first < n:
        raise codec.StateFormatError(f"a window from {first} in a state of {n} tokens")
    return first, n


def _tail_froms(opened: list[OpenedBlock], first: int, n: int) -> list[int]:
    """Per block, the first sliding row the window needs (its tail rows if none)."""
    froms = []
    for block_file in opened:
        start, end, rows = block_file.row.start, block_file.row.end, block_file.tail_rows
        stored = end - rows  # the first position the block keeps sliding rows of
        need = max(first, start)
        if need > n or need >= end:
            froms.append(rows)
            continue
        if need < stored:
            raise codec.StateFormatError(f"the window needs row {need}, stored from {stored}")
        froms.append(need - stored)
    return froms


def read_window_chain(
    store: SnapshotStore, session: ModelSession, opened: list[OpenedBlock]
) -> tuple[list[Block], np.ndarray]:
    """The blocks, and the whole state of their tokens but the last (see the module)."""
    layout = _layout(opened)
    first, n = _window_start(opened)
    froms = _tail_froms(opened, first, n)
    if layout.v_trans:
        return _read_transposed(store, opened, layout, (first, n), froms)
    base = codec.state_size(layout.layers, False, n, session.cell_ext)
    section = codec.state_size(layout.window, False, n - first) - partial.HEADER
    buffer, k_rows, v_rows = session.restore_buffer(layout.layers, n, section)
    _, wk, wv = codec.assembly(
        layout.window, n - first, scratch=buffer[base:], first=first, header=False
    )
    spill = np.empty(sum(x[1] + x[3] for x in (*layout.layers, *layout.window)), np.uint8)
    targets = []
    for block_file, tail_from in zip(opened, froms, strict=True):
        start, end = block_file.row.start, block_file.row.end
        places: _Targets = {}
        used = _place(
            places, "", layout.layers, (k_rows, v_rows), (start, end, 0), n=n, spill=spill
        )
        if tail_from < block_file.tail_rows:
            stored = end - block_file.tail_rows + tail_from
            rows = (wk, wv)
            _place(
                places, WINDOW, layout.window, rows, (stored, end, first), n=n, spill=spill[used:]
            )
        else:  # no row of this block is in the window: its tails are not read
            places.update({name: [] for name in block_file.specs if name.startswith(WINDOW)})
        targets.append(places)
    blocks = store.fill_blocks(opened, targets, tails=froms)
    return blocks, buffer


def _place(  # noqa: PLR0913 - to take a value type
    places: _Targets,
    prefix: str,
    layers: tuple[codec.LayerLayout, ...],
    rows: tuple[list[np.ndarray], list[np.ndarray]],
    span: tuple[int, int, int],
    *,
    n: int,
    spill: np.ndarray,
) -> int:
    """Targets for positions ``span[0]..span[1]-1`` of ``layers``' K/V tensors: rows
    ``pos - span[2]`` of ``rows`` below ``n``, the spill area for position ``n``.
    Returns the spill bytes used."""
    lo, hi, origin = span
    keep = min(hi, n) - lo
    used = 0
    for i, (_, k_bytes, _, v_bytes) in enumerate(layers):
        k, v = (f"{prefix}k.{i}", rows[0][i], k_bytes), (f"{prefix}v.{i}", rows[1][i], v_bytes)
        for name, dst, width in (k, v):
            places[name] = [dst[lo - origin : lo - origin + keep]]
            if hi > n:
                places[name].append(spill[used : used + width])
                used += width
    return used


def _read_transposed(
    store: SnapshotStore,
    opened: list[OpenedBlock],
    layout: BlockLayout,
    window: tuple[int, int],
    froms: list[int],
) -> tuple[list[Block], np.ndarray]:
    """With transposed V (flash attention off): rows read as arrays, then assembled."""
    first, n = window
    targets: list[_Targets] = []
    for block_file, tail_from in zip(opened, froms, strict=True):
        rows = block_file.tail_rows - tail_from
        targets.append(
            {
                name: [np.empty((rows, *spec.shape[1:]), dtype=spec.dtype)]
                for name, spec in block_file.specs.items()
                if name.startswith(WINDOW)
            }
        )
    blocks = store.fill_blocks(opened, targets, tails=froms)
    base = codec.assemble(
        [tensors_to_state(b.tensors, b.meta, b.start) for b in blocks], n_tokens=n
    )
    parts = []
    for block, places, block_file, tail_from in zip(blocks, targets, opened, froms, strict=True):
        if tail_from == block_file.tail_rows:
            continue
        got = {name: arrays[0] for name, arrays in places.items()}
        at = block.end - block_file.tail_rows + tail_from
        piece = window_state(got, block.meta, at)
        parts.append(piece.slice(0, min(piece.n_tokens, n - at)))
    sliding = codec.assemble([p for p in parts if p.n_tokens], n_tokens=n - first)
    return blocks, partial.join(base, sliding)
