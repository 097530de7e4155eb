"""Block files as bytes: a block encoded as a safetensors file, and parsed back strictly.

A block file is a safetensors file that ``safetensors.numpy`` (or
``safetensors.torch``) loads as it is: the caller's tensors as given, plus
``tokens`` and ``pos`` (int32), and ``__metadata__`` with the format version,
hash, parent, identity, namespace, start, batch ends, probe digest and the
caller's metadata (all strings). The index row records its size and the
xxh3-128 of its bytes; a read checks both, and the metadata, tokens and
positions against the row. A block's ``partial`` tensor (a sliding-window or
recurrent state, used only when a restore ends at that block) is left out of
that checksum and carries its own, ``partial_xxh3`` in the metadata, so a
restore reads it from a chain's last block only (``checksum``, ``readinto``).

A file also carries the rest of its index row (the probe's top entries,
``probe_top`` in hex, and ``prefill_seconds``) and ``data_xxh3``, the
xxh3-128 of its data section: ``localkv cache repair`` rebuilds the index
from the files alone (``storage/repair.py``). Files written before these
fields are read as before; repair reports them as not recoverable.

Why uncompressed (``lkv-block2``): restoring is what the cache is for, and
decompressing dominated it, while compression saved little of a KV cache's
bytes; a plain file is read straight into llama.cpp's state buffer
(``readinto``), checksum included. ``localkv bench`` measures the encodings
(docs/performance/benchmarks.md).

A store opened ``compact`` writes a compact file instead (format
``lkv-planes2``, see ``planes`` and ``q6``): still a safetensors file, each
F16 tensor as its U8 low plane plus its high bytes in a 6-bit code.
``expand`` gives the plain file a compact one stands for. Its index row's
``raw_bytes`` is the plain file's size.

Parsing is strict and copies nothing: tensors are read-only views of the
buffer. Any failure raises ``BlockCorrupt`` with a reason.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import xxhash
from safetensors.numpy import save as _st_save

from ..chain import tokens_sha
from ..values import (
    DETACHED,
    DETACHED_XXH3,
    RESERVED_META,
    TAIL_XXH3,
    Block,
    BlockCorrupt,
    BlockRow,
    is_tail,
)
from . import planes
from .stheader import (
    DecodedBlock,
    TensorSpec,
    header_span,
    parse_header,
    parse_safetensors,
)
from .tails import group_digests

__all__ = [
    "FORMAT_VERSION",
    "DecodedBlock",
    "TensorSpec",
    "apart_specs",
    "block_of",
    "check_metadata",
    "checksum",
    "data_checksum",
    "decode",
    "detached_spec",
    "encode",
    "end_state_of",
    "expand",
    "index_row",
    "parse_header",
    "sealed",
]

FORMAT_VERSION = "lkv-block2"


def checksum(data: bytes | bytearray | memoryview) -> str:
    """The index's checksum of a stored block file: xxh3-128 of its bytes.

    A detached tensor's bytes (``values.DETACHED``) are left out when the file
    carries their own digest, and so are the tail tensors' (``tails``): the rest
    of the file, header included, is hashed in order as if they were not there.
    A file that does not parse is hashed whole.
    """
    view = memoryview(data).cast("B")
    try:
        body = header_span(view[:8], len(view))
        apart = apart_specs(*parse_header(view[8:body], len(view) - body))
    except BlockCorrupt:  # not a block file: hashed whole (a read refuses it anyway)
        apart = []
    digest = xxhash.xxh3_128()
    at = 0
    for spec in apart:
        digest.update(view[at : body + spec.begin])
        at = body + spec.end
    digest.update(view[at:])
    return "xxh3:" + digest.hexdigest()


def apart_specs(metadata: dict[str, str], specs: dict[str, TensorSpec]) -> list[TensorSpec]:
    """The tensors left out of the index's checksum (the detached one, the tails), in order."""
    detached = detached_spec(metadata, specs)
    tails = [s for n, s in specs.items() if is_tail(n)]
    if tails and TAIL_XXH3 not in metadata:
        raise BlockCorrupt("tail tensors without their digests")
    found = tails + ([detached] if detached is not None else [])
    return sorted(found, key=lambda s: s.begin)


