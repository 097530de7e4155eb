"""Block encodings compared on a real KV state: what plain block files win over compression.

The store writes each block's K and V rows uncompressed and reads them straight
into the state buffer. ``localkv bench`` measures the alternatives that were
rejected for it in the same run, on the KV state of the bench prompt, so the
trade between bytes on disk and restore time is shown by measurement:

- ``raw``: a block file is the block's K and V row slices, concatenated
  (tensor order: every layer's K, then every layer's V, as in
  ``codec.assemble``). Decode: one ``os.preadv`` straight into the block's
  slices of the destination buffer.
- ``zstd-1``: each tensor's slice compressed as its own zstd frame (level 1),
  frames concatenated. Decode: read the file into a per-thread buffer, then
  decompress each frame straight into its place (``stream_reader.readinto``).
  One frame per tensor decodes faster than one frame per block decompressed
  and copied into place: on the default model's 2,048-token state (f16 K/V,
  one thread) 42 ms against 43-47 ms, at the same ratio (0.920).
- ``hi-plane zstd-1``: each 2-byte float tensor (F16, BF16) split into its low
  byte plane, stored as is, and its high byte plane (sign, exponent and the top
  mantissa bits), compressed with zstd level 1. Decode: read, decompress the
  high plane, interleave the two planes into the destination as ``uint16``.
  Other tensors (F32, quantized rows) are stored as in ``zstd-1``.

Every encoding writes one file per block of ``block_size`` tokens and records
the xxh3-128 digest of the file's bytes; every decode hashes the bytes it read
and raises ``BlockMismatch`` when the digest differs, as the store checks its
blocks. Frame and plane sizes are kept in memory, not in the files: a file
header would add a few hundred bytes per block.

The destination is one preallocated buffer holding, for each tensor, all N
tokens' rows contiguous (``codec.assemble``'s layout without the header, V
token-major). Blocks are decoded in parallel by a thread pool, each thread
with its own ``zstandard.ZstdDecompressor`` (they are not thread-safe). The
buffers are allocated and touched beforehand, so no decode time counts page
faults. Each encoding is decoded twice over: ``decode`` with the files in the
page cache (just written), counting reading, hashing, decompressing and
copying, not disk reads; ``decode_cold`` with the encoding's files flushed and
dropped from the page cache before each run (``benchdisk.evict``), so it also
counts reading them from storage, with the bytes each run read from storage
(``/proc/self/io``) to show the eviction worked. The first decode of each
encoding fills a buffer holding the complement of the expected bytes and is
compared with the original (``np.array_equal``): a decoder that gets or leaves
any byte wrong is reported unverified, with no time.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np
import xxhash
import zstandard

from localkv import codec
from localkv.benchbaselines import ColdStat, Stat, timed
from localkv.benchdisk import cold_call

__all__ = [
    "ENCODINGS",
    "BlockMismatch",
    "Encoded",
    "Encoding",
    "EncodingResult",
    "HiPlaneZstd",
    "Layout",
    "Raw",
    "StoredBlock",
    "Workers",
    "Zstd",
    "compare",
    "decode",
    "encode",
    "measure",
]

ZSTD_LEVEL = 1
# ggml types whose elements are 2-byte floats (F16, BF16): the high byte holds
# the sign and the exponent, which compress; the low byte is mantissa noise
_TWO_BYTE_FLOATS = frozenset({1, 30})
_IOV_MAX = 1024  # POSIX minimum is 16; Linux, macOS and the BSDs allow 1024

Piece = bytes | memoryview  # arrays go in as ``ndarray.data``


class BlockMismatch(ValueError):
    """A block file's bytes do not hash to the digest recorded when it was written."""


@dataclass(frozen=True, slots=True)
class EncodingResult:
    """One encoding of one state: size, encode time and decode time over ``repeats``."""

    name: str
    ratio: float  # bytes in the block files / raw KV bytes (K and V rows, no state header)
    encode_s: float  # one run: encode and write every block file, on the pool
    decode: Stat | None  # decode of every block into the destination; None unless verified
    verified: bool  # the first decode equals the original bytes
    # the same decode, the block files evicted from the page cache first; None unless verified
    decode_cold: ColdStat | None = None

    def as_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "stored_over_raw": self.ratio,
            "encode_s": self.encode_s,
            "decode_s": None if self.decode is None else self.decode.as_json(),
            "decode_cold": None if self.decode_cold is None else self.decode_cold.as_json(),
            "verified": self.verified,
        }


# ------------------------------------------------------------------ layout
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


def _slices(views: Sequence[np.ndarray], start: int, stop: int) -> list[np.ndarray]:
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
@dataclass(frozen=True, slots=True)
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


class HiPlaneZstd(Encoding):
    """2-byte floats: low byte plane raw, high byte plane zstd-1; others as ``Zstd``."""

    name = "hi-plane zstd-1"

    def pieces(self, layout: Layout, slices: list[np.ndarray], local: _Local) -> list[Piece]:
        out: list[Piece] = []
        for ggml_type, s in zip(layout.types, slices, strict=True):
            if ggml_type in _TWO_BYTE_FLOATS:
                pairs = s.reshape(-1, 2)  # little-endian: [low byte, high byte]
                out.append(np.ascontiguousarray(pairs[:, 0]).data)
                out.append(local.cctx.compress(np.ascontiguousarray(pairs[:, 1]).data))
            else:
                out.append(local.cctx.compress(s.data))
        return out

    def decode_block(
        self, layout: Layout, block: StoredBlock, dst: list[np.ndarray], local: _Local
    ) -> None:
        buf = _read_checked(block, local)
        sizes = iter(block.pieces)
        off = 0
        for ggml_type, d in zip(layout.types, dst, strict=True):
            if ggml_type not in _TWO_BYTE_FLOATS:
                size = next(sizes)
                _decompress_into(d, buf[off : off + size], local)
                off += size
                continue
            lo_size, hi_size = next(sizes), next(sizes)
            lo = buf[off : off + lo_size]
            hi = local.buffer("hi", lo_size)
            _decompress_into(hi, buf[off + lo_size : off + lo_size + hi_size], local)
            off += lo_size + hi_size
            out16 = d.view("<u2")
            np.copyto(out16, hi)
            np.left_shift(out16, 8, out=out16)
            np.bitwise_or(out16, lo, out=out16)


