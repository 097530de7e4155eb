"""A request body's JSON, and checks of its values that every protocol shares.

``decode_body`` refuses what no protocol accepts: a body that is not a JSON
object, one nested deeper than ``MAX_DEPTH``, a NUL character or a lone
surrogate (``\\ud800``, not Unicode) in any string, each a 400 naming where.
The value checks take the field's name as the protocol spells it, so an error
names the field the client sent (``max_tokens``, ``options.num_predict``).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from localkv.model.sampling import GrammarError, json_object_grammar, json_schema_grammar
from localkv.server.errors import bad_request
from localkv.server.schemas import check_schema

__all__ = [
    "MAX_DEPTH",
    "MAX_STOPS",
    "decode_body",
    "flag",
    "integer",
    "is_int",
    "json_grammar",
    "number",
    "seed",
    "stop_list",
    "top_p",
]

MAX_DEPTH = 32  # a request body needs 5 levels
MAX_STOPS = 4
_REFUSED_CHARS = re.compile("[\x00\ud800-\udfff]")


def decode_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body (400 when it is not one, or holds refused text)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad_request(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError; an int too long
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _check_values(body)
    return body


def _check_values(body: dict[str, Any]) -> None:
    """Refuse a body nested deeper than ``MAX_DEPTH``, or with NUL or surrogates in a string."""
    stack: list[tuple[object, str, int]] = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise bad_request(f"the request body nests deeper than {MAX_DEPTH} levels", path)
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path or None)
                stack.append((item, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))


def _check_text(text: str, path: str | None) -> None:
    found = _REFUSED_CHARS.search(text)
    if found is None:
        return
    where = f"{path}, character {found.start()}" if path else f"character {found.start()}"
    if found.group() == "\x00":
        raise bad_request(f"NUL characters are not allowed in text ({where})", path)
    raise bad_request(
        f"a lone surrogate (U+{ord(found.group()):04X}) is not valid Unicode ({where})", path
    )


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(value: object, name: str, minimum: int | None = None) -> int | None:
    """``value`` as an int (None when absent), or a 400 naming ``name``."""
    if value is None:
        return None
    too_low = isinstance(value, int) and minimum is not None and value < minimum
    if not isinstance(value, int) or isinstance(value, bool) or too_low:
        floor = "" if minimum is None else f" of at least {minimum}"
        raise bad_request(f"'{name}' must be an integer{floor}", name)
    return value


def number(value: object, name: str, low: float, high: float) -> float | None:
    """``value`` as a float within [low, high] (None when absent), or a 400 naming ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a number", name)
    if not low <= value <= high:
        raise bad_request(f"'{name}' must be between {low:g} and {high:g}", name)
    return float(value)


def top_p(value: object, name: str) -> float | None:
    """A nucleus share in (0, 1] (None when absent), or a 400 naming ``name``."""
    share = number(value, name, 0.0, 1.0)
    if share == 0.0:
        raise bad_request(f"'{name}' must be above 0", name)
    return share


def seed(value: object, name: str) -> int | None:
    """A sampling seed (None when absent): any integer, kept to the sampler's 63 bits."""
    given = integer(value, name)
    return None if given is None else given & (2**63 - 1)


def flag(value: object, name: str, default: bool = False) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false", name)
    return value


def stop_list(value: object, name: str) -> tuple[str, ...]:
    """Stop sequences: a non-empty string or an array of at most ``MAX_STOPS`` of them."""
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request(f"'{name}' must be a non-empty string or an array of them", name)
    if len(stops) > MAX_STOPS:
        raise bad_request(f"'{name}' takes at most {MAX_STOPS} sequences", name)
    return tuple(stops)


def json_grammar(schema: object, where: str, param: str | None = None) -> str:
    """The grammar of JSON answers: any object (``schema`` None), else ``schema``'s, which
    is at ``where`` in the request (a 400 for ``param``, default ``where``, names why
    the schema cannot become a faithful grammar)."""
    if schema is None:
        return json_object_grammar()
    param = param or where
    check_schema(schema, where, param)
    try:
        return json_schema_grammar(schema)  # type: ignore[arg-type]
    except GrammarError as exc:
        raise bad_request(f"{where}: {exc}", param) from None
