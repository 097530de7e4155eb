"""KV state <-> the store's block tensors (per-layer, token-major, in their ggml dtype).

F16 and F32 rows are stored as float16/float32 tensors, so a block file
opens as real numbers with ``safetensors.numpy`` or
``safetensors.torch``; quantized types (q8_0, ...) are stored as uint8 rows.

A block of a model whose memory has a partial part (``kv.partial``: an SWA
window, a recurrent state) also holds that part as it stood before its last
token was decoded: the tensor ``partial``, its bytes padded into one uint8 row
per token (the store wants a row per token), ``partial_bytes`` long. A
recurrent model's blocks hold no K/V layers at all.
"""

from __future__ import annotations

import json

import numpy as np

from localkv.kv import codec
from localkv.storage.values import DETACHED

__all__ = [
    "PARTIAL",
    "add_partial",
    "block_layout",
    "block_partial",
    "state_to_tensors",
    "tensors_to_state",
]

PARTIAL = DETACHED  # a tensor the store reads only when asked, with its own digest

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
    extra = 1 if PARTIAL in shapes else 0
    if not (out or extra) or len(shapes) != 2 * len(out) + 2 + extra:
        raise codec.StateFormatError("block tensors do not match its KV layout")
    return v_trans, tuple(out)


def add_partial(
    tensors: dict[str, np.ndarray], meta: dict[str, str], blob: np.ndarray, n_tokens: int
) -> None:
    """Store a partial part in a block of ``n_tokens`` tokens (see the module docstring)."""
    width = -(-blob.shape[0] // n_tokens)
    rows = np.zeros(n_tokens * width, dtype=np.uint8)
    rows[: blob.shape[0]] = blob
    tensors[PARTIAL] = rows.reshape(n_tokens, width)
    meta["partial_bytes"] = str(int(blob.shape[0]))


def block_partial(tensors: dict[str, np.ndarray], meta: dict[str, str]) -> np.ndarray:
    """A block's partial part (``StateFormatError`` if it has none or it is damaged)."""
    try:
        rows, size = tensors[PARTIAL], int(meta["partial_bytes"])
    except (KeyError, ValueError):
        raise codec.StateFormatError("the block holds no partial state") from None
    flat = np.ascontiguousarray(rows).view(np.uint8).reshape(-1)
    if not 0 < size <= flat.shape[0] or np.any(flat[size:]):
        raise codec.StateFormatError("the block's partial state has the wrong size")
    return flat[:size]


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
    if n is None and PARTIAL in tensors:
        n = int(tensors[PARTIAL].shape[0])
    if n is None:
        raise codec.StateFormatError("block holds no layers")
    positions = np.arange(start, start + n, dtype=np.int32)
    return codec.KVState(positions, v_trans, tuple(layers))
