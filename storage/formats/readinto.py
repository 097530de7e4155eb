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
   (``discard``) leaves it unread.

Nothing a target receives may be used unless ``fill_block`` returns: a
checksum mismatch raises ``BlockCorrupt`` after the bytes were written.

A compact file (``planes``) is read whole into a per-thread buffer in step 2
and its checksum compared before anything is decoded; each split tensor is
then decoded straight into its targets (``q6``: one compiled call per file).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from ..disk import open_block_file, read_exactly
from ..paths import CacheLayout
from ..values import DETACHED, DETACHED_XXH3, RESERVED_TENSORS, Block, BlockCorrupt, BlockRow
from . import planes, q6
from .blockcodec import (
    TensorSpec,
    block_of,
    check_metadata,
    check_rows,
    check_tokens,
    detached_spec,
    header_span,
    parse_header,
)
from .headers import HeaderCache

__all__ = ["HeaderCache", "OpenedBlock", "Targets", "fill_block", "open_block"]

# The first read of a file: the 8-byte length and, usually, the whole header.
_FIRST_READ = 64 << 10


Targets = Mapping[str, Sequence[np.ndarray]]


@dataclass(slots=True, eq=False)
class OpenedBlock:
    """A block file opened and its header checked; ``close()`` when done."""

    row: BlockRow
    fd: int
    header: bytes  # the file's bytes up to its data section
    metadata: dict[str, str]  # the caller's metadata (format fields removed)
    specs: dict[str, TensorSpec]  # the block's tensors (a compact file's split ones joined)
    physical: dict[str, TensorSpec] | None = None  # a compact file's own tensors
    planes: list[tuple[str, np.dtype[np.generic]]] | None = None  # a compact file's split ones
    detached: str | None = None  # the detached tensor's own digest, if the file keeps it apart

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_block(
    layout: CacheLayout, row: BlockRow, max_raw_bytes: int, cache: HeaderCache | None = None
) -> OpenedBlock:
    """Open ``row``'s file and check its header (``BlockCorrupt`` on any failure)."""
    fd = open_block_file(layout, row.file, row.stored_bytes)
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
        if metadata.get("format") == planes.Q6_FORMAT:
            meta = check_metadata(metadata, row, file_format=planes.Q6_FORMAT)
            known_compact = cache.compact(row, header) if cache is not None else None
            if known_compact is None:
                order = planes.parse_planes(metadata.get("planes"))
                known_compact = (order, _logical(specs, order))
                if cache is not None:
                    cache.put_compact(row, header, known_compact)
            order, logical = known_compact
            return OpenedBlock(row, fd, header, meta, logical, specs, order, detached)
        if row.stored_bytes != row.raw_bytes:
            raise BlockCorrupt(
                f"file of {row.stored_bytes} bytes, the index expects {row.raw_bytes} raw"
            )
        meta = check_metadata(metadata, row)
        return OpenedBlock(row, fd, header, meta, specs, detached=detached)
    except BaseException:
        os.close(fd)
        raise


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
        out[name] = TensorSpec(dtype, lo.shape, 0, lo.nbytes * dtype.itemsize)
    return out


def _pread_all(fd: int, start: int, end: int) -> bytes:
    buf = bytearray(end - start)
    read_exactly(fd, [memoryview(buf)], start)
    return bytes(buf)


def _byte_view(arr: np.ndarray) -> memoryview:
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        raise ValueError("a read target must be a writable C-contiguous array")
    return arr.reshape(-1).view(np.uint8).data


def fill_block(
    opened: OpenedBlock, targets: Targets | None = None, discard: Collection[str] = ()
) -> Block:
    """Read the block's tensors, those named in ``targets`` into their buffers.

    A target is a sequence of writable C-contiguous arrays whose sizes add up
    to the tensor's bytes; they are filled in order. ``discard``: tensors left
    out of the block, unread if detached, else read and hashed through a
    scratch buffer. Returns the block with the
    tensors that had no target (read-only). ``ValueError`` for a target that
    does not fit, ``BlockCorrupt`` for a file that fails a check.
    """
    targets = targets or {}
    unknown = (set(targets) | set(discard)) - set(opened.specs)
    if unknown:
        raise ValueError(f"targets for tensors the block does not hold: {sorted(unknown)}")
    row = opened.row
    pieces: list[_Piece] = []  # the data section in order
    own: dict[str, np.ndarray] = {}
    placed: list[tuple[str, list[memoryview]]] = []
    for name, spec in sorted(opened.specs.items(), key=lambda item: item[1].begin):
        if name not in RESERVED_TENSORS:
            check_rows(name, spec.shape, row)
        apart = name == DETACHED and opened.detached is not None
        if name in discard:
            views = None
        elif name in targets:
            views = [_byte_view(a) for a in targets[name]]
            if sum(len(p) for p in views) != spec.nbytes:
                raise ValueError(
                    f"targets of {name!r} hold {sum(len(p) for p in views)} bytes, "
                    f"the tensor {spec.nbytes}"
                )
            placed.append((name, views))
        else:
            arr = np.empty(spec.shape, dtype=spec.dtype)
            own[name] = arr
            views = [_byte_view(arr)]
        pieces.append(_Piece(spec.nbytes, views, apart))
    if opened.planes is not None:
        _fill_planes(opened, own, placed, DETACHED not in discard)
    else:
        _read_checked(opened, pieces)
    tokens = check_tokens(own.pop("tokens", None), own.pop("pos", None), row)
    for arr in own.values():
        arr.setflags(write=False)
    tokens.setflags(write=False)
    return block_of(row, tokens, own, dict(opened.metadata))


