"""Sequence 0's raw llama.cpp state, read into and written from numpy buffers (and what
a prefill did, and why one stopped).

A restore assembles a state in memory from ``large_buffer`` (huge pages where
the system gives them), reused from one restore to the next.

A model whose KV cache keeps llama.cpp's cell extension (M-RoPE: Qwen3.5,
Qwen-VL; ``localkv.kv.section``) writes each cell's token into the state; a
state assembled from blocks gets the sequence's tokens written into its cells
before it is loaded, and a captured one must name the tokens the session holds.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from localkv.kv import codec
from localkv.kv.section import name_cell_tokens
from localkv.model.native import llama_cpp

RESTORE_SEQ = 1  # the sequence a piece of a state goes through (``append_state``)

__all__ = [
    "RESTORE_SEQ",
    "STATE_WORK",
    "ContextFullError",
    "PrefillCancelled",
    "PrefillResult",
    "StateWork",
    "append_state",
    "cell_ext_of",
    "check_cells",
    "large_buffer",
    "read_after",
    "read_state",
    "write_state",
]

# rope types whose cache keeps several positions per token (n_pos_per_embd > 1)
_MROPE = {int(llama_cpp.LLAMA_ROPE_TYPE_MROPE), int(llama_cpp.LLAMA_ROPE_TYPE_IMROPE)}


def cell_ext_of(model: Any, kind: str | None) -> bool:
    """Whether the model's KV cells carry llama.cpp's extension (``has_cell_ext``).

    llama.cpp 0.3.36 writes it for M-RoPE (``n_pos_per_embd > 1``) and for
    per-layer n-gram embeddings, which only an M-RoPE architecture has.
    Recurrent memory has no KV cells.
    """
    if kind in (None, "recurrent"):
        return False
    return int(llama_cpp.llama_model_rope_type(model)) in _MROPE


def check_cells(state: codec.KVState, tokens: Sequence[int], cell_ext: bool) -> codec.KVState:
    """``state``, a capture of the session's sequence, if its cells are the ones expected.

    ``StateFormatError`` if its cell layout is not the model's, or its cells
    name other tokens than the sequence holds.
    """
    if state.cell_ext != cell_ext:
        found, expected = ("extended", "plain") if state.cell_ext else ("plain", "extended")
        raise codec.StateFormatError(f"the KV cells are {found}, where the model's are {expected}")
    cell_tokens = state.cell_tokens
    if cell_tokens is not None and not np.array_equal(cell_tokens, tokens[: state.n_tokens]):
        raise codec.StateFormatError("the KV cells name other tokens than the sequence holds")
    return state


@dataclass(slots=True)
class StateWork:
    """State captures in this process (whole, or from a position on) and their bytes."""

    captures: int = 0
    captured_bytes: int = 0


STATE_WORK = StateWork()


def read_state(ctx: Any, seq_id: int = 0) -> np.ndarray:
    """The raw state of a sequence (0), written straight into a new uint8 array."""
    size = int(llama_cpp.llama_state_seq_get_size(ctx, seq_id))
    STATE_WORK.captures += 1
    STATE_WORK.captured_bytes += size
    arr = np.empty(size, dtype=np.uint8)
    ptr = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    written = llama_cpp.llama_state_seq_get_data(ctx, ptr, size, seq_id)
    if written != size:
        raise RuntimeError(f"state capture wrote {written} of {size} bytes")
    return arr


def read_after(ctx: Any, memory: Any, first: int) -> np.ndarray:
    """The raw state of sequence 0's positions ``first``.. alone (``append_state``'s
    context): its cells join ``RESTORE_SEQ``, which is read and emptied again."""
    llama_cpp.llama_memory_seq_rm(memory, RESTORE_SEQ, -1, -1)
    try:
        llama_cpp.llama_memory_seq_cp(memory, 0, RESTORE_SEQ, first, -1)
        return read_state(ctx, RESTORE_SEQ)
    finally:
        llama_cpp.llama_memory_seq_rm(memory, RESTORE_SEQ, -1, -1)


def write_state(
    ctx: Any,
    data: bytes | bytearray | np.ndarray,
    cell_tokens: Sequence[int] | None = None,
    seq_id: int = 0,
) -> None:
    """Load a raw state into sequence ``seq_id`` (``StateFormatError`` unless llama.cpp
    takes it all), replacing what that sequence held.

    With ``cell_tokens``, they are first written into the state's extended
    cells (in place where ``data`` is a writable array).
    """
    if isinstance(data, np.ndarray):
        arr = np.ascontiguousarray(data, dtype=np.uint8)
    else:
        arr = np.frombuffer(bytes(data), dtype=np.uint8)
    if cell_tokens is not None:
        arr = arr if arr.flags.writeable else arr.copy()
        name_cell_tokens(arr, cell_tokens)
    size = int(arr.shape[0])
    ptr = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    read = llama_cpp.llama_state_seq_set_data(ctx, ptr, size, seq_id)
    if read != size:
        raise codec.StateFormatError(f"llama.cpp accepted {read} of {size} state bytes")


def append_state(
    ctx: Any, memory: Any, data: np.ndarray, cell_tokens: Sequence[int] | None = None
) -> None:
    """Add a raw state of the positions after sequence 0's to sequence 0.

    llama.cpp loads a sequence's state only whole, emptying the sequence first;
    so the piece goes into ``RESTORE_SEQ`` (a second sequence in the same cells:
    ``loading.open_native`` makes one for plain KV memory), whose cells then join
    sequence 0. Its cells follow sequence 0's, as a prefill's would. Sequence ``RESTORE_SEQ``
    is empty after, whatever happens.
    """
    llama_cpp.llama_memory_seq_rm(memory, RESTORE_SEQ, -1, -1)
    try:
        write_state(ctx, data, cell_tokens, RESTORE_SEQ)
        llama_cpp.llama_memory_seq_cp(memory, RESTORE_SEQ, 0, -1, -1)
    finally:
        llama_cpp.llama_memory_seq_rm(memory, RESTORE_SEQ, -1, -1)


class ContextFullError(ValueError):
    """The request does not fit in the context window."""

    def __init__(self, needed: int, n_ctx: int) -> None:
        super().__init__(
            f"{needed} tokens do not fit in the context of {n_ctx} tokens "
            "(raise it with --ctx, or shorten the input)"
        )
        self.needed = needed
        self.n_ctx = n_ctx


class PrefillCancelled(Exception):
    """Prefill stopped on request; ``done`` tokens are in the KV sequence."""

    def __init__(self, done: int) -> None:
        super().__init__(f"prefill cancelled after {done} tokens")
        self.done = done


@dataclass(slots=True)
class PrefillResult:
    """What a prefill did: probe logits by absolute position of tokens decoded alone."""

    start: int
    end: int
    probes: dict[int, np.ndarray] = field(default_factory=dict)


def large_buffer(nbytes: int) -> np.ndarray:
    """A uint8 array for a restore buffer, backed by transparent huge pages where possible.

    Its pages are touched for the first time by a restore; with huge pages that
    costs one page fault per huge page instead of one per 4 KiB page.
    """
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if advice is None or not flags:
        return np.empty(nbytes, dtype=np.uint8)
    mapping = mmap.mmap(-1, nbytes, flags=flags)
    with contextlib.suppress(OSError):
        mapping.madvise(advice)
    return np.frombuffer(mapping, dtype=np.uint8)
