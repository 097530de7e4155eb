"""Reading a block file straight into the caller's buffers.

A restore does not want a block's tensors as arrays of their own: it wants
their bytes at given places in one large buffer (llama.cpp's state). So a
read has two steps:

1. ``open_block``: open the file (``disk.open_block_file`` checks what it
   is and its size), read and parse its safetensors header, and check the
   metadata against the index row. The caller now knows every tensor's dtype
   and shape.
2. ``fill_block``: one ``preadv`` scatters the data section into the
   caller's targets (a list of writable buffers per tensor, filled in order;
   tensors without a target get arrays of their own), while the xxh3-128 of
   the file is computed over what was read and compared with the index.
   Tokens and positions are then checked against the row. A detached tensor
   (``values.DETACHED``: a block's partial state) is outside that checksum
   and has its own, checked when it is read; a caller that does not need it
   (``discard``) leaves it unread. Tail tensors (``tails``: a sliding-window
   block's last rows) are outside it too: a caller may read them from any row
   (``tail_from``), and the row groups it reads are checked by their digests.

Nothing a target receives may be used unless ``fill_block`` returns: a
checksum mismatch raises ``BlockCorrupt`` after the bytes were written.

A compact file (``planes``) is read whole into a per-thread buffer in step 2
and its digests compared before anything is decoded (``compactread``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from ..disk import open_block_file, read_exactly
from ..paths import CacheLayout
from ..values import (
    DETACHED,
    DETACHED_XXH3,
    RESERVED_TENSORS,
    TAIL_GROUP,
    Block,
    BlockCorrupt,
    BlockRow,
    is_tail,
)
from . import planes
from .blockcodec import (
    TensorSpec,
    block_of,
    check_metadata,
    check_rows,
    check_tokens,
    detached_spec,
)
from .compactread import byte_view, fill_planes, scratch
from .headers import HeaderCache
from .stheader import header_span, parse_header
from .tails import TailHashes, tail_digests, tail_names

__all__ = ["HeaderCache", "OpenedBlock", "Targets", "fill_block", "open_block"]

# The first read of a file: the 8-byte length and, usually, the whole header.
_FIRST_READ = 64 << 10


Targets = Mapping[str, Sequence[np.ndarray]]


@dataclass(slots=True, eq=False, kw_only=True)
class OpenedBlock:
    """A block file opened and its header checked; ``close()`` when done."""

    row: BlockRow
    fd: int
    header: bytes  # the file's bytes up to its data section
    metadata: dict[str, str]  # the caller's metadata (format fields removed)
    metadata_all: dict[str, str]  # the file's metadata as it is
    specs: dict[str, TensorSpec]  # the block's tensors (a compact file's split ones joined)
    physical: dict[str, TensorSpec] | None = None  # a compact file's own tensors
    planes: list[tuple[str, np.dtype[np.generic]]] | None = None  # a compact file's split ones
    detached: str | None = None  # the detached tensor's own digest, if the file keeps it apart
    tail_rows: int = 0  # rows of each tail tensor (``tails``), and their groups' digests
    tail_sums: tuple[str, ...] = ()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_block(
    layout: CacheLayout, row: BlockRow, max_raw_bytes: int, cache: HeaderCache | None = None
) -> OpenedBlock:
    """Open ``row``'s file and check its header (``BlockCorrupt`` on any failure)."""
    fd = open_block_file(layout, row.file, row.stored_bytes)
    _no_readahead(fd)
    try:
        known = cache.size_of(row) if cache is not None else None
        first = os.pread(fd, min(known or _FIRST_READ, row.stored_bytes), 0)
        if row.raw_bytes > max_raw_bytes:
            raise BlockCorrupt(f"block of {row.raw_bytes} bytes is over the limit {max_raw_bytes}")
        body = header_span(first[:8], row.stored_bytes)
        header = first[:body] if body <= len(first) else first + _pread_all(fd, len(first), body)
        parsed = cache.get(row, header) if cache is not None else None
        if parsed is None:
            parsed = parse_header(header[8:], row.stored_bytes - body)
            if cache is not None:
                cache.put(row, header, *parsed)
        metadata, specs = parsed
        detached = metadata.get(DETACHED_XXH3) if detached_spec(metadata, specs) else None
        tail_rows, tail_sums = _tails_of(metadata, specs)
        if metadata.get("format") == planes.Q6_FORMAT:
            meta = check_metadata(metadata, row, file_format=planes.Q6_FORMAT)
            known_compact = cache.compact(row, header) if cache is not None else None
            if known_compact is None:
                order = planes.parse_planes(metadata.get("planes"))
                known_compact = (order, _logical(specs, order))
                if cache is not None:
                    cache.put_compact(row, header, known_compact)
            order, logical = known_compact
            physical: dict[str, TensorSpec] | None = specs
        else:
            if row.stored_bytes != row.raw_bytes:
                raise BlockCorrupt(
                    f"file of {row.stored_bytes} bytes, the index expects {row.raw_bytes} raw"
                )
            meta = check_metadata(metadata, row)
            order, logical, physical = None, specs, None
        return OpenedBlock(
            row=row,
            fd=fd,
            header=header,
            metadata=meta,
            metadata_all=metadata,
            specs=logical,
            physical=physical,
            planes=order,
            detached=detached,
            tail_rows=tail_rows,
            tail_sums=tail_sums,
        )
    except BaseException:
        os.close(fd)
        raise


