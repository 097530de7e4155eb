"""Compact block files (``lkv-planes1``): 2-byte floats as two byte planes, one compressed.

A KV cache of f16 values compresses badly as it is (zstd-1: 0.92 of raw):
the low byte of each value is mantissa noise, and a byte-wise entropy coder
that sees both bytes mixed cannot code the high bytes (sign, exponent, the
top mantissa bits) well. Split apart, the high bytes compress to about 0.7
of their size and the low bytes are kept as they are: 0.855 of raw on the
default model.

A compact block file is still a plain safetensors file. Each F16 tensor
``name`` of the block becomes ``name@lo``, a U8 tensor of its low bytes with
the tensor's own shape; the high bytes of all of them, one tensor after the
other in the order the metadata's ``planes`` entry lists them, are one zstd
frame (level 1, content size declared), the U8 tensor ``@hi.zst``. Every
other tensor, and every other metadata field, is as in the plain format.
``blockfile.expand`` turns a compact file into the plain file it stands for.

One frame per file, not one per tensor: a restore then makes one
decompression call and one join call (``_planes.c``) per block, both without
the GIL, so the reader threads work in parallel instead of queueing for it.
The whole file's xxh3-128 (the index's checksum) is checked before anything
is decompressed, so the frame carries no checksum of its own.

The second compact format, ``lkv-planes2`` (what a compact store writes),
codes the high bytes with ``q6`` instead of zstd: each split tensor ``name``
is ``name@lo`` as above, ``name@q6`` (its 6-bit indices) and ``name@tab``
(its table and escaped bytes), all U8. About 0.89 of raw instead of 0.855,
decoded in about half the time. Both formats are read.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import zstandard

from . import q6
from .compiled import extension as _planes
from .values import BlockCorrupt

__all__ = [
    "CODECS",
    "FORMATS",
    "HI",
    "LO",
    "PLANES_FORMAT",
    "Q6_FORMAT",
    "Item",
    "compiled",
    "decode_planes",
    "decompress_into",
    "join",
    "join_into",
    "lo_name",
    "logical_dtype",
    "parse_planes",
    "parts",
    "split",
]

PLANES_FORMAT = "lkv-planes1"  # high bytes in one zstd frame
Q6_FORMAT = "lkv-planes2"  # high bytes in the 6-bit code of ``q6``
FORMATS = {"q6": Q6_FORMAT, "zstd": PLANES_FORMAT}  # by codec name
CODECS = tuple(FORMATS)
LO = "@lo"
HI = "@hi.zst"  # the one tensor holding the frame of high bytes (lkv-planes1)
Q6_INDEX = "@q6"  # a tensor's 6-bit indices (lkv-planes2)
Q6_TABLE = "@tab"  # its table and escaped high bytes (lkv-planes2)
ZSTD_LEVEL = 1
# the dtypes split into planes: little-endian 2-byte floats
_SPLIT: dict[str, np.dtype[np.generic]] = {"F16": np.dtype("<f2")}

Item = tuple[np.ndarray, np.ndarray]  # (low bytes, their output: twice as many bytes)


class _Contexts(threading.local):
    """zstd contexts are not thread-safe: one pair per thread."""

    def __init__(self) -> None:
        self.cctx = zstandard.ZstdCompressor(
            level=ZSTD_LEVEL, write_checksum=False, write_content_size=True
        )
        self.dctx = zstandard.ZstdDecompressor()


_contexts = _Contexts()


def compiled() -> bool:
    """True if planes are joined by the compiled extension (``storage/_planes.c``)."""
    return _planes is not None


def lo_name(name: str) -> str:
    """The name of tensor ``name``'s low plane."""
    return name + LO


def logical_dtype(text: str) -> np.dtype[np.generic]:
    """The dtype of a split tensor as the metadata names it (BlockCorrupt if unknown)."""
    dtype = _SPLIT.get(text)
    if dtype is None:
        raise BlockCorrupt(f"planes: cannot join tensors of dtype {text!r}")
    return dtype


