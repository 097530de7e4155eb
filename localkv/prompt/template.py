"""Prompts as token lists, built segment by segment (DESIGN §2).

Each message is rendered with the model's chat template *as a delta* (the
rendering with the message minus the rendering without it), and only that
delta is tokenized. The conversation's earlier tokens therefore never change,
and the same document after the same system prompt always gives the same
tokens, whichever command built the request. Generated tokens are appended as
the ids that were sampled, never re-tokenized.

The deltas are rendered with placeholders for the messages' text, after a
bounded window of the history (``rendering``), and tokenized so that only the
template's markup holds special tokens (``markup``): a message's text is text,
whatever it contains.

Which template is used (the model's own, ``--chat-template``, or one chosen by
architecture) is decided in ``localkv.prompt.templatechoice``.
"""

from __future__ import annotations

import ctypes
import json
import logging
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any

from localkv.model.native import llama_cpp
from localkv.prompt.jinja import JinjaRenderer, JsonObject, TemplateRenderError
from localkv.prompt.markup import MarkupTokenizer, control_texts, special_texts
from localkv.prompt.rendering import Deltas, Piece, Renderer, pieces, window
from localkv.prompt.templatechoice import (
    ChatTemplateError,
    TemplateChoice,
    choose_template,
    refused,
    template_name,
)

if TYPE_CHECKING:
    from localkv.model.session import ModelSession

