"""A conversation rendered whole, as its Jinja template renders it, then tokenized.

A Jinja template may change earlier text when a message is added (drop earlier
reasoning, move the system prompt, date the first turn), so a request is not
built by appending deltas: the whole conversation is rendered once, with the
assistant's opening after it, and its pieces are tokenized (``markup``: the
template's markup may hold special tokens, the messages' text never does).
Reuse is then the longest exact common prefix of these tokens with what is
cached, whatever the template did.

The segment ends the batch schedule relies on come from the rendering: where
each message's own rendering ends inside the whole one (found by rendering the
conversation up to it; so a prefilled system prompt and document end where a
chat's do), where a special token follows, and after an assistant's opening. An
assistant's text follows its opening as it did when it was generated: ``recall``
gives the ids that were sampled for it (after the same tokens), else it is
tokenized with the text around it up to the next special token, as the whole
rendering is; either way it is a span decoded one token at a time, as sampled
tokens are.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from localkv.prompt.renderbudget import UnsafeTemplateError
from localkv.prompt.rendering import Piece, pieces

if TYPE_CHECKING:
    from localkv.prompt.template import ChatTemplate, Message

__all__ = ["Rendered", "Room", "render_whole"]

Recall = Callable[[Sequence[int], str], Sequence[int] | None]


class Room(Protocol):
    """What a prompt may cost (``localkv.server.limits.Budget``)."""

    @property
    def limit(self) -> int: ...
    def before_chars(self, n_tokens: int, n_chars: int) -> None: ...
    def after(self, n_tokens: int) -> None: ...
    def too_long(self, n_tokens: int, *, exact: bool) -> Exception: ...


# conversations of up to this many messages get a segment end after each message
# (one render of each prefix); longer ones only after each assistant's opening, so
# a request costs work linear in its messages
MAX_SEGMENTED = 64


@dataclass(kw_only=True)
class Rendered:
    """A whole conversation's tokens, its segment ends and its assistants' spans."""

    tokens: list[int] = field(default_factory=list)
    boundaries: list[int] = field(default_factory=list)
    generated: list[tuple[int, int]] = field(default_factory=list)
    thinking: bool = False  # the assistant's opening opens its reasoning (``<think>``)
    # each segment end: the highest index of a message whose text comes before it
    # (-1: none), so where a message ends is known from this one rendering
    reach: dict[int, int] = field(default_factory=dict)


def render_whole(
    template: ChatTemplate,
    messages: Sequence[Message],
    *,
    tools: Sequence[dict[str, Any]] | None = None,
    recall: Recall | None = None,
    room: Room | None = None,
) -> Rendered:
    """``messages`` and the assistant's opening as ``template`` renders them, as tokens."""
    renderer = template.jinja
    if renderer is None:
        raise ValueError("a whole rendering needs a Jinja template")
    if room is not None and len(messages) > room.limit:  # a message renders a token at least
        raise room.too_long(len(messages), exact=False)
    marked = renderer.marked(messages, True, tools)
    literals = list(renderer.literals)
    cuts = _segments(template, messages, marked, tools)
    segments = [(pieces(marked[a:b], messages, literals), after) for a, b, after in cuts]
    if room is not None:
        n_chars = sum(len(p.text) for parts, _ in segments for p in parts if p.content)
        room.before_chars(0, n_chars)
    out = Rendered()
    tokens = _Tokens(template, messages, out, recall, room)
    for parts, after in segments:
        tokens.run(parts, after)
    out.boundaries = sorted(set(out.boundaries))
    think = renderer.think
    out.thinking = think is not None and marked.rstrip().endswith(think[0])
    return out


class _Cut(NamedTuple):
    """One segment of the whole rendering: characters ``start:end``, after message ``after``."""

    start: int
    end: int
    after: int  # the index of the message whose rendering ends there


def _segments(
    template: ChatTemplate,
    messages: Sequence[Message],
    marked: str,
    tools: Sequence[dict[str, Any]] | None,
) -> list[_Cut]:
    """Where the whole rendering is cut into segments: where each message's own
    rendering ends (as ``ChatTemplate.message_tokens`` builds a conversation, so a
    prefilled prefix and a chat share their schedule), except before an assistant's
    answer (its opening ends that segment) and where the template changed what it
    had rendered; only before a special token, where a cut changes no token. Each
    segment as (start, end, the index of the message whose rendering ends there)."""
    renderer = template.jinja
    if renderer is None:
        raise ValueError("a whole rendering needs a Jinja template")
    cuts, after = [0], [-1]
    for i in range(len(messages) - 1 if len(messages) <= MAX_SEGMENTED else 0):
        if messages[i + 1].role == "assistant":
            continue
        try:
            prefix = renderer.marked(messages[: i + 1], False, tools)
        except UnsafeTemplateError:  # stopped by its limits: so is the request
            raise
        except ValueError:  # a template that refuses a part of the conversation
            continue
        at = len(prefix)
        if cuts[-1] < at < len(marked) and marked.startswith(prefix):
            following = pieces(marked[at:], messages, ())
            head = following[0] if following else None
            special = head is not None and not head.content
            if special and head is not None and template.tokenizer.leading_special(head.text):
                cuts.append(at)
                after.append(i)
    cuts.append(len(marked))
    after.append(len(messages) - 1)
    return [_Cut(a, b, i) for (a, b), i in zip(itertools.pairwise(cuts), after[1:], strict=True)]


