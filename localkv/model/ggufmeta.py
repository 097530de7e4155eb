"""A GGUF file's metadata and tensor shapes, read from its header without loading it.

The layout is GGUF v2/v3 (little-endian): magic ``GGUF``, version, tensor count, key
count, the key/value pairs, then one (name, dims, ggml type, offset) record per tensor.
``gguf.GGUFReader`` reads the same, but builds an array per vocabulary string, which
is slow for a large vocabulary. Here arrays longer than a few items are skipped
(their element type and length are kept), so a header reads without that work.
Every length is checked against the file, so a damaged or hostile file is a
``GGUFError``, never an unbounded read (tests compare the result with ``GGUFReader``).
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "GGUFArray",
    "GGUFError",
    "GGUFMetadata",
    "TensorInfo",
    "read_gguf_metadata",
    "read_gguf_values_before",
]

MAGIC = b"GGUF"
MAX_KEYS = 1 << 20
MAX_TENSORS = 1 << 24
MAX_DIMS = 8
SMALL_ARRAY = 64  # arrays up to this length are kept as tuples

_T = TypeVar("_T")

# GGUF value types -> struct formats (8: string, 9: array)
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9

Value = int | float | bool | str | tuple[object, ...]


class GGUFError(ValueError):
    """Not a GGUF file this reader understands, or a damaged one."""


@dataclass(frozen=True, slots=True)
class GGUFArray:
    """A long array, not read: its element type (GGUF value type) and length."""

    item_type: int
    length: int


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class GGUFMetadata:
    version: int
    values: dict[str, Value | GGUFArray]
    tensors: tuple[TensorInfo, ...]

    def get(self, key: str) -> Value | GGUFArray | None:
        return self.values.get(key)

    @property
    def architecture(self) -> str | None:
        arch = self.values.get("general.architecture")
        return arch if isinstance(arch, str) else None

    @property
    def parameters(self) -> int:
        return sum(t.n_elements for t in self.tensors)


class _Cursor:
    def __init__(self, data: mmap.mmap | bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, fmt: str) -> tuple[Any, ...]:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.data):
            raise GGUFError(f"truncated at byte {self.pos}")
        out = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += size
        return out

    def one(self, fmt: str) -> Any:
        return self.take(fmt)[0]

    def uint(self, fmt: str = "I") -> int:
        return int(self.one(fmt))

    def count(self, limit: int, what: str) -> int:
        n = self.uint("Q")
        if n > limit:
            raise GGUFError(f"implausible {what}: {n}")
        return n

    def length(self) -> int:
        """A string or array length: at most the bytes left in the file."""
        return self.count(len(self.data) - self.pos - 8, "length")

    def string(self) -> str:
        n = self.length()
        raw = self.data[self.pos : self.pos + n]
        self.pos += n
        return bytes(raw).decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        n = self.length()
        self.pos += n


def _value(cur: _Cursor, kind: int) -> Value | GGUFArray:
    if kind in _SCALARS:
        value: Value = cur.one(_SCALARS[kind])
        return value
    if kind == _STRING:
        return cur.string()
    if kind != _ARRAY:
        raise GGUFError(f"unknown value type {kind} at byte {cur.pos}")
    item = cur.uint()
    n = cur.length()
    if item == _ARRAY:
        raise GGUFError("nested arrays are not supported")
    if n <= SMALL_ARRAY:
        return tuple(_value(cur, item) for _ in range(n))
    if item in _SCALARS:
        cur.pos += n * struct.calcsize("<" + _SCALARS[item])
    elif item == _STRING:
        for _ in range(n):
            cur.skip_string()
    else:
        raise GGUFError(f"unknown array type {item}")
    if cur.pos > len(cur.data):
        raise GGUFError("truncated array")
    return GGUFArray(item, n)


def _tensor(cur: _Cursor) -> TensorInfo:
    name = cur.string()
    n_dims = cur.uint()
    if n_dims > MAX_DIMS:
        raise GGUFError(f"tensor {name!r} has {n_dims} dimensions")
    shape = tuple(int(d) for d in cur.take("Q" * n_dims))
    ggml_type, _offset = cur.take("IQ")
    return TensorInfo(name, shape, int(ggml_type))


def read_gguf_metadata(path: str | Path) -> GGUFMetadata:
    """The key/value metadata and tensor infos of the GGUF at ``path``.

    Raises ``GGUFError`` for what is not a readable GGUF, ``OSError`` for what cannot
    be opened.
    """
    return _read(path, _parse)


def read_gguf_values_before(path: str | Path, prefix: str) -> dict[str, Value | GGUFArray]:
    """The key/values at the start of the GGUF at ``path``, up to the first key that
    starts with ``prefix`` (``tokenizer.``: the vocabulary, slow to walk); no tensors.

    Raises as ``read_gguf_metadata`` does.
    """

    def values_before(cur: _Cursor) -> dict[str, Value | GGUFArray]:
        values: dict[str, Value | GGUFArray] = {}
        for _ in range(_header(cur).n_keys):
            key = cur.string()
            if key.startswith(prefix):
                break
            values[key] = _value(cur, cur.uint())
        return values

    return _read(path, values_before)


def _read(path: str | Path, parse: Callable[[_Cursor], _T]) -> _T:
    """``parse`` over the GGUF at ``path``, mapped; what is not a GGUF is a ``GGUFError``."""
    if not Path(path).is_file():  # a FIFO would block the open
        raise GGUFError("not a regular file")
    try:
        with open(path, "rb") as f:
            if f.read(4) != MAGIC:
                raise GGUFError("not a GGUF file (bad magic)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return parse(_Cursor(data))
    except struct.error as exc:  # pragma: no cover - lengths are checked first
        raise GGUFError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class _Header:
    version: int
    n_tensors: int
    n_keys: int


def _header(cur: _Cursor) -> _Header:
    """The version, tensor count and key count after the magic, each checked."""
    cur.pos = 4
    version = cur.uint()
    if version not in (2, 3):
        raise GGUFError(f"GGUF version {version} is not supported")
    n_tensors = cur.count(MAX_TENSORS, "tensor count")
    return _Header(version, n_tensors, cur.count(MAX_KEYS, "key count"))


def _parse(cur: _Cursor) -> GGUFMetadata:
    header = _header(cur)
    values: dict[str, Value | GGUFArray] = {}
    for _ in range(header.n_keys):
        key = cur.string()
        kind = cur.uint()
        values[key] = _value(cur, kind)
    tensors = tuple(_tensor(cur) for _ in range(header.n_tensors))
    return GGUFMetadata(header.version, values, tensors)
