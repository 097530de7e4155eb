"""A client's JSON schema checked for what the grammar converter would get wrong, before it runs.

``response_format``, Ollama's ``format`` and the parameters of a tool call that
must be made become a grammar through llama-cpp-python's converter
(``model.sampling.json_schema_grammar``). Some schemas it turns into a grammar
llama.cpp refuses: a ``type``, ``enum``, ``anyOf`` or ``oneOf`` that is an
empty array, a quote in a property name or a ``const`` or ``enum`` string (it
escapes the quote wrongly; a backslash, and the grammar holds to another
string). Others it turns into one that silently means something else: it
merges an ``allOf`` as the union of its members' object ``properties``,
ignoring every other keyword, so an ``allOf`` of a string and an integer
becomes ``{ }``. Those are refused with a 400 naming the place in the schema:
a member of an ``allOf`` must be an object schema, its properties named once,
and nothing but ``allOf`` may describe the object's properties.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from localkv.server.errors import bad_request

__all__ = ["check_schema"]

_LISTS = ("anyOf", "oneOf", "allOf")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "contains", "if", "then", "else")
_NAMED = ("properties", "$defs", "definitions", "patternProperties")
_UNWRITABLE = ('"', "\\")  # characters the converter cannot write in a literal


def check_schema(schema: object, where: str, param: str) -> None:
    """A 400 for the request's field ``param`` that names the place in ``schema`` (which is
    at ``where`` in the request) that cannot become a faithful grammar."""
    for at, node in _nodes(schema, where):
        why = _unfaithful(node, at)
        if why is not None:
            raise bad_request(why, param)


def _nodes(schema: object, where: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema object under ``schema`` with where it is (a request body is shallow)."""
    stack = [(schema, where)]
    while stack:
        node, at = stack.pop()
        if not isinstance(node, dict):
            continue
        yield at, node
        for key in _SUBSCHEMAS:
            stack.append((node.get(key), f"{at}.{key}"))
        for key in _NAMED:
            named = node.get(key)
            if isinstance(named, dict):
                stack.extend((value, f"{at}.{key}.{name}") for name, value in named.items())
        for key in (*_LISTS, "prefixItems"):
            items = node.get(key)
            if isinstance(items, list):
                stack.extend((item, f"{at}.{key}[{i}]") for i, item in enumerate(items))


def _unfaithful(node: dict[str, Any], at: str) -> str | None:
    """Why ``node`` (at ``at``) cannot become a faithful grammar; None: it can."""
    kind = node.get("type")
    if isinstance(kind, list) and (not kind or not all(isinstance(k, str) for k in kind)):
        return f"{at}.type: an array of types must name one or more"
    for key in ("enum", *_LISTS):
        if key in node and (not isinstance(node[key], list) or not node[key]):
            return f"{at}.{key}: must be a non-empty array"
    for key in _LISTS:
        for i, item in enumerate(node.get(key, ())):
            if not isinstance(item, dict):
                return f"{at}.{key}[{i}]: must be a schema (an object)"
    properties = node.get("properties")
    names = list(properties) if isinstance(properties, dict) else []
    literals = [(f"{at}.properties: the name {name!r}", name) for name in names]
    if "const" in node:
        literals.append((f"{at}.const", node["const"]))
    literals += [(f"{at}.enum[{i}]", value) for i, value in enumerate(node.get("enum", ()))]
    for what, value in literals:
        if not _writable(value):
            return (
                f"{what}: a quote or backslash in a property name or a const or enum "
                "string cannot be held to by a grammar here"
            )
    return _all_of(node, at) if "allOf" in node else None


def _writable(value: object) -> bool:
    """Whether every string in ``value`` can be written as a grammar's literal."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if any(c in item for c in _UNWRITABLE):
                return False
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True


def _all_of(node: dict[str, Any], at: str) -> str | None:
    """Why an ``allOf`` is not merged faithfully: members that are not object schemas, or
    that name a property twice, or properties beside it (None: it is)."""
    why = "an allOf is held to as the union of its members' object properties"
    if not _may_be(node.get("type"), "object"):
        return f"{at}: a schema of type {node['type']!r} cannot have allOf ({why})"
    if "properties" in node:
        return f"{at}: properties beside allOf are not supported: move them into a member ({why})"
    seen: dict[str, int] = {}
    for i, member in enumerate(node["allOf"]):
        here = f"{at}.allOf[{i}]"
        if not _may_be(member.get("type"), "object") or "const" in member or "enum" in member:
            return f"{here}: is not an object schema, so allOf cannot hold ({why})"
        named = member.get("properties")
        for name in named if isinstance(named, dict) else ():
            if name in seen:
                return (
                    f"{here}.properties.{name}: allOf[{seen[name]}] names it too, and the "
                    f"two cannot both be held to ({why})"
                )
            seen[name] = i
    return None


def _may_be(kind: object, wanted: str) -> bool:
    """Whether a ``type`` (None: any) allows ``wanted``."""
    return kind is None or kind == wanted or (isinstance(kind, list) and wanted in kind)
