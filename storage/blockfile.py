"""One file per block: a plain safetensors file, checked by an xxh3-128 checksum.

A block file is a safetensors file that ``safetensors.numpy`` (or
``safetensors.torch``) loads as it is: the caller's tensors as given, plus
``tokens`` and ``pos`` (int32), and ``__metadata__`` with the format version,
hash, parent, identity, namespace, start, batch ends, probe digest and the
caller's metadata (all strings). The index row records its size and the xxh3-128 of
all its bytes; a read checks both, and the metadata, tokens and positions
against the row.

Why uncompressed (``lkv-block2``): restoring is what the cache is for, and
decompression dominated it. Measured on the default model's f16 K/V (2,048
tokens, 47 MB, 2 cores): zstd-1 stores 0.92 of raw but decodes in ~21 ms;
the high byte plane alone compressed stores 0.853 and decodes in ~17 ms;
raw files read straight into llama.cpp's state buffer (``blockread``) take
~6 ms, checksum included. ``localkv bench`` measures the three in every run.

A store opened ``compact`` writes a compact file instead (format
``lkv-planes2``, see ``planes`` and ``q6``): still a safetensors file, each
F16 tensor as its U8 low plane plus its high bytes in a 6-bit code; the
earlier compact format ``lkv-planes1`` (the high bytes of all tensors in one
zstd frame) is still read, and written with the ``zstd`` codec. ``expand``
gives the plain file a compact one stands for. Its index row's
``raw_bytes`` is the plain file's size.

Files of the first format (``lkv-block1``: the same safetensors compressed as
one zstd frame with its content size and checksum, indexed with a CRC-32) are
still read: ``decode`` checks the declared size against the index *before*
decompressing, decompresses exactly one frame, and lets zstd verify it.

Parsing is strict and copies nothing: tensors are read-only views of the
buffer. Any failure raises ``BlockCorrupt`` with a reason.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import xxhash
import zstandard
from safetensors.numpy import save as _st_save

from . import planes
from .chain import tokens_sha
from .values import RESERVED_META, Block, BlockCorrupt, BlockRow

__all__ = [
    "FORMAT_VERSION",
    "LEGACY_FORMAT",
    "DecodedBlock",
    "TensorSpec",
    "block_of",
    "check_metadata",
    "checksum",
    "checksum_matches",
    "decode",
    "encode",
    "expand",
    "frame_content_size",
    "index_row",
    "is_zstd",
    "parse_header",
]

FORMAT_VERSION = "lkv-block2"
LEGACY_FORMAT = "lkv-block1"  # zstd-compressed, CRC-32 in the index: read, never written
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_MAX_HEADER = 16 << 20
_MAX_DIMS = 8
_DTYPES: dict[str, np.dtype[np.generic]] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}


@dataclass(frozen=True, slots=True, eq=False)
class DecodedBlock:
    """A decoded block file: its metadata and tensors (read-only views)."""

    metadata: dict[str, str]
    tensors: dict[str, np.ndarray]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Where one tensor lies in a safetensors file's data section."""

    dtype: np.dtype[np.generic]
    shape: tuple[int, ...]
    begin: int  # byte offsets, relative to the start of the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def checksum(data: bytes | bytearray | memoryview) -> str:
    """The index's checksum of a stored block file: xxh3-128 of all its bytes."""
    return "xxh3:" + xxhash.xxh3_128_hexdigest(data)


def checksum_matches(expected: str, data: bytes | bytearray | memoryview) -> str | None:
    """None if ``data`` has the checksum ``expected`` (xxh3 or a first-format CRC-32).

    Otherwise the reason, naming what was found.
    """
    if expected.startswith("crc32:"):
        actual = f"crc32:{zlib.crc32(data):08x}"
    elif expected.startswith("xxh3:"):
        actual = checksum(data)
    else:
        return f"the index's checksum {expected!r} names no known algorithm"
    if actual != expected:
        return f"checksum {actual} differs from the index's {expected}"
    return None


def is_zstd(data: bytes | bytearray | memoryview) -> bool:
    """True if ``data`` starts like a zstd frame (a first-format block file)."""
    return bytes(data[:4]) == _ZSTD_MAGIC


def encode(block: Block, *, compact: bool = False, codec: str = "q6") -> bytes:
    """A block as a safetensors file; ``compact``: its F16 tensors split into planes.

    See ``planes`` for the compact formats; ``codec`` (``q6`` or ``zstd``) picks one.
    """
    tensors: dict[str, np.ndarray] = {}
    for name, arr in block.tensors.items():
        tensors[name] = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    tensors["tokens"] = block.tokens
    tensors["pos"] = np.arange(block.start, block.end, dtype="<i4")
    metadata = dict(block.meta)
    metadata.update(
        format=FORMAT_VERSION,
        hash=block.hash,
        parent=block.parent or "",
        identity=block.identity,
        namespace=block.namespace,
        start=str(block.start),
        ends=ends_text(block.ends),
        probe_digest=block.probe.digest,
    )
    if compact:
        tensors, metadata["planes"], metadata["format"] = planes.split(tensors, codec)
    return bytes(_st_save(tensors, metadata=metadata))