def parts(name: str, file_format: str) -> tuple[str, ...]:
    """The stored tensors that hold split tensor ``name`` in a file of ``file_format``."""
    if file_format == Q6_FORMAT:
        return (name + LO, name + Q6_INDEX, name + Q6_TABLE)
    return (name + LO,)


def split(
    tensors: Mapping[str, np.ndarray], codec: str = "q6"
) -> tuple[dict[str, np.ndarray], str, str]:
    """The compact file's tensors for ``tensors``, its ``planes`` metadata (JSON) and format.

    Every little-endian F16 tensor of at least one dimension is split; the
    others are returned as they are. ``codec``: ``q6`` or ``zstd``.
    """
    file_format = FORMATS.get(codec)
    if file_format is None:
        raise ValueError(f"codec must be one of {', '.join(CODECS)}, not {codec!r}")
    out: dict[str, np.ndarray] = {}
    order: list[list[str]] = []
    highs: list[np.ndarray] = []
    if HI in tensors:
        raise ValueError(f"tensor name {HI!r} is taken")
    for name in sorted(tensors):
        arr = tensors[name]
        if arr.dtype != _SPLIT["F16"] or arr.ndim < 1:
            out[name] = arr
            continue
        taken = [p for p in parts(name, file_format) if p in tensors]
        if taken:
            raise ValueError(f"tensor name {taken[0]!r} is taken")
        if file_format == Q6_FORMAT:
            lo, index, table = q6.encode(arr)
            out[name + LO] = lo.reshape(arr.shape)
            out[name + Q6_INDEX], out[name + Q6_TABLE] = index, table
        else:
            pairs = np.ascontiguousarray(arr).view(np.uint8).reshape(*arr.shape, 2)
            out[lo_name(name)] = np.ascontiguousarray(pairs[..., 0])
            highs.append(pairs[..., 1].reshape(-1))
        order.append([name, "F16"])
    if highs:
        high = np.concatenate(highs) if len(highs) > 1 else np.ascontiguousarray(highs[0])
        out[HI] = np.frombuffer(_contexts.cctx.compress(high.data), dtype=np.uint8)
    return out, json.dumps(order), file_format


def parse_planes(text: str | None) -> list[tuple[str, np.dtype[np.generic]]]:
    """The ``planes`` metadata entry: the split tensors, in frame order, and their dtypes."""
    if text is None:
        raise BlockCorrupt("planes: the metadata does not list the split tensors")
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BlockCorrupt(f"planes: metadata is not JSON: {exc}") from None
    if not isinstance(entries, list) or not all(
        isinstance(e, list) and len(e) == 2 and all(isinstance(x, str) for x in e) for e in entries
    ):
        raise BlockCorrupt("planes: metadata must list [tensor name, dtype] pairs")
    if len({e[0] for e in entries}) != len(entries):
        raise BlockCorrupt("planes: a tensor is listed twice")
    return [(name, logical_dtype(dtype)) for name, dtype in entries]


def decompress_into(frame: np.ndarray, out: np.ndarray) -> None:
    """Decompress the high-byte ``frame`` into ``out``, which it must fill exactly."""
    size = out.nbytes
    try:
        params = zstandard.get_frame_parameters(frame.data)
    except zstandard.ZstdError as exc:
        raise BlockCorrupt(f"planes: not a zstd frame: {exc}") from None
    if params.content_size != size:
        raise BlockCorrupt(
            f"planes: the frame declares {params.content_size} bytes, {size} expected"
        )
    target = out.reshape(-1).data
    got = 0
    try:
        with _contexts.dctx.stream_reader(frame.data, read_across_frames=False) as reader:
            while got < size:
                n = reader.readinto(target[got:])
                if not n:
                    break
                got += n
            extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise BlockCorrupt(f"planes: zstd: {exc}") from None
    if got != size or extra:
        raise BlockCorrupt(f"planes: the frame decompressed to other than {size} bytes")


