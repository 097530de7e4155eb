"""The frame of a KV section of llama.cpp's sequence state: its cells and layer headers.

``llama_kv_cache::state_write`` (llama-cpp-python 0.3.36) writes a section as
``u32 n_stream`` (localkv: 1), ``u32 cell_count``, the cells, ``u32 v_trans``,
``u32 n_layer`` and the layers' K then V rows (``codec`` for the rows). A cell
is ``i32 pos, u32 n_seq_id, i32 seq_id``, or, where the cache keeps
``llama_kv_cell_ext`` (``has_cell_ext``: M-RoPE models such as Qwen3.5 and
Qwen-VL, whose ``n_pos_per_embd`` is 4, and per-layer n-gram embeddings),
``i32 pos, u32 n_seq_id, i32 x, i32 y, i32 tok, i32 seq_id``.

Nothing in the section names its cell layout, so ``kv_section`` walks it with
each and keeps the one that fits: the cells must be text cells of one sequence
and the layers must end where the buffer (or the next section) does. As seen
on the tiny qwen35 model (``tests/unit/test_codec.py``), text decoded into an
M-RoPE cache writes ``x = y = pos`` and ``tok`` = the cell's token: the codec
checks that, keeps the tokens, and writes the extension back from a block's
tokens. Cells with other 2D positions (image input) are refused.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

__all__ = [
    "ELEMENT_BYTES",
    "EXT_CELL",
    "PLAIN_CELL",
    "STATE_MAGIC",
    "TOKEN_NULL",
    "Reader",
    "StateFormatError",
    "known_type",
    "kv_section",
    "name_cell_tokens",
    "write_cells",
]

# ggml types whose elements are whole numbers of bytes: only these can sit in a
# transposed V cache (llama.cpp needs flash attention for quantized V).
ELEMENT_BYTES = {0: 4, 1: 2, 30: 2}
_EXPECTED_ROW_TYPES = {0, 1, 2, 3, 6, 7, 8, 30}
STATE_MAGIC = 0xAF143CD8
PLAIN_CELL = 12  # bytes of a cell: i32 pos, u32 n_seq_id, i32 seq_id
EXT_CELL = 24  # the same with llama_kv_cell_ext (i32 x, i32 y, i32 tok) before the seq id
TOKEN_NULL = -1  # LLAMA_TOKEN_NULL: a cell's token where it is not known yet


class StateFormatError(ValueError):
    """The state buffer is not a layout this codec knows."""


class Reader:
    """Reads a state buffer front to back, every read checked against its end."""

    def __init__(self, buf: bytes | bytearray | memoryview) -> None:
        self.buf = memoryview(buf).cast("B")
        self.off = 0

    def take(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        if self.off + size > len(self.buf):
            raise StateFormatError(f"state truncated at byte {self.off}")
        (value,) = struct.unpack_from(fmt, self.buf, self.off)
        self.off += size
        return int(value)

    def rows(self, n: int, row_bytes: int) -> np.ndarray:
        size = n * row_bytes
        if self.off + size > len(self.buf):
            raise StateFormatError(f"state truncated at byte {self.off} (need {size} bytes)")
        arr = np.frombuffer(self.buf, dtype=np.uint8, count=size, offset=self.off)
        self.off += size
        return arr.reshape(n, row_bytes)


def known_type(type_id: int) -> int:
    if type_id not in _EXPECTED_ROW_TYPES:
        raise StateFormatError(f"unknown ggml type {type_id} in KV state")
    return type_id


class _CellMisfit(StateFormatError):
    """A KV section's cells read with a cell size they do not have."""


def _bytes(buf: bytes | bytearray | memoryview | np.ndarray) -> memoryview:
    if isinstance(buf, np.ndarray):
        return np.ascontiguousarray(buf, dtype=np.uint8).data.cast("B")
    return memoryview(buf).cast("B")


def _field(buf: memoryview, off: int, fmt: str) -> int:
    if off + struct.calcsize(fmt) > len(buf):
        raise StateFormatError(f"state truncated at byte {off}")
    return int(struct.unpack_from(fmt, buf, off)[0])


def _check_cells(cells: np.ndarray, cell_bytes: int) -> None:
    """int32 cells ``[n, cell_bytes // 4]`` must be text cells of one sequence."""
    if not np.all(cells[:, 1] == 1):
        raise _CellMisfit("a KV cell belongs to several sequences")
    pos = cells[:, 0]
    if cell_bytes == EXT_CELL and not (
        np.array_equal(cells[:, 2], pos) and np.array_equal(cells[:, 3], pos)
    ):
        raise _CellMisfit("KV cells carry 2D positions other than their own (image input)")


