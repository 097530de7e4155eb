"""Sequence 0's raw llama.cpp state, read into and written from numpy buffers."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from localkv.kv import codec
from localkv.model.native import llama_cpp

__all__ = ["read_state", "write_state"]


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
