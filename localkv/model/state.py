"""Sequence 0's raw llama.cpp state, read into and written from numpy buffers; what a
prefill did, and why one stopped."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from localkv.kv import codec
from localkv.model.native import llama_cpp

__all__ = ["ContextFullError", "PrefillCancelled", "PrefillResult", "read_state", "write_state"]


def read_state(ctx: Any) -> np.ndarray:
    """The raw state of sequence 0, written straight into a new uint8 array."""
    size = int(llama_cpp.llama_state_seq_get_size(ctx, 0))
    arr = np.empty(size, dtype=np.uint8)
    ptr = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    written = llama_cpp.llama_state_seq_get_data(ctx, ptr, size, 0)
    if written != size:
        raise RuntimeError(f"state capture wrote {written} of {size} bytes")
    return arr


def write_state(ctx: Any, data: bytes | bytearray | np.ndarray) -> None:
    """Load a raw state into sequence 0 (``StateFormatError`` unless llama.cpp takes it all)."""
    if isinstance(data, np.ndarray):
        arr = np.ascontiguousarray(data, dtype=np.uint8)
    else:
        arr = np.frombuffer(bytes(data), dtype=np.uint8)
    size = int(arr.shape[0])
    ptr = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    read = llama_cpp.llama_state_seq_set_data(ctx, ptr, size, 0)
    if read != size:
        raise codec.StateFormatError(f"llama.cpp accepted {read} of {size} state bytes")


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
