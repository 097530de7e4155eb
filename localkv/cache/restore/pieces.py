"""Restoring plain KV memory a piece at a time, so no second copy of the whole state is held.

llama.cpp loads a sequence's state only whole (``llama_state_seq_set_data``
empties the sequence first), so a restore used to assemble the whole state in
a buffer as large as the KV cells it fills: twice the state's memory while it
loads, kept for the next restore, and on a machine that backs fresh memory
lazily (a virtual machine handing freed pages back to its host, as here) the
dearest part of a fresh process's restore. Here consecutive blocks are read,
up to ``PIECE_BYTES`` of rows at a time (one block at least), into a reused
piece buffer: each piece's checksums are checked as it is read, its chain hashes
before it is loaded, and it goes in after the pieces before it
(``ModelSession.load_state(first=...)``, through the context's second
sequence). The cells, and so the bits, are those a whole restore gives (tested).
With transposed V (flash attention off) a piece's V rows are read token-major
into a staging area of their own and go into llama.cpp's columns from there
(``kv.columns``), a block at a time on the thread that read it, while its rows
are still in the CPU's cache. Where there are reader threads, the next pieces
are read into buffers of their own while one loads (``pieces_ahead``): enough of
them that every reader has a block to read, so the copy into llama.cpp, on the
model's thread, overlaps the reads, and a model whose block fills a piece alone
(a large model's) still reads on every reader.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from localkv.cache.restore.verify import check_chain
from localkv.kv import codec
from localkv.kv.columns import to_columns
from localkv.kv.layout import LayerLayout, state_size
from localkv.model.loading import kv_bytes_per_token
from localkv.model.session import ModelSession
from localkv.model.state import large_buffer
from localkv.storage.formats.readinto import OpenedBlock
from localkv.storage.readpool import PendingFill
from localkv.storage.store import SnapshotStore
from localkv.storage.values import Block

__all__ = [
    "MAX_AHEAD",
    "PIECE_BYTES",
    "fill_targets",
    "groups",
    "pieces_ahead",
    "prepare_buffers",
    "read_in_pieces",
    "token_rows",
    "transpose_v",
]

PIECE_BYTES = 16 << 20
MAX_AHEAD = 2  # pieces read while one loads, at most: each holds a piece's buffers


def groups(opened: list[OpenedBlock], n: int, per_token: int) -> list[list[OpenedBlock]]:
    """Consecutive blocks whose rows of tokens ``< n`` make up to ``PIECE_BYTES`` (one at
    least); a block with no such token joins the group before it."""
    out: list[list[OpenedBlock]] = []
    held = 0
    for block_file in opened:
        start, end = block_file.row.start, min(block_file.row.end, n)
        rows = max(0, end - start) * per_token
        if out and (rows == 0 or held + rows <= PIECE_BYTES):
            out[-1].append(block_file)
            held += rows
        else:
            out.append([block_file])
            held = rows
    return out


class _Piece(threading.local):
    """This thread's piece buffers and V staging areas, one of each a slot, reused."""

    def __init__(self) -> None:
        self.buffers: list[np.ndarray | None] = []
        self.staged: list[np.ndarray | None] = []


_PIECE = _Piece()


def _slot(areas: list[np.ndarray | None], nbytes: int, slot: int) -> np.ndarray:
    """``areas[slot]``, made (or grown to) ``nbytes`` at least."""
    areas.extend([None] * (slot + 1 - len(areas)))
    area = areas[slot]
    if area is None or area.shape[0] < nbytes:
        area = areas[slot] = large_buffer(nbytes)
    return area


def _buffer(nbytes: int, slot: int = 0) -> np.ndarray:
    """This thread's reused piece buffer ``slot``, of ``nbytes`` at least."""
    return _slot(_PIECE.buffers, nbytes, slot)


