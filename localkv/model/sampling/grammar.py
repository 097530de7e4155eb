"""Grammars for sampling: GBNF text checked before llama.cpp parses it, and JSON schemas as GBNF.

llama.cpp parses GBNF recursively: groups nested deep enough overflow the
thread's stack (a segmentation fault, not an error), so ``check_gbnf``
refuses grammars that nest deeper than ``MAX_NESTING`` or are longer than
``MAX_GRAMMAR_CHARS`` before llama.cpp sees them. What llama.cpp itself
refuses (a syntax error, an undefined rule, no ``root``, left recursion) is
found when the sampler is built (``chain.check_grammar``).

JSON schemas become GBNF through llama-cpp-python's converter
(``llama_cpp.llama_grammar.json_schema_to_gbnf``, a port of llama.cpp's own):
whatever it cannot convert is a ``GrammarError`` naming the reason. It
expands string lengths and array sizes into nested groups, so bounds above
``MAX_REPEAT`` are refused before it runs. It does not enforce ``minimum``
and ``maximum`` of numbers, nor ``format`` beyond dates, times and uuids. Its
translation of a string's ``pattern`` is replaced: a pattern becomes a
deterministic automaton (``pattern``), so no pattern makes llama.cpp follow
many readings of a token, and one that cannot be made one within bounds is a
``GrammarError`` naming it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

from localkv.model.sampling.errors import GrammarError

__all__ = [
    "MAX_GRAMMAR_CHARS",
    "MAX_NESTING",
    "MAX_REPEAT",
    "GrammarError",
    "check_gbnf",
    "json_object_grammar",
    "json_schema_grammar",
]

MAX_GRAMMAR_CHARS = 1_000_000
MAX_NESTING = 1_000
MAX_REPEAT = 1_000  # minLength, maxLength, minItems, maxItems: the converter nests each one
_REPEAT_KEYS = ("minLength", "maxLength", "minItems", "maxItems")
_NAMED_KEYS = ("properties", "$defs", "definitions", "patternProperties")


def check_gbnf(text: object) -> str:
    """``text`` when llama.cpp's parser may be given it, else ``GrammarError``."""
    if not isinstance(text, str):
        raise GrammarError(f"a grammar is GBNF text, not {type(text).__name__}")
    if not text.strip():
        raise GrammarError("the grammar is empty")
    if "\x00" in text:
        raise GrammarError("the grammar holds a NUL character")
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(
            f"the grammar is {len(text):,} characters long (at most {MAX_GRAMMAR_CHARS:,})"
        )
    depth = _nesting(text)
    if depth > MAX_NESTING:
        raise GrammarError(f"the grammar nests groups {depth:,} deep (at most {MAX_NESTING:,})")
    return text


def _nesting(text: str) -> int:
    """How deep ``(`` groups nest, outside literals, character classes and comments."""
    depth = deepest = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in '"[':
            i = _skip_quoted(text, i + 1, '"' if c == '"' else "]")
            continue
        if c == "#":
            end = text.find("\n", i)
            i = n if end < 0 else end
            continue
        if c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth = max(0, depth - 1)
        i += 1
    return deepest


def _skip_quoted(text: str, i: int, close: str) -> int:
    """The index after the ``close`` that ends a literal or class starting at ``i``."""
    n = len(text)
    while i < n:
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == close:
            return i + 1
        i += 1
    return n  # unterminated: llama.cpp's parser says so


def json_schema_grammar(schema: Mapping[str, Any] | str) -> str:
    """GBNF for the JSON texts that ``schema`` (an object, or its JSON text) describes."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except RecursionError:
            raise GrammarError("the JSON schema nests too deep") from None
        except ValueError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, Mapping):
        raise GrammarError(f"a JSON schema must be an object, not {type(schema).__name__}")
    for where, key, value in _bounds(schema, "schema"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise GrammarError(f"{where}.{key} must be a non-negative integer, got {value!r}")
        if value > MAX_REPEAT:
            raise GrammarError(
                f"{where}.{key} is {value:,}: the grammar converter takes at most {MAX_REPEAT:,}"
            )
    try:
        text = _convert(json.loads(json.dumps(schema)))
    except GrammarError:
        raise
    except RecursionError:
        raise GrammarError("the JSON schema nests too deep") from None
    except Exception as exc:  # the converter asserts and raises whatever it meets
        reason = str(exc) or type(exc).__name__
        if isinstance(exc, KeyError | AttributeError | TypeError):
            reason = f"{type(exc).__name__}: {reason}"
        raise GrammarError(f"the JSON schema cannot be converted to a grammar: {reason}") from None
    return check_gbnf(text)


def _convert(schema: Any) -> str:
    """``json_schema_to_gbnf`` with each ``pattern`` written by ``pattern.pattern_rules``."""
    converter = _converter()(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    schema = converter.resolve_refs(schema, "stdin")
    converter.visit(schema, "")
    return str(converter.format_grammar())


@functools.cache
def _converter() -> type[Any]:
    """llama-cpp-python's converter, its pattern translation replaced (imported when needed)."""
    from llama_cpp.llama_grammar import SchemaConverter

    from localkv.model.sampling.pattern import pattern_rules

    class Converter(SchemaConverter):
        def _visit_pattern(self, pattern: object, name: str) -> str:
            start, rules = pattern_rules(pattern, name, self._rules)
            self._rules.update(rules)
            return str(self._add_rule(name, f'"\\"" {start} "\\"" space'))  # type: ignore[no-untyped-call]

    return Converter


class _Bound(NamedTuple):
    """A length or size bound in a schema."""

    where: str  # the path to the object holding it
    key: str  # e.g. maxLength
    value: object


def _bounds(node: object, where: str, depth: int = 0, named: bool = False) -> Iterator[_Bound]:
    """Every length or size bound in a schema, with where it is (``named``: keys are names)."""
    if depth > 64:
        raise GrammarError("the JSON schema nests too deep")
    if isinstance(node, Mapping):
        for key, value in node.items():
            if key in _REPEAT_KEYS and not named:
                yield _Bound(where, str(key), value)
            else:
                inner = not named and key in _NAMED_KEYS
                yield from _bounds(value, f"{where}.{key}", depth + 1, inner)
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from _bounds(item, f"{where}[{i}]", depth + 1)


_JSON_OBJECT: str | None = None


def json_object_grammar() -> str:
    """GBNF for any JSON object (OpenAI's ``response_format`` ``json_object``)."""
    global _JSON_OBJECT
    if _JSON_OBJECT is None:
        _JSON_OBJECT = json_schema_grammar({"type": "object"})
    return _JSON_OBJECT
