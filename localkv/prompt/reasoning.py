"""An answer's reasoning apart from its content, as the text streams in.

Reasoning models write their thinking between markers (``<think>`` …
``</think>``); a template whose assistant opening ends with the opening marker
(DeepSeek-R1's) starts the answer inside it. The split is made piece by piece,
holding back only what could be the start of a marker, so a streamed answer and
a whole one split the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ReasoningSplit", "split_reasoning"]

Part = tuple[str, str]  # ("reasoning" | "content", text)


@dataclass(kw_only=True)
class ReasoningSplit:
    markers: tuple[str, str] = ("<think>", "</think>")
    thinking: bool = False  # inside the reasoning now
    _held: str = ""
    _after_close: bool = field(default=False, repr=False)

    def push(self, text: str) -> list[Part]:
        """The parts ``text`` completes (what may start a marker is held back)."""
        self._held += text
        out: list[Part] = []
        while self._held:
            marker = self.markers[1] if self.thinking else self.markers[0]
            at = self._held.find(marker)
            if at >= 0:
                self._emit(out, self._held[:at])
                self._held = self._held[at + len(marker) :]
                self.thinking = not self.thinking
                self._after_close = not self.thinking
                continue
            keep = _partial_suffix(self._held, marker)
            self._emit(out, self._held[: len(self._held) - keep])
            self._held = self._held[len(self._held) - keep :]
            break
        return out

    def flush(self) -> list[Part]:
        out: list[Part] = []
        self._emit(out, self._held)
        self._held = ""
        return out

    def _emit(self, out: list[Part], text: str) -> None:
        if self._after_close and not self.thinking:
            text = text.lstrip()  # the blank line a model writes after its reasoning
            if not text:
                return
            self._after_close = False
        if text:
            out.append(("reasoning" if self.thinking else "content", text))


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def split_reasoning(text: str, *, thinking: bool = False) -> tuple[str | None, str]:
    """The reasoning (None: there was none) and the content of a whole answer."""
    split = ReasoningSplit(thinking=thinking)
    parts = split.push(text) + split.flush()
    reasoning = "".join(t for kind, t in parts if kind == "reasoning")
    content = "".join(t for kind, t in parts if kind == "content")
    return (reasoning if reasoning or thinking else None), content
