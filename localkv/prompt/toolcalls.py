"""Tool calls in a model's answer, in the formats models are trained to write them.

- Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one
  block per call, text around them is the answer's content;
- Llama 3.x: the answer is one JSON object ``{"name": ..., "parameters": {...}}``
  (``arguments`` too), after ``<|python_tag|>`` or alone;
- Mistral: ``[TOOL_CALLS]`` and a JSON array of ``{"name", "arguments"}``, or
  ``[TOOL_CALLS]name[ARGS]{...}`` (the newer form).

A call names one of the request's functions, or it is no call (the text stays
content). Arguments are given back as JSON text, as OpenAI gives them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from localkv.model.sampling import json_schema_grammar

__all__ = ["CALL_OPENERS", "ParsedCall", "call_grammar", "call_style", "parse_tool_calls"]

HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
MISTRAL = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
# how an answer that is a call begins (a stream holds such text back)
CALL_OPENERS = ("<tool_call>", MISTRAL, PYTHON_TAG, "{")


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


def parse_tool_calls(text: str, names: Collection[str]) -> tuple[str, list[ParsedCall]]:
    """The answer's content without its calls, and the calls, in order."""
    if "<tool_call>" in text:
        calls, content = _hermes(text, names)
        if calls:
            return content, calls
    stripped = text.strip()
    if stripped.startswith(MISTRAL):
        calls = _mistral(stripped[len(MISTRAL) :], names)
        if calls:
            return "", calls
    body = stripped.removeprefix(PYTHON_TAG).strip()
    if body.startswith("{"):
        call = _call(_json_prefix(body, whole=True), names)
        if call is not None:
            return "", [call]
    return text, []


def _hermes(text: str, names: Collection[str]) -> tuple[list[ParsedCall], str]:
    calls: list[ParsedCall] = []
    kept: list[str] = []
    pos = 0
    for match in HERMES.finditer(text):
        call = _call(_json_prefix(match.group(1), whole=False), names)
        if call is None:
            continue
        kept.append(text[pos : match.start()])
        pos = match.end()
        calls.append(call)
    kept.append(text[pos:])
    return calls, "".join(kept).strip()


def _mistral(rest: str, names: Collection[str]) -> list[ParsedCall]:
    rest = rest.strip()
    if rest.startswith("["):
        value = _json_prefix(rest, whole=False)
        items = value if isinstance(value, list) else []
        found = [_call(item, names) for item in items]
        return [c for c in found if c is not None] if all(found) else []
    calls = []
    for chunk in rest.split(MISTRAL):
        name, sep, args = chunk.partition("[ARGS]")
        if not sep:
            return []
        call = _call({"name": name.strip(), "arguments": _json_prefix(args, whole=False)}, names)
        if call is None:
            return []
        calls.append(call)
    return calls


def _json_prefix(text: str, *, whole: bool) -> Any:
    """The JSON value ``text`` starts with (``whole``: and nothing after it); None if none."""
    text = text.strip()
    try:
        value, end = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None
    if whole and text[end:].strip():
        return None
    return value


def _call(value: Any, names: Collection[str]) -> ParsedCall | None:
    if not isinstance(value, dict):
        return None
    if isinstance(value.get("function"), dict):  # {"type": "function", "function": {...}}
        value = value["function"]
    name = value.get("name")
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or name not in names or not isinstance(arguments, dict):
        return None
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


def call_style(template_source: str | None) -> str:
    """How a template asks for calls: "llama3" (a bare JSON object with ``parameters``),
    else "hermes" (``<tool_call>`` blocks; the preamble asks for these too)."""
    source = template_source or "<tool_call>"
    if "<tool_call>" not in source and '"parameters"' in source and "<|eot_id|>" in source:
        return "llama3"
    return "hermes"


def call_grammar(tools: Sequence[dict[str, Any]], name: str | None, style: str) -> str:
    """GBNF for one call of ``name`` (None: of any of ``tools``), its arguments valid
    against the function's JSON schema, in ``style`` (see ``call_style``)."""
    key = "parameters" if style == "llama3" else "arguments"
    alternatives = []
    for tool in tools:
        function = tool["function"]
        if name is not None and function["name"] != name:
            continue
        alternatives.append(
            {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, key: function["parameters"]},
                "required": ["name", key],
            }
        )
    grammar = json_schema_grammar({"anyOf": alternatives})
    if style == "llama3":
        return grammar
    renamed = re.sub(r"^root ::=", "tool-call ::=", grammar, flags=re.MULTILINE)
    return renamed + '\nroot ::= "<tool_call>\\n" tool-call "\\n</tool_call>"\n'
