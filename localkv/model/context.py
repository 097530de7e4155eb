"""The context a command opens when ``--ctx`` is not given: the model's own.

The rule: the length the model was trained for (its GGUF ``<arch>.context_length``),
lowered, in steps of 256 tokens, until the KV cache at that length (every layer's
keys and values in f16, as if none were a sliding window) fits in a quarter of the
memory available now (``$LOCALKV_MEMORY`` bytes where it is set); never below
``FLOOR`` tokens (or the trained length, where it is shorter). A model whose header
says neither gets ``FLOOR``. Read from the header alone (``localkv.model.ggufmeta``),
before llama.cpp loads anything.
"""

from __future__ import annotations

import os
from pathlib import Path

from localkv.model.ggufmeta import (
    GGUFError,
    GGUFMetadata,
    read_gguf_metadata,
    read_gguf_values_before,
)

__all__ = [
    "ENV_MEMORY",
    "FLOOR",
    "MEMORY_SHARE",
    "available_memory",
    "context_for",
    "default_context",
    "kv_bytes_per_token",
    "trained_length",
]

FLOOR = 4096  # the context before it followed the model
MEMORY_SHARE = 4  # the KV cache may take 1/MEMORY_SHARE of the available memory
_STEP = 256  # llama.cpp rounds a context up to a multiple of this
_F16 = 2
ENV_MEMORY = "LOCALKV_MEMORY"  # bytes of memory to assume available, instead of reading it


def default_context(path: Path, available: int | None = None) -> int:
    """The context for the model at ``path`` (see the module's rule)."""
    try:
        meta = _hyperparameters(path)
    except (OSError, GGUFError):
        return FLOOR
    return context_for(meta, available)


def context_for(meta: GGUFMetadata, available: int | None = None) -> int:
    """The context for the model whose header is ``meta`` (see the module's rule)."""
    trained = trained_length(meta)
    if trained is None:
        return FLOOR
    per_token = kv_bytes_per_token(meta)
    if per_token is None:
        return min(trained, FLOOR)
    memory = available_memory() if available is None else available
    fits = (memory // MEMORY_SHARE // per_token) // _STEP * _STEP if memory else trained
    return max(min(trained, fits), min(trained, FLOOR))


def _hyperparameters(path: Path) -> GGUFMetadata:
    """The header's values before its vocabulary (where converters write the model's
    shape), or the whole header where the shape is not there."""
    head = GGUFMetadata(version=3, values=read_gguf_values_before(path, "tokenizer."), tensors=())
    if _int(head, "context_length") is not None and _int(head, "block_count") is not None:
        return head
    return read_gguf_metadata(path)


def trained_length(meta: GGUFMetadata) -> int | None:
    """``<arch>.context_length``: the context the model was trained for."""
    return _int(meta, "context_length")


def kv_bytes_per_token(meta: GGUFMetadata) -> int | None:
    """Bytes of f16 keys and values one token takes over every layer (None: unknown)."""
    layers = _int(meta, "block_count")
    heads = _int(meta, "attention.head_count")
    kv_heads = _int(meta, "attention.head_count_kv") or heads
    width = _int(meta, "embedding_length")
    if not layers or not kv_heads:
        return None
    head = width // heads if width and heads else None
    key = _int(meta, "attention.key_length") or head
    value = _int(meta, "attention.value_length") or head
    if not key or not value:
        return None
    return layers * kv_heads * (key + value) * _F16


def available_memory() -> int | None:
    """Bytes of memory available now: ``$LOCALKV_MEMORY`` where it is a positive count
    of bytes, else ``MemAvailable``, else the physical memory."""
    given = os.environ.get(ENV_MEMORY, "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None


def _int(meta: GGUFMetadata, key: str) -> int | None:
    """``<arch>.key`` as an int; for a per-layer array, its largest entry."""
    value = meta.get(f"{meta.architecture}.{key}")
    if isinstance(value, tuple):
        value = max((v for v in value if isinstance(v, int)), default=None)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value