def _no_readahead(fd: int) -> None:
    """Read from storage only what is asked for: a restore may read part of a file
    (tails from a row, a detached tensor left unread), and the kernel's readahead,
    once the header read started it, would read the rest of a file.
    Set before the first read; a whole-file read is still one request."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:
        with contextlib.suppress(OSError):  # advice only
            advise(fd, 0, 0, os.POSIX_FADV_RANDOM)


def _tails_of(
    metadata: dict[str, str], specs: dict[str, TensorSpec]
) -> tuple[int, tuple[str, ...]]:
    """The tail tensors' row count and group digests (``BlockCorrupt`` if inconsistent)."""
    names = tail_names(specs)
    rows = {specs[n].shape[0] if specs[n].shape else -1 for n in names}
    if len(rows) > 1 or -1 in rows:
        raise BlockCorrupt("tail tensors of different row counts")
    if not names:
        return 0, ()
    n = rows.pop()
    return n, tuple(tail_digests(metadata, n))


def _logical(
    specs: dict[str, TensorSpec], order: list[tuple[str, np.dtype[np.generic]]]
) -> dict[str, TensorSpec]:
    """A compact file's tensors as the block holds them: each split tensor whole again.

    The offsets of a split tensor are 0..its size: it is not in the file as such.
    """
    out = dict(specs)
    for name, dtype in order:
        lo = out.pop(planes.lo_name(name), None)
        if lo is None or lo.dtype != np.uint8 or name in out:
            raise BlockCorrupt(f"planes: tensor {name!r} lacks its U8 low plane")
        for part in planes.parts(name)[1:]:
            spec = out.pop(part, None)
            if spec is None or spec.dtype != np.uint8 or len(spec.shape) != 1:
                raise BlockCorrupt(f"planes: tensor {name!r} lacks its U8 part {part!r}")
        out[name] = TensorSpec(dtype=dtype, shape=lo.shape, begin=0, end=lo.nbytes * dtype.itemsize)
    return out


def _pread_all(fd: int, start: int, end: int) -> bytes:
    buf = bytearray(end - start)
    read_exactly(fd, [memoryview(buf)], start)
    return bytes(buf)