def expand(data: bytes | bytearray | memoryview) -> bytes:
    """A compact block file as the plain safetensors file it stands for.

    The same tensors and metadata as ``encode(block)`` (the metadata may be
    serialized in another order). A plain file is returned as it is.
    """
    decoded = parse_safetensors(data)
    file_format = decoded.metadata.get("format", "")
    if file_format not in planes.FORMATS.values():
        return bytes(data)
    metadata = dict(decoded.metadata)
    order = planes.parse_planes(metadata.pop("planes", None))
    metadata["format"] = FORMAT_VERSION
    tensors = planes.join(decoded.tensors, order, file_format)
    return bytes(_st_save(tensors, metadata=metadata))


def frame_content_size(data: bytes | bytearray | memoryview) -> int:
    """The content size a zstd frame declares (BlockCorrupt if none or unreadable)."""
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as exc:
        raise BlockCorrupt(f"not a zstd frame: {exc}") from exc
    size = int(params.content_size)
    if size == zstandard.CONTENTSIZE_UNKNOWN or size == zstandard.CONTENTSIZE_ERROR:
        raise BlockCorrupt("zstd frame does not declare its content size")
    if not params.has_checksum:
        raise BlockCorrupt("zstd frame has no content checksum")
    return size


def decode(
    data: bytes | bytearray | memoryview, expected_raw_size: int, max_raw_size: int
) -> DecodedBlock:
    """Parse a block file; a first-format one is decompressed, sizes checked before.

    ``expected_raw_size`` is the size of the safetensors content (the index's
    ``raw_bytes``): the file's own size, or what its zstd frame must declare.
    """
    if not is_zstd(data):
        if len(data) != expected_raw_size:
            raise BlockCorrupt(
                f"file holds {len(data)} bytes, the index expects {expected_raw_size}"
            )
        if len(data) > max_raw_size:
            raise BlockCorrupt(f"file of {len(data)} bytes is over the limit {max_raw_size}")
        return parse_safetensors(data)
    declared = frame_content_size(data)
    if declared != expected_raw_size:
        raise BlockCorrupt(
            f"frame declares {declared} bytes, the index expects {expected_raw_size}"
        )
    if declared > max_raw_size:
        raise BlockCorrupt(f"frame declares {declared} bytes, over the limit {max_raw_size}")
    try:
        raw = zstandard.ZstdDecompressor().decompress(
            data, max_output_size=declared, read_across_frames=False, allow_extra_data=False
        )
    except zstandard.ZstdError as exc:
        raise BlockCorrupt(f"zstd: {exc}") from exc
    if len(raw) != declared:
        raise BlockCorrupt(f"decompressed {len(raw)} bytes, frame declared {declared}")
    return parse_safetensors(raw)


def parse_safetensors(raw: bytes | bytearray | memoryview) -> DecodedBlock:
    """Parse a safetensors buffer strictly, returning read-only views into ``raw``.

    Accepts what ``safetensors`` itself accepts for these dtypes: a JSON header
    of string metadata and tensors whose byte ranges tile the data exactly.
    """
    body = header_span(raw[:8], len(raw))
    metadata, specs = parse_header(raw[8:body], len(raw) - body)
    tensors: dict[str, np.ndarray] = {}
    for name, spec in specs.items():
        count = math.prod(spec.shape)
        view = np.frombuffer(raw, dtype=spec.dtype, count=count, offset=body + spec.begin)
        view = view.reshape(spec.shape)
        view.setflags(write=False)
        tensors[name] = view
    return DecodedBlock(metadata, tensors)


def header_span(first8: bytes | bytearray | memoryview, file_size: int) -> int:
    """Where the data section of a safetensors file of ``file_size`` bytes starts."""
    if len(first8) < 8 or file_size < 8:
        raise BlockCorrupt("safetensors: shorter than its header length")
    (header_len,) = struct.unpack_from("<Q", first8, 0)
    if header_len > min(_MAX_HEADER, file_size - 8):
        raise BlockCorrupt(f"safetensors: header length {header_len} out of range")
    return 8 + int(header_len)


