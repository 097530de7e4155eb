"""Codec for llama.cpp's per-sequence KV state (llama-cpp-python 0.3.36).

``llama_state_seq_get_data`` writes, little-endian (llama.cpp
``llama_context::state_seq_get_data`` and ``llama_kv_cache::state_write``)::

    u32 magic 0xaf143cd8, i32 seq_id
    u32 n_stream                      (localkv: exactly 1)
    per stream: u32 cell_count
      per cell: i32 pos, u32 n_seq_id (=1), [i32 x, i32 y, i32 tok], i32 seq_id
      u32 v_trans, u32 n_layer
      per layer: i32 k_type, u64 k_row_bytes, cell_count K rows
      V, untransposed: per layer i32 v_type, u64 v_row_bytes, cell_count rows
      V, transposed:   per layer i32 v_type, u32 elem_bytes, u32 n_embd_v,
                       then for each of n_embd_v rows, the cells' elements

The bracketed cell extension is written by M-RoPE models (``localkv.kv.section``
finds the layout); a state keeps its cells' tokens, and an assembly writes it back.

The codec keeps K and V token-major (one row
of bytes per token, V transposed back), so a state can be cut at any token and
blocks concatenated. Anything it does not recognise raises ``StateFormatError``
and the caller runs uncached.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from localkv.kv.columns import to_columns
from localkv.kv.layout import Assembly, LayerLayout, assembly, scratch_view, state_size
from localkv.kv.section import ELEMENT_BYTES as _ELEMENT_BYTES
from localkv.kv.section import (
    EXT_CELL,
    PLAIN_CELL,
    STATE_MAGIC,
    StateFormatError,
    kv_section,
    write_cells,
)
from localkv.kv.section import Reader as _Reader
from localkv.kv.section import known_type as _known_type

__all__ = [
    "STATE_MAGIC",
    "Assembly",
    "KVLayer",
    "KVState",
    "LayerLayout",
    "StateFormatError",
    "assemble",
    "assembly",
    "concat",
    "parse",
    "state_size",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class KVLayer:
    """One layer's K and V, token-major: ``k[i]`` / ``v[i]`` are token i's rows."""

    k_type: int
    v_type: int
    k: np.ndarray  # uint8 [n_tokens, k_row_bytes]
    v: np.ndarray  # uint8 [n_tokens, v_row_bytes]
    v_elem_bytes: int  # element size of V (used when V is stored transposed)

    @property
    def k_row_bytes(self) -> int:
        return int(self.k.shape[1])

    @property
    def v_row_bytes(self) -> int:
        return int(self.v.shape[1])


@dataclass(frozen=True, slots=True, kw_only=True)
class KVState:
    """A parsed sequence state: positions plus per-layer token-major K/V rows."""

    positions: np.ndarray  # int32 [n_tokens]
    v_trans: bool
    layers: tuple[KVLayer, ...]
    # int32 [n_tokens]: the token each cell names, where cells carry llama.cpp's
    # extension; None for plain cells (and for states rebuilt from blocks)
    cell_tokens: np.ndarray | None = None

    @property
    def cell_ext(self) -> bool:
        return self.cell_tokens is not None

    @property
    def n_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(layer.k.nbytes + layer.v.nbytes for layer in self.layers)

    def layout(self) -> tuple[LayerLayout, ...]:
        """Per layer (k_type, k_row_bytes, v_type, v_row_bytes): the representation."""
        return tuple((x.k_type, x.k_row_bytes, x.v_type, x.v_row_bytes) for x in self.layers)

    def slice(self, start: int, stop: int) -> KVState:
        """Tokens ``start..stop-1`` (views, no copy)."""
        if not 0 <= start <= stop <= self.n_tokens:
            raise ValueError(f"slice {start}:{stop} outside 0:{self.n_tokens}")
        layers = tuple(
            KVLayer(
                k_type=x.k_type,
                v_type=x.v_type,
                k=x.k[start:stop],
                v=x.v[start:stop],
                v_elem_bytes=x.v_elem_bytes,
            )
            for x in self.layers
        )
        tokens = None if self.cell_tokens is None else self.cell_tokens[start:stop]
        return KVState(
            positions=self.positions[start:stop],
            v_trans=self.v_trans,
            layers=layers,
            cell_tokens=tokens,
        )


def parse(
    buf: bytes | bytearray | memoryview, *, copy: bool = True, header: bool = True
) -> KVState:
    """Parse a ``llama_state_seq_get_data`` buffer of one sequence.

    With ``copy=False`` the arrays are views into ``buf`` (keep it alive).
    ``header=False``: ``buf`` is a KV section without the magic and sequence id
    (the sliding part of an SWA state, after its full-attention part).
    """
    r = _Reader(buf)
    if header:
        magic = r.take("<I")
        if magic != STATE_MAGIC:
            raise StateFormatError(f"not a llama.cpp sequence state (magic {magic:#010x})")
        r.take("<i")  # the sequence it was taken from; set_data takes the target id
    section = r.off
    n_stream = r.take("<I")
    if n_stream != 1:
        raise StateFormatError(f"{n_stream} KV streams (localkv handles exactly 1)")
    n = r.take("<I")
    if n == 0:
        raise StateFormatError("empty sequence state")
    _, cell_bytes = kv_section(r.buf, section, end=len(r.buf))
    cells = r.rows(n, cell_bytes).view("<i4")  # pos, n_seq_id, [x, y, tok], seq_id
    positions = cells[:, 0].astype(np.int32)
    tokens = cells[:, 4].astype(np.int32) if cell_bytes == EXT_CELL else None
    v_trans = r.take("<I")
    n_layer = r.take("<I")
    layers = _parse_layers(r, n, n_layer, bool(v_trans), copy)
    if r.off != len(r.buf):
        raise StateFormatError(f"{len(r.buf) - r.off} unexpected trailing bytes")
    return KVState(positions=positions, v_trans=bool(v_trans), layers=layers, cell_tokens=tokens)


def _parse_layers(
    r: _Reader, n: int, n_layer: int, v_trans: bool, copy: bool
) -> tuple[KVLayer, ...]:
    ks = []
    for _ in range(n_layer):
        k_type = _known_type(r.take("<i"))
        ks.append((k_type, r.rows(n, r.take("<Q"))))
    layers = []
    for k_type, k in ks:
        v_type = _known_type(r.take("<i"))
        if v_trans:
            elem = r.take("<I")
            if _ELEMENT_BYTES.get(v_type) != elem:
                raise StateFormatError(f"transposed V of type {v_type} with {elem}-byte elements")
            n_embd_v = r.take("<I")
            v = _untranspose(r.rows(n_embd_v, n * elem), n, elem)
        else:
            v = r.rows(n, r.take("<Q"))
            elem = _ELEMENT_BYTES.get(v_type, 1)
        if copy:
            k = k.copy()
            v = v if v_trans else v.copy()
        layers.append(KVLayer(k_type=k_type, v_type=v_type, k=k, v=v, v_elem_bytes=elem))
    return tuple(layers)


_ELEM_DTYPES: dict[int, np.dtype[np.unsignedinteger]] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.uint16),
    4: np.dtype(np.uint32),
}


def _elem_dtype(elem: int) -> np.dtype[np.unsignedinteger]:
    return _ELEM_DTYPES[elem]


def _untranspose(rows: np.ndarray, n: int, elem: int) -> np.ndarray:
    """[n_embd_v, n*elem] bytes (dimension-major) -> [n, n_embd_v*elem] token-major."""
    as_elems = rows.view(_elem_dtype(elem))  # [n_embd_v, n]
    return np.ascontiguousarray(as_elems.T).view(np.uint8).reshape(n, -1)


def _check_same_layout(parts: Sequence[KVState]) -> None:
    first = parts[0]
    for p in parts[1:]:
        same = p.v_trans == first.v_trans and p.cell_ext == first.cell_ext
        if not same or p.layout() != first.layout():
            raise StateFormatError("blocks of different KV layouts cannot be joined")


def concat(parts: Sequence[KVState]) -> KVState:
    """Join consecutive pieces of one sequence (block after block)."""
    if not parts:
        raise ValueError("nothing to concatenate")
    first = parts[0]
    _check_same_layout(parts)
    if len(parts) == 1:
        return first
    layers = tuple(
        KVLayer(
            k_type=x.k_type,
            v_type=x.v_type,
            k=np.concatenate([p.layers[i].k for p in parts]),
            v=np.concatenate([p.layers[i].v for p in parts]),
            v_elem_bytes=x.v_elem_bytes,
        )
        for i, x in enumerate(first.layers)
    )
    positions = np.concatenate([p.positions for p in parts])
    tokens = _cell_tokens(parts, len(positions)) if first.cell_ext else None
    return KVState(positions=positions, v_trans=first.v_trans, layers=layers, cell_tokens=tokens)


def _cell_tokens(parts: Sequence[KVState], n: int) -> np.ndarray | None:
    """The first ``n`` cell tokens of consecutive parts (None unless every part has them)."""
    if any(p.cell_tokens is None for p in parts):
        return None
    return np.concatenate([p.cell_tokens for p in parts if p.cell_tokens is not None])[:n]


def assembled_size(parts: Sequence[KVState], n: int, cell_ext: bool | None = None) -> int:
    ext = parts[0].cell_ext if cell_ext is None else cell_ext
    return state_size(parts[0].layout(), parts[0].v_trans, n, ext)


_Span = tuple["KVState", int, int]  # (part, offset in the sequence, rows used)


class _StateWriter:
    """Writes a state buffer front to back."""

    def __init__(self, out: np.ndarray) -> None:
        self.out = out
        self.off = 0

    def put(self, fmt: str, *values: int) -> None:
        struct.pack_into(fmt, self.out, self.off, *values)  # type: ignore[arg-type]
        self.off += struct.calcsize(fmt)

    def take(self, nbytes: int) -> np.ndarray:
        """The next ``nbytes`` of the buffer, to fill in place."""
        view = self.out[self.off : self.off + nbytes]
        self.off += nbytes
        return view


def _spans(parts: list[KVState], n: int) -> list[_Span]:
    """Which rows of which part fill tokens 0..n-1."""
    spans: list[_Span] = []
    at = 0
    for p in parts:
        rows = min(p.n_tokens, n - at)
        if rows <= 0:
            break
        spans.append((p, at, rows))
        at += rows
    return spans


def _put_rows(
    w: _StateWriter, spans: list[_Span], n: int, layer: int, kind: str, *, width: int
) -> None:
    dst = w.take(n * width).reshape(n, width)
    for p, at, rows in spans:
        dst[at : at + rows] = getattr(p.layers[layer], kind)[:rows]


def _put_v_transposed(w: _StateWriter, spans: list[_Span], n: int, layer: int) -> None:
    x = spans[0][0].layers[layer]
    elem = x.v_elem_bytes
    n_embd_v = x.v_row_bytes // elem
    w.put("<iII", x.v_type, elem, n_embd_v)
    dtype = _elem_dtype(elem)
    dst = w.take(n * x.v_row_bytes).view(dtype).reshape(n_embd_v, n)
    for p, at, rows in spans:
        to_columns(p.layers[layer].v[:rows].view(dtype).reshape(rows, n_embd_v), dst, at)


def assemble(
    state: KVState | Sequence[KVState],
    seq_id: int = 0,
    n_tokens: int | None = None,
    scratch: np.ndarray | None = None,
    cell_ext: bool | None = None,
) -> np.ndarray:
    """Build the ``llama_state_seq_set_data`` buffer (uint8 array).

    ``state`` may be consecutive pieces (blocks); they are written straight
    into the buffer, cut after ``n_tokens`` tokens, without joining them first.
    With a large enough ``scratch`` array the result is a view into it: reusing
    one buffer spares the page faults of a fresh allocation on every restore.
    The cells carry the extension if ``cell_ext`` (default: if the parts do),
    with the parts' cell tokens where they have them (else ``TOKEN_NULL``).
    """
    parts = [state] if isinstance(state, KVState) else list(state)
    if not parts:
        raise ValueError("nothing to assemble")
    first = parts[0]
    _check_same_layout(parts)
    total = sum(p.n_tokens for p in parts)
    n = total if n_tokens is None else n_tokens
    if not 0 < n <= total:
        raise ValueError(f"cannot assemble {n} of {total} tokens")
    spans = _spans(parts, n)
    ext = first.cell_ext if cell_ext is None else cell_ext
    w = _StateWriter(scratch_view(assembled_size(parts, n, ext), scratch))
    w.put("<IiII", STATE_MAGIC, seq_id, 1, n)
    positions = np.concatenate([p.positions[:rows] for p, _, rows in spans])
    cells = w.take(n * (EXT_CELL if ext else PLAIN_CELL))
    write_cells(cells, positions, seq_id, ext, _cell_tokens(parts, n) if ext else None)
    w.put("<II", 1 if first.v_trans else 0, len(first.layers))
    for i, x in enumerate(first.layers):
        w.put("<iQ", x.k_type, x.k_row_bytes)
        _put_rows(w, spans, n, i, "k", width=x.k_row_bytes)
    for i, x in enumerate(first.layers):
        if first.v_trans:
            _put_v_transposed(w, spans, n, i)
        else:
            w.put("<iQ", x.v_type, x.v_row_bytes)
            _put_rows(w, spans, n, i, "v", width=x.v_row_bytes)
    if w.off != w.out.shape[0]:
        raise RuntimeError(f"assembled {w.off} of {w.out.shape[0]} bytes")
    return w.out
