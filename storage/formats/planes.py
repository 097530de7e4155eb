"""Compact block files (``lkv-planes2``): 2-byte floats as a low byte plane and a 6-bit code.

A KV cache of f16 values compresses badly as it is: the low byte of each
value is mantissa noise, and a byte-wise coder that sees both bytes mixed
cannot code the high bytes (sign, exponent, the top mantissa bits) well.
Split apart, the low bytes are kept as they are and the high bytes, which
take few values, are coded in 6 bits each (``q6``).

A compact block file is still a plain safetensors file. Each F16 tensor
``name`` of the block becomes three U8 tensors: ``name@lo``, its low bytes
with the tensor's own shape; ``name@q6``, the 6-bit indices of its high
bytes; ``name@tab``, their table and escaped bytes. The metadata's
``planes`` entry lists the split tensors in order. Every other tensor, and
every other metadata field, is as in the plain format.
``blockcodec.expand`` turns a compact file into the plain file it stands for.

The whole file's xxh3-128 (the index's checksum) is checked before anything
is decoded, so the code carries no checksum of its own; decoding checks
only that the code is consistent (see ``q6``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from ..values import BlockCorrupt, is_tail
from . import q6

__all__ = [
    "LO",
    "Q6_FORMAT",
    "Q6_INDEX",
    "Q6_TABLE",
    "Split",
    "decode_planes",
    "join",
    "lo_name",
    "logical_dtype",
    "parse_planes",
    "parts",
    "split",
]

Q6_FORMAT = "lkv-planes2"  # high bytes in the 6-bit code of ``q6``
LO = "@lo"  # a tensor's low bytes
Q6_INDEX = "@q6"  # its 6-bit indices
Q6_TABLE = "@tab"  # its table and escaped high bytes
# the dtypes split into planes: little-endian 2-byte floats
_SPLIT: dict[str, np.dtype[np.generic]] = {"F16": np.dtype("<f2")}


def lo_name(name: str) -> str:
    """The name of tensor ``name``'s low plane."""
    return name + LO


def logical_dtype(text: str) -> np.dtype[np.generic]:
    """The dtype of a split tensor as the metadata names it (BlockCorrupt if unknown)."""
    dtype = _SPLIT.get(text)
    if dtype is None:
        raise BlockCorrupt(f"planes: cannot join tensors of dtype {text!r}")
    return dtype


def parts(name: str) -> tuple[str, ...]:
    """The stored tensors that hold split tensor ``name``: low plane, indices, table."""
    return (name + LO, name + Q6_INDEX, name + Q6_TABLE)


class Split(NamedTuple):
    """A compact file's tensors and the metadata that names what was split."""

    tensors: dict[str, np.ndarray]
    planes: str  # the ``planes`` metadata entry (JSON)
    format: str


def split(tensors: Mapping[str, np.ndarray]) -> Split:
    """The compact file's tensors for ``tensors``, its ``planes`` metadata and format.

    Every little-endian F16 tensor of at least one dimension is split but the
    tail tensors (read by row groups, ``tails``); the others are returned as they are.
    """
    out: dict[str, np.ndarray] = {}
    order: list[list[str]] = []
    for name in sorted(tensors):
        arr = tensors[name]
        if arr.dtype != _SPLIT["F16"] or arr.ndim < 1 or is_tail(name):
            out[name] = arr
            continue
        taken = [p for p in parts(name) if p in tensors]
        if taken:
            raise ValueError(f"tensor name {taken[0]!r} is taken")
        lo, index, table = q6.encode(arr)
        out[name + LO] = lo.reshape(arr.shape)
        out[name + Q6_INDEX], out[name + Q6_TABLE] = index, table
        order.append([name, "F16"])
    return Split(out, json.dumps(order), Q6_FORMAT)


def parse_planes(text: str | None) -> list[tuple[str, np.dtype[np.generic]]]:
    """The ``planes`` metadata entry: the split tensors, in order, and their dtypes."""
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


def decode_planes(
    stored: Mapping[str, np.ndarray],
    order: Sequence[tuple[str, np.dtype[np.generic]]],
    outputs: Mapping[str, Sequence[np.ndarray]],
) -> None:
    """Decode the split tensors of a compact file into their outputs.

    ``stored``: the file's own tensors (flat uint8 views will do); ``outputs``:
    for each split tensor, flat uint8 buffers that take its bytes in order.
    ``BlockCorrupt`` if a part is missing or the code does not decode.
    """

    def part(name: str, suffix: str) -> np.ndarray:
        arr = stored.get(name + suffix)
        if arr is None or arr.dtype != np.uint8:
            raise BlockCorrupt(f"planes: tensor {name!r} lacks its U8 {suffix} part")
        return arr.reshape(-1)

    q6.decode_into(
        [
            (part(name, LO), part(name, Q6_INDEX), part(name, Q6_TABLE), outputs[name])
            for name, _ in order
        ]
    )


def join(
    tensors: Mapping[str, np.ndarray], order: Sequence[tuple[str, np.dtype[np.generic]]]
) -> dict[str, np.ndarray]:
    """The logical tensors of a compact file's ``tensors`` (new arrays for the split ones)."""
    out = dict(tensors)
    outputs: dict[str, list[np.ndarray]] = {}
    for name, dtype in order:
        lo = tensors.get(lo_name(name))
        if lo is None or lo.dtype != np.uint8 or name in out:
            raise BlockCorrupt(f"planes: tensor {name!r} lacks its U8 low plane")
        for p in parts(name):
            out.pop(p, None)
        arr = np.empty(lo.shape, dtype=dtype)
        outputs[name] = [arr.reshape(-1).view(np.uint8)]
        out[name] = arr
    if order:
        decode_planes(tensors, order, outputs)
    for name, _ in order:
        out[name].setflags(write=False)
    return out
