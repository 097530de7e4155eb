"""A chat conversation kept as messages *and* as the exact token list in the KV sequence."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from localkv.prompt import ChatTemplate, Message
from localkv.sampling import SamplingParams
from localkv.session import ModelSession

__all__ = ["Conversation", "TokenStream"]


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
        new = template.message_tokens(self.messages, message)
        self.messages.append(message)
        self.tokens.extend(new)
        return new


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


def reply(
    session: ModelSession,
    template: ChatTemplate,
    conv: Conversation,
    params: SamplingParams,
    *,
    cancel: Callable[[], bool] | None = None,
) -> Iterator[str]:
    """Generate the assistant's turn after ``conv`` (whose tokens are in ``session``).

    Yields text pieces; when done, the answer and its closing tokens are part of
    ``conv`` and of the session's sequence bookkeeping.
    """
    opener = template.assistant_start_tokens(conv.messages)
    if opener:
        session.prefill(opener, block_size=max(1, len(opener)))
        conv.tokens.extend(opener)
    stream = TokenStream(session)
    for token in session.generate(params, cancel=cancel):
        piece = stream.push(token)
        if piece:
            yield piece
    tail = stream.flush()
    if tail:
        yield tail
    conv.tokens.extend(stream.ids)
    history = list(conv.messages)
    conv.messages.append(Message("assistant", stream.text))
    closing = template.assistant_end_tokens(history, stream.text)
    # the sequence holds every generated id except the last one sampled
    # (generation stopped before decoding it); bring it in line with conv.tokens
    pending = conv.tokens[session.n_tokens :] + closing
    conv.tokens.extend(closing)
    if pending:
        session.prefill(pending, block_size=max(1, len(pending)))
