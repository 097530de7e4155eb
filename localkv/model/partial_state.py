"""Memory that is not a plain KV cache: its kind, partial-state captures and settling.

A model whose per-sequence memory holds a sliding window (iSWA) or a recurrent
state keeps a *partial* part that is a point value (``localkv.kv.partial``).
A restore can end only where that part can be rebuilt exactly, with the
tokens before the block's last token in the sequence, so that the last token
is decoded alone as the probe.

**Recurrent and hybrid** memories keep the recurrent state itself: the session
captures it before a block's last token where a block can end (see
``snapshot_here``): at every segment end, and on the block grid every
``snapshot_interval`` tokens, chosen so the states cost no more disk than the
attention rows between them (a state of a real model is tens of MB: storing
one per 256-token block would be many times the rows). A divergence recomputes
at most one interval. They need no settling (tests: bit-identical continuations).

**Settling (SWA).** A live context with ``swa_full`` keeps every SWA cell, but
a state write (and so a restore) holds only the window: on the tiny gemma3
model, a batch decoded after a restore differs from the live run in its
logits (tests). So where a restore may end the SWA session *settles*:
it writes its state, clears the memory and loads that state back, exactly
what a restore does. It settles before a token decoded alone at a block-grid
end, before one decoded alone right after a batch of several tokens (a
segment's end: ``settles_before``), and at an empty batch of the schedule
(``schedule.settle_marks``: before a segment's last token where the token
before it was decoded alone too, as a turn's closing tokens after its answer).
All of these depend on the position and the batch ends alone, which the chain
hash covers, so every writer (prefill, generation, a replay) settles at the
same positions, and a restore there is the state the uncached run holds. The
window written at a settle gives the block its sliding rows (``windows``): a
block stores each token's rows once, and a restore assembles the window from
the blocks that cover it.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import numpy as np

from localkv.kv import codec
from localkv.kv.partial import PARTIAL_ONLY, MemoryKind, attention_end, split
from localkv.model.native import llama_cpp

__all__ = [
    "attention_state",
    "classify",
    "memory_kind",
    "memory_of",
    "partial_after",
    "partial_before",
    "read_state_ext",
    "settle",
    "settle_at",
    "settles_before",
    "snapshot_here",
    "snapshot_interval",
    "window_of",
]

log = logging.getLogger(__name__)


def _architecture(model: Any) -> str:
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_model_meta_val_str(model, b"general.architecture", buf, len(buf))
    return buf.value.decode("utf-8", errors="replace") if n >= 0 else "unknown architecture"


def memory_kind(model: Any) -> MemoryKind:
    """What the model keeps per sequence (``StateFormatError`` for what localkv cannot cache)."""
    return classify(
        _architecture(model),
        recurrent=bool(llama_cpp.llama_model_is_recurrent(model)),
        hybrid=bool(llama_cpp.llama_model_is_hybrid(model)),
        n_swa=int(llama_cpp.llama_model_n_swa(model)),
    )


def classify(arch: str, *, recurrent: bool, hybrid: bool, n_swa: int) -> MemoryKind:
    """The memory kind of llama.cpp's flags; ``StateFormatError`` naming ``arch`` and why not.

    A hybrid with sliding-window layers would keep two partial parts (a window
    and a recurrent state) in one section that localkv does not parse.
    """
    swa = n_swa > 0
    if hybrid and swa:
        raise codec.StateFormatError(
            f"{arch}: hybrid memory with sliding-window layers is not cached "
            "(its window and recurrent state are not stored as snapshots)"
        )
    if recurrent:
        return "recurrent"
    if hybrid:
        return "hybrid"
    return "swa" if swa else "kv"


def read_state_ext(ctx: Any, flags: int) -> np.ndarray:
    """Sequence 0's state written with ``flags`` (``PARTIAL_ONLY``: the partial part)."""
    size = int(llama_cpp.llama_state_seq_get_size_ext(ctx, 0, flags))
    arr = np.empty(size, dtype=np.uint8)
    ptr = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    written = int(llama_cpp.llama_state_seq_get_data_ext(ctx, ptr, size, 0, flags))
    if written != size:
        raise RuntimeError(f"state capture wrote {written} of {size} bytes")
    return arr


# per token, the least a recurrent state's bytes are weighed against (memory with few
# or no attention rows): 32 KiB, about what a 7-8B model's KV cache keeps per token
MIN_ROW_BYTES = 32 << 10


