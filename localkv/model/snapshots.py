"""Memory that is not a plain KV cache: its kind, partial-state captures and settling.

A model whose per-sequence memory holds a sliding window (iSWA) or a recurrent
state keeps a *partial* part that is a point value (``localkv.kv.partial``).
The session captures it where a block can end (see ``snapshot_here``), with
the tokens before the block's last token in the sequence, so a restore can
rebuild exactly that state and decode the last token alone as the probe.

**Settling (SWA).** A live context with ``swa_full`` keeps every SWA cell, but
a state write (and so a restore) holds only the window: measured on the tiny
gemma3 model, a batch decoded after a restore differs from the live run by up
to 3e-3 in a logit. So at every block-grid end the SWA session *settles*:
it writes its state, clears the memory and loads that state back, exactly
what a restore does. Every writer settles at the same positions (block-grid
ends depend on the position alone, in prefill and generation alike), so a
restore at a block-grid end is the state the uncached run holds there. Recurrent
and hybrid memories need no settling (measured: bit-identical continuations).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import numpy as np

from localkv.kv import codec
from localkv.kv.partial import PARTIAL_ONLY, MemoryKind, split
from localkv.model.native import llama_cpp

__all__ = [
    "attention_state",
    "classify",
    "memory_kind",
    "memory_of",
    "partial_before",
    "read_state_ext",
    "settle",
    "snapshot_here",
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


def snapshot_here(kind: MemoryKind, pos: int, block_size: int, probe: bool) -> bool:
    """Whether the partial part is captured before decoding token ``pos`` alone.

    SWA: at block-grid ends only (where every writer settles). Recurrent and
    hybrid: also wherever a probe is kept (segment ends), for finer reuse.
    """
    if kind == "kv":
        return False
    grid = (pos + 1) % block_size == 0
    return grid if kind == "swa" else grid or probe


def settle(ctx: Any, memory: Any) -> None:
    """Write the whole state, clear the memory, load it back (see the module docstring)."""
    state = read_state_ext(ctx, 0)
    llama_cpp.llama_memory_clear(memory, False)
    ptr = state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    read = int(llama_cpp.llama_state_seq_set_data(ctx, ptr, state.shape[0], 0))
    if read != state.shape[0]:
        raise RuntimeError(f"settling the SWA state: llama.cpp took {read} of {state.shape[0]}")


def memory_of(model: Any) -> tuple[MemoryKind | None, str | None]:
    """The model's memory kind, or None and why localkv cannot cache it."""
    try:
        return memory_kind(model), None
    except codec.StateFormatError as exc:
        return None, str(exc)


def partial_before(session: Any, pos: int, probe: bool) -> None:
    """Before token ``pos`` is decoded alone: settle (SWA) and capture the partial part."""
    kind = session.memory_kind
    if kind is None or not snapshot_here(kind, pos, session.config.block_size, probe):
        return
    if pos in session.partials:  # just restored to this state (``cache.restore``)
        return
    if kind == "swa":
        settle(session.ctx, session.memory)
    session.partials[pos] = read_state_ext(session.ctx, PARTIAL_ONLY)


def attention_state(state: np.ndarray, kind: MemoryKind | None) -> codec.KVState:
    """The attention part of a captured state, parsed (views into ``state``)."""
    if kind in ("swa", "hybrid"):
        return codec.parse(split(state, kind)[0], copy=False)
    if kind == "recurrent":
        raise codec.StateFormatError("recurrent memory holds no attention rows")
    return codec.parse(state.data, copy=False)
