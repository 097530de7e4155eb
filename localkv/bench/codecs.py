"""Block encodings compared on a real KV state: what plain block files win over compression.

The store writes each block's K and V rows uncompressed and reads them straight
into the state buffer. ``localkv bench`` measures the alternatives that were
rejected for it in the same run, on the KV state of the bench prompt, so the
trade between bytes on disk and restore time is shown by measurement. The
encodings (``raw``, ``zstd-1``, ``hi-plane zstd-1``, ``hi-plane q6``) are in
``encodings``; this module writes a state's block files with each, decodes
them and times it.

Every encoding writes one file per block of ``block_size`` tokens and records
the xxh3-128 digest of the file's bytes; every decode hashes the bytes it read
and raises ``BlockMismatch`` when the digest differs, as the store checks its
blocks. Frame and plane sizes are kept in memory, not in the files, so the
ratio counts the encoded rows alone, not a per-block header.

The destination is one preallocated buffer holding, for each tensor, all N
tokens' rows contiguous (``codec.assemble``'s layout without the header, V
token-major). Blocks are decoded in parallel by a thread pool, each thread
with its own ``zstandard.ZstdDecompressor`` (they are not thread-safe). The
buffers are allocated and touched beforehand, so no decode time counts page
faults. Each encoding is decoded twice over: ``decode`` with the files in the
page cache (just written), counting reading, hashing, decompressing and
copying, not disk reads; ``decode_cold`` with the encoding's files flushed and
dropped from the page cache before each run (``disk.evict``), so it also
counts reading them from storage, with the bytes each run read from storage
(``/proc/self/io``) to show the eviction worked. The first decode of each
encoding fills a buffer holding the complement of the expected bytes and is
compared with the original (``np.array_equal``): a decoder that gets or leaves
any byte wrong is reported unverified, with no time.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from localkv.bench.disk import cold_call
from localkv.bench.encodings import (
    ENCODINGS,
    BlockMismatch,
    Encoding,
    Layout,
    Raw,
    StoredBlock,
    Workers,
    Zstd,
    _Local,
    block_slices,
)
from localkv.bench.stats import ColdStat, Stat, timed
from localkv.kv import codec

# the encodings and Layout are imported from here too (the tests)
__all__ = [
    "ENCODINGS",
    "BlockMismatch",
    "Encoded",
    "Encoding",
    "EncodingResult",
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


@dataclass(frozen=True, slots=True, kw_only=True)
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
        slices = [np.ascontiguousarray(s) for s in block_slices(sources, start, stop)]
        pieces = encoding.pieces(layout, slices, local)
        path = directory / f"block-{i:05d}.bin"
        h = xxhash.xxh3_128()
        with open(path, "wb", buffering=0) as f:
            for p in pieces:
                h.update(p)
                f.write(p)
        sizes = tuple(len(p) if isinstance(p, bytes) else p.nbytes for p in pieces)
        stored[i] = StoredBlock(
            path=path, start=start, stop=stop, size=sum(sizes), digest=h.digest(), pieces=sizes
        )

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
        encoded.encoding.decode_block(layout, b, block_slices(views, b.start, b.stop), local)

    workers.map(one, len(blocks))


# ----------------------------------------------------------------- measure
def measure(  # noqa: PLR0913 - to take a value type
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
            return EncodingResult(
                name=encoding.name, ratio=ratio, encode_s=encode_s, decode=None, verified=False
            )
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
                return EncodingResult(
                    name=encoding.name, ratio=ratio, encode_s=encode_s, decode=None, verified=False
                )
    cold = ColdStat.of(colds, encoded.stored_bytes)
    return EncodingResult(
        name=encoding.name,
        ratio=ratio,
        encode_s=encode_s,
        decode=Stat.of(times),
        verified=True,
        decode_cold=cold,
    )


def compare(  # noqa: PLR0913 - to take a value type
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