def snapshot_interval(state_bytes: int, row_bytes: int, block_size: int) -> int:
    """Tokens between recurrent snapshots on the block grid: the fewest blocks whose
    attention rows (``row_bytes`` per token, at least ``MIN_ROW_BYTES``) outweigh a state."""
    per_block = block_size * max(row_bytes, MIN_ROW_BYTES)
    return block_size * max(1, -(-state_bytes // per_block))


def snapshot_here(kind: MemoryKind, pos: int, interval: int, segment_ends: set[int]) -> bool:
    """Whether a recurrent or hybrid partial part is captured before decoding token
    ``pos`` alone: every ``interval`` tokens, and at the end of a segment."""
    if kind in ("kv", "swa"):
        return False
    return (pos + 1) % interval == 0 or pos + 1 in segment_ends


def settles_before(pos: int, batch_ends: list[int], block_size: int) -> bool:
    """Whether an SWA session settles before decoding token ``pos`` alone.

    At a block-grid end, and right after a batch of two or more tokens: where a
    segment ends (the batch before its last token). ``batch_ends`` is how the
    sequence was batched so far (its last entry is ``pos``).
    """
    if (pos + 1) % block_size == 0:
        return True
    if not batch_ends or batch_ends[-1] != pos:
        return False
    before = batch_ends[-2] if len(batch_ends) > 1 else 0
    return pos - before >= 2


def settle(ctx: Any, memory: Any) -> np.ndarray:
    """Write the whole state, clear the memory, load it back (see the module docstring).

    Returns the state written.
    """
    state = read_state_ext(ctx, 0)
    llama_cpp.llama_memory_clear(memory, False)
    ptr = state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    read = int(llama_cpp.llama_state_seq_set_data(ctx, ptr, state.shape[0], 0))
    if read != state.shape[0]:
        raise RuntimeError(f"settling the SWA state: llama.cpp took {read} of {state.shape[0]}")
    return state


def window_of(state: np.ndarray) -> codec.KVState:
    """The sliding layers' rows of a whole SWA state (the window), parsed (views)."""
    view = state.data.cast("B")
    return codec.parse(view[attention_end(view, "swa") :], copy=False, header=False)


def memory_of(model: Any) -> tuple[MemoryKind | None, str | None]:
    """The model's memory kind, or None and why localkv cannot cache it."""
    try:
        return memory_kind(model), None
    except codec.StateFormatError as exc:
        return None, str(exc)


def partial_before(session: Any, pos: int) -> None:
    """Before token ``pos`` is decoded alone: settle (SWA) or capture the partial part."""
    kind = session.memory_kind
    if kind == "swa" and settles_before(pos, session.batch_ends, session.config.block_size):
        settle_at(session, pos)
        return
    interval, ends = session.snapshot_interval, session.segment_ends
    if kind is None or not snapshot_here(kind, pos, interval, ends):
        return
    if pos in session.partials:  # just restored to this state (``cache.restore``)
        return
    session.partials[pos] = read_state_ext(session.ctx, PARTIAL_ONLY)


def settle_at(session: Any, pos: int) -> None:
    """Settle an SWA session holding ``pos`` tokens, before its token ``pos`` (decoded
    alone next), and collect the window for the block ending after it.

    Also where the schedule says so (an empty batch: ``schedule.settle_marks``).
    """
    if session.settled_at == pos:  # just restored to this state (``cache.restore``)
        return
    block = session.config.block_size
    window = window_of(settle(session.ctx, session.memory))
    session.windows.open(pos + 1, pos // block * block, window)
    session.settled_at = pos


def partial_after(session: Any, pos: int) -> None:
    """After token ``pos`` was decoded alone: an SWA window narrower than a block has
    already dropped a settled block's last row by the next settle, so take it now."""
    if session.memory_kind != "swa" or session.settled_at != pos:
        return
    if session.windows.missing_last() and session.swa_window < session.config.block_size:
        blob = read_state_ext(session.ctx, PARTIAL_ONLY)
        session.windows.harvest(codec.parse(blob.data, copy=False))


def attention_state(state: np.ndarray, kind: MemoryKind | None) -> codec.KVState:
    """The attention part of a captured state, parsed (views into ``state``)."""
    if kind in ("swa", "hybrid"):
        return codec.parse(split(state, kind)[0], copy=False)
    if kind == "recurrent":
        raise codec.StateFormatError("recurrent memory holds no attention rows")
    return codec.parse(state.data, copy=False)
