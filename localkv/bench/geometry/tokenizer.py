"""The tokenizer of an existing GGUF (every ``tokenizer.*`` key), for a synthetic model.

The synthetic models borrow a real model's tokenizer, chat template included,
so that llama.cpp tokenizes and templates them as that model. The header is
parsed here: ``gguf.GGUFReader`` takes seconds to decode a 49k-token
vocabulary.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import gguf

__all__ = ["TOKENIZER_PREFIX", "read_tokenizer"]

TOKENIZER_PREFIX = "tokenizer."
_T = gguf.GGUFValueType
_SCALARS = {
    _T.UINT8: "B",
    _T.INT8: "b",
    _T.BOOL: "?",
    _T.UINT16: "H",
    _T.INT16: "h",
    _T.UINT32: "I",
    _T.INT32: "i",
    _T.FLOAT32: "f",
    _T.UINT64: "Q",
    _T.INT64: "q",
    _T.FLOAT64: "d",
}


def read_tokenizer(path: Path) -> dict[str, gguf.GGUFValue]:
    """The ``tokenizer.*`` metadata of the little-endian GGUF v2/v3 file ``path``."""
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        magic, version, _, n_kv = struct.unpack_from("<4sIQQ", data, 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path} is not a little-endian GGUF v2/v3 file")
        offset, out = 24, {}
        for _ in range(n_kv):
            key, offset = _value(data, offset, _T.STRING)
            value_type = _T(struct.unpack_from("<I", data, offset)[0])
            sub = (
                _T(struct.unpack_from("<I", data, offset + 4)[0])
                if value_type == _T.ARRAY
                else None
            )
            value, offset = _value(data, offset + 4, value_type)
            if key.decode().startswith(TOKENIZER_PREFIX):
                out[key.decode()] = gguf.GGUFValue(value, value_type, sub)
    return out


def _value(data: Any, offset: int, value_type: int) -> tuple[Any, int]:
    """The metadata value of ``value_type`` at ``offset``, and where it ends."""
    if value_type == _T.STRING:
        (length,) = struct.unpack_from("<Q", data, offset)
        return data[offset + 8 : offset + 8 + length], offset + 8 + length
    if value_type == _T.ARRAY:
        item_type, count = struct.unpack_from("<IQ", data, offset)
        offset += 12
        if item_type in _SCALARS:
            layout = struct.Struct(f"<{count}{_SCALARS[_T(item_type)]}")
            return list(layout.unpack_from(data, offset)), offset + layout.size
        items = []
        for _ in range(count):
            item, offset = _value(data, offset, item_type)
            items.append(item)
        return items, offset
    layout = struct.Struct("<" + _SCALARS[_T(value_type)])
    return layout.unpack_from(data, offset)[0], offset + layout.size
