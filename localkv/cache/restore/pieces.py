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
With transposed V (flash attention off) a block's V rows are read token-major
into a staging area of one block's rows (``_STAGING``: taken by the thread that
reads the block, given back once its rows are in; as many are held as readers
read at once), and go into llama.cpp's columns from there (``kv.columns``) on
that thread, while they are still in the CPU's cache. Where there are reader
threads, the next pieces are read into buffers of their own while one loads
(``pieces_ahead``): enough of them that every reader has a block to read, so
the copy into llama.cpp, on the model's thread, overlaps the reads, and a model
whose block fills a piece alone (a large model's) still reads on every reader.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from localkv.cache.restore.verify import check_chain
from localkv.kv import codec
from localkv.kv.columns import to_columns
from localkv.kv.layout import LayerLayout, state_size
from localkv.model.loading import kv_bytes_per_token
from localkv.model.session import ModelSession
from localkv.model.state import large_buffer
from localkv.storage.formats.readinto import OpenedBlock, Targets
from localkv.storage.readpool import Fills, PendingFill, Then
from localkv.storage.store import SnapshotStore
from localkv.storage.values import Block

__all__ = [
    "MAX_AHEAD",
    "PIECE_BYTES",
    "block_targets",
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
        rows = _kept(block_file, n) * per_token
        if out and (rows == 0 or held + rows <= PIECE_BYTES):
            out[-1].append(block_file)
            held += rows
        else:
            out.append([block_file])
            held = rows
    return out


class _Piece(threading.local):
    """This thread's piece buffers, one a slot, reused."""

    def __init__(self) -> None:
        self.buffers: list[np.ndarray | None] = []


_PIECE = _Piece()


class _Staging:
    """Areas for V rows on their way into llama.cpp's columns: a block's rows (or, for
    ``transpose_v``, a layer's), taken by the thread that reads them and given back once
    they are in, so that as many are held as are in use at once."""

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A free area of ``nbytes`` at least; none: a new one, in place of the largest
        free one (too small), so that their number does not grow."""
        with self._lock:
            fits = [i for i, area in enumerate(self._free) if area.shape[0] >= nbytes]
            if fits:
                return self._free.pop(fits[0])
            if self._free:  # by position: arrays compare element by element, not as items
                del self._free[max(range(len(self._free)), key=lambda i: self._free[i].shape[0])]
        return large_buffer(nbytes)

    def give(self, area: np.ndarray) -> None:
        with self._lock:
            self._free.append(area)

    def ready(self, count: int, nbytes: int) -> int:
        """Hold ``count`` free areas of ``nbytes`` at least (others dropped), every page
        touched; their bytes."""
        with self._lock:
            kept = [area for area in self._free if area.shape[0] >= nbytes][:count]
            kept += [large_buffer(nbytes) for _ in range(count - len(kept))]
            self._free = kept
            return sum(_touch(area) for area in kept)

    def held(self) -> list[np.ndarray]:
        """The free areas (none is in use between restores)."""
        with self._lock:
            return list(self._free)


_STAGING = _Staging()


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
    """Make this thread's piece buffers and the V staging areas as large as a restore into
    ``session`` with ``readers`` reader threads needs, and touch every page of them; the
    bytes made ready (0: it restores otherwise).

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
    ready = 0
    for slot in range(1 + pieces_ahead(per_token, block, readers)):
        ready += _touch(_buffer(_size_bound(tokens, per_token), slot))
    if session.flash_attn_setting() != "on":  # V may be transposed: staged a block at a time
        ready += _STAGING.ready(max(1, readers), block * per_token // 2 + _HEADER_BOUND)
    return ready


def _size_bound(tokens: int, per_token: int) -> int:
    """Bytes of a state of ``tokens``: their rows, and the other fields (a cell, and per
    layer a few header words)."""
    return tokens * (per_token + _CELL_BOUND) + _HEADER_BOUND


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
        took: list[float] = []  # appended on each reader: one list.append is atomic
        targets: Fills
        then: Then | None = None
        if self.v_trans:  # a block's V rows are staged on its reader, then put in columns
            staged = _Staged(
                group=group,
                layout=layout,
                k_rows=k_rows,
                v_rows=v_rows,
                span=(first, n),
                spill=self.spill,
                took=took,
            )
            targets, then = [staged.targets(i) for i in range(len(group))], staged.then
        else:
            targets = fill_targets(group, layout, k_rows, v_rows, n, spill=self.spill, first=first)
        piece = _Reading(group=group, first=first, stop=stop, buf=buf, took=took)
        if self.parallel and (len(group) > 1 or self.ahead):
            return replace(piece, pending=self.store.start_fill_blocks(group, targets, then=then))
        got = self.store.fill_blocks(
            group, targets, [set()] * len(group), parallel=False, then=then
        )
        return replace(piece, done=got)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Staged:
    """A piece's blocks with transposed V: each block's V rows are read token-major into
    a staging area (``_STAGING``, one block's) taken on its reader as its read starts,
    and go into llama.cpp's columns from there once it is read and checked, on the same
    thread, while they are still in the CPU's cache."""

    group: list[OpenedBlock]
    layout: tuple[LayerLayout, ...]
    k_rows: list[np.ndarray]
    v_rows: list[np.ndarray]  # the piece's columns, per layer
    span: tuple[int, int]  # the piece's first token, and the tokens loaded (``n``)
    spill: np.ndarray
    took: list[float]  # the seconds of each block's columns
    held: dict[int, tuple[np.ndarray, list[np.ndarray]]] = field(default_factory=dict)

    def targets(self, i: int) -> Callable[[], Targets]:
        """Block ``i``'s targets, made on the thread that reads it."""
        return functools.partial(self._targets, i)

    def _targets(self, i: int) -> Targets:
        block_file, (first, n) = self.group[i], self.span
        keep = _kept(block_file, n)
        area = _STAGING.take(keep * sum(x[3] for x in self.layout))
        rows, at = [], 0
        for _, _, _, v_bytes in self.layout:
            rows.append(area[at : at + keep * v_bytes].reshape(keep, v_bytes))
            at += keep * v_bytes
        self.held[i] = (area, rows)  # one block a reader: a dict's item set is atomic
        return block_targets(
            block_file,
            self.layout,
            self.k_rows,
            rows,
            n,
            spill=self.spill,
            first=first,
            v_first=block_file.row.start,
        )

    def then(self, i: int, _block: Block) -> None:
        """Block ``i``'s staged V rows into the columns; its staging area given back."""
        t0 = time.perf_counter()
        area, rows = self.held.pop(i)
        start = self.group[i].row.start - self.span[0]
        for staged, columns in zip(rows, self.v_rows, strict=True):
            to_columns(staged.view(columns.dtype), columns, start)
        _STAGING.give(area)
        self.took.append(time.perf_counter() - t0)


def _kept(block_file: OpenedBlock, n: int) -> int:
    """How many of ``block_file``'s tokens are below ``n`` (loaded)."""
    return max(0, min(block_file.row.end, n) - block_file.row.start)


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
    """Where each block's K and V rows go (``block_targets``)."""
    return [block_targets(b, layout, k_rows, v_places, n, spill=spill, first=first) for b in opened]


def block_targets(  # noqa: PLR0913 - to take a value type
    block_file: OpenedBlock,
    layout: tuple[LayerLayout, ...],
    k_rows: list[np.ndarray],
    v_places: list[np.ndarray],
    n: int,
    *,
    spill: np.ndarray,
    first: int = 0,
    v_first: int | None = None,
) -> dict[str, list[np.ndarray]]:
    """Where a block's K and V rows go: its rows of ``k_rows`` (whose first row holds token
    ``first``) and of ``v_places`` (token ``v_first``; ``first`` by default); a token at
    ``n`` or after (the chain's final one: read, not loaded) to ``spill``."""
    start, keep = block_file.row.start - first, _kept(block_file, n)
    v_start = block_file.row.start - (first if v_first is None else v_first)
    places: dict[str, list[np.ndarray]] = {}
    spilled = 0
    for i, (_, k_bytes, _, v_bytes) in enumerate(layout):
        places[f"k.{i}"] = [k_rows[i][start : start + keep]]
        places[f"v.{i}"] = [v_places[i][v_start : v_start + keep]]
        if block_file.row.end > n:
            places[f"k.{i}"].append(spill[spilled : spilled + k_bytes])
            places[f"v.{i}"].append(spill[spilled + k_bytes : spilled + k_bytes + v_bytes])
            spilled += k_bytes + v_bytes
    return places


def token_rows(columns: np.ndarray, n: int) -> np.ndarray:
    """The bytes of a layer's V columns (``[n_embd_v, n]``) as ``n`` token-major rows."""
    return columns.reshape(-1).view(np.uint8).reshape(n, -1)


def transpose_v(v_places: list[np.ndarray], v_rows: list[np.ndarray]) -> None:
    """Each layer's V rows, read token-major as stored into the columns' own bytes
    (``token_rows``), into llama.cpp's columns, through one layer's staging rows (a
    ``_STAGING`` area: not the chain's, as every page a fresh process touches costs a page
    fault, and one that the host backs lazily costs more than a copy)."""
    for rows, columns in zip(v_places, v_rows, strict=True):
        area = _STAGING.take(rows.nbytes)
        try:
            staged = area[: rows.nbytes].reshape(rows.shape)
            staged[...] = rows
            to_columns(staged.view(columns.dtype), columns)
        finally:
            _STAGING.give(area)
