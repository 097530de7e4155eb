"""KV state <-> the store's block tensors (per-layer, token-major, in their ggml dtype).

F16 and F32 rows are stored as float16/float32 tensors, so a block file
opens as real numbers with ``safetensors.numpy`` or
``safetensors.torch``; quantized types (q8_0, ...) are stored as uint8 rows.

A block of a recurrent or hybrid model may also hold its recurrent state as
it stood before its last token was decoded: the tensor ``partial``, its bytes
padded into one uint8 row per token (the store wants a row per token),
``partial_bytes`` long. A recurrent model's blocks hold no K/V layers at all.

A block of a sliding-window (iSWA) model holds its full-attention layers'
rows as ``k.{i}``/``v.{i}`` and, as tail tensors (the store's ``w.`` prefix),
its sliding layers' rows of positions ``window_first..end-1`` clipped to the
block: ``w.k.{j}``/``w.v.{j}`` (``kv.windows``). ``window_layout`` gives
their types, ``window_first`` the first position of the window held before
the block's last token, where a restore ending at the block starts it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from localkv.kv import codec
from localkv.storage.values import DETACHED, TAIL_PREFIX

__all__ = [
    "PARTIAL",
    "BlockLayout",
    "add_partial",
    "add_window",
    "block_layout",
    "block_partial",
    "end_state_bytes",
    "state_to_tensors",
    "tensors_to_state",
    "window_differs",
    "window_state",
]

PARTIAL = DETACHED  # a tensor the store reads only when asked, with its own digest
WINDOW = TAIL_PREFIX  # sliding rows: tail tensors, read from any row

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


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """A stored block's V orientation, per-layer (k_type, k_row_bytes, v_type, v_row_bytes)
    of its full-attention layers and of its sliding layers (empty without a window)."""

    v_trans: bool
    layers: tuple[codec.LayerLayout, ...]
    window: tuple[codec.LayerLayout, ...] = ()


def _layers(
    text: str, prefix: str, shapes: dict[str, tuple[int, ...]], itemsizes: dict[str, int]
) -> list[codec.LayerLayout]:
    out = []
    for i, (k_type, v_type, _) in enumerate(json.loads(text)):
        k_bytes = _row_bytes(shapes[f"{prefix}k.{i}"], itemsizes[f"{prefix}k.{i}"])
        v_bytes = _row_bytes(shapes[f"{prefix}v.{i}"], itemsizes[f"{prefix}v.{i}"])
        out.append((int(k_type), k_bytes, int(v_type), v_bytes))
    return out


def block_layout(
    meta: dict[str, str], shapes: dict[str, tuple[int, ...]], itemsizes: dict[str, int]
) -> BlockLayout:
    """A stored block's layout (see ``BlockLayout``).

    From its metadata and its tensors' shapes and item sizes, before reading
    any data (``StateFormatError`` if inconsistent).
    """
    try:
        out = _layers(meta["kv_layout"], "", shapes, itemsizes)
        window = _layers(meta.get("window_layout", "[]"), WINDOW, shapes, itemsizes)
        v_trans = meta["v_trans"] == "1"
    except (KeyError, ValueError, TypeError) as exc:
        raise codec.StateFormatError(f"block metadata lacks the KV layout: {exc}") from None
    extra = 1 if PARTIAL in shapes else 0
    n_tensors = 2 * (len(out) + len(window)) + 2 + extra
    if len(shapes) != n_tensors:  # (a recurrent block without its state holds none)
        raise codec.StateFormatError("block tensors do not match its KV layout")
    return BlockLayout(v_trans, tuple(out), tuple(window))


def add_window(
    tensors: dict[str, np.ndarray], meta: dict[str, str], rows: codec.KVState, window_first: int
) -> None:
    """Store a block's sliding rows as tail tensors (see the module docstring)."""
    layout = []
    for j, layer in enumerate(rows.layers):
        tensors[f"{WINDOW}k.{j}"] = _as_stored(np.ascontiguousarray(layer.k), layer.k_type)
        tensors[f"{WINDOW}v.{j}"] = _as_stored(np.ascontiguousarray(layer.v), layer.v_type)
        layout.append([layer.k_type, layer.v_type, layer.v_elem_bytes])
    meta["window_layout"] = json.dumps(layout)
    meta["window_first"] = str(window_first)


def window_state(tensors: dict[str, np.ndarray], meta: dict[str, str], first: int) -> codec.KVState:
    """A block's sliding rows as a parsed state of positions ``first..`` (rows as given)."""
    try:
        layout = json.loads(meta["window_layout"])
    except (KeyError, ValueError) as exc:
        raise codec.StateFormatError(f"block metadata lacks the window layout: {exc}") from None
    layers = []
    for j, (k_type, v_type, v_elem) in enumerate(layout):
        k, v = _as_rows(tensors[f"{WINDOW}k.{j}"]), _as_rows(tensors[f"{WINDOW}v.{j}"])
        layers.append(
            codec.KVLayer(
                k_type=int(k_type), v_type=int(v_type), k=k, v=v, v_elem_bytes=int(v_elem)
            )
        )
    n = layers[0].k.shape[0] if layers else 0
    positions = np.arange(first, first + n, dtype=np.int32)
    return codec.KVState(positions=positions, v_trans=meta["v_trans"] == "1", layers=tuple(layers))


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
        layers.append(
            codec.KVLayer(
                k_type=int(k_type), v_type=int(v_type), k=k, v=v, v_elem_bytes=int(v_elem)
            )
        )
    if n is None and PARTIAL in tensors:
        n = int(tensors[PARTIAL].shape[0])
    if n is None:
        raise codec.StateFormatError("block holds no layers")
    positions = np.arange(start, start + n, dtype=np.int32)
    return codec.KVState(positions=positions, v_trans=v_trans, layers=tuple(layers))


def end_state_bytes(meta: dict[str, str], nbytes: dict[str, int]) -> int:
    """The bytes a block keeps for a restore to end at it, beyond its attention rows:
    its recurrent state, or its sliding rows (``nbytes``: each tensor's size)."""
    if "partial_bytes" in meta:
        return int(meta["partial_bytes"])
    return sum(size for name, size in nbytes.items() if name.startswith(WINDOW))


def window_differs(computed: codec.KVState | None, tensors: dict[str, np.ndarray]) -> bool:
    """Whether a block's stored sliding rows differ from recomputed ones, bit for bit
    (``computed``: the rows a replay collected for the block; False without stored rows)."""
    names = sorted(n for n in tensors if n.startswith(WINDOW))
    if not names:
        return False
    if computed is None:
        return True
    mine = {f"{WINDOW}k.{j}": x.k for j, x in enumerate(computed.layers)}
    mine.update({f"{WINDOW}v.{j}": x.v for j, x in enumerate(computed.layers)})
    return sorted(mine) != names or any(
        _as_rows(tensors[n]).tobytes() != np.ascontiguousarray(mine[n]).tobytes() for n in names
    )