def fill_block(
    opened: OpenedBlock,
    targets: Targets | None = None,
    discard: Collection[str] = (),
    tail_from: int | None = None,
) -> Block:
    """Read the block's tensors, those named in ``targets`` into their buffers.

    A target: writable C-contiguous arrays, filled in order, as large as the
    tensor. ``discard``: tensors left out of the block, unread if detached, else
    read and hashed through a scratch buffer. ``tail_from``: the first tail row
    wanted (``tails``; each tail then needs a target for its rows from there,
    earlier groups are not read); None reads the tails whole. Returns the block
    with the tensors that had no target (read-only). ``ValueError`` for a target
    that does not fit, ``BlockCorrupt`` for a file that fails a check.
    """
    targets = targets or {}
    unknown = (set(targets) | set(discard)) - set(opened.specs)
    if unknown:
        raise ValueError(f"targets for tensors the block does not hold: {sorted(unknown)}")
    if any(is_tail(n) for n in discard):
        raise ValueError("tail tensors are left unread by ``tail_from``, not discarded")
    row = opened.row
    tail_rows = opened.tail_rows
    start = 0 if tail_from is None else tail_from
    if not 0 <= start <= tail_rows:
        raise ValueError(f"tail rows from {start} of {tail_rows}")
    hashes = _tail_hashes(opened, start)
    pieces: list[_Piece] = []  # the data section in order
    own: dict[str, np.ndarray] = {}
    placed: list[tuple[str, list[memoryview]]] = []
    for name, spec in sorted(opened.specs.items(), key=lambda item: item[1].begin):
        if name not in RESERVED_TENSORS:
            check_rows(name, spec.shape, row, tail_rows)
        if is_tail(name):
            into = _tail_views(name, spec, targets, tail_from, own, rows=tail_rows)
            if name in targets:
                placed.append((name, into))
            pieces.extend(_tail_pieces(name, spec, into, start, tail_rows))
            continue
        apart = name == DETACHED and opened.detached is not None
        if name in discard:
            views = None
        elif name in targets:
            views = _views(name, targets[name], spec.nbytes)
            placed.append((name, views))
        else:
            arr = np.empty(spec.shape, dtype=spec.dtype)
            own[name] = arr
            views = [byte_view(arr)]
        pieces.append(_Piece(nbytes=spec.nbytes, views=views, kind="apart" if apart else "main"))
    if opened.planes is not None:
        fill_planes(opened, own, placed, DETACHED not in discard, (start, hashes))
    else:
        _read_checked(opened, pieces, hashes)
    tokens = check_tokens(own.pop("tokens", None), own.pop("pos", None), row)
    for arr in own.values():
        arr.setflags(write=False)
    tokens.setflags(write=False)
    return block_of(row, tokens, own, dict(opened.metadata))


def _views(name: str, arrays: Sequence[np.ndarray], nbytes: int) -> list[memoryview]:
    views = [byte_view(a) for a in arrays]
    if sum(len(p) for p in views) != nbytes:
        raise ValueError(
            f"targets of {name!r} hold {sum(len(p) for p in views)} bytes, the tensor {nbytes}"
        )
    return views