def detached_spec(metadata: dict[str, str], specs: dict[str, TensorSpec]) -> TensorSpec | None:
    """Where the detached tensor lies, if the file keeps its digest apart (else None)."""
    if DETACHED_XXH3 not in metadata:
        return None
    spec = specs.get(DETACHED)
    if spec is None:
        raise BlockCorrupt(f"metadata holds the digest of a tensor {DETACHED!r} the file lacks")
    return spec


def encode(block: Block, *, compact: bool = False) -> bytes:
    """A block as a safetensors file; ``compact``: its F16 tensors split into planes.

    See ``planes`` for the compact format.
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
        probe_top=block.probe.top_bytes().hex(),
        prefill_seconds=repr(float(block.prefill_seconds)),
    )
    if DETACHED in tensors:
        metadata[DETACHED_XXH3] = xxhash.xxh3_128_hexdigest(tensors[DETACHED].data)
    tails = {name: arr for name, arr in tensors.items() if is_tail(name)}
    if tails:
        metadata[TAIL_XXH3] = ",".join(group_digests(tails))
    metadata["end_state"] = "1" if block.end_state else "0"
    if compact:
        tensors, metadata["planes"], metadata["format"] = planes.split(tensors)
    return sealed(bytes(_st_save(tensors, metadata=metadata)))


def data_checksum(data: bytes | bytearray | memoryview, body: int) -> str:
    """xxh3-128 hex of a safetensors file's data section (from offset ``body``)."""
    return xxhash.xxh3_128_hexdigest(memoryview(data)[body:])


def sealed(data: bytes) -> bytes:
    """A safetensors file with ``data_xxh3`` (its data section's checksum) in its metadata."""
    body = header_span(data[:8], len(data))
    header = json.loads(data[8:body])
    header.setdefault("__metadata__", {})["data_xxh3"] = data_checksum(data, body)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return b"".join((struct.pack("<Q", len(text)), text, memoryview(data)[body:]))


def expand(data: bytes | bytearray | memoryview) -> bytes:
    """A compact block file as the plain safetensors file it stands for.

    The same tensors and metadata as ``encode(block)`` (the metadata may be
    serialized in another order). A plain file is returned as it is.
    """
    decoded = parse_safetensors(data)
    if decoded.metadata.get("format") != planes.Q6_FORMAT:
        return bytes(data)
    metadata = dict(decoded.metadata)
    order = planes.parse_planes(metadata.pop("planes", None))
    metadata["format"] = FORMAT_VERSION
    metadata.pop("data_xxh3", None)
    tensors = planes.join(decoded.tensors, order)
    return sealed(bytes(_st_save(tensors, metadata=metadata)))


def decode(
    data: bytes | bytearray | memoryview, expected_raw_size: int, max_raw_size: int
) -> DecodedBlock:
    """Parse a plain block file whole, its size checked first.

    ``expected_raw_size`` is the index's ``raw_bytes``: the file must hold
    exactly that many bytes, and no more than ``max_raw_size``.
    """
    if len(data) != expected_raw_size:
        raise BlockCorrupt(f"file holds {len(data)} bytes, the index expects {expected_raw_size}")
    if len(data) > max_raw_size:
        raise BlockCorrupt(f"file of {len(data)} bytes is over the limit {max_raw_size}")
    return parse_safetensors(data)


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
        end_state=block.end_state,
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


def check_rows(name: str, shape: tuple[int, ...], row: BlockRow, tail_rows: int) -> None:
    """A block tensor must have one row per token; a tail tensor ``tail_rows`` rows."""
    want = tail_rows if is_tail(name) else row.n_tokens
    if len(shape) < 1 or shape[0] != want or want > row.n_tokens:
        raise BlockCorrupt(f"tensor {name!r} does not have one row per token")


def end_state_of(meta: dict[str, str]) -> bool:
    """A block file's ``end_state`` (files written before it was recorded: True)."""
    return meta.get("end_state", "1") != "0"


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
        end_state=row.end_state,
    )
