"""safetensors files parsed strictly: the header's metadata and tensor specs, and views.

Accepts what ``safetensors`` itself accepts for these dtypes: a JSON header of
string metadata and tensors whose byte ranges tile the data exactly. Parsing
copies nothing: tensors are read-only views of the buffer. Any failure raises
``BlockCorrupt`` with a reason.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import numpy as np

from ..values import BlockCorrupt

__all__ = ["DecodedBlock", "TensorSpec", "header_span", "parse_header", "parse_safetensors"]

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


# specs already made, shared by the blocks of one geometry (they are immutable)
_SPECS: dict[tuple[np.dtype[np.generic], tuple[int, ...], int, int], TensorSpec] = {}
_MAX_SPECS = 4096
# whole tensor tables already checked, by their ``repr`` (exact for JSON values: an int,
# a float and a bool of equal value differ) and data size: the blocks of one chain
# describe their tensors alike, whatever their metadata
_TABLES: dict[tuple[str, int], dict[str, TensorSpec]] = {}
_MAX_TABLES = 64


@dataclass(frozen=True, slots=True, eq=False)
class DecodedBlock:
    """A decoded block file: its metadata and tensors (read-only views)."""

    metadata: dict[str, str]
    tensors: dict[str, np.ndarray]


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSpec:
    """Where one tensor lies in a safetensors file's data section."""

    dtype: np.dtype[np.generic]
    shape: tuple[int, ...]
    begin: int  # byte offsets, relative to the start of the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


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
    return metadata, _specs(header, data_size)


def _specs(header: dict[str, object], data_size: int) -> dict[str, TensorSpec]:
    """The tensor table's specs, checked; a table written as one checked before (the same
    JSON values of the same types, in the same order, the same data size) gets its specs
    (a copy)."""
    key = (repr(header), data_size)
    known = _TABLES.get(key)
    if known is None:
        known = _check_table(header, data_size)
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.clear()
        _TABLES[key] = known
    return dict(known)


def _check_table(header: dict[str, object], data_size: int) -> dict[str, TensorSpec]:
    specs: dict[str, TensorSpec] = {}
    ranges: list[tuple[int, int, int, str]] = []  # in the header's order where ranges tie
    for name, info in header.items():
        spec = specs[name] = _tensor_spec(name, info, data_size)
        ranges.append((spec.begin, spec.end, len(ranges), name))
    ranges.sort()
    cursor = 0
    for begin, end, _, name in ranges:
        if begin != cursor:
            raise BlockCorrupt(f"safetensors: tensor {name!r} leaves a gap or overlaps")
        cursor = end
    if cursor != data_size:
        raise BlockCorrupt("safetensors: data does not end where the tensors do")
    return specs


def _tensor_spec(name: str, info: object, data_size: int) -> TensorSpec:
    # JSON gives exact types: ``type(x) is int`` is an int that is not a bool, and
    # ``map(type, ...)`` and ``min`` check a whole list without a Python-level loop
    if type(info) is not dict:
        raise BlockCorrupt(f"safetensors: tensor {name!r} is not described by an object")
    kind = info.get("dtype")
    dtype = _DTYPES.get(kind) if type(kind) is str else None
    shape = info.get("shape")
    offsets = info.get("data_offsets")
    if dtype is None:
        raise BlockCorrupt(f"safetensors: tensor {name!r} has unsupported dtype")
    if (
        type(shape) is not list
        or list(map(type, shape)).count(int) != len(shape)
        or min(shape, default=0) < 0
    ):
        raise BlockCorrupt(f"safetensors: tensor {name!r} has a bad shape")
    if (
        type(offsets) is not list
        or len(offsets) != 2
        or type(offsets[0]) is not int
        or type(offsets[1]) is not int
    ):
        raise BlockCorrupt(f"safetensors: tensor {name!r} has bad data offsets")
    begin, end = offsets
    count = math.prod(shape)
    if not 0 <= begin <= end <= data_size or end - begin != count * dtype.itemsize:
        raise BlockCorrupt(f"safetensors: tensor {name!r} offsets do not match its shape")
    if len(shape) > _MAX_DIMS:
        raise BlockCorrupt(f"safetensors: tensor {name!r} has {len(shape)} dimensions")
    # numpy refuses such a shape even when another dimension is 0
    if (count or math.prod(filter(None, shape))) * dtype.itemsize >= 1 << 62:
        raise BlockCorrupt(f"safetensors: tensor {name!r} has an impossible shape")
    key = (dtype, tuple(shape), begin, end)
    spec = _SPECS.get(key)
    if spec is None:
        if len(_SPECS) >= _MAX_SPECS:
            _SPECS.clear()
        spec = _SPECS[key] = TensorSpec(dtype=dtype, shape=key[1], begin=begin, end=end)
    return spec
