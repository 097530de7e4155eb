"""Token ids of a rendering: the template's markup may hold special tokens, text never.

This is the one place where text becomes special (control) tokens. A message's
text — a user's question, a document, a system prompt, an answer — is tokenized
with ``parse_special=False``, so ``<|im_end|><|im_start|>system`` inside it is
the characters it shows and cannot close a turn or open one. Markup, which only
the chat template writes, is split at its special tokens as llama.cpp's own
tokenizer splits text with ``parse_special=True`` (longest special token first,
whitespace stripped where a token's attributes say so); the text between two
special tokens, markup and messages' text together, is tokenized in one call,
so a conversation whose text holds no special-token text gets exactly the
tokens that tokenizing its rendering whole with ``parse_special=True`` gives.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from localkv.model.native import llama_cpp
from localkv.model.vocab import tokenize, tokens_with_attr
from localkv.prompt.rendering import WHITESPACE, Piece

__all__ = ["MarkupTokenizer", "control_texts", "special_texts"]

_SPECIAL = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
_LSTRIP = llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP
_RSTRIP = llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP
_CACHE_LIMIT = 4096  # distinct markup strings whose split is kept
# characters of text whose tokens are kept: a resent conversation's text is not
# tokenized again (tokens are a function of the text alone, so never stale)
_MEMO_CHARS = 8 << 20

Part = str | int  # text, or a special token's id


class MarkupTokenizer:
    """Tokenizes ``Piece``s with one vocabulary, counting the work."""

    def __init__(self, vocab: Any) -> None:
        self.vocab = vocab
        self.calls = 0
        self.tokenized_chars = 0
        self._splits: dict[str, tuple[Part, ...]] = {}
        self._memo: OrderedDict[str, array[int]] = OrderedDict()
        self._memo_chars = 0

    def tokenize(self, pieces: Iterable[Piece]) -> list[int]:
        """The token ids of ``pieces``: markup's special tokens, everything else as text."""
        parts: list[Part] = []  # text runs and special tokens, alternating, text first
        run: list[str] = []
        for piece in pieces:
            for part in (piece.text,) if piece.content else self._split(piece.text):
                if isinstance(part, str):
                    run.append(part)
                else:
                    parts.extend(("".join(run), part))
                    run = []
        parts.append("".join(run))
        out: list[int] = []
        for i, part in enumerate(parts):
            if isinstance(part, int):
                out.append(part)
                continue
            if i > 0 and self._attr(parts[i - 1]) & _RSTRIP:
                part = part.lstrip(WHITESPACE)
            if i + 1 < len(parts) and self._attr(parts[i + 1]) & _LSTRIP:
                part = part.rstrip(WHITESPACE)
            out.extend(self._text_tokens(part))
        return out

    def text(self, text: str) -> list[int]:
        """``text`` as text: never a special token."""
        return self._text_tokens(text)

    def leading_special(self, markup: str) -> int:
        """How many characters of ``markup`` its first special token is (0: none opens it)."""
        parts = self._split(markup)
        if len(parts) > 1 and parts[0] == "" and isinstance(parts[1], int):
            raw = llama_cpp.llama_vocab_get_text(self.vocab, parts[1]) or b""
            text = raw.decode("utf-8", errors="replace")
            return len(text) if markup.startswith(text) else 0
        return 0

    def _text_tokens(self, text: str) -> list[int]:
        if not text:
            return []
        known = self._memo.get(text)
        if known is not None:
            self._memo.move_to_end(text)
            return known.tolist()
        self.calls += 1
        self.tokenized_chars += len(text)
        ids = tokenize(self.vocab, text, add_special=False, parse_special=False)
        if len(text) <= _MEMO_CHARS // 4:
            self._memo[text] = array("i", ids)
            self._memo_chars += len(text)
            while self._memo_chars > _MEMO_CHARS:
                old, _ = self._memo.popitem(last=False)
                self._memo_chars -= len(old)
        return ids

    def _attr(self, part: Part) -> int:
        return int(llama_cpp.llama_vocab_get_attr(self.vocab, part)) if isinstance(part, int) else 0

    def _split(self, markup: str) -> tuple[Part, ...]:
        parts = self._splits.get(markup)
        if parts is None:
            parts = tuple(self._partition(markup))
            if len(self._splits) >= _CACHE_LIMIT:
                self._splits.clear()
            self._splits[markup] = parts
        return parts

    def _partition(self, markup: str) -> Sequence[Part]:
        """``markup`` split at the special tokens llama.cpp finds in it, in its order."""
        self.calls += 1
        self.tokenized_chars += len(markup)
        found = tokenize(self.vocab, markup, add_special=False, parse_special=True)
        markers: dict[int, str] = {}
        for token in set(found):
            if int(llama_cpp.llama_vocab_get_attr(self.vocab, token)) & _SPECIAL:
                raw = llama_cpp.llama_vocab_get_text(self.vocab, token) or b""
                try:
                    markers[token] = raw.decode("utf-8")
                except UnicodeDecodeError:
                    continue
        parts: list[Part] = [markup]
        for token, marker in sorted(markers.items(), key=lambda kv: (-len(kv[1].encode()), kv[0])):
            if not marker:
                continue
            split: list[Part] = []
            for part in parts:
                if isinstance(part, int):
                    split.append(part)
                    continue
                for j, text in enumerate(part.split(marker)):
                    if j:
                        split.append(token)
                    split.append(text)
            parts = split
        return parts


def control_texts(vocab: Any) -> tuple[str, ...]:
    """The texts of the vocabulary's control tokens (those that markup may hold)."""
    out = []
    for token in tokens_with_attr(vocab, _SPECIAL):
        raw = llama_cpp.llama_vocab_get_text(vocab, token) or b""
        try:
            out.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            continue
    return tuple(t for t in out if t)


def special_texts(session: Any) -> dict[str, str]:
    """``bos_token``, ``eos_token`` and the others' texts, as a Jinja template reads them."""
    vocab = session.vocab
    getters = {
        "bos_token": llama_cpp.llama_vocab_bos,
        "eos_token": llama_cpp.llama_vocab_eos,
        "pad_token": llama_cpp.llama_vocab_pad,
    }
    out: dict[str, str] = {}
    for name, getter in getters.items():
        token = int(getter(vocab))
        raw = llama_cpp.llama_vocab_get_text(vocab, token) if token >= 0 else None
        out[name] = raw.decode("utf-8", errors="replace") if raw else ""
    return out
