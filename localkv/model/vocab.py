"""A model's vocabulary through llama.cpp: text to token ids and token ids to bytes.

Functions of a ``llama_vocab`` pointer, so a session and a vocabulary-only
load (``cache forget`` tokenizing a document) share one implementation.
"""

from __future__ import annotations

import ctypes
from array import array
from typing import Any

from localkv.model.native import llama_cpp

try:
    from localkv.model import _vocab
except ImportError:  # not built (setup.py: it is optional): asked token by token
    _vocab = None  # type: ignore[assignment]

__all__ = ["token_piece", "tokenize", "tokens_with_attr"]


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


def tokens_with_attr(vocab: Any, mask: int) -> list[int]:
    """The ids of the tokens whose llama.cpp attributes share a bit with ``mask``.

    Scanned in C (``_vocab``, the GIL released) where it was built: through
    ctypes the scan costs a microsecond per token of the vocabulary.
    """
    n = int(llama_cpp.llama_vocab_n_tokens(vocab))
    address = vocab if isinstance(vocab, int) else getattr(vocab, "value", None)
    if _vocab is not None and address:
        get_attr = ctypes.cast(llama_cpp.llama_vocab_get_attr, ctypes.c_void_p).value
        found = array("i")
        found.frombytes(_vocab.scan(get_attr or 0, address, n, mask))
        return found.tolist()
    return [t for t in range(n) if int(llama_cpp.llama_vocab_get_attr(vocab, t)) & mask]