def _tail_hashes(opened: OpenedBlock, start: int) -> TailHashes | None:
    names = tail_names(opened.specs)
    if not names:
        return None
    return TailHashes(
        names, list(opened.tail_sums), -(-_group_start(start, opened.tail_rows) // TAIL_GROUP)
    )


def _group_start(start: int, rows: int) -> int:
    """The first tail row read for rows from ``start`` on: its group's first (none: ``rows``)."""
    return rows if start >= rows else start // TAIL_GROUP * TAIL_GROUP


def _tail_views(
    name: str,
    spec: TensorSpec,
    targets: Targets,
    tail_from: int | None,
    own: dict[str, np.ndarray],
    *,
    rows: int,
) -> list[memoryview]:
    """Where a tail tensor's rows from ``tail_from`` go (all rows when None)."""
    row_bytes = spec.nbytes // rows if rows else 0
    if name in targets:
        return _views(name, targets[name], (rows - (tail_from or 0)) * row_bytes)
    if tail_from is not None:
        raise ValueError(f"tail tensor {name!r} read from row {tail_from} needs a target")
    arr = np.empty(spec.shape, dtype=spec.dtype)
    own[name] = arr
    return [byte_view(arr)]


def _tail_pieces(
    name: str, spec: TensorSpec, views: list[memoryview], start: int, rows: int
) -> list[_Piece]:
    """A tail tensor as pieces: its groups before ``start``'s unread, the rest of
    ``start``'s group read into scratch and hashed, then its rows from ``start``."""
    row_bytes = spec.nbytes // rows if rows else 0
    first = _group_start(start, rows)
    out = [_Piece(nbytes=first * row_bytes, views=None, kind="tail")] if first else []
    if start > first:
        lead = scratch.get("lead:" + name, (start - first) * row_bytes)
        out.append(
            _Piece(
                nbytes=lead.shape[0],
                views=[lead.data],
                kind="tail",
                name=name,
                first_row=first,
                row_bytes=row_bytes,
            )
        )
    out.append(
        _Piece(
            nbytes=(rows - start) * row_bytes,
            views=views,
            kind="tail",
            name=name,
            first_row=start,
            row_bytes=row_bytes,
        )
    )
    return out


_CHUNK = 256 << 10  # a discarded tensor is hashed through a buffer that stays in cache


@dataclass(slots=True, kw_only=True)
class _Piece:
    """One tensor (or a tail tensor's row range) of a data section, as ``fill_block`` reads it."""

    nbytes: int
    views: list[memoryview] | None  # where its bytes go; None: discarded (a tail's: unread)
    kind: str  # "main": under the index's checksum; "apart": the detached tensor; "tail"
    name: str = ""  # a tail's tensor, its first row and row size
    first_row: int = 0
    row_bytes: int = 0


def _read_checked(opened: OpenedBlock, pieces: list[_Piece], tails: TailHashes | None) -> None:
    """Read the data section's ``pieces`` in order and check the file's digests.

    Consecutive pieces are read with one ``preadv``. A discarded piece the
    index's checksum covers is read in small chunks into this thread's scratch
    buffer, hashed and dropped; a discarded piece apart from it is not read.
    ``BlockCorrupt`` on a digest that differs (the index's first).
    """
    digest = xxhash.xxh3_128(opened.header)
    apart = xxhash.xxh3_128()
    at, run = len(opened.header), []
    for piece in [
        *pieces,
        _Piece(nbytes=0, views=None, kind="apart"),
    ]:  # the empty last piece reads the last run
        if piece.views is not None:
            run.append(piece)
            continue
        read_exactly(opened.fd, [v for p in run for v in p.views or ()], at)
        for done in run:
            _hash_piece(done, digest, apart, tails)
            at += done.nbytes
        run = []
        if piece.kind != "main":
            at += piece.nbytes
            continue
        chunk = scratch.get("discard", min(piece.nbytes, _CHUNK)).data
        left = piece.nbytes
        while left > 0:
            part = chunk[: min(left, len(chunk))]
            read_exactly(opened.fd, [part], at)
            digest.update(part)
            at, left = at + len(part), left - len(part)
    found = "xxh3:" + digest.hexdigest()
    if found != opened.row.checksum:
        raise BlockCorrupt(f"checksum {found} differs from the index's {opened.row.checksum}")
    kept = [p for p in pieces if p.kind == "apart" and p.views is not None]
    if kept and apart.hexdigest() != opened.detached:
        raise BlockCorrupt(f"tensor {DETACHED!r} differs from its checksum")
    if tails is not None:
        tails.check()


def _hash_piece(
    piece: _Piece, digest: xxhash.xxh3_128, apart: xxhash.xxh3_128, tails: TailHashes | None
) -> None:
    row = piece.first_row
    for view in piece.views or ():
        if piece.kind == "main":
            digest.update(view)
        elif piece.kind == "apart":
            apart.update(view)
        elif tails is not None and piece.row_bytes:
            tails.update(piece.name, view, row, piece.row_bytes)
            row += len(view) // piece.row_bytes