def pieces_ahead(per_token: int, block_size: int, readers: int) -> int:
    """How many pieces are read on ``readers`` reader threads while one loads (0: none
    where there is one reader): enough that every reader has a block, a piece holding as
    many blocks as fit in ``PIECE_BYTES`` (one at least), and ``MAX_AHEAD`` at most. Each
    takes a piece's memory."""
    if readers < 2:
        return 0
    blocks = max(1, PIECE_BYTES // max(1, per_token) // max(1, block_size))
    return min(MAX_AHEAD, -(-readers // blocks))


def prepare_buffers(session: ModelSession, readers: int) -> int:
    """Make this thread's piece buffers and V staging as large as a restore into ``session``
    with ``readers`` reader threads needs, and touch every page of them; the bytes made
    ready (0: it restores otherwise).

    A fresh process's first restore would otherwise fault in every page of them as it
    copies into them (on a machine whose host backs fresh memory lazily, as here, slower
    than reading the blocks): a server calls this on its model thread before it says it
    is ready. The sizes are an upper bound from the model's K/V bytes per token (a
    restore that needs more grows the buffers as before).
    """
    if session.memory_kind != "kv" or not session.in_pieces:
        return 0
    per_token = max(1, kv_bytes_per_token(session.config, session.model))
    block = session.config.block_size
    tokens = min(session.n_ctx, max(PIECE_BYTES // per_token, block) + block)
    rows = tokens * per_token
    # the state's other fields: a cell, and per layer a few header words
    size = rows + tokens * _CELL_BOUND + _HEADER_BOUND
    ready = 0
    for slot in range(1 + pieces_ahead(per_token, block, readers)):
        ready += _touch(_buffer(size, slot))
        if session.flash_attn_setting() != "on":  # V may be transposed: staged on its way
            ready += _touch(_staging(rows // 2 + _HEADER_BOUND, slot))
    return ready


_CELL_BOUND = 64  # bytes of a cell's fields in a state, at most (``kv.layout``)
_HEADER_BOUND = 1 << 16
_PAGE = 4096


def _touch(buf: np.ndarray) -> int:
    """Write to every page of ``buf`` (its first use: the pages are faulted in now)."""
    buf[::_PAGE] = 0
    return int(buf.shape[0])


def parallel_reads(session: ModelSession) -> bool:
    """Whether a restore for ``session`` reads its block files on the store's reader threads.

    Only while its decodes have more than one thread (``ThreadFit``: cores are free). When
    other work holds the cores, each hand-off to a reader thread waits for a time slice, so
    a restore reads sooner on its own thread; on free cores the readers read in parallel
    (``benchmarks/faces.py`` times the warm first token idle and with ``--load``)."""
    session.threads.check()
    return session.threads.current > 1


def read_in_pieces(  # noqa: PLR0913 - to take a value type
    store: SnapshotStore,
    session: ModelSession,
    opened: list[OpenedBlock],
    layout: tuple[LayerLayout, ...],
    v_trans: bool,
    *,
    parent: str,
    spent: dict[str, float] | None = None,
    whole: bool = False,
) -> list[Block]:
    """Read and load the chain but its final token (``whole``: with it), a piece at a
    time; the blocks read.

    ``parent`` is the chain's root. The session holds the tokens loaded so far if a
    piece fails (``BlockCorrupt``, ``StateFormatError``); the caller empties it.
    ``spent`` gets the seconds of two parts of the work: ``columns`` (V into llama.cpp's
    columns, on the reader threads: summed over them) and ``load`` (the pieces into
    llama.cpp).
    """
    spent = {} if spent is None else spent
    spent.setdefault("columns", 0.0)
    spent.setdefault("load", 0.0)
    n = opened[-1].row.end - (0 if whole else 1)
    per_token = sum(x[1] + x[3] for x in layout)
    parallel = parallel_reads(session)
    block = session.config.block_size
    into = _Into(
        store=store,
        session=session,
        layout=layout,
        v_trans=v_trans,
        n=n,
        spill=np.empty(per_token, dtype=np.uint8),
        parallel=parallel,
        ahead=pieces_ahead(per_token, block, store.readers) if parallel else 0,
    )
    plan = groups(opened, n, per_token)
    blocks: list[Block] = []
    reading: deque[_Reading] = deque()  # pieces started, in order: the next to load first
    started = 0
    try:
        for i in range(len(plan)):
            # start the pieces up to ``ahead`` after this one: each into the slot of a
            # piece already loaded (queued behind this one's blocks on the readers)
            while started < min(len(plan), i + 1 + into.ahead):
                reading.append(into.start(plan[started], started % (into.ahead + 1)))
                started += 1
            piece = reading.popleft()
            got = piece.wait(spent)
            parent = check_chain(parent, [g.row for g in piece.group], got)
            tokens = np.concatenate([b.tokens for b in got])[: piece.stop - piece.first]
            t0 = time.perf_counter()
            session.load_state(piece.buf, tokens.tolist(), first=piece.first)
            spent["load"] += time.perf_counter() - t0
            blocks.extend(got)
    finally:
        for left in reading:  # their readers write into buffers: done before they are reused
            left.settle()
    return blocks


@dataclass(frozen=True, slots=True, kw_only=True)
class _Reading:
    """A piece being read: its blocks' reads, and where its state goes."""

    group: list[OpenedBlock]
    first: int  # its first token, and the token after its last loaded one
    stop: int
    buf: np.ndarray  # the piece's state, once read
    took: list[float]  # the seconds of its blocks' columns, as each reader finishes one
    pending: PendingFill | None = None  # on the reader threads, or
    done: list[Block] | None = None  # read on this thread

    def wait(self, spent: dict[str, float]) -> list[Block]:
        """Its blocks once read and checked (``BlockCorrupt`` for a bad one)."""
        got = self.done if self.pending is None else self.pending.wait()
        assert got is not None
        spent["columns"] += sum(self.took)
        return got

    def settle(self) -> None:
        """Wait for its reads, whatever they found (a restore that failed is leaving with
        its own error, which this must not replace)."""
        with contextlib.suppress(Exception):
            self.wait({"columns": 0.0})


@dataclass(frozen=True, slots=True, kw_only=True)
class _Into:
    """What a piece is read into: one restore's settings."""

    store: SnapshotStore
    session: ModelSession
    layout: tuple[LayerLayout, ...]
    v_trans: bool
    n: int  # the tokens loaded: a token at ``n`` or after is read into ``spill``
    spill: np.ndarray
    parallel: bool  # read on the reader threads, else on this one
    ahead: int  # pieces read while one loads (``pieces_ahead``)

    def start(self, group: list[OpenedBlock], slot: int) -> _Reading:
        """Start reading ``group`` into piece buffer ``slot`` (read at once, unless parallel)."""
        session, layout, n = self.session, self.layout, self.n
        first, stop = group[0].row.start, min(group[-1].row.end, n)
        size = state_size(layout, self.v_trans, stop - first, session.cell_ext)
        buf, k_rows, v_rows = codec.assembly(
            layout,
            stop - first,
            scratch=_buffer(size, slot),
            cell_ext=session.cell_ext,
            first=first,
            v_trans=self.v_trans,
        )
        v_places = _staged(v_rows, stop - first, slot) if self.v_trans else v_rows
        targets = fill_targets(group, layout, k_rows, v_places, n, spill=self.spill, first=first)
        # a block's V rows go into the columns on its reader, while they are in the cache
        took: list[float] = []  # appended on each reader: one list.append is atomic
        then = _into_columns(group, v_places, v_rows, (first, n), took) if self.v_trans else None
        piece = _Reading(group=group, first=first, stop=stop, buf=buf, took=took)
        if self.parallel and (len(group) > 1 or self.ahead):
            return replace(piece, pending=self.store.start_fill_blocks(group, targets, then=then))
        got = self.store.fill_blocks(
            group, targets, [set()] * len(group), parallel=False, then=then
        )
        return replace(piece, done=got)


def _into_columns(
    group: list[OpenedBlock],
    v_places: list[np.ndarray],
    v_rows: list[np.ndarray],
    span: tuple[int, int],
    took: list[float],
) -> Callable[[int, Block], None]:
    """For ``fill_blocks``' ``then``: block ``i``'s staged V rows (tokens below ``n``) into
    llama.cpp's columns of a piece starting at token ``first``; each call's seconds are
    appended to ``took``."""
    first, n = span

    def then(i: int, _block: Block) -> None:
        t0 = time.perf_counter()
        row = group[i].row
        start, keep = row.start - first, max(0, min(row.end, n) - row.start)
        for rows, columns in zip(v_places, v_rows, strict=True):
            to_columns(rows[start : start + keep].view(columns.dtype), columns, start)
        took.append(time.perf_counter() - t0)

    return then


def _staged(v_rows: list[np.ndarray], n: int, slot: int) -> list[np.ndarray]:
    """Per layer, ``n`` token-major V rows in this thread's reused staging area ``slot``."""
    area = _staging(sum(v.nbytes for v in v_rows), slot)
    out, at = [], 0
    for v in v_rows:
        out.append(area[at : at + v.nbytes].reshape(n, -1))
        at += v.nbytes
    return out


def fill_targets(  # noqa: PLR0913 - to take a value type
    opened: list[OpenedBlock],
    layout: tuple[LayerLayout, ...],
    k_rows: list[np.ndarray],
    v_places: list[np.ndarray],
    n: int,
    *,
    spill: np.ndarray,
    first: int = 0,
) -> list[dict[str, list[np.ndarray]]]:
    """Where each block's K and V rows go: rows ``first..`` of ``k_rows``/``v_places``;
    a token at ``n`` or after (the chain's final one: read, not loaded) to ``spill``."""
    targets = []
    for block_file in opened:
        start, end = block_file.row.start - first, block_file.row.end - first
        keep = max(0, min(end, n - first) - start)
        places: dict[str, list[np.ndarray]] = {}
        spilled = 0
        for i, (_, k_bytes, _, v_bytes) in enumerate(layout):
            places[f"k.{i}"] = [k_rows[i][start : start + keep]]
            places[f"v.{i}"] = [v_places[i][start : start + keep]]
            if end > n - first:
                k_spill = spill[spilled : spilled + k_bytes]
                v_spill = spill[spilled + k_bytes : spilled + k_bytes + v_bytes]
                places[f"k.{i}"].append(k_spill)
                places[f"v.{i}"].append(v_spill)
                spilled += k_bytes + v_bytes
        targets.append(places)
    return targets


def token_rows(columns: np.ndarray, n: int) -> np.ndarray:
    """The bytes of a layer's V columns (``[n_embd_v, n]``) as ``n`` token-major rows."""
    return columns.reshape(-1).view(np.uint8).reshape(n, -1)


def transpose_v(v_places: list[np.ndarray], v_rows: list[np.ndarray]) -> None:
    """Each layer's V rows, read token-major as stored into the columns' own bytes
    (``token_rows``), into llama.cpp's columns, through one layer's staging rows."""
    for rows, columns in zip(v_places, v_rows, strict=True):
        staged = _staging(rows.nbytes)[: rows.nbytes].reshape(rows.shape)
        staged[...] = rows
        to_columns(staged.view(columns.dtype), columns)


def _staging(nbytes: int, slot: int = 0) -> np.ndarray:
    """This thread's reused staging bytes for V rows on their way into columns.

    A piece's (at most ``PIECE_BYTES`` of rows), or one layer's for a whole
    restore, not the chain's: every page a fresh process touches costs a page
    fault, and one that the host backs lazily (a virtual machine that hands
    freed memory back, as here) costs more than a copy.
    """
    return _slot(_PIECE.staged, nbytes, slot)
