"""What a render of a chat template may cost, and what an operation would build.

A render's ``Budget`` (from ``RenderLimits``) counts steps (each loop iteration
and call) and characters (what the render writes and the strings and lists it
builds), and has a deadline; the sandbox (``localkv.prompt.sandbox``) takes a
step or claims characters from inside the render, and the budget raises
``UnsafeTemplateError`` at the first that passes what is left. The ``*_size``
functions say what an operation would build before it runs, from its operands
alone, so a result past the budget is refused without being allocated.
"""

from __future__ import annotations

import contextvars
import json
import math
import re
import string
import sys
import time
from dataclasses import dataclass
from typing import Any, NoReturn

__all__ = [
    "BUDGET",
    "ITEM",
    "MAX_DIGITS",
    "SIZED_FILTERS",
    "SMALL",
    "Budget",
    "RenderLimits",
    "TemplateRenderError",
    "UnsafeTemplateError",
    "active",
    "binop_size",
    "built",
    "characters",
    "depth",
    "extent",
    "filter_size",
    "format_size",
    "joined_size",
    "lorem_size",
    "str_method_size",
    "whole",
]

# the most digits an integer may have: what Python prints (``sys.get_int_max_str_digits``)
MAX_DIGITS = sys.get_int_max_str_digits() or 4300
# a string joined by ``+`` that counts for nothing: the template's own pieces
SMALL = 4096
# what a list's item counts for against the characters (a reference is 8 bytes)
ITEM = 8
_LOG10_2 = 0.30103


@dataclass(frozen=True, slots=True, kw_only=True)
class RenderLimits:
    """What one render of a chat template may cost."""

    steps: int = 1_000_000  # loop iterations and calls
    steps_per_item: int = 1_000  # more for each message and tool the render is given
    chars: int = 8 * 1024 * 1024  # characters written and built
    chars_per_input: int = 16  # more for each character of the messages and tools
    seconds: float = 10.0  # wall-clock

    def __post_init__(self) -> None:
        if min(self.steps, self.steps_per_item, self.chars, self.chars_per_input) < 0:
            raise ValueError("render limits are not negative")
        if not self.seconds > 0:
            raise ValueError("a render's time limit is positive")


class TemplateRenderError(ValueError):
    """A chat template that does not compile, refused a conversation, or failed.

    The message names the template (``template``, "the chat template" until a
    renderer that knows which one names it: ``named``).
    """

    def __init__(self, reason: str, template: str = "the chat template") -> None:
        super().__init__(f"{template} {reason}")
        self.reason = reason
        self.template = template

    def named(self, template: str) -> TemplateRenderError:
        """The same error, naming ``template``."""
        return type(self)(self.reason, template)


class UnsafeTemplateError(TemplateRenderError):
    """A render the sandbox stopped: past a limit, or text that is not Unicode."""


BUDGET: contextvars.ContextVar[Budget | None] = contextvars.ContextVar(
    "localkv_render_budget", default=None
)


class Budget:
    """What is left to the render in progress."""

    __slots__ = ("chars", "chars_limit", "deadline", "seconds", "steps", "steps_limit")

    def __init__(self, limits: RenderLimits, items: int, input_chars: int) -> None:
        self.steps_limit = limits.steps + limits.steps_per_item * items
        self.chars_limit = limits.chars + limits.chars_per_input * input_chars
        self.steps, self.chars = self.steps_limit, self.chars_limit
        self.seconds = limits.seconds
        self.deadline = time.monotonic() + limits.seconds

    def step(self, writes: int = 0) -> None:
        """One step, which writes ``writes`` characters."""
        self.steps -= 1
        self.chars -= writes
        if self.steps < 0 or self.chars < 0 or time.monotonic() > self.deadline:
            self._past()

    def _past(self) -> NoReturn:
        if self.steps < 0:
            raise UnsafeTemplateError(
                f"ran past its limit of {self.steps_limit:,} steps (loop iterations and calls)"
            )
        if self.chars < 0:
            self.claim(0)
        raise UnsafeTemplateError(f"ran past its time limit of {self.seconds:g} s")

    def claim(self, n: int) -> None:
        if n > self.chars or self.chars < 0:
            raise UnsafeTemplateError(
                f"would build more than its limit of {self.chars_limit:,} characters"
            )
        self.chars -= n


def active() -> Budget:
    budget = BUDGET.get()
    if budget is None:
        raise RuntimeError("a chat template is rendered only by its render() or generate()")
    return budget


# ----------------------------------------------------------------- sizes
def _digits(n: int) -> int:
    return int(abs(n).bit_length() * _LOG10_2) + 1


