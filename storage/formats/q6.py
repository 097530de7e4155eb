"""A 6-bit code for the high bytes of 2-byte floats, decoded with a few vector instructions.

An f16 value's low byte is mantissa noise; its high byte (sign, exponent, two
mantissa bits) takes few values, and the 63 most frequent cover nearly all of
a KV tensor's values. So each high byte becomes a 6-bit index into a table of
the tensor's 63 most frequent high bytes; index 63 means "escaped", and the
escaped high bytes follow the table, in value order. An entropy coder stores
a little less but decodes symbol by symbol; this code decodes 64 values with
a few vector instructions (``_planes.c``, AVX2) and writes them straight to
their place (docs/performance/benchmarks.md has the sizes and times).

Per tensor of n values, three arrays:

- ``lo``: the n low bytes;
- ``q6``: the indices, 48 bytes per group of 64 values (the last group padded
  with index 0): bytes 0-31 hold values j (low nibble) and j+32 (high nibble)
  of the group; bytes 32-47 hold the indices' top two bits, byte j those of
  values j, j+16, j+32 and j+48 (bits 0-1, 2-3, 4-5, 6-7);
- ``tab``: the 64-byte table (entry 63 unused, 0), then the escaped bytes.

This layout lets a vector decoder unpack a group with shifts and masks alone.
Decoding checks that the escapes in the indices use up the escaped bytes
exactly; everything else is the file checksum's job.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..values import BlockCorrupt
from .compiled import extension as _planes

__all__ = [
    "GROUP",
    "GROUP_BYTES",
    "TABLE",
    "Code",
    "Item",
    "compiled",
    "decode_into",
    "decode_views",
    "encode",
    "simd",
]

GROUP = 64  # values per group
GROUP_BYTES = 48  # index bytes per group
TABLE = 64  # table bytes before the escaped ones
ESCAPE = 63

Code = tuple[np.ndarray, np.ndarray, np.ndarray]  # (lo, q6, tab)
Item = tuple[np.ndarray, np.ndarray, np.ndarray, Sequence[np.ndarray]]  # a Code and its outputs


def compiled() -> bool:
    """True if the compiled decoder (``_planes.decode6``) is built."""
    return _planes is not None


def simd() -> bool:
    """True if the compiled decoder is built and can use AVX2 on this CPU."""
    return _planes is not None and bool(_planes.avx2())


def _groups(n: int) -> int:
    return -(-n // GROUP)


def encode(values: np.ndarray) -> Code:
    """The code of a little-endian f16 (or any 2-byte) array, as flat uint8 arrays."""
    pairs = np.ascontiguousarray(values).reshape(-1).view(np.uint8).reshape(-1, 2)
    lo, hi = np.ascontiguousarray(pairs[:, 0]), pairs[:, 1]
    counts = np.bincount(hi, minlength=256)
    order = np.argsort(-counts, kind="stable")[:ESCAPE]
    order = order[counts[order] > 0]
    index = np.full(256, ESCAPE, dtype=np.uint8)
    index[order] = np.arange(order.size, dtype=np.uint8)
    table = np.zeros(TABLE, dtype=np.uint8)
    table[: order.size] = order
    idx = np.zeros(_groups(hi.size) * GROUP, dtype=np.uint8)
    idx[: hi.size] = index[hi]
    escaped = hi[idx[: hi.size] == ESCAPE]
    g = idx.reshape(-1, GROUP)
    q6 = np.empty((g.shape[0], GROUP_BYTES), dtype=np.uint8)
    q6[:, :32] = (g[:, :32] & 15) | ((g[:, 32:] & 15) << 4)
    top = g >> 4
    q6[:, 32:] = top[:, :16] | (top[:, 16:32] << 2) | (top[:, 32:48] << 4) | (top[:, 48:] << 6)
    return lo, q6.reshape(-1), np.concatenate([table, escaped])


def _indices(q6: np.ndarray, n: int) -> np.ndarray:
    q = q6.reshape(-1, GROUP_BYTES)
    idx = np.empty((q.shape[0], GROUP), dtype=np.uint8)
    idx[:, :32] = q[:, :32] & 15
    idx[:, 32:] = q[:, :32] >> 4
    for part in range(4):
        idx[:, 16 * part : 16 * part + 16] |= ((q[:, 32:] >> (2 * part)) & 3) << 4
    return idx.reshape(-1)[:n]


def _check(lo: np.ndarray, q6: np.ndarray, tab: np.ndarray, outs: Sequence[np.ndarray]) -> None:
    n = lo.size
    if q6.size != _groups(n) * GROUP_BYTES:
        raise BlockCorrupt(f"q6: {q6.size} index bytes for {n} values")
    if tab.size < TABLE:
        raise BlockCorrupt(f"q6: a table of {tab.size} bytes")
    if sum(out.nbytes for out in outs) != 2 * n:
        raise ValueError(f"outputs of {sum(o.nbytes for o in outs)} bytes for {n} values")


def _decode_numpy(
    lo: np.ndarray, q6: np.ndarray, tab: np.ndarray, outs: Sequence[np.ndarray]
) -> None:
    idx = _indices(q6, lo.size)
    hi = tab[:TABLE][idx]
    escaped = idx == ESCAPE
    if int(np.count_nonzero(escaped)) != tab.size - TABLE:
        raise BlockCorrupt("q6: the escaped values do not match the table")
    hi[escaped] = tab[TABLE:]
    values = hi.astype("<u2") << 8
    values |= lo
    flat = values.view(np.uint8)
    at = 0
    for out in outs:
        target = out.reshape(-1).view(np.uint8)
        target[...] = flat[at : at + target.size]
        at += target.size


def decode_views(
    items: Sequence[tuple[memoryview, memoryview, memoryview, Sequence[memoryview]]],
) -> None:
    """``decode_into`` for byte buffers, straight to the compiled decoder (it must be built).

    The decoder checks every size itself; ``BlockCorrupt`` if anything is off.
    """
    if _planes is None:
        raise RuntimeError("the compiled decoder is not built")
    try:
        _planes.decode6(items, True)
    except ValueError as exc:
        raise BlockCorrupt(f"q6: {exc}") from None


def decode_into(items: Sequence[Item], *, compiled: bool = True, vector: bool = True) -> None:
    """Decode each (lo, q6, tab, outs): the tensor's bytes into ``outs``, one after the other.

    All flat uint8 arrays; ``outs`` writable and 2 bytes a value in all.
    One compiled call without the GIL where built (``vector``: AVX2 where the
    CPU has it), else numpy. ``BlockCorrupt`` if the code is inconsistent.
    """
    for lo, index, tab, outs in items:
        _check(lo, index, tab, outs)
    if compiled and _planes is not None:
        views = [
            (lo.data, ix.data, tab.data, [o.data for o in outs]) for lo, ix, tab, outs in items
        ]
        try:
            _planes.decode6(views, vector)
        except ValueError as exc:
            raise BlockCorrupt(f"q6: {exc}") from None
        return
    for lo, index, tab, outs in items:
        _decode_numpy(lo, index, tab, outs)
