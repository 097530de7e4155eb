"""A model's vocabulary through llama.cpp: text to token ids and token ids to bytes.

Functions of a ``llama_vocab`` pointer, so a session and a vocabulary-only
load (``cache forget`` tokenizing a document) share one implementation.
"""

from __future__ import annotations

import ctypes
from typing import Any

from localkv.model.native import llama_cpp

__all__ = ["token_piece", "tokenize"]


def tokenize(vocab: Any, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
    """``text`` as token ids (ValueError if llama.cpp cannot tokenize it)."""
    data = text.encode("utf-8")
    cap = len(data) + 16
    for _ in range(2):  # a second try with the size llama.cpp asked for
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
        if n >= 0:
            return list(buf[:n])
        cap = -n
    raise ValueError("tokenization failed")


def token_piece(vocab: Any, token: int, *, special: bool) -> bytes:
    """The bytes a token stands for (a piece of UTF-8, possibly split mid-character)."""
    buf = ctypes.create_string_buffer(128)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    return buf.raw[:n]
