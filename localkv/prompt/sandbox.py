"""The sandbox a Jinja chat template renders in: transformers' environment, bounded.

A chat template is code that comes with a model file. transformers renders it in
jinja2's ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, its ``tojson`` filter
(``json.dumps`` with ``ensure_ascii=False``) and the globals ``raise_exception``
and ``strftime_now``. That sandbox keeps a template from Python's internals, not
from running for ever (two nested loops over ``range(100000)``) or from filling
memory (``'a' * 400000000``; jinja2's optimizer even computes such a constant
when the template compiles, behind ``{% if false %}``). So every render here has
a budget (``RenderLimits``), checked from inside the render:

- steps: each iteration of a loop and each call (a macro, a method, a filter, an
  intercepted operator) is one; a render may take ``steps`` and ``steps_per_item``
  more for each message and tool it is given;
- characters: what a render writes and every string or list it builds count
  against ``chars`` (and ``chars_per_input`` more for each character of the
  messages and tools it is given); an operation that can multiply a size (``*``,
  ``**``, ``+``, ``%``, ``~``, ``str.format``, ``replace``, ``join``, a width given
  to ``center`` or ``indent``, ...) is refused before it runs when its result could
  pass what is left, so it never allocates; an integer has at most
  ``MAX_DIGITS`` digits, the most Python prints;
- time: a render past ``seconds`` of wall-clock stops at its next step.

``*``, ``**``, ``+`` and ``%`` are intercepted operators and filters take the
render's context, so the optimizer folds none of them when the template
compiles: a constant is computed, and bounded, only when a render reaches it. A
render that passes a limit, or writes text that is not Unicode (a lone
surrogate, which no tokenizer takes), raises ``UnsafeTemplateError``; any other
failure of the template is the template's error (``TemplateRenderError``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes as nodes
import jinja2.sandbox
from jinja2.runtime import LoopContext
from jinja2.utils import generate_lorem_ipsum
from jinja2.visitor import NodeTransformer

from localkv.prompt.renderbudget import (
    BUDGET,
    SIZED_FILTERS,
    SMALL,
    Budget,
    RenderLimits,
    TemplateRenderError,
    UnsafeTemplateError,
    active,
    binop_size,
    built,
    characters,
    depth,
    extent,
    filter_size,
    format_size,
    joined_size,
    lorem_size,
    str_method_size,
    whole,
)

__all__ = ["BoundedEnvironment", "BoundedTemplate"]


# --------------------------------------------------------------- filters
def _gathered(name: str, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``value`` read into a list where the filter ``name`` gathers it (``join``, ``sum``
    of strings or lists), its size claimed first."""
    if name == "join" and not isinstance(value, str):
        items = list(value)
        sep = args[0] if args else kwargs.get("d", "")
        active().claim(joined_size(sep if isinstance(sep, str) else "", items))
        return items
    start = args[1] if len(args) > 1 else kwargs.get("start", 0)
    if name == "sum" and isinstance(start, str | list | tuple):
        items = list(value)
        active().claim(extent(start) + sum(extent(x) for x in items))
        return items
    return value


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` as a filter that takes a step, claims what it builds, and is never
    folded when the template compiles (it takes the render's context)."""
    passed = getattr(getattr(func, "jinja_pass_arg", None), "name", None)
    sized, gathers = name in SIZED_FILTERS, name in ("join", "sum")

    @jinja2.pass_context
    def bounded(context: jinja2.runtime.Context, value: Any, *args: Any, **kwargs: Any) -> Any:
        budget = active()
        budget.step()
        if sized:
            budget.claim(filter_size(name, value, args, kwargs))
        if gathers:
            value = _gathered(name, value, args, kwargs)
        if passed == "context":
            out = func(context, value, *args, **kwargs)
        elif passed == "eval_context":
            out = func(context.eval_ctx, value, *args, **kwargs)
        elif passed == "environment":
            out = func(context.environment, value, *args, **kwargs)
        else:
            out = func(value, *args, **kwargs)
        budget.claim(len(out) if type(out) is str else built(out))
        return out

    bounded.__name__ = getattr(func, "__name__", name)
    return bounded


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson``; indented JSON is claimed piece by piece as it is written
    (the deepest line's indentation first)."""
    if indent is None:
        return json.dumps(x, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
    budget = active()
    width = len(indent) if isinstance(indent, str) else whole(indent)
    budget.claim(width * depth(x))
    encoder = json.JSONEncoder(
        ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    parts = []
    for part in encoder.iterencode(x):
        budget.claim(len(part))
        parts.append(part)
    return "".join(parts)


def _raise_exception(message: str) -> NoReturn:
    raise TemplateRenderError(f"refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# ---------------------------------------------------------- the template
class _Counted:
    """An iterable whose every item is a step, and writes ``weight`` characters (the
    text of the loop's body)."""

    __slots__ = ("items", "weight")

    def __init__(self, items: Iterable[Any], weight: int) -> None:
        self.items, self.weight = items, weight

    def __len__(self) -> int:
        return len(self.items)  # type: ignore[arg-type]  # TypeError: LoopContext counts

    def __iter__(self) -> Iterator[Any]:
        budget, weight = active(), self.weight
        for item in self.items:
            budget.step(weight)
            yield item


def _text_in(body: list[nodes.Node]) -> int:
    """The characters of text and string constants in ``body`` (what one pass writes
    without a variable, at most)."""
    size = 0
    for node in body:
        for found in node.find_all((nodes.TemplateData, nodes.Const)):
            data = getattr(found, "data" if isinstance(found, nodes.TemplateData) else "value")
            size += len(data) if isinstance(data, str) else 0
    return size


def _helper(name: str, args: list[Any], lineno: int) -> nodes.Call:
    return nodes.Call(nodes.EnvironmentAttribute(name), args, [], None, None, lineno=lineno)


class _Bounds(NodeTransformer):
    """Rewrites a parsed template: each loop's items counted (``counted``), each ``~``
    joined by ``joined``, so both are bounded while the template renders."""

    def __init__(self) -> None:
        self.weights: list[int] = [0]

    def visit_For(self, node: nodes.For) -> nodes.Node:
        weight = _text_in(node.body)
        self.weights.append(weight)
        try:
            self.generic_visit(node)
        finally:
            self.weights.pop()
        node.iter = _helper("counted", [node.iter, nodes.Const(weight)], node.lineno)
        return node

    def visit_Call(self, node: nodes.Call) -> nodes.Node:
        self.generic_visit(node)
        if isinstance(node.node, nodes.Name) and node.node.name == "loop" and node.args:
            weight = nodes.Const(self.weights[-1])
            node.args[0] = _helper("counted", [node.args[0], weight], node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return _helper("joined", list(node.nodes), node.lineno)


class BoundedTemplate(jinja2.Template):
    """A template whose renders each have a budget (the environment's ``limits``)."""

    environment: BoundedEnvironment

    def render(self, *args: Any, **kwargs: Any) -> str:
        variables = dict(*args, **kwargs)
        token = BUDGET.set(self.environment.budget(variables))
        try:
            out = super().render(variables)
        finally:
            BUDGET.reset(token)
        try:
            out.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise UnsafeTemplateError(
                f"wrote text that is not Unicode ({exc.reason} at character {exc.start:,})"
            ) from None
        return out

    def generate(self, *args: Any, **kwargs: Any) -> Iterator[str]:
        yield self.render(*args, **kwargs)


class BoundedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """transformers' sandboxed environment, whose renders are bounded by ``limits``."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    template_class = BoundedTemplate

    def __init__(self, limits: RenderLimits | None = None) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols],
            finalize=self.written,
        )
        self.limits = limits or RenderLimits()
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now

    def budget(self, variables: dict[str, Any]) -> Budget:
        """The budget of a render given ``variables``: more for more messages and tools."""
        given = [v for k, v in variables.items() if k in ("messages", "tools") and v]
        items = sum(len(v) for v in given if hasattr(v, "__len__"))
        return Budget(self.limits, items, characters(given))

    def compile(
        self,
        source: str | nodes.Template,
        name: str | None = None,
        filename: str | None = None,
        raw: bool = False,
        defer_init: bool = False,
    ) -> Any:
        """``source`` compiled with its loops counted and its ``~`` joins bounded."""
        if isinstance(source, str):
            source = self.parse(source, name, filename)
        tree = _Bounds().visit(source)
        tree.set_environment(self)
        if raw:
            return super().compile(tree, name, filename, True, defer_init)
        return super().compile(tree, name, filename, False, defer_init)

    # ------------------------------------------------- hooks the render calls
    def counted(self, items: Iterable[Any], weight: int) -> _Counted:
        return _Counted(items, weight)

    def joined(self, *parts: Any) -> str:
        texts = [p if isinstance(p, str) else str(p) for p in parts]
        active().claim(sum(map(len, texts)))
        return "".join(texts)

    def written(self, value: Any) -> Any:
        """Each ``{{ ... }}`` a render writes (and, when the template compiles, each
        constant one, which its loop's weight counts instead)."""
        budget = BUDGET.get()
        if budget is not None:
            budget.claim(len(value) if type(value) is str else len(str(value)))
        return value

    def call_binop(
        self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any
    ) -> Any:
        kinds = (type(left), type(right))
        if kinds == (str, str) and operator == "+":
            if len(left) + len(right) > SMALL:
                active().claim(len(left) + len(right))
            return left + right
        if kinds == (int, int) and operator in ("+", "%"):  # a digit more, at most
            return self.binop_table[operator](left, right)
        active().claim(binop_size(operator, left, right))
        return self.binop_table[operator](left, right)

    def call(
        __self,
        __context: jinja2.runtime.Context,
        __obj: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        budget = active()
        budget.step()
        if getattr(__obj, "__self__", None) is __self:  # counted, joined: they claim
            kwargs.pop("_loop_vars", None)  # what jinja2 passes every call in a loop or block
            kwargs.pop("_block_vars", None)
            return __obj(*args, **kwargs)
        if isinstance(__obj, LoopContext) and args and not isinstance(args[0], _Counted):
            args = (_Counted(args[0], 0), *args[1:])
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            name = getattr(__obj, "__name__", "")
            if name == "join" and args:
                items = list(args[0])
                budget.claim(joined_size(owner, items))
                args = (items, *args[1:])
            budget.claim(str_method_size(owner, name, args, kwargs))
        elif __obj is generate_lorem_ipsum:
            budget.claim(lorem_size(*args, **kwargs))
        out = super().call(__context, __obj, *args, **kwargs)
        budget.claim(built(out))
        return out

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """``str.format`` as the sandbox wraps it, its result claimed before it is built."""
        if getattr(value, "__name__", None) not in ("format", "format_map"):
            return None
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__
        formatting = wrapped

        def bounded(*args: Any, **kwargs: Any) -> str:
            if kwargs or len(args) != 1 or value.__name__ != "format_map":
                active().claim(format_size(fmt, args, kwargs))
            else:
                active().claim(format_size(fmt, (), dict(args[0])))
            return formatting(*args, **kwargs)

        return bounded