__all__ = ["ChatTemplate", "Message", "ToolCall"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call an assistant message made: ``arguments`` is JSON text."""

    id: str
    name: str
    arguments: str

    def as_template(self) -> dict[str, Any]:
        """The call as templates read it (OpenAI's shape, the arguments as an object)."""
        try:
            arguments: Any = json.loads(self.arguments)
        except ValueError:
            arguments = self.arguments
        if isinstance(arguments, dict):
            arguments = JsonObject(arguments)
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": arguments},
        }


@dataclass(frozen=True, slots=True)
class Message:
    """A role and its text, given in that order; the rest by keyword."""

    role: str  # "system" | "user" | "assistant" | "tool"
    content: str
    _: KW_ONLY
    reasoning: str | None = None  # an assistant's thinking, apart from its answer
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None  # a tool result: the call it answers
    name: str | None = None  # a tool result: the function's name


class ChatTemplate:
    """Renders messages with llama.cpp's template engine and tokenizes the deltas."""

    def __init__(self, session: ModelSession, override: str | None = None) -> None:
        """``override``: a built-in llama.cpp name or a template file (``--chat-template``).

        A Jinja template that fails the choice's check, or on the turn closing found
        here, is a ``ChatTemplateError`` that names it.
        """
        self.session = session
        self.choice: TemplateChoice = choose_template(session, override)
        self.template = self.choice.template
        self.jinja: JinjaRenderer | None = None
        self.renderer: Deltas = Renderer(self.template)
        if self.choice.jinja is not None:
            self.jinja = JinjaRenderer(
                self.choice.jinja,
                special_texts(session),
                control_texts(session.vocab),
                template_name(self.choice, session.config.model_path),
            )
            self.renderer = self.jinja
        self.tokenizer = MarkupTokenizer(session.vocab)
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(session.vocab))
        try:
            self.end_of_turn = self._end_of_turn()
        except TemplateRenderError as exc:
            raise ChatTemplateError(refused(exc, self.choice)) from None

    @property
    def name(self) -> str:
        """The built-in format's name, or "model" for the GGUF's own template."""
        return self.choice.name

    def _end_of_turn(self) -> int | None:
        """The token that closes an assistant turn; generation stops there too.

        A special (control) token that the model does not end generation on is
        added to the session's stop tokens, with a warning; a closing that
        starts with ordinary text (a space, a newline) is not: an answer would
        end at its first such piece.
        """
        closing = self.assistant_end_tokens([Message("user", "U")], "A")
        if not closing:
            return None
        token = closing[0]
        session = self.session
        if not session.is_end_of_generation(token):
            text = session.detokenize(closing, special=True).strip()
            if llama_cpp.llama_vocab_is_control(session.vocab, token):
                session.stop_tokens.add(token)
                log.warning(
                    "chat template %r closes a turn with %r, which this model does not end "
                    "generation on: answers stop there anyway",
                    self.name,
                    text,
                )
            else:
                log.warning(
                    "chat template %r closes a turn with %r, which is no special token of "
                    "this model: answers may run past the end of their turn",
                    self.name,
                    text,
                )
        return token

    def work(self) -> tuple[int, int, int, int]:
        """Renders, characters rendered, tokenize calls, characters tokenized (so far)."""
        r, t = self.renderer, self.tokenizer
        return r.renders, r.rendered_chars, t.calls, t.tokenized_chars

    def render(self, messages: Sequence[Message], *, add_assistant: bool = False) -> str:
        """The text the template renders for ``messages`` (their text in it)."""
        if self.jinja is not None:
            marked = self.jinja.marked(messages, add_assistant)
            return "".join(p.text for p in pieces(marked, messages, self.jinja.literals))
        arr = (llama_cpp.llama_chat_message * max(1, len(messages)))()
        keep: list[bytes] = []  # the C strings must outlive the call
        for i, m in enumerate(messages):
            role, content = m.role.encode(), m.content.encode("utf-8")
            keep.extend((role, content))
            arr[i].role = role
            arr[i].content = content
        size = 256 + 2 * sum(len(m.content.encode("utf-8")) for m in messages)
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_chat_apply_template(
                self.template, arr, len(messages), add_assistant, buf, size
            )
            if n < 0:
                raise ValueError("the model's chat template is not supported by llama.cpp")
            if n <= size:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = n + 1
        raise RuntimeError("chat template output kept growing")

    def start_tokens(self) -> list[int]:
        """Tokens before the first message: BOS when the model wants one, except that a
        Jinja template writes its own (``bos_token``), as transformers renders it."""
        return [] if self.jinja is not None else self.prompt_start_tokens()

    def prompt_start_tokens(self) -> list[int]:
        """Tokens before a raw prompt (BOS when the model wants one)."""
        bos = self.session.bos_token()
        return [bos] if self.add_bos and bos is not None else []

    def message_tokens(self, history: Sequence[Message], message: Message) -> list[int]:
        """The tokens that ``message`` adds after ``history``."""
        before = window(history, self.renderer.window_size)
        return self.tokens(self.renderer.delta(before or None, [*before, message]))

    def message_parts(
        self, history: Sequence[Message], message: Message
    ) -> tuple[list[int], list[int]]:
        """The tokens that ``message`` adds after ``history``, and the segment ends inside them.

        A format may render a system prompt inside the first user turn (Gemma's does).
        Where its text ends is a segment end, as it is where the format gives it a turn
        of its own, so that two requests with the same system prompt share their
        batches up to its end; only where the tokens of the rendering up to there are
        the first of the whole message's tokens (the end changes no token). Each end
        is a count of the message's tokens.
        """
        before = window(history, self.renderer.window_size)
        delta = self.renderer.delta(before or None, [*before, message])
        tokens = self.tokens(delta)
        ends = []
        for i, piece in enumerate(delta[:-1]):
            source = piece.source
            if source is None or not 0 <= source < len(before) or before[source].role != "system":
                continue  # markup, or the text of this message or of one not a system prompt
            head = self.tokens(delta[: i + 1])
            if 0 < len(head) < len(tokens) and tokens[: len(head)] == head:
                ends.append(len(head))
        return tokens, ends

    def assistant_start_tokens(self, history: Sequence[Message]) -> list[int]:
        """The tokens that open the assistant's turn after ``history``."""
        before = window(history, self.renderer.window_size)
        return self.tokens(self.renderer.delta(before, before, open_after=True))

    def assistant_end_tokens(self, history: Sequence[Message], answer: str | Message) -> list[int]:
        """The tokens that close an assistant turn whose text is ``answer``."""
        before = window(history, self.renderer.window_size)
        message = answer if isinstance(answer, Message) else Message("assistant", answer)
        after = [*before, message]
        delta = self.renderer.delta(before, after, open_before=True)
        if delta and delta[0].source == len(before):  # the answer (trimmed by some formats)
            return self.tokens(delta[1:])
        log.debug("template changes the answer text when closing the turn")
        return []

    def tokens(self, pieces: Sequence[Piece]) -> list[int]:
        """Markup with its special tokens, the messages' text as text."""
        return self.tokenizer.tokenize(pieces)

    def text_tokens(self, text: str) -> list[int]:
        """``text`` as text (an answer the server did not sample, a raw prompt)."""
        return self.tokenizer.text(text)
