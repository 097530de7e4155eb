"""Jinja chat templates rendered as Hugging Face's ``apply_chat_template`` renders them.

The environment is the one transformers builds, with every render bounded in
steps, characters and time (``sandbox``). A template gets ``messages``,
``tools``, ``add_generation_prompt``, ``bos_token``, ``eos_token`` and the other
special tokens' texts, as transformers passes them.

A template is rendered with placeholders in place of the messages' text (see
``rendering``), so the rendering says which characters the template wrote and
which are a message's: only the template's may become special tokens. A
template that trims a message (``content.strip()``, ``| trim``) shows it by
dropping the placeholder's vertical tabs. Other strings a template writes from
the request (tool definitions, tool calls' names and arguments) go in as they
are, except that the text of any control token in them is replaced by a
placeholder too, so ``<|im_start|>`` in a tool's description is text. Earlier
reasoning is given to a template as ``reasoning_content`` when the template
reads that field, else inside the content between the template's thinking
markers, so a template that drops earlier reasoning drops it here as well.

Whatever a render fails with is a ``TemplateRenderError`` that names the
template (``UnsafeTemplateError`` where the sandbox stopped it).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from typing import Any

import jinja2

from localkv.prompt.renderbudget import TemplateRenderError, UnsafeTemplateError
from localkv.prompt.rendering import Deltas, Message
from localkv.prompt.sandbox import BoundedEnvironment

__all__ = [
    "JinjaRenderer",
    "JsonObject",
    "TemplateRenderError",
    "UnsafeTemplateError",
    "compile_template",
    "failure",
    "literal_marker",
]

THINK = ("<think>", "</think>")


@functools.cache
def _environment() -> BoundedEnvironment:
    return BoundedEnvironment()


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    """``source`` compiled in the bounded sandbox, once per process.

    Choosing a template compiles it to check it, then the renderer uses it: one
    compile, not two (a real chat template is slow to compile). A
    Template keeps no state between renders, so one object serves every renderer.
    """
    try:
        return _environment().from_string(source)
    except jinja2.TemplateError as exc:
        raise TemplateRenderError(f"does not compile: {exc}") from None
    except (RecursionError, MemoryError) as exc:  # nested past what the compiler takes
        raise TemplateRenderError(f"does not compile: {type(exc).__name__}") from None


def failure(exc: Exception, template: str) -> TemplateRenderError:
    """What a render that raised ``exc`` tells the user, naming ``template``."""
    if isinstance(exc, TemplateRenderError):
        return exc.named(template)
    return TemplateRenderError(f"failed: {type(exc).__name__}: {exc}", template)


class JsonObject(dict[str, Any]):
    """A tool call's arguments: an object to ``tojson`` (Qwen's, Llama's templates), the
    JSON text when a template adds it to a string (DeepSeek's, which expect text)."""

    def _text(self) -> str:
        return json.dumps(self, ensure_ascii=False)

    def __add__(self, other: object) -> str:
        if isinstance(other, str):
            return self._text() + other
        return NotImplemented

    def __radd__(self, other: object) -> str:
        if isinstance(other, str):
            return other + self._text()
        return NotImplemented

    def __str__(self) -> str:
        return self._text()


def literal_marker(index: int) -> str:
    """The placeholder of the ``index``-th control-token text found in a request's strings."""
    return f"\ue002{index}\ue003"


class JinjaRenderer(Deltas):
    """Renders placeholder conversations with one Jinja template, counting the work.

    A Jinja template may read any message (the first one's role, the last user
    message's index), so a delta renders the whole history (``window_size``).
    """

    window_size = None

    def __init__(
        self,
        source: str,
        special: dict[str, str],
        control_texts: Sequence[str],
        name: str = "the chat template",
    ) -> None:
        """``special``: ``bos_token`` etc. as text; ``control_texts``: the vocabulary's
        control tokens, which must not come out of a request's strings; ``name``: the
        template as errors name it."""
        self.source = source
        self.name = name
        self.template = compile_template(source)
        self.special = dict(special)
        texts = sorted((t for t in control_texts if t), key=len, reverse=True)
        self._control = re.compile("|".join(map(re.escape, texts))) if texts else None
        self.reads_reasoning = "reasoning_content" in source
        self.think = THINK if THINK[0] in source or THINK[1] in source else None
        self.literals: list[str] = []
        self.renders = 0
        self.rendered_chars = 0

    def marked(
        self,
        messages: Sequence[Message],
        add_assistant: bool = False,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        """The rendering of ``messages`` with placeholders for their text."""
        self.literals = []
        variables: dict[str, Any] = {
            **self.special,
            "messages": [self._message(i, m) for i, m in enumerate(messages)],
            "add_generation_prompt": add_assistant,
            "tools": [self._safe(t) for t in tools] if tools else None,
        }
        try:
            out = self.template.render(**variables)
        except Exception as exc:  # the template's own failure, whatever it raises
            raise failure(exc, self.name) from None
        self.renders += 1
        self.rendered_chars += len(out)
        return out

    def _message(self, i: int, m: Message) -> dict[str, Any]:
        content = f"\v\ue000{i}\ue001\v" if m.content else m.content
        out: dict[str, Any] = {"role": m.role, "content": content}
        reasoning = getattr(m, "reasoning", None)
        if reasoning:
            mark = f"\v\ue000r{i}\ue001\v"
            if self.reads_reasoning:
                out["reasoning_content"] = mark
            elif self.think is not None:
                out["content"] = f"{self.think[0]}\n{mark}\n{self.think[1]}\n\n{content}"
        calls = getattr(m, "tool_calls", ())
        if calls:
            out["tool_calls"] = [self._safe(call.as_template()) for call in calls]
        for name in ("tool_call_id", "name"):
            value = getattr(m, name, None)
            if value is not None:
                out[name] = self._safe(value)
        return out

    def _safe(self, value: Any) -> Any:
        """``value`` with control-token texts in its strings replaced by placeholders."""
        if isinstance(value, str):
            if self._control is None or not self._control.search(value):
                return value
            return self._control.sub(self._literal, value)
        if isinstance(value, dict):
            safe = {self._safe(k): self._safe(v) for k, v in value.items()}
            return JsonObject(safe) if isinstance(value, JsonObject) else safe
        if isinstance(value, list | tuple):
            return [self._safe(v) for v in value]
        return value

    def _literal(self, match: re.Match[str]) -> str:
        self.literals.append(match.group())
        return literal_marker(len(self.literals) - 1)
