"""What a request may cost before it is refused: the context's room, and its client.

A prompt is built message by message; before each message is tokenized the
budget checks that the client is still there and that the message's text can
still fit (a token never stands for more than ``MAX_BYTES_PER_TOKEN`` bytes, so
text longer than that many per token of room cannot), and after it that the
tokens so far fit. A prompt that cannot fit is refused with a 413 as soon as
that is known, not after all of it is rendered and tokenized.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from localkv.prompt.request import MAX_BYTES_PER_TOKEN
from localkv.server.errors import RAISE_CTX, ApiError

__all__ = ["Budget", "disconnected"]


def disconnected() -> ApiError:
    """The error of a request whose client went away (nobody reads it)."""
    return ApiError(499, "the client disconnected", code="client_disconnected")


@dataclass(frozen=True, slots=True)
class Budget:
    """A prompt must leave room in ``n_ctx`` for the answer's first token (a prefill's
    ``documents``, which no answer follows, may fill it)."""

    n_ctx: int
    cancelled: Callable[[], bool] = lambda: False
    param: str = "messages"

    @property
    def answered(self) -> bool:
        """Whether an answer follows the prompt (not a prefill's documents)."""
        return self.param != "documents"

    @property
    def limit(self) -> int:
        """The most tokens a prompt may have."""
        return self.n_ctx - 1 if self.answered else self.n_ctx

    def before_text(self, n_tokens: int, text: str) -> None:
        """Before ``text`` is tokenized after ``n_tokens``: still wanted, and it can fit."""
        self.before_chars(n_tokens, len(text))

    def before_chars(self, n_tokens: int, n_chars: int) -> None:
        """Before ``n_chars`` characters of text are tokenized after ``n_tokens``."""
        if self.cancelled():
            raise disconnected()
        room = self.limit - n_tokens
        # characters are at most the bytes: a bound that needs no encoding
        if n_chars > max(0, room) * MAX_BYTES_PER_TOKEN:
            least = n_tokens + n_chars // MAX_BYTES_PER_TOKEN
            raise self.too_long(least, exact=False)

    def after(self, n_tokens: int) -> None:
        """After tokenizing: the prompt's ``n_tokens`` so far still fit."""
        if n_tokens > self.limit:
            raise self.too_long(n_tokens, exact=True)

    def too_long(self, n_tokens: int, *, exact: bool) -> ApiError:
        count = f"{n_tokens:,}" if exact else f"at least {n_tokens:,}"
        with_answer = "with the answer's first token " if self.answered else ""
        return ApiError(
            413,
            f"the prompt has {count} tokens; {with_answer}it does not fit "
            f"in the context of {self.n_ctx:,} tokens ({RAISE_CTX})",
            param=self.param,
            code="context_length_exceeded",
            too_long=(n_tokens, self.limit),
        )
