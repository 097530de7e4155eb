"""A Responses request's tools: function tools, namespaces of them, hosted tools.

Function tools are flat (``name``, ``description``, ``parameters`` beside
``type``). A ``namespace`` tool groups function tools: its functions are
flattened into the one list the template renders, each named
``namespace.function`` (``flat_name``), and a call of one goes back as a
``function_call`` item with ``name`` and ``namespace`` apart, as the Responses
API returns it (``ToolSet.names``). A call or a call's output sent back in
``input`` with a ``namespace`` renders under the same flat name, so a
conversation's tokens do not depend on how the client spells the call.
``defer_loading`` is accepted: every function is rendered (the server has no
tool search). Tools the API's host runs (``web_search``, ``file_search``,
``code_interpreter``, ``image_generation``, remote ``mcp``, ``tool_search``, ...)
are left out, with a log line the first time a set of them is seen; tool kinds
a client runs that are not functions (``custom``, ``local_shell``, ``shell``,
``apply_patch``, computer use) are refused with a 400, as the model could not
make their calls.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from localkv.server.errors import bad_request
from localkv.server.requests import ToolChoice
from localkv.server.tools import TOOL_NAME, checked_choice, function_tool

__all__ = ["ToolSet", "echo_tools", "flat_name", "parse_tools"]

logger = logging.getLogger(__name__)

# run by the API's host, not by the client: nothing here can run them
HOSTED = frozenset(
    {
        "web_search",
        "web_search_2025_08_26",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "mcp",
        "tool_search",
        "programmatic_tool_calling",
    }
)
CHOICE_SHAPE = (
    "'tool_choice' is 'auto', 'none', 'required' or "
    "{'type': 'function', 'name': ...} (with 'namespace' for a namespace's function)"
)
MAX_NAME = 64


@dataclass(frozen=True, slots=True)
class ToolSet:
    """The function tools the template renders, the choice over them, and where each
    flattened name came from (``namespace.function`` -> (namespace, function))."""

    tools: tuple[dict[str, Any], ...] = ()
    choice: ToolChoice | None = None
    names: Mapping[str, tuple[str, str]] = field(default_factory=dict)


def flat_name(namespace: str, name: str) -> str:
    """The one name a namespace's function has in the flat list: ``namespace.name``, cut
    to ``MAX_NAME`` characters with a digest of the whole where longer."""
    whole = f"{namespace}.{name}"
    if len(whole) <= MAX_NAME:
        return whole
    return whole[: MAX_NAME - 9] + "-" + hashlib.sha256(whole.encode()).hexdigest()[:8]


def parse_tools(body: dict[str, Any]) -> ToolSet:
    """``tools`` and ``tool_choice``, or a 400 naming the field."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is not None and not isinstance(raw, list):
        raise bad_request("'tools' must be an array of tools", "tools")
    tools: list[dict[str, Any]] = []
    paths: list[str] = []  # where each function is in the request
    names: dict[str, tuple[str, str]] = {}
    hosted: list[str] = []
    for i, tool in enumerate(raw or []):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind in HOSTED:
            hosted.append(kind)
        elif isinstance(tool, dict) and kind == "namespace":
            for j, (function, name) in enumerate(_namespace(tool, where)):
                names[function["function"]["name"]] = (tool["name"], name)
                tools.append(function)
                paths.append(f"{where}.tools[{j}]")
        else:
            tools.append(_function(tool, where))
            paths.append(where)
    if hosted:
        _left_out(tuple(sorted(set(hosted))))
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return ToolSet()
    checked = checked_choice(
        tools,
        _choice(choice, names),
        choice_at="tool_choice",
        parameters_at=lambda k: f"{paths[k]}.parameters",
    )
    return ToolSet(tools=tuple(tools), choice=checked, names=names)


@functools.cache
def _left_out(kinds: tuple[str, ...]) -> None:
    """Say once per set of hosted tools that they are left out (a client sends the same
    set with every request)."""
    logger.info("tools left out, as their host runs them and this server cannot: %s",
                ", ".join(kinds))  # fmt: skip


def _function(raw: object, where: str) -> dict[str, Any]:
    """A flat function tool as the template renders it."""
    kind = raw.get("type") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or kind != "function":
        raise bad_request(
            f"{where}: tools of type {kind!r} are not supported: only function tools "
            "({'type': 'function', 'name': ..., 'parameters': {...}}), namespaces of them, "
            "and hosted tools (left out)",
            where,
        )
    if "function" in raw:
        raise bad_request(
            f"{where}: a Responses function tool is flat ('name', 'parameters' beside "
            "'type'), not nested in 'function'",
            where,
        )
    for name in ("strict", "defer_loading"):
        if raw.get(name) is not None and not isinstance(raw[name], bool):
            raise bad_request(f"{where}.{name} must be true or false", f"{where}.{name}")
    return function_tool(
        raw.get("name"), raw.get("description"), raw.get("parameters"), lambda f: f"{where}.{f}"
    )


def _namespace(raw: dict[str, Any], where: str) -> list[tuple[dict[str, Any], str]]:
    """A namespace's functions under their flat names, each with its own name."""
    name = raw.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise bad_request(
            f"{where}.name must be 1 to 64 letters, digits, '_', '-', '.' or ':'",
            f"{where}.name",
        )
    if raw.get("description") is not None and not isinstance(raw["description"], str):
        raise bad_request(f"{where}.description must be a string", f"{where}.description")
    inner = raw.get("tools")
    if not isinstance(inner, list) or not inner:
        raise bad_request(
            f"{where}.tools must be a non-empty array of function tools", f"{where}.tools"
        )
    out = []
    for j, tool in enumerate(inner):
        function = _function(tool, f"{where}.tools[{j}]")["function"]
        flat = {**function, "name": flat_name(name, function["name"])}
        out.append(({"type": "function", "function": flat}, function["name"]))
    return out


def _choice(choice: object, names: Mapping[str, tuple[str, str]]) -> ToolChoice:
    if choice is None or choice in ("auto", "none", "required"):
        return ToolChoice(str(choice or "auto"))
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise bad_request(CHOICE_SHAPE, "tool_choice")
    name, namespace = choice.get("name"), choice.get("namespace")
    if not isinstance(name, str) or not isinstance(namespace, str | None):
        raise bad_request(CHOICE_SHAPE, "tool_choice")
    if namespace is not None:
        return ToolChoice("function", flat_name(namespace, name))
    # a namespace's function by its own name, where no other function has it
    found = [flat for flat, (_, function) in names.items() if function == name]
    if name not in names and len(found) == 1:
        return ToolChoice("function", found[0])
    return ToolChoice("function", name)


def echo_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's tools as a response lists them: function tools with ``strict`` as
    given (else true), namespaces with theirs, other tools as given."""
    out: list[dict[str, Any]] = []
    for tool in body.get("tools") or []:
        if tool.get("type") == "function":
            out.append(_echo_function(tool))
        elif tool.get("type") == "namespace":
            out.append({**tool, "tools": [_echo_function(t) for t in tool["tools"]]})
        else:
            out.append(tool)
    return out


def _echo_function(tool: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "name": tool["name"],
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict", True),
    }
