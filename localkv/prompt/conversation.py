"""A chat conversation kept as messages *and* as the exact token list in the KV sequence."""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from localkv.model.sampling import SamplingParams
from localkv.model.session import CancelFn, FinishReason, ModelSession
from localkv.prompt.template import ChatTemplate, Message

__all__ = ["Conversation", "Streamed", "TokenStream", "stream_answer"]


@dataclass
class Conversation:
    """Messages plus the tokens that encode them; ``tokens`` only ever grows by appending."""

    messages: list[Message] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def start(self, template: ChatTemplate, system: str | None) -> None:
        self.messages.clear()
        self.tokens[:] = template.start_tokens()
        if system:
            self.add(template, Message("system", system))

    def add(self, template: ChatTemplate, message: Message) -> list[int]:
        """Append ``message``'s tokens; the segment ends inside them, as token counts of
        the conversation (``ChatTemplate.message_parts``)."""
        new, inner = template.message_parts(self.messages, message)
        self.messages.append(message)
        start = len(self.tokens)
        self.tokens.extend(new)
        return [start + end for end in inner]


class TokenStream:
    """Turns sampled token ids into text pieces, holding back split UTF-8 sequences."""

    def __init__(self, session: ModelSession) -> None:
        self.session = session
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.ids: list[int] = []
        self.text = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        piece = self._decoder.decode(self.session.token_bytes(token))
        self.text += piece
        return piece

    def flush(self) -> str:
        piece = self._decoder.decode(b"", final=True)
        self.text += piece
        return piece


@dataclass(frozen=True, slots=True, kw_only=True)
class Streamed:
    """An answer as generated: its text, the sampled ids, when tokens came, why it ended."""

    text: str
    ids: list[int]
    ttft_s: float  # from ``t0`` to the first token (to the end if there was none)
    tokens_per_s: float  # after the first token
    # "stop" (end of generation or of the turn), "length" (max tokens), "context"
    # (the context is full) or "cancelled"
    finish_reason: FinishReason = "stop"


def stream_answer(
    session: ModelSession,
    params: SamplingParams,
    t0: float,
    on_text: Callable[[str], None] | None = None,
    cancel: CancelFn | None = None,
) -> Streamed:
    """Generate after the session's sequence, sending text pieces to ``on_text``.

    It stops where ``ModelSession.generate`` does (the chat template's end of
    turn among the stop tokens) and says why in ``finish_reason``.
    """
    stream = TokenStream(session)
    t_first = 0.0
    tokens = session.generate(params, cancel=cancel)
    while True:
        try:
            token = next(tokens)
        except StopIteration as ended:
            reason: FinishReason = ended.value
            break
        if not stream.ids:
            t_first = time.perf_counter()
        piece = stream.push(token)
        if piece and on_text is not None:
            on_text(piece)
    tail = stream.flush()
    if tail and on_text is not None:
        on_text(tail)
    end = time.perf_counter()
    if not stream.ids:
        return Streamed(
            text=stream.text,
            ids=stream.ids,
            ttft_s=end - t0,
            tokens_per_s=0.0,
            finish_reason=reason,
        )
    elapsed = end - t_first
    rate = (len(stream.ids) - 1) / elapsed if len(stream.ids) > 1 and elapsed > 0 else 0.0
    return Streamed(
        text=stream.text,
        ids=stream.ids,
        ttft_s=t_first - t0,
        tokens_per_s=rate,
        finish_reason=reason,
    )
