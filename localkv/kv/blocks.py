"""KV state <-> the store's block tensors (per-layer, token-major, in their ggml dtype).

F16 and F32 rows are stored as float16/float32 tensors, so a block file
opens as real numbers with ``safetensors.numpy`` or
``safetensors.torch``; quantized types (q8_0, ...) are stored as uint8 rows.
"""

from __future__ import annotations

import json

import numpy as np

from localkv.kv import codec

__all__ = ["block_layout", "state_to_tensors", "tensors_to_state"]

_FLOAT_VIEWS: dict[int, np.dtype[np.floating]] = {0: np.dtype("<f4"), 1: np.dtype("<f2")}


def _as_stored(rows: np.ndarray, ggml_type: int) -> np.ndarray:
    dtype = _FLOAT_VIEWS.get(ggml_type)
    return rows if dtype is None else rows.view(dtype)


def _as_rows(tensor: np.ndarray) -> np.ndarray:
    arr = np.ascontiguousarray(tensor)
    return arr.view(np.uint8).reshape(arr.shape[0], -1)


def state_to_tensors(state: codec.KVState) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Named tensors and metadata for a slice of a KV state."""
    tensors: dict[str, np.ndarray] = {}
    layout = []
    for i, layer in enumerate(state.layers):
        tensors[f"k.{i}"] = _as_stored(np.ascontiguousarray(layer.k), layer.k_type)
        tensors[f"v.{i}"] = _as_stored(np.ascontiguousarray(layer.v), layer.v_type)
        layout.append([layer.k_type, layer.v_type, layer.v_elem_bytes])
    meta = {"kv_layout": json.dumps(layout), "v_trans": "1" if state.v_trans else "0"}
    return tensors, meta


def block_layout(
    meta: dict[str, str], shapes: dict[str, tuple[int, ...]], itemsizes: dict[str, int]
) -> tuple[bool, tuple[codec.LayerLayout, ...]]:
    """A stored block's V orientation and per-layer (k_type, k_row_bytes, v_type, v_row_bytes).

    From its metadata and its tensors' shapes and item sizes, before reading
    any data (``StateFormatError`` if inconsistent).
    """
    try:
        layout = json.loads(meta["kv_layout"])
        v_trans = meta["v_trans"] == "1"
        out = []
        for i, (k_type, v_type, _) in enumerate(layout):
            k_bytes = _row_bytes(shapes[f"k.{i}"], itemsizes[f"k.{i}"])
            v_bytes = _row_bytes(shapes[f"v.{i}"], itemsizes[f"v.{i}"])
            out.append((int(k_type), k_bytes, int(v_type), v_bytes))
    except (KeyError, ValueError, TypeError) as exc:
        raise codec.StateFormatError(f"block metadata lacks the KV layout: {exc}") from None
    if not out or len(shapes) != 2 * len(out) + 2:
        raise codec.StateFormatError("block tensors do not match its KV layout")
    return v_trans, tuple(out)


def _row_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    n = itemsize
    for d in shape[1:]:
        n *= d
    return n


def tensors_to_state(
    tensors: dict[str, np.ndarray], meta: dict[str, str], start: int
) -> codec.KVState:
    """Rebuild a KV state slice from a block's tensors (``StateFormatError`` if inconsistent)."""
    try:
        layout = json.loads(meta["kv_layout"])
        v_trans = meta["v_trans"] == "1"
    except (KeyError, ValueError) as exc:
        raise codec.StateFormatError(f"block metadata lacks the KV layout: {exc}") from None
    layers = []
    n = None
    for i, (k_type, v_type, v_elem) in enumerate(layout):
        try:
            k, v = _as_rows(tensors[f"k.{i}"]), _as_rows(tensors[f"v.{i}"])
        except KeyError:
            raise codec.StateFormatError(f"block lacks the tensors of layer {i}") from None
        if n is None:
            n = k.shape[0]
        if k.shape[0] != n or v.shape[0] != n:
            raise codec.StateFormatError(f"layer {i} holds a different token count")
        layers.append(codec.KVLayer(int(k_type), int(v_type), k, v, int(v_elem)))
    if n is None:
        raise codec.StateFormatError("block holds no layers")
    positions = np.arange(start, start + n, dtype=np.int32)
    return codec.KVState(positions, v_trans, tuple(layers))