_CHUNK = 256 << 10  # a discarded tensor is hashed through a buffer that stays in cache


@dataclass(slots=True)
class _Piece:
    """One tensor of a data section, as ``fill_block`` reads it."""

    nbytes: int
    views: list[memoryview] | None  # where its bytes go; None: discarded
    apart: bool  # left out of the index's checksum, checked by its own digest


def _read_checked(opened: OpenedBlock, pieces: list[_Piece]) -> None:
    """Read the data section's ``pieces`` in order and check the file's digests.

    Consecutive pieces are read with one ``preadv``. A discarded piece the
    index's checksum covers is read in small chunks into this thread's scratch
    buffer, hashed and dropped; a discarded piece apart from it is not read.
    ``BlockCorrupt`` on a digest that differs (the index's first).
    """
    digest = xxhash.xxh3_128(opened.header)
    apart = xxhash.xxh3_128()
    at, run = len(opened.header), []
    for piece in [*pieces, _Piece(0, None, False)]:  # the empty last piece reads the last run
        if piece.views is not None:
            run.append(piece)
            continue
        read_exactly(opened.fd, [v for p in run for v in p.views or ()], at)
        for done in run:
            for view in done.views or ():
                (apart if done.apart else digest).update(view)
            at += done.nbytes
        run = []
        if piece.apart:
            at += piece.nbytes
            continue
        chunk = _scratch.get("discard", min(piece.nbytes, _CHUNK)).data
        left = piece.nbytes
        while left > 0:
            part = chunk[: min(left, len(chunk))]
            read_exactly(opened.fd, [part], at)
            digest.update(part)
            at, left = at + len(part), left - len(part)
    found = "xxh3:" + digest.hexdigest()
    if found != opened.row.checksum:
        raise BlockCorrupt(f"checksum {found} differs from the index's {opened.row.checksum}")
    kept = [p for p in pieces if p.apart and p.views is not None]
    if kept and apart.hexdigest() != opened.detached:
        raise BlockCorrupt(f"tensor {DETACHED!r} differs from its checksum")


class _Scratch(threading.local):
    """Each reading thread's buffer for compact files' data sections (reused)."""

    def __init__(self) -> None:
        self.buffers: dict[str, np.ndarray] = {}

    def get(self, name: str, size: int) -> np.ndarray:
        if size > _KEEP_SCRATCH:
            return np.empty(size, dtype=np.uint8)
        buf = self.buffers.get(name)
        if buf is None or buf.shape[0] < size:
            buf = self.buffers[name] = np.empty(size, dtype=np.uint8)
        return buf[:size]


_scratch = _Scratch()
_KEEP_SCRATCH = 64 << 20  # a larger buffer is not kept between reads


def _check_compact(opened: OpenedBlock, whole: memoryview, with_detached: bool) -> None:
    """A compact file's digests, its data section read whole (``BlockCorrupt`` if one differs)."""
    assert opened.physical is not None
    digest = xxhash.xxh3_128(opened.header)
    spec = opened.physical.get(DETACHED) if opened.detached is not None else None
    if spec is None:
        digest.update(whole)
    else:
        digest.update(whole[: spec.begin])
        digest.update(whole[spec.end :])
    found = "xxh3:" + digest.hexdigest()
    if found != opened.row.checksum:
        raise BlockCorrupt(f"checksum {found} differs from the index's {opened.row.checksum}")
    if (
        spec is not None
        and with_detached
        and xxhash.xxh3_128_hexdigest(whole[spec.begin : spec.end]) != opened.detached
    ):
        raise BlockCorrupt(f"tensor {DETACHED!r} differs from its checksum")


def _fill_planes(
    opened: OpenedBlock,
    own: dict[str, np.ndarray],
    placed: list[tuple[str, list[memoryview]]],
    with_detached: bool,
) -> None:
    """A compact file: read and checksum it whole, then decode its planes into the targets."""
    assert opened.physical is not None and opened.planes is not None
    row, physical = opened.row, opened.physical
    data = _scratch.get("data", row.stored_bytes - len(opened.header))
    whole, body = data.data, len(opened.header)
    skip = physical.get(DETACHED) if opened.detached is not None and not with_detached else None
    if skip is None:
        read_exactly(opened.fd, [whole], body)
    else:  # the detached tensor is not needed: its bytes are left unread (a hole in ``whole``)
        read_exactly(opened.fd, [whole[: skip.begin]], body)
        read_exactly(opened.fd, [whole[skip.end :]], body + skip.end)
    _check_compact(opened, whole, with_detached)  # before anything is decoded or written

    def section(name: str) -> memoryview:
        spec = physical[name]
        return whole[spec.begin : spec.end]

    outputs = {name: [_byte_view(arr)] for name, arr in own.items()}
    outputs.update(placed)
    for name, parts in outputs.items():
        if name in physical:  # stored whole: copied
            src, at = section(name), 0
            for part in parts:
                part[:] = src[at : at + len(part)]
                at += len(part)
    split = [name for name, _ in opened.planes]
    if q6.compiled():
        # straight to the compiled decoder: one call, no arrays made (_logical checked the parts)
        q6.decode_views(
            [
                (
                    section(name + planes.LO),
                    section(name + planes.Q6_INDEX),
                    section(name + planes.Q6_TABLE),
                    outputs[name],
                )
                for name in split
            ]
        )
        return
    stored = {name: np.frombuffer(section(name), dtype=np.uint8) for name in physical}
    planes.decode_planes(
        stored,
        opened.planes,
        {name: [np.frombuffer(v, dtype=np.uint8) for v in outputs[name]] for name in split},
    )