def extent(value: object) -> int:
    """What ``value`` counts for against the characters (a string's length, a list's
    references); 0 for what has no size."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list | tuple | dict | set | frozenset):
        return ITEM * len(value)
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return _digits(value)
    return 0


def built(value: object) -> int:
    """What a result counts for: its extent, and a list's or tuple's strings too."""
    size = extent(value)
    if isinstance(value, list | tuple):
        size += sum(len(x) for x in value if isinstance(x, str))
    return size


def whole(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _int_result(n_digits: int) -> int:
    if n_digits > MAX_DIGITS:
        raise UnsafeTemplateError(f"would build an integer of more than {MAX_DIGITS:,} digits")
    return 0


def binop_size(op: str, left: Any, right: Any) -> int:
    """What ``left op right`` would build, before it is computed."""
    ints = isinstance(left, int) and isinstance(right, int)
    if op == "*":
        if ints:
            return _int_result(_digits(left) + _digits(right))
        if isinstance(right, int) and not isinstance(left, int):
            return extent(left) * max(right, 0)
        if isinstance(left, int):
            return extent(right) * max(left, 0)
        return 0
    if op == "+":
        if ints:
            return _int_result(max(_digits(left), _digits(right)) + 1)
        return extent(left) + extent(right)
    if op == "**":
        if ints and right > 0 and abs(left) > 1:
            if right > 4 * MAX_DIGITS:  # past the limit whatever the base
                return _int_result(MAX_DIGITS + 1)
            return _int_result(int(math.log10(abs(left)) * right) + 1)
        return 0
    if op == "%" and isinstance(left, str):
        return _printf_size(left, right)
    return 0


_PRINTF = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")
_NUMBER = re.compile(r"\d+")


def _printf_size(fmt: str, args: Any) -> int:
    """At most what ``fmt % args`` writes: the format, each field as wide as the
    widest value or its width and precision."""
    values = list(args.values()) if isinstance(args, dict) else args
    values = values if isinstance(values, tuple | list) else [values]
    widest = max((extent(v) for v in values), default=0)
    size = len(fmt)
    for match in _PRINTF.finditer(fmt):
        size += widest
        for part in match.groups():
            if part == "*":
                size += sum(whole(v) for v in values)
            elif part:
                size += int(part) if len(part) < 12 else sys.maxsize
    return size


def format_size(fmt: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """At most what ``fmt.format(*args, **kwargs)`` writes."""
    values = [*args, *kwargs.values()]
    widest = max((extent(v) for v in values), default=0)
    size = 0
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return len(fmt)  # format() raises the same error
    for literal, field, spec, _ in fields:
        size += len(literal)
        if field is None:
            continue
        if spec and "{" in spec:
            raise UnsafeTemplateError("uses a format spec that is itself formatted")
        numbers = _NUMBER.findall(spec or "")
        size += widest + sum(int(n) if len(n) < 12 else sys.maxsize for n in numbers)
    return size


def _pieces(s: str, sep: Any) -> int:
    return s.count(sep) + 1 if isinstance(sep, str) and sep else len(s) // 2 + 1


def joined_size(sep: str, items: list[Any]) -> int:
    return len(sep) * max(len(items) - 1, 0) + sum(extent(x) for x in items)


def _replaced_size(s: str, old: Any, new: Any, count: Any) -> int:
    if not isinstance(old, str) or not isinstance(new, str):
        return len(s)
    found = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    return len(s) + found * len(new)


def str_method_size(s: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """What the method ``name`` of ``s`` would build, before it runs."""
    first = args[0] if args else next(iter(kwargs.values()), None)
    if name in ("center", "ljust", "rjust", "zfill"):
        return max(len(s), whole(first))
    if name == "expandtabs":
        size = whole(first) if args or kwargs else 8
        return len(s) + s.count("\t") * size
    if name == "replace":
        rest = [*args, *kwargs.values(), None, None, None]
        return _replaced_size(s, rest[0], rest[1], rest[2])
    if name in ("split", "rsplit"):
        return ITEM * _pieces(s, first) + len(s)
    if name == "splitlines":
        return ITEM * (s.count("\n") + 1) + len(s)
    if name == "translate" and isinstance(first, dict):
        widest = max((extent(v) for v in first.values()), default=1)
        return len(s) * max(widest, 1)
    return 0


SIZED_FILTERS = frozenset(
    {"center", "indent", "wordwrap", "replace", "format", "batch", "slice", "list"}
)


def filter_size(name: str, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """What the filter ``name`` would build from ``value``, before it runs."""
    rest = [*args, *kwargs.values(), None, None, None]
    text = value if isinstance(value, str) else ""
    if name == "center":
        return max(len(text), whole(rest[0]) if args or kwargs else 80)
    if name == "indent":
        width = rest[0] if args or kwargs else 4
        wide = len(width) if isinstance(width, str) else whole(width)
        return len(text) + (text.count("\n") + 1) * wide
    if name == "wordwrap":
        wrap = kwargs.get("wrapstring", args[2] if len(args) > 2 else None)
        return len(text) * (1 + len(wrap if isinstance(wrap, str) else "\n"))
    if name == "replace":
        return _replaced_size(str(value), rest[0], rest[1], rest[2])
    if name == "format":
        return _printf_size(str(value), kwargs or args)
    if name in ("batch", "slice"):
        return ITEM * (whole(rest[0]) + (len(value) if hasattr(value, "__len__") else 0))
    if name == "list" and hasattr(value, "__len__"):
        return ITEM * len(value)
    return 0


def depth(value: Any) -> int:
    """How deep lists and dicts nest in ``value``."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        if isinstance(item, dict):
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list | tuple):
            stack.extend((v, level + 1) for v in item)
    return deepest


def lorem_size(n: Any = 5, html: Any = True, min: Any = 20, max: Any = 100) -> int:
    return whole(n) * (whole(max) + 1) * 16


def characters(values: list[Any]) -> int:
    """About the characters of ``values`` (messages, tools): their length as JSON."""
    try:
        return len(json.dumps(values, ensure_ascii=False, default=str))
    except (ValueError, TypeError, RecursionError):  # circular, or keys JSON cannot hold
        return 0
