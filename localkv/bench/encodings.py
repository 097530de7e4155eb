"""Block encodings of a KV state, the raw one the store uses and those it rejected.

The state's K and V rows live in one flat buffer (``Layout``): every layer's K,
then every layer's V; each tensor's rows for all N tokens contiguous
(``codec.assemble``'s layout without the header, V token-major). A block is a
range of tokens: in each tensor, a contiguous run of rows (``block_slices``).
A block file holds one block's tensor slices, written as:

- ``raw``: a block file is the block's K and V row slices, concatenated
  (tensor order: every layer's K, then every layer's V, as in
  ``codec.assemble``). Decode: one ``os.preadv`` straight into the block's
  slices of the destination buffer.
- ``zstd-1``: each tensor's slice compressed as its own zstd frame (level 1),
  frames concatenated. Decode: read the file into a per-thread buffer, then
  decompress each frame straight into its place (``stream_reader.readinto``).
  One frame per tensor rather than one per block, so that nothing is
  decompressed into a scratch buffer and copied into place afterwards.
- ``hi-plane zstd-1``: each 2-byte float tensor (F16, BF16) split into its low
  byte plane, stored as is, and its high byte plane (sign, exponent and the top
  mantissa bits), compressed with zstd level 1. Decode: read, decompress the
  high plane, interleave the two planes into the destination as ``uint16``.
  Other tensors (F32, quantized rows) are stored as in ``zstd-1``.
- ``hi-plane q6``: as ``hi-plane zstd-1``, but the high bytes in the 6-bit
  code of ``storage.q6`` (the compact block format's): decoded with the two
  planes interleaved in one compiled call per block.

Every decode hashes the bytes it read and raises ``BlockMismatch`` when the
xxh3-128 digest recorded at write time (``StoredBlock``) differs. Blocks are
encoded and decoded on ``Workers``, a thread pool whose threads each hold their
own ``zstandard`` contexts (they are not thread-safe) and scratch buffers.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np
import xxhash
import zstandard

from localkv.kv import codec
from localkv.storage.formats import q6

__all__ = [
    "ENCODINGS",
    "BlockMismatch",
    "Encoding",
    "HiPlaneQ6",
    "HiPlaneZstd",
    "Layout",
    "Piece",
    "Raw",
    "StoredBlock",
    "Workers",
    "Zstd",
    "block_slices",
]

ZSTD_LEVEL = 1
# ggml types whose elements are 2-byte floats (F16, BF16): the high byte holds
# the sign and the exponent, which compress; the low byte is mantissa noise
_TWO_BYTE_FLOATS = frozenset({1, 30})
_IOV_MAX = 1024  # POSIX minimum is 16; Linux, macOS and the BSDs allow 1024

Piece = bytes | memoryview  # arrays go in as ``ndarray.data``


class BlockMismatch(ValueError):
    """A block file's bytes do not hash to the digest recorded when it was written."""


# ------------------------------------------------------------------- layout
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


# ------------------------------------------------------------------ workers
class _Local(threading.local):
    """Per-thread zstd contexts and scratch buffers (zstd contexts are not thread-safe)."""

    def __init__(self) -> None:
        self.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        self.dctx = zstandard.ZstdDecompressor()
        self.scratch: dict[str, np.ndarray] = {}

    def buffer(self, name: str, size: int) -> np.ndarray:
        """A reusable uint8 buffer of at least ``size`` bytes (grown, never shrunk)."""
        buf = self.scratch.get(name)
        if buf is None or buf.shape[0] < size:
            buf = np.zeros(size, dtype=np.uint8)  # zeros: touched here, not in a timed run
            self.scratch[name] = buf
        return buf[:size]


class Workers:
    """A thread pool whose threads each hold their own zstd contexts and buffers."""

    def __init__(self, workers: int | None = None) -> None:
        self.n = workers or os.cpu_count() or 1
        self.pool = ThreadPoolExecutor(self.n, thread_name_prefix="benchcodecs")
        self.local = _Local()

    def map(self, fn: Callable[[_Local, int], None], count: int) -> None:
        """``fn(thread_state, i)`` for ``i`` in ``range(count)``; re-raises the first error."""
        futures = [self.pool.submit(fn, self.local, i) for i in range(count)]
        for f in futures:
            f.result()

    def close(self) -> None:
        self.pool.shutdown()

    def __enter__(self) -> Workers:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# ---------------------------------------------------------------- encodings
@dataclass(frozen=True, slots=True, kw_only=True)
class StoredBlock:
    path: Path
    start: int
    stop: int
    size: int  # bytes in the file
    digest: bytes  # xxh3-128 of the file's bytes
    pieces: tuple[int, ...]  # sizes of the file's pieces, in order (encoding-specific)


class Encoding(ABC):
    """How one block's tensor slices become a file, and back."""

    name: str

    @abstractmethod
    def pieces(self, layout: Layout, slices: list[np.ndarray], local: _Local) -> list[Piece]:
        """The block file's contents, in order."""

    @abstractmethod
    def decode_block(
        self, layout: Layout, block: StoredBlock, dst: list[np.ndarray], local: _Local
    ) -> None:
        """Read ``block``'s file, check its digest and fill the tensor slices ``dst``."""


def _read_checked(block: StoredBlock, local: _Local) -> np.ndarray:
    """The whole file in a per-thread buffer, its digest checked."""
    buf = local.buffer("file", block.size)
    with open(block.path, "rb", buffering=0) as f:
        if f.readinto(buf.data) != block.size:
            raise BlockMismatch(f"{block.path}: short read")
    _check(block, xxhash.xxh3_128(buf.data).digest())
    return buf