def _walk(buf: memoryview, off: int, n: int, cell_bytes: int) -> int:
    """Where a stream of ``n`` cells of ``cell_bytes`` and its layers, at ``off``, ends."""
    size = n * cell_bytes
    if off + size > len(buf):
        raise _CellMisfit(f"state truncated at byte {off} (need {size} bytes)")
    _check_cells(np.frombuffer(buf, "<i4", size // 4, off).reshape(n, -1), cell_bytes)
    off += size
    v_trans, n_layer = _field(buf, off, "<I"), _field(buf, off + 4, "<I")
    if v_trans not in (0, 1) or not 0 < n_layer <= 4096:
        raise StateFormatError(f"KV section with v_trans {v_trans}, {n_layer} layers")
    off += 8
    for _ in range(n_layer):  # K
        known_type(_field(buf, off, "<i"))
        off += 12 + n * _field(buf, off + 4, "<Q")
    for _ in range(n_layer):  # V
        v_type = known_type(_field(buf, off, "<i"))
        if v_trans:
            elem, n_embd_v = _field(buf, off + 4, "<I"), _field(buf, off + 8, "<I")
            if ELEMENT_BYTES.get(v_type) != elem:
                raise StateFormatError(f"transposed V of type {v_type} with {elem}-byte elements")
            off += 12 + n * elem * n_embd_v
        else:
            off += 12 + n * _field(buf, off + 4, "<Q")
    if off > len(buf):
        raise StateFormatError(f"state truncated: its KV section needs {off} of {len(buf)} bytes")
    return off


def kv_section(
    buf: bytes | bytearray | memoryview | np.ndarray, off: int, end: int | None = None
) -> tuple[int, int]:
    """(where the KV section at ``off``, its ``n_stream``, ends; its cell size in bytes).

    The cell size is the one of ``PLAIN_CELL`` and ``EXT_CELL`` with which the
    cells are one sequence's text cells and the layers that follow fit the
    buffer (ending at ``end`` where given): ``StateFormatError`` saying why when
    neither fits, or both do.
    """
    view = _bytes(buf)
    n_stream = _field(view, off, "<I")
    if n_stream != 1:
        raise StateFormatError(f"{n_stream} KV streams (localkv handles exactly 1)")
    n = _field(view, off + 4, "<I")
    if n == 0:  # an empty stream is its count alone
        return off + 8, PLAIN_CELL
    fits, cell_errors, errors = [], [], []
    for cell_bytes in (PLAIN_CELL, EXT_CELL):
        try:
            stop = _walk(view, off + 8, n, cell_bytes)
            if end is not None and stop < end:
                raise StateFormatError(f"{end - stop} unexpected trailing bytes")
            if end is not None and stop > end:
                raise StateFormatError(f"state truncated: its KV section needs {stop} bytes")
            fits.append((stop, cell_bytes))
        except _CellMisfit as exc:
            cell_errors.append(f"{cell_bytes}-byte cells: {exc}")
        except StateFormatError as exc:
            errors.append(str(exc))
    if len(fits) == 1:
        return fits[0]
    if fits:
        raise StateFormatError("the KV cells fit both cell layouts")
    if errors:
        raise StateFormatError("; ".join(errors))
    raise StateFormatError(f"KV cells of no layout llama.cpp writes ({'; '.join(cell_errors)})")


def write_cells(
    out: np.ndarray, positions: np.ndarray, seq_id: int, ext: bool, tokens: np.ndarray | None
) -> None:
    """One sequence's cells into ``out`` (uint8, ``n`` cells of ``EXT_CELL`` or ``PLAIN_CELL``).

    Extended cells get ``x = y = pos`` and ``tokens`` (``TOKEN_NULL`` where None:
    ``name_cell_tokens`` names them before the state is loaded).
    """
    n = positions.shape[0]
    cells = out.view("<i4").reshape(n, EXT_CELL // 4 if ext else PLAIN_CELL // 4)
    cells[:, 0] = positions
    cells[:, 1] = 1
    cells[:, -1] = seq_id
    if ext:
        cells[:, 2] = positions
        cells[:, 3] = positions
        cells[:, 4] = TOKEN_NULL if tokens is None else tokens


def name_cell_tokens(state: np.ndarray, tokens: Sequence[int] | np.ndarray) -> None:
    """Write ``tokens`` into the extended cells of a state buffer (uint8, in place).

    ``StateFormatError`` unless its first section holds exactly one extended
    cell per token.
    """
    n, view = len(tokens), _bytes(state)
    if _field(view, 0, "<I") != STATE_MAGIC:
        raise StateFormatError("not a llama.cpp sequence state")
    count = _field(view, 12, "<I")
    if count != n:
        raise StateFormatError(f"a state of {count} cells cannot hold {n} tokens")
    if n == 0:
        return
    if kv_section(view, 8)[1] != EXT_CELL:
        raise StateFormatError("the state's KV cells carry no tokens")
    state[16 : 16 + n * EXT_CELL].view("<i4").reshape(n, EXT_CELL // 4)[:, 4] = tokens
