"""The partial part of a sequence state: an SWA window or a recurrent state.

As llama-cpp-python 0.3.36 does it (tiny gemma3, lfm2 and mamba2 models,
``tests/unit/test_partial_state.py``), ``llama_state_seq_get_data_ext`` writes,
after the common ``u32 magic, i32 seq_id`` header:

- iSWA (Gemma 2/3, gpt-oss): the base KV section (full-attention layers, every
  cell) then the SWA KV section (the SWA layers, only the cells inside the
  window: positions ``n - window .. n - 1``); both in ``codec``'s KV layout;
- hybrid (LFM2, Granite 4, Nemotron-H, ...): the attention KV section, then the
  recurrent section;
- recurrent (Mamba): the recurrent section alone.

With ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`` only the last section is written
(the same header first). A recurrent section is ``u32 cell_count (=1), i32
pos, u32 n_seq_id (=0)``, then per-layer r/s rows of a fixed size per model:
localkv keeps it as opaque bytes, checked by its header, its position and its
size. The partial part is a point value: valid with exactly the tokens before
it and never cut to a shorter prefix.

A full state is therefore ``attention part + partial part``: ``split`` cuts a
captured state in two and ``join`` glues an assembled attention part (``codec``)
to a stored partial part.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Literal

import numpy as np

from localkv.kv import codec, section

__all__ = [
    "PARTIAL_ONLY",
    "MemoryKind",
    "PartialInfo",
    "attention_end",
    "check_partial",
    "join",
    "join_into",
    "split",
]

PARTIAL_ONLY = 1  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
HEADER = 8  # u32 magic, i32 seq_id

MemoryKind = Literal["kv", "swa", "hybrid", "recurrent"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PartialInfo:
    """What a partial part holds: its positions and size."""

    first: int  # first position it covers (recurrent: its only position)
    last: int  # last position it covers
    nbytes: int  # bytes, header included
    layout: str  # its layers' types and row sizes, for the identity


def _u32(buf: memoryview, off: int) -> int:
    if off + 4 > len(buf):
        raise codec.StateFormatError(f"state truncated at byte {off}")
    return int(struct.unpack_from("<I", buf, off)[0])


def _kv_section_end(buf: memoryview, off: int) -> int:
    """Where the KV section that starts at ``off`` (its ``n_stream``) ends."""
    return section.kv_section(buf, off)[0]


def _view(buf: bytes | bytearray | memoryview | np.ndarray) -> memoryview:
    if isinstance(buf, np.ndarray):
        return np.ascontiguousarray(buf, dtype=np.uint8).data.cast("B")
    return memoryview(buf).cast("B")


def attention_end(buf: bytes | bytearray | memoryview | np.ndarray, kind: MemoryKind) -> int:
    """Bytes of the attention part of a full state (header included)."""
    view = _view(buf)
    if _u32(view, 0) != codec.STATE_MAGIC:
        raise codec.StateFormatError("not a llama.cpp sequence state")
    if kind == "recurrent":
        return HEADER
    end = _kv_section_end(view, HEADER)
    if kind == "kv":
        if end != len(view):
            raise codec.StateFormatError("a plain KV state with more sections")
        return end
    if end >= len(view):
        raise codec.StateFormatError(f"{kind} state without its partial part")
    return end


def split(
    buf: bytes | bytearray | memoryview | np.ndarray, kind: MemoryKind
) -> tuple[memoryview, bytes]:
    """(attention part, a state buffer of its own; partial part, header included)."""
    view = _view(buf)
    end = attention_end(view, kind)
    partial = bytes(view[:HEADER]) + bytes(view[end:])
    return view[:end], partial


def join(attention: np.ndarray, partial: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """A full state: an assembled attention part (header included) + a partial part."""
    tail = _view(partial)[HEADER:]
    out = np.empty(attention.shape[0] + len(tail), dtype=np.uint8)
    out[: attention.shape[0]] = attention
    out[attention.shape[0] :] = np.frombuffer(tail, dtype=np.uint8)
    return out


def join_into(buffer: np.ndarray, partial: bytes | bytearray | np.ndarray) -> np.ndarray:
    """``join`` in place: ``buffer`` holds the attention part, then room for the partial part."""
    tail = _view(partial)[HEADER:]
    if len(tail) > buffer.shape[0]:
        raise codec.StateFormatError("no room for the partial part after the attention part")
    buffer[buffer.shape[0] - len(tail) :] = np.frombuffer(tail, dtype=np.uint8)
    return buffer


def check_partial(
    blob: bytes | bytearray | memoryview | np.ndarray, kind: MemoryKind, n_tokens: int
) -> PartialInfo:
    """Check that ``blob`` is a partial part taken with ``n_tokens`` tokens in the sequence.

    ``StateFormatError`` unless its header, positions and sizes are consistent:
    an SWA part must end at position ``n_tokens - 1`` with consecutive cells, a
    recurrent part must sit at ``n_tokens - 1``.
    """
    view = _view(blob)
    if len(view) < HEADER + 12 or _u32(view, 0) != codec.STATE_MAGIC:
        raise codec.StateFormatError("not a partial sequence state")
    if kind == "swa":
        if _kv_section_end(view, HEADER) != len(view):
            raise codec.StateFormatError("SWA part of the wrong size")
        state = codec.parse(view, copy=False)
        cell_pos = state.positions
        first, last = int(cell_pos[0]), int(cell_pos[-1])
        if last != n_tokens - 1 or not np.array_equal(cell_pos, np.arange(first, last + 1)):
            raise codec.StateFormatError(
                f"SWA part holds positions {first}..{last}, expected up to {n_tokens - 1}"
            )
        layout = ";".join(f"{a}/{b}/{c}/{d}" for a, b, c, d in state.layout())
        ext = ":ext" if state.cell_ext else ""
        return PartialInfo(
            first=first, last=last, nbytes=len(view), layout=f"v{int(state.v_trans)}{ext}:{layout}"
        )
    if kind not in ("hybrid", "recurrent"):
        raise codec.StateFormatError(f"a {kind} memory has no partial part")
    if len(view) < HEADER + 32:  # cell header, s_trans, n_layer, a first row's type and size
        raise codec.StateFormatError("recurrent part truncated")
    cells, pos, n_seq = _u32(view, HEADER), _u32(view, HEADER + 4), _u32(view, HEADER + 8)
    if cells != 1 or n_seq != 0:
        raise codec.StateFormatError(f"recurrent part with {cells} cells")
    if pos != n_tokens - 1:
        raise codec.StateFormatError(f"recurrent part at position {pos}, expected {n_tokens - 1}")
    head = bytes(view[HEADER + 12 : HEADER + 32]).hex()
    return PartialInfo(first=pos, last=pos, nbytes=len(view), layout=f"rs:{head}")