def _check(block: StoredBlock, digest: bytes) -> None:
    if digest != block.digest:
        raise BlockMismatch(f"{block.path}: xxh3-128 {digest.hex()} != {block.digest.hex()}")


def _decompress_into(dst: np.ndarray, frame: np.ndarray, local: _Local) -> None:
    """Decompress one zstd frame of exactly ``dst.nbytes`` bytes straight into ``dst``."""
    size = zstandard.frame_content_size(frame.data)
    if size != dst.nbytes:
        raise BlockMismatch(f"a frame declares {size} bytes, {dst.nbytes} expected")
    target = dst.data
    got = 0
    with local.dctx.stream_reader(frame.data) as reader:
        while got < dst.nbytes:
            n = reader.readinto(target[got:])
            if not n:
                raise BlockMismatch(f"a frame decompressed to {got} of {dst.nbytes} bytes")
            got += n


class Raw(Encoding):
    """The rows as they are; decoded by ``os.preadv`` into the destination, then hashed."""

    name = "raw"

    def pieces(self, layout: Layout, slices: list[np.ndarray], local: _Local) -> list[Piece]:
        return [s.data for s in slices]

    def decode_block(
        self, layout: Layout, block: StoredBlock, dst: list[np.ndarray], local: _Local
    ) -> None:
        fd = os.open(block.path, os.O_RDONLY)
        try:
            offset = 0
            for i in range(0, len(dst), _IOV_MAX):
                views = [d.data for d in dst[i : i + _IOV_MAX]]
                want = sum(v.nbytes for v in views)
                if os.preadv(fd, views, offset) != want:
                    raise BlockMismatch(f"{block.path}: short read")
                offset += want
        finally:
            os.close(fd)
        if offset != block.size:
            raise BlockMismatch(f"{block.path}: {block.size} bytes, {offset} expected")
        h = xxhash.xxh3_128()
        for d in dst:
            h.update(d.data)
        _check(block, h.digest())


class Zstd(Encoding):
    """One zstd frame (level 1) per tensor."""

    name = "zstd-1"

    def pieces(self, layout: Layout, slices: list[np.ndarray], local: _Local) -> list[Piece]:
        return [local.cctx.compress(s.data) for s in slices]

    def decode_block(
        self, layout: Layout, block: StoredBlock, dst: list[np.ndarray], local: _Local
    ) -> None:
        buf = _read_checked(block, local)
        off = 0
        for d, size in zip(dst, block.pieces, strict=True):
            _decompress_into(d, buf[off : off + size], local)
            off += size


class _HiPlane(Encoding):
    """2-byte float tensors split into ``parts`` pieces by ``split``; others as in ``Zstd``."""

    parts: int

    @abstractmethod
    def split(self, values: np.ndarray, local: _Local) -> list[Piece]:
        """The pieces of one 2-byte float tensor's bytes."""

    def pieces(self, layout: Layout, slices: list[np.ndarray], local: _Local) -> list[Piece]:
        out: list[Piece] = []
        for ggml_type, s in zip(layout.types, slices, strict=True):
            if ggml_type in _TWO_BYTE_FLOATS:
                out.extend(self.split(s, local))
            else:
                out.append(local.cctx.compress(s.data))
        return out

    def split_tensors(
        self, layout: Layout, block: StoredBlock, dst: list[np.ndarray], local: _Local
    ) -> list[tuple[np.ndarray, list[np.ndarray]]]:
        """Read ``block`` (checked) and decode its other tensors into ``dst``.

        Returns each 2-byte float tensor's destination and pieces, for the
        caller to decode.
        """
        buf = _read_checked(block, local)
        sizes = iter(block.pieces)
        off = 0
        out = []
        for ggml_type, d in zip(layout.types, dst, strict=True):
            split = ggml_type in _TWO_BYTE_FLOATS
            parts = []
            for _ in range(self.parts if split else 1):
                size = next(sizes)
                parts.append(buf[off : off + size])
                off += size
            if split:
                out.append((d, parts))
            else:
                _decompress_into(d, parts[0], local)
        return out


class HiPlaneZstd(_HiPlane):
    """2-byte floats: low byte plane raw, high byte plane zstd-1; others as ``Zstd``."""

    name = "hi-plane zstd-1"
    parts = 2

    def split(self, values: np.ndarray, local: _Local) -> list[Piece]:
        pairs = values.reshape(-1, 2)  # little-endian: [low byte, high byte]
        high = local.cctx.compress(np.ascontiguousarray(pairs[:, 1]).data)
        return [np.ascontiguousarray(pairs[:, 0]).data, high]

    def decode_block(
        self, layout: Layout, block: StoredBlock, dst: list[np.ndarray], local: _Local
    ) -> None:
        for d, (lo, frame) in self.split_tensors(layout, block, dst, local):
            hi = local.buffer("hi", lo.size)
            _decompress_into(hi, frame, local)
            out16 = d.view("<u2")
            np.copyto(out16, hi)
            np.left_shift(out16, 8, out=out16)
            np.bitwise_or(out16, lo, out=out16)


class HiPlaneQ6(_HiPlane):
    """2-byte floats: low byte plane raw, high bytes in ``q6``'s code; others as ``Zstd``."""

    name = "hi-plane q6"
    parts = 3

    def split(self, values: np.ndarray, local: _Local) -> list[Piece]:
        return [part.data for part in q6.encode(values)]

    def decode_block(
        self, layout: Layout, block: StoredBlock, dst: list[np.ndarray], local: _Local
    ) -> None:
        split = self.split_tensors(layout, block, dst, local)
        q6.decode_into([(lo, index, table, [d]) for d, (lo, index, table) in split])


ENCODINGS: tuple[Encoding, ...] = (Raw(), Zstd(), HiPlaneZstd(), HiPlaneQ6())