def parse_header(
    text: bytes | bytearray | memoryview, data_size: int
) -> tuple[dict[str, str], dict[str, TensorSpec]]:
    """The metadata and tensor specs of a safetensors JSON header, checked strictly.

    The tensors' byte ranges must tile the ``data_size`` bytes of data exactly.
    """
    try:
        header = json.loads(bytes(text))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BlockCorrupt(f"safetensors: header is not JSON: {exc}") from exc
    except RecursionError:
        raise BlockCorrupt("safetensors: header nests too deeply") from None
    if not isinstance(header, dict):
        raise BlockCorrupt("safetensors: header is not an object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise BlockCorrupt("safetensors: metadata must map strings to strings")
    specs = {name: _tensor_spec(name, info, data_size) for name, info in header.items()}
    cursor = 0
    for name, spec in sorted(specs.items(), key=lambda item: (item[1].begin, item[1].end)):
        if spec.begin != cursor:
            raise BlockCorrupt(f"safetensors: tensor {name!r} leaves a gap or overlaps")
        cursor = spec.end
    if cursor != data_size:
        raise BlockCorrupt("safetensors: data does not end where the tensors do")
    return metadata, specs


def _tensor_spec(name: str, info: object, data_size: int) -> TensorSpec:
    if not isinstance(info, dict):
        raise BlockCorrupt(f"safetensors: tensor {name!r} is not described by an object")
    dtype = _DTYPES.get(str(info.get("dtype")))
    shape = info.get("shape")
    offsets = info.get("data_offsets")
    if dtype is None:
        raise BlockCorrupt(f"safetensors: tensor {name!r} has unsupported dtype")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise BlockCorrupt(f"safetensors: tensor {name!r} has a bad shape")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise BlockCorrupt(f"safetensors: tensor {name!r} has bad data offsets")
    begin, end = offsets
    count = math.prod(shape)
    if not 0 <= begin <= end <= data_size or end - begin != count * dtype.itemsize:
        raise BlockCorrupt(f"safetensors: tensor {name!r} offsets do not match its shape")
    if len(shape) > _MAX_DIMS:
        raise BlockCorrupt(f"safetensors: tensor {name!r} has {len(shape)} dimensions")
    if math.prod(d for d in shape if d) * dtype.itemsize >= 1 << 62:
        # numpy refuses such a shape even when another dimension is 0
        raise BlockCorrupt(f"safetensors: tensor {name!r} has an impossible shape")
    return TensorSpec(dtype, tuple(shape), begin, end)


def index_row(
    block: Block, data: bytes, relpath: str, now: float, raw_bytes: int | None = None
) -> BlockRow:
    """The index row of ``block`` stored as ``data`` at ``relpath``.

    ``raw_bytes``: the size of the plain file, if ``data`` is a compact one.
    """
    return BlockRow(
        hash=block.hash,
        parent=block.parent,
        identity=block.identity,
        namespace=block.namespace,
        start=block.start,
        tokens=block.tokens,
        ends=block.ends,
        tokens_sha=tokens_sha(block.tokens),
        file=relpath,
        raw_bytes=len(data) if raw_bytes is None else raw_bytes,
        stored_bytes=len(data),
        checksum=checksum(data),
        probe=block.probe,
        prefill_seconds=block.prefill_seconds,
        created=now,
        last_used=now,
        hits=0,
    )


def ends_text(ends: np.ndarray) -> str:
    """A block's batch ends as file metadata: offsets joined by commas."""
    return ",".join(str(int(e)) for e in ends)


def check_metadata(
    meta: dict[str, str], row: BlockRow, *, file_format: str = FORMAT_VERSION
) -> dict[str, str]:
    """Check a block file's metadata against its index row; return the caller's part.

    A compact file's ``planes`` entry is not the caller's either.
    """
    expect = {
        "format": file_format,
        "hash": row.hash,
        "parent": row.parent or "",
        "identity": row.identity,
        "namespace": row.namespace,
        "start": str(row.start),
        "ends": ends_text(row.ends),
        "probe_digest": row.probe.digest,
    }
    for key, value in expect.items():
        if meta.get(key) != value:
            raise BlockCorrupt(f"metadata {key!r} is {meta.get(key)!r}, expected {value!r}")
    return {k: v for k, v in meta.items() if k not in RESERVED_META}


def check_tokens(tokens: np.ndarray | None, pos: np.ndarray | None, row: BlockRow) -> np.ndarray:
    """The block's tokens, if they and its positions are what the index row says."""
    if tokens is None or tokens.dtype != np.dtype("<i4") or not np.array_equal(tokens, row.tokens):
        raise BlockCorrupt("tokens differ from the index")
    if pos is None or not np.array_equal(pos, np.arange(row.start, row.end, dtype=np.int32)):
        raise BlockCorrupt("positions are not start..end-1")
    return tokens


def check_rows(name: str, shape: tuple[int, ...], row: BlockRow) -> None:
    """A block tensor must have one row per token."""
    if len(shape) < 1 or shape[0] != row.n_tokens:
        raise BlockCorrupt(f"tensor {name!r} does not have one row per token")


def block_of(
    row: BlockRow, tokens: np.ndarray, tensors: dict[str, np.ndarray], meta: dict[str, str]
) -> Block:
    """The block an index row describes, with its checked tokens, tensors and metadata."""
    return Block(
        hash=row.hash,
        parent=row.parent,
        identity=row.identity,
        namespace=row.namespace,
        start=row.start,
        tokens=tokens,
        ends=row.ends,
        tensors=tensors,
        probe=row.probe,
        meta=meta,
        prefill_seconds=row.prefill_seconds,
    )
