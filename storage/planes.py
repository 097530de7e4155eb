"""Compact block files (``lkv-planes1``): 2-byte floats as two byte planes, one compressed.

A KV cache of f16 values compresses badly as it is (zstd-1: 0.92 of raw):
the low byte of each value is mantissa noise, and a byte-wise entropy coder
that sees both bytes mixed cannot code the high bytes (sign, exponent, the
top mantissa bits) well. Split apart, the high bytes compress to about 0.7
of their size and the low bytes are kept as they are: 0.853 of raw on the
default model.

A compact block file is still a plain safetensors file. Each F16 tensor
``name`` of the block is stored as two U8 tensors:

- ``name@lo``: the low bytes, with the tensor's own shape;
- ``name@hi.zst``: one zstd frame (level 1, content size declared) of the
  high bytes, in the same order.

The metadata's ``planes`` entry (JSON) lists the split tensors and their
dtype; every other tensor, and every other metadata field, is as in the
plain format. ``expand`` turns a compact file into the plain one, byte for
byte what the plain format would have written; ``join`` gives the tensors.

The whole file's xxh3-128 (the index's checksum) is checked before anything
is decompressed, so the zstd frames carry no checksum of their own.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence

import numpy as np
import zstandard

from .values import BlockCorrupt

__all__ = [
    "HI",
    "LO",
    "PLANES_FORMAT",
    "high_plane",
    "interleave",
    "join",
    "logical_dtype",
    "parse_planes",
    "plane_names",
    "split",
]

PLANES_FORMAT = "lkv-planes1"
LO = "@lo"
HI = "@hi.zst"
ZSTD_LEVEL = 1
# the dtypes split into planes: little-endian 2-byte floats
_SPLIT: dict[str, np.dtype[np.generic]] = {"F16": np.dtype("<f2")}


class _Contexts(threading.local):
    """zstd contexts are not thread-safe: one pair per thread."""

    def __init__(self) -> None:
        self.cctx = zstandard.ZstdCompressor(
            level=ZSTD_LEVEL, write_checksum=False, write_content_size=True
        )
        self.dctx = zstandard.ZstdDecompressor()


_contexts = _Contexts()


def plane_names(name: str) -> tuple[str, str]:
    """The names of ``name``'s low and high plane tensors."""
    return name + LO, name + HI


def logical_dtype(text: str) -> np.dtype[np.generic]:
    """The dtype of a split tensor as the metadata names it (BlockCorrupt if unknown)."""
    dtype = _SPLIT.get(text)
    if dtype is None:
        raise BlockCorrupt(f"planes: cannot join tensors of dtype {text!r}")
    return dtype


def split(tensors: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], str]:
    """The compact file's tensors for ``tensors``, and its ``planes`` metadata (JSON).

    Every little-endian F16 tensor of at least one dimension is split; the
    others are returned as they are.
    """
    out: dict[str, np.ndarray] = {}
    planes: dict[str, str] = {}
    for name, arr in tensors.items():
        if arr.dtype != _SPLIT["F16"] or arr.ndim < 1:
            out[name] = arr
            continue
        lo_name, hi_name = plane_names(name)
        if lo_name in tensors or hi_name in tensors:
            raise ValueError(f"tensor names {lo_name!r} or {hi_name!r} are taken")
        pairs = np.ascontiguousarray(arr).view(np.uint8).reshape(*arr.shape, 2)
        out[lo_name] = np.ascontiguousarray(pairs[..., 0])
        frame = _contexts.cctx.compress(np.ascontiguousarray(pairs[..., 1]).data)
        out[hi_name] = np.frombuffer(frame, dtype=np.uint8)
        planes[name] = "F16"
    return out, json.dumps(planes, sort_keys=True)


def parse_planes(text: str | None) -> dict[str, np.dtype[np.generic]]:
    """The ``planes`` metadata entry: split tensor name -> logical dtype."""
    if text is None:
        raise BlockCorrupt("planes: the metadata does not list the split tensors")
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BlockCorrupt(f"planes: metadata is not JSON: {exc}") from None
    if not isinstance(entries, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in entries.items()
    ):
        raise BlockCorrupt("planes: metadata must map tensor names to dtypes")
    return {name: logical_dtype(dtype) for name, dtype in entries.items()}


def high_plane(frame: np.ndarray, size: int) -> np.ndarray:
    """Decompress one high-plane frame that must hold exactly ``size`` bytes."""
    try:
        params = zstandard.get_frame_parameters(frame.data)
    except zstandard.ZstdError as exc:
        raise BlockCorrupt(f"planes: not a zstd frame: {exc}") from None
    if params.content_size != size:
        raise BlockCorrupt(f"planes: a frame declares {params.content_size} bytes, {size} expected")
    try:
        data = _contexts.dctx.decompress(
            frame.data, max_output_size=size, read_across_frames=False, allow_extra_data=False
        )
    except zstandard.ZstdError as exc:
        raise BlockCorrupt(f"planes: zstd: {exc}") from None
    if len(data) != size:
        raise BlockCorrupt(f"planes: a frame decompressed to {len(data)} of {size} bytes")
    return np.frombuffer(data, dtype=np.uint8)


def interleave(lo: np.ndarray, hi: np.ndarray, parts: Sequence[np.ndarray]) -> None:
    """Write the 2-byte values of planes ``lo`` and ``hi`` into ``parts``, in order.

    ``parts`` are writable uint8 arrays whose sizes add up to twice the planes'.
    """
    at = 0
    for part in parts:
        n = part.nbytes // 2
        out = part.reshape(-1).view("<u2")
        np.copyto(out, hi[at : at + n])
        np.left_shift(out, 8, out=out)
        np.bitwise_or(out, lo[at : at + n], out=out)
        at += n
    if at != lo.shape[0]:
        raise ValueError(f"targets hold {2 * at} bytes, the planes {2 * lo.shape[0]}")


def join(
    tensors: Mapping[str, np.ndarray], planes: Mapping[str, np.dtype[np.generic]]
) -> dict[str, np.ndarray]:
    """The logical tensors of a compact file's ``tensors`` (new arrays for the split ones)."""
    out = dict(tensors)
    for name, dtype in planes.items():
        lo_name, hi_name = plane_names(name)
        lo, hi = out.pop(lo_name, None), out.pop(hi_name, None)
        if lo is None or hi is None or lo.dtype != np.uint8 or hi.dtype != np.uint8:
            raise BlockCorrupt(f"planes: tensor {name!r} lacks its U8 planes")
        if name in out:
            raise BlockCorrupt(f"planes: tensor {name!r} is stored both whole and split")
        arr = np.empty(lo.shape, dtype=dtype)
        lo_flat = lo.reshape(-1)
        interleave(lo_flat, high_plane(hi.reshape(-1), lo_flat.shape[0]), [arr.view(np.uint8)])
        arr.setflags(write=False)
        out[name] = arr
    return out