ENCODINGS: tuple[Encoding, ...] = (Raw(), Zstd(), HiPlaneZstd())


# ------------------------------------------------------------ encode/decode
@dataclass(frozen=True, slots=True)
class Encoded:
    """One state encoded as block files."""

    encoding: Encoding
    layout: Layout
    blocks: tuple[StoredBlock, ...]

    @property
    def stored_bytes(self) -> int:
        return sum(b.size for b in self.blocks)


def encode(
    encoding: Encoding,
    state: codec.KVState,
    directory: Path,
    workers: Workers,
    block_size: int = 256,
) -> Encoded:
    """Write ``state`` as block files of ``block_size`` tokens under ``directory``."""
    layout = Layout.of(state)
    sources = [x.k for x in state.layers] + [x.v for x in state.layers]
    spans = layout.blocks(block_size)
    directory.mkdir(parents=True, exist_ok=True)
    stored: list[StoredBlock | None] = [None] * len(spans)

    def one(local: _Local, i: int) -> None:
        start, stop = spans[i]
        slices = [np.ascontiguousarray(s) for s in _slices(sources, start, stop)]
        pieces = encoding.pieces(layout, slices, local)
        path = directory / f"block-{i:05d}.bin"
        h = xxhash.xxh3_128()
        with open(path, "wb", buffering=0) as f:
            for p in pieces:
                h.update(p)
                f.write(p)
        sizes = tuple(len(p) if isinstance(p, bytes) else p.nbytes for p in pieces)
        stored[i] = StoredBlock(path, start, stop, sum(sizes), h.digest(), sizes)

    workers.map(one, len(spans))
    return Encoded(encoding, layout, tuple(b for b in stored if b is not None))


def decode(encoded: Encoded, out: np.ndarray, workers: Workers) -> None:
    """Decode every block file into ``out`` (flat uint8, ``layout.nbytes``), in parallel."""
    layout = encoded.layout
    if out.dtype != np.uint8 or out.shape != (layout.nbytes,):
        raise ValueError(f"need a uint8 buffer of {layout.nbytes} bytes")
    views = layout.views(out)
    blocks = encoded.blocks

    def one(local: _Local, i: int) -> None:
        b = blocks[i]
        encoded.encoding.decode_block(layout, b, _slices(views, b.start, b.stop), local)

    workers.map(one, len(blocks))


# ----------------------------------------------------------------- measure
def measure(
    encoding: Encoding,
    state: codec.KVState,
    directory: Path,
    *,
    block_size: int = 256,
    workers: int | None = None,
    repeats: int = 5,
    expected: np.ndarray | None = None,
) -> EncodingResult:
    """Encode ``state`` once (timed), check one decode, then time ``repeats`` decodes
    from the page cache and ``repeats`` with the files evicted from it first.

    ``expected`` is ``Layout.of(state).assemble(state)`` when the caller has it.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be positive, got {repeats}")
    layout = Layout.of(state)
    want = layout.assemble(state) if expected is None else expected
    with Workers(workers) as pool:
        t0 = time.perf_counter()
        encoded = encode(encoding, state, directory, pool, block_size)
        encode_s = time.perf_counter() - t0
        ratio = encoded.stored_bytes / layout.nbytes
        out = np.bitwise_not(want)  # every byte wrong until a decode writes it
        decode(encoded, out, pool)
        if not np.array_equal(out, want):
            return EncodingResult(encoding.name, ratio, encode_s, None, False)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            decode(encoded, out, pool)
            times.append(time.perf_counter() - t0)
        paths = [b.path for b in encoded.blocks]
        colds = []
        for _ in range(repeats):
            np.bitwise_not(want, out=out)  # every byte wrong again (not timed)
            colds.append(cold_call(paths, lambda: timed(lambda: decode(encoded, out, pool))))
            if not np.array_equal(out, want):  # each decode from storage is checked too
                return EncodingResult(encoding.name, ratio, encode_s, None, False)
    cold = ColdStat.of(colds, encoded.stored_bytes)
    return EncodingResult(encoding.name, ratio, encode_s, Stat.of(times), True, cold)


def compare(
    raw_state: bytes | bytearray | memoryview,
    directory: Path,
    *,
    block_size: int = 256,
    workers: int | None = None,
    repeats: int = 5,
    encodings: Sequence[Encoding] = ENCODINGS,
    keep_files: bool = False,
) -> list[EncodingResult]:
    """Every encoding of a ``llama_state_seq_get_data`` buffer, in turn.

    Each writes its block files into its own subfolder of ``directory``, removed
    after its measurement unless ``keep_files``.
    """
    state = codec.parse(raw_state)
    expected = Layout.of(state).assemble(state)
    results = []
    for i, enc in enumerate(encodings):
        folder = directory / f"{i}-{enc.name.replace(' ', '-')}"
        results.append(
            measure(
                enc,
                state,
                folder,
                block_size=block_size,
                workers=workers,
                repeats=repeats,
                expected=expected,
            )
        )
        if not keep_files:
            shutil.rmtree(folder)
    return results