def join_into(hi: np.ndarray, items: Sequence[Item], *, use_compiled: bool = True) -> None:
    """For each (lo, out) in turn: ``out`` gets the values of ``lo`` and the next bytes of ``hi``.

    All uint8, ``out`` writable and twice the size of ``lo``; ``hi`` must be
    used up exactly. One compiled call (without the GIL) where the extension
    is built and ``use_compiled``, else three numpy passes per item.
    """
    if use_compiled and _planes is not None:
        _planes.join(hi.data, [(lo.data, out.data) for lo, out in items])
        return
    at = 0
    for lo, out in items:
        n = lo.size
        if out.nbytes != 2 * n:
            raise ValueError(f"{n} low bytes cannot fill {out.nbytes} bytes")
        values = out.reshape(-1).view("<u2")
        np.copyto(values, hi[at : at + n])
        np.left_shift(values, 8, out=values)
        np.bitwise_or(values, lo.reshape(-1), out=values)
        at += n
    if at != hi.size:
        raise ValueError(f"the items take {at} high bytes, {hi.size} given")


def decode_planes(
    stored: Mapping[str, np.ndarray],
    order: Sequence[tuple[str, np.dtype[np.generic]]],
    outputs: Mapping[str, Sequence[np.ndarray]],
    file_format: str,
    scratch: Callable[[int], np.ndarray] | None = None,
) -> None:
    """Decode the split tensors of a compact file into their outputs.

    ``stored``: the file's own tensors (flat uint8 views will do); ``outputs``:
    for each split tensor, flat uint8 buffers that take its bytes in order;
    ``scratch(n)``: a reusable uint8 buffer of n bytes for the zstd format's
    high bytes (a new one if None). ``BlockCorrupt`` if a part is missing or
    the code does not decode.
    """

    def part(name: str, suffix: str) -> np.ndarray:
        arr = stored.get(name + suffix)
        if arr is None or arr.dtype != np.uint8:
            raise BlockCorrupt(f"planes: tensor {name!r} lacks its U8 {suffix} part")
        return arr.reshape(-1)

    if file_format == Q6_FORMAT:
        q6.decode_into(
            [
                (part(name, LO), part(name, Q6_INDEX), part(name, Q6_TABLE), outputs[name])
                for name, _ in order
            ]
        )
        return
    items: list[Item] = []
    for name, _ in order:
        lo, at = part(name, LO), 0
        for out in outputs[name]:
            n = out.shape[0] // 2
            if at + n > lo.shape[0]:
                raise BlockCorrupt(f"planes: the low plane of {name!r} is too short")
            items.append((lo[at : at + n], out))
            at += n
    if items:
        frame = stored.get(HI)
        if frame is None or frame.dtype != np.uint8 or frame.ndim != 1:
            raise BlockCorrupt(f"planes: the U8 tensor {HI!r} is missing")
        size = sum(lo.shape[0] for lo, _ in items)
        hi = scratch(size) if scratch is not None else np.empty(size, dtype=np.uint8)
        decompress_into(frame, hi)
        join_into(hi, items)


def join(
    tensors: Mapping[str, np.ndarray],
    order: Sequence[tuple[str, np.dtype[np.generic]]],
    file_format: str = PLANES_FORMAT,
) -> dict[str, np.ndarray]:
    """The logical tensors of a compact file's ``tensors`` (new arrays for the split ones)."""
    out = dict(tensors)
    out.pop(HI, None)
    outputs: dict[str, list[np.ndarray]] = {}
    for name, dtype in order:
        lo = tensors.get(lo_name(name))
        if lo is None or lo.dtype != np.uint8 or name in out:
            raise BlockCorrupt(f"planes: tensor {name!r} lacks its U8 low plane")
        for p in parts(name, file_format):
            out.pop(p, None)
        arr = np.empty(lo.shape, dtype=dtype)
        outputs[name] = [arr.reshape(-1).view(np.uint8)]
        out[name] = arr
    if order:
        decode_planes(tensors, order, outputs, file_format)
    for name, _ in order:
        out[name].setflags(write=False)
    return out