class _Tokens:
    def __init__(
        self,
        template: ChatTemplate,
        messages: Sequence[Message],
        out: Rendered,
        recall: Recall | None,
        room: Room | None,
    ) -> None:
        self.tokenizer = template.tokenizer
        self.messages = messages
        self.out = out
        self.recall = recall
        self.room = room
        self.group: list[Piece] = []
        self.answer_at: int | None = None  # where an answer tokenized from its text starts
        self.seen = -1  # the highest index of a message whose text was taken so far
        # an earlier message's text that ends inside the group (a system prompt the
        # template writes into the first user turn): its tokens alone, and the reach there
        self.inner: list[tuple[list[int], int]] = []

    def boundary(self, at: int, after: int) -> None:
        """A segment end at token ``at``, after message ``after``'s rendering (and the text
        of every message taken so far: ``Rendered.reach``)."""
        reach = max(after, self.seen)
        self.out.boundaries.append(at)
        self.out.reach[at] = min(self.out.reach.get(at, reach), reach)

    def flush(self) -> None:
        tokens = self.out.tokens
        start = len(tokens)
        new = self.tokenizer.tokenize(self.group)
        tokens.extend(new)
        self.group = []
        for head, reach in self.inner:  # only where the end changes no token
            if 0 < len(head) < len(new) and new[: len(head)] == head:
                self.out.boundaries.append(start + len(head))
                self.out.reach[start + len(head)] = reach
        self.inner = []
        if self.answer_at is not None:  # an answer's text ends in this group
            self.out.generated.append((self.answer_at, len(tokens)))
            self.answer_at = None
        if self.room is not None:
            self.room.after(len(tokens))

    def run(self, parts: Sequence[Piece], after: int) -> None:
        """Tokenize a segment, which ends after message ``after``'s rendering.

        A system prompt's text inside it (written into the first user turn, as Gemma's
        template does) ends a segment where it ends, as a system prompt of its own turn
        does, where the tokens up to there are the first of the group's.
        """
        after_text = False
        for i, piece in enumerate(parts):
            if piece.content and self._is_answer(piece):
                self._answer(piece)
                self._saw(piece)
                after_text = True
                continue
            if not piece.content and after_text:
                piece = self._close(piece)
            after_text = piece.content and piece.source is not None and piece.source >= 0
            if piece.text:
                self.group.append(piece)
            self._saw(piece)
            if self._carried(piece, after) and i + 1 < len(parts) and self.answer_at is None:
                self.inner.append((self.tokenizer.tokenize(self.group), self.seen))
        self.flush()
        self.boundary(len(self.out.tokens), after)

    def _carried(self, piece: Piece, after: int) -> bool:
        """Whether ``piece`` is the text of a system message before message ``after``."""
        source = piece.source
        return (
            source is not None
            and 0 <= source < after
            and bool(piece.text)
            and self.messages[source].role == "system"
        )

    def _saw(self, piece: Piece) -> None:
        if piece.content and piece.source is not None:
            self.seen = max(self.seen, piece.source)

    def _close(self, markup: Piece) -> Piece:
        """After a message's text: an answer's span ends at the special token closing it.

        An answer tokenized from its text is tokenized with the text around it up to
        the next special token, as the whole rendering is.
        """
        head = self.tokenizer.leading_special(markup.text)
        if head:
            self.flush()  # the answer's span, if one is open, ends here
        return markup

    def _is_answer(self, piece: Piece) -> bool:
        source = piece.source
        return (
            source is not None
            and source >= 0
            and not piece.reasoning
            and self.messages[source].role == "assistant"
        )

    def _answer(self, piece: Piece) -> None:
        """An assistant's text: its sampled ids after its opening, when they are known;
        else tokenized with the text before it (as the whole rendering would be), its
        span starting at the opening's last token."""
        out, group = self.out, self.group
        start = len(out.tokens)
        self.flush()
        opened = len(out.tokens)
        if self._recalled(piece.text):
            self.boundary(opened, (piece.source or 0) - 1)  # after the messages before it
            return
        del out.tokens[start:]
        self.group = [*group, piece]
        self.answer_at = max(start, opened - 1)

    def _recalled(self, text: str) -> bool:
        """Whether the ids sampled for the answer ``text`` here are known (then added)."""
        tokens = self.out.tokens
        ids = self.recall(tokens, text) if self.recall is not None else None
        if ids is None:
            return False
        if ids:
            self.out.generated.append((len(tokens), len(tokens) + len(ids)))
            tokens.extend(ids)
        if self.room is not None:
            self.room.after(len(tokens))
        return True
