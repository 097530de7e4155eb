"""Which chat template a model gets: its own, the one ``--chat-template`` names, or one
chosen by architecture when the GGUF has none.

A Jinja template (the GGUF's ``tokenizer.chat_template``, or a ``--chat-template``
file) is rendered as Hugging Face renders it (``localkv.prompt.jinja``), each render
bounded (``localkv.prompt.sandbox``). It is checked on conversations of every
length up to ``CHECKED_MESSAGES`` messages, with tools and without: one that the
sandbox stops on any of them (past a limit, text that is not Unicode) is refused,
a ``ChatTemplateError`` that names it, as is one larger than ``MAX_TEMPLATE_BYTES``.
One that does not compile, or fails on the small conversation, falls back to
llama.cpp's built-in formats: ``llama_chat_apply_template`` knows a fixed set, by name
(``gemma``, ``llama3``, ``chatml``, ...), and recognizes a template text by its
markers (``<start_of_turn>`` is gemma, ``<|im_start|>`` is chatml). A built-in
name given to ``--chat-template`` is always llama.cpp's format.

The choice only changes the tokens of a request, and the tokens are the cache key, so
two templates share cached state exactly as far as their tokens agree.
"""

from __future__ import annotations

import ctypes
import difflib
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from localkv.model.native import llama_cpp
from localkv.prompt.jinja import (
    TemplateRenderError,
    UnsafeTemplateError,
    compile_template,
    failure,
)

if TYPE_CHECKING:
    from localkv.model.session import ModelSession

__all__ = [
    "ChatTemplateError",
    "TemplateChoice",
    "builtin_templates",
    "choose_template",
    "has_token",
    "jinja_problem",
    "parse_template_option",
    "refused",
    "render_probe",
    "template_for_architecture",
    "template_name",
]

log = logging.getLogger(__name__)

MAX_TEMPLATE_BYTES = 1024 * 1024
_FILE_SUFFIXES = {".jinja", ".jinja2", ".j2", ".txt", ".tmpl", ".template"}
FALLBACK = "chatml"

# general.architecture -> built-in names to try in order: the first whose marker is
# one token of the model's vocabulary wins (the last one of each list needs none).
_BY_ARCHITECTURE: dict[str, tuple[str, ...]] = {
    "llama": ("llama3", "chatml", "mistral-v7", "llama2"),
    "llama4": ("llama4",),
    "mistral3": ("mistral-v7-tekken", "mistral-v7"),
    "gemma": ("gemma",),
    "gemma2": ("gemma",),
    "gemma3": ("gemma",),
    "gemma3n": ("gemma",),
    "qwen2": ("chatml",),
    "qwen2moe": ("chatml",),
    "qwen2vl": ("chatml",),
    "qwen3": ("chatml",),
    "qwen3moe": ("chatml",),
    "phi3": ("phi4", "phi3"),
    "command-r": ("command-r",),
    "cohere2": ("command-r",),
    "deepseek2": ("deepseek3", "deepseek2"),
    "exaone": ("exaone3",),
    "exaone4": ("exaone4",),
    "granite": ("granite",),
    "granitemoe": ("granite",),
    "chatglm": ("chatglm4", "chatglm3"),
    "minicpm": ("minicpm",),
    "falcon-h1": ("falcon3",),
    "smollm3": ("chatml",),
}
# a token each built-in format needs in the vocabulary to be chosen by architecture
# (in the order an unknown architecture tries them: the more specific first)
_MARKERS: dict[str, str] = {
    "llama3": "<|start_header_id|>",
    "llama4": "<|header_start|>",
    "phi4": "<|im_sep|>",
    "chatml": "<|im_start|>",
    "mistral-v7": "[SYSTEM_PROMPT]",
    "mistral-v7-tekken": "[SYSTEM_PROMPT]",
    "gemma": "<start_of_turn>",
    "phi3": "<|user|>",
    "command-r": "<|START_OF_TURN_TOKEN|>",
    "granite": "<|start_of_role|>",
}
_PROBE = (("system", "S"), ("user", "U"), ("assistant", "A"), ("user", "V"))
# the check renders conversations of 1 to this many messages, with tools and without
CHECKED_MESSAGES = 12
_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}
_warned: set[tuple[str, str]] = set()


class ChatTemplateError(ValueError):
    """A chat template that llama.cpp cannot apply, or that does not exist."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TemplateChoice:
    """What ``llama_chat_apply_template`` is given, and why."""

    template: bytes
    name: str  # a built-in name, "model" for the GGUF's own template, "jinja" for a file
    source: str  # "model", "--chat-template", "architecture", or "file PATH"
    jinja: str | None = None  # the Jinja source, when it is rendered as Jinja


def template_name(choice: TemplateChoice, model: str | Path) -> str:
    """The template as errors name it: the model file's, or the ``--chat-template`` file."""
    if choice.source.startswith("file "):
        return f"the chat template in {choice.source.removeprefix('file ')}"
    return f"the chat template of {Path(model).name}"


def refused(exc: TemplateRenderError, choice: TemplateChoice | None = None) -> str:
    """The one line that says a template cannot be used; for the model's own, how to
    use another."""
    hint = "; use another with --chat-template NAME|FILE"
    return f"{exc}{hint if choice is None or choice.source == 'model' else ''}"


def jinja_problem(source: str, name: str = "the chat template") -> str | None:
    """Why ``source`` cannot be rendered as Jinja (None: it can); ``UnsafeTemplateError``
    (naming it ``name``) where the sandbox stops it on any conversation of the check.

    The small conversation must render; the longer ones (up to ``CHECKED_MESSAGES``
    messages, with a tool call and its result, tools given and not) may be refused,
    as a template may refuse roles or tools it does not take.
    """
    try:
        template = compile_template(source)
    except TemplateRenderError as exc:
        return str(exc)
    for variables, must_render in _checks():
        try:
            template.render(**variables)
        except UnsafeTemplateError as exc:
            raise exc.named(name) from None
        except Exception as exc:  # a template's own failure, whatever it raises
            if must_render:
                reason = failure(exc, name).reason.removeprefix("failed: ")
                return f"the chat template failed on a small conversation: {reason}"
    return None


def _checks() -> list[tuple[dict[str, object], bool]]:
    """The check's conversations, as a template is given them, and whether each must render."""
    special = {"bos_token": "", "eos_token": ""}
    small = [{"role": role, "content": text} for role, text in _PROBE[:3]]
    checks: list[tuple[dict[str, object], bool]] = [
        ({"messages": small, "add_generation_prompt": True, **special}, True)
    ]
    plain = _long_conversation(False)
    for n in range(1, len(plain) + 1):
        variables = {"messages": plain[:n], "add_generation_prompt": n % 2 == 0, **special}
        checks.append((variables, False))
    with_tools = _long_conversation(True)
    for n in (len(with_tools) - 4, len(with_tools)):
        variables = {"messages": with_tools[:n], "tools": [_TOOL], **special}
        checks.append(({**variables, "add_generation_prompt": True}, False))
    return checks


def _long_conversation(tools: bool) -> list[dict[str, object]]:
    """A system prompt and turns up to ``CHECKED_MESSAGES`` messages; with ``tools``, an
    answer that calls a tool and the tool's result."""
    out: list[dict[str, object]] = [{"role": "system", "content": "S"}]
    turn = 0
    while len(out) < CHECKED_MESSAGES:
        turn += 1
        out.append({"role": "user", "content": f"U{turn}"})
        if tools and turn == 2:
            call = {"name": "get_time", "arguments": {"zone": "UTC"}}
            out.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"id": "call_1", "type": "function", "function": call}],
                }
            )
            out.append(
                {"role": "tool", "tool_call_id": "call_1", "name": "get_time", "content": "T"}
            )
        out.append({"role": "assistant", "content": f"A{turn}"})
    return out[:CHECKED_MESSAGES]


@functools.cache
def builtin_templates() -> tuple[str, ...]:
    """The names of llama.cpp's built-in chat formats."""
    count = int(llama_cpp.llama_chat_builtin_templates(None, 0))
    names = (ctypes.c_char_p * max(1, count))()
    llama_cpp.llama_chat_builtin_templates(names, count)
    return tuple(sorted(name.decode() for name in names[:count] if name))


def render_probe(template: bytes) -> str | None:
    """A fixed small conversation rendered with ``template``; None if llama.cpp refuses it."""
    arr = (llama_cpp.llama_chat_message * len(_PROBE))()
    keep = [(role.encode(), text.encode()) for role, text in _PROBE]
    for i, (role, text) in enumerate(keep):
        arr[i].role, arr[i].content = role, text
    buf = ctypes.create_string_buffer(4096)
    n = llama_cpp.llama_chat_apply_template(template, arr, len(keep), True, buf, len(buf))
    if n < 0 or n > len(buf):
        return None
    return buf.raw[:n].decode("utf-8", errors="replace")


def _recognized_as(template: bytes) -> str | None:
    """The built-in format that renders like ``template``, if any."""
    rendered = render_probe(template)
    for name in builtin_templates():
        if render_probe(name.encode()) == rendered:
            return name
    return None


def parse_template_option(value: str) -> TemplateChoice:
    """``--chat-template NAME|FILE`` as a choice, or ``ChatTemplateError`` in one line."""
    names = builtin_templates()
    if value in names:
        return TemplateChoice(template=value.encode(), name=value, source="--chat-template")
    path = Path(value).expanduser()
    if path.is_file():
        return _template_file(path)
    if path.exists():
        raise ChatTemplateError(f"chat template {value!r} is not a regular file")
    if "/" in value or "\\" in value or path.suffix.lower() in _FILE_SUFFIXES:
        raise ChatTemplateError(f"chat template file not found: {path}")
    close = difflib.get_close_matches(value, names, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    raise ChatTemplateError(
        f"unknown chat template {value!r}: neither a built-in name nor a file{hint} "
        f"(built-in names: {', '.join(names)})"
    )


def _template_file(path: Path) -> TemplateChoice:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_TEMPLATE_BYTES + 1)
    except OSError as exc:
        raise ChatTemplateError(f"cannot read chat template {path}: {exc.strerror}") from None
    if len(data) > MAX_TEMPLATE_BYTES or b"\0" in data:
        raise ChatTemplateError(f"chat template {path} is not a template text file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ChatTemplateError(f"chat template {path} is not UTF-8 text") from None
    name = f"the chat template in {path}"
    try:
        problem = jinja_problem(text, name)
    except UnsafeTemplateError as exc:
        raise ChatTemplateError(str(exc)) from None
    if problem is not None:
        raise ChatTemplateError(f"cannot use {name}: {problem}")
    log.info("chat template %s is rendered as Jinja", path)
    return TemplateChoice(template=data, name="jinja", source=f"file {path}", jinja=text)


def has_token(session: ModelSession, text: str) -> bool:
    """Whether ``text`` is a single (special) token of the model's vocabulary."""
    ids = session.tokenize(text, parse_special=True)
    return len(ids) == 1 and session.token_bytes(ids[0], special=True) == text.encode()


def template_for_architecture(session: ModelSession, architecture: str) -> str | None:
    """The built-in format for ``architecture``, checked against the vocabulary's markers.

    For an architecture not in the table, the first format whose marker the vocabulary
    has, or None.
    """
    candidates = _BY_ARCHITECTURE.get(architecture)
    if candidates is None:
        return next((n for n in _MARKERS if has_token(session, _MARKERS[n])), None)
    for name in candidates:
        marker = _MARKERS.get(name)
        if marker is None or has_token(session, marker):
            return name
    return candidates[-1]


def choose_template(session: ModelSession, override: str | None = None) -> TemplateChoice:
    """The template for ``session``: ``override``, else the model's own, else by architecture."""
    if override:
        choice = parse_template_option(override)
        log.info("chat template: %s (from %s)", choice.name, choice.source)
        return choice
    raw = llama_cpp.llama_model_chat_template(session.model, None)
    if raw:
        own = _own_jinja(session, raw)
        if own is not None:
            return own
    if raw and render_probe(raw) is not None:
        return TemplateChoice(template=raw, name="model", source="model")
    architecture = session.meta("general.architecture") or "unknown"
    name = template_for_architecture(session, architecture)
    if name is None:
        name = FALLBACK
        why = f"localkv knows no format for architecture {architecture}"
    else:
        why = f"for architecture {architecture}"
    problem = "has no chat template" if not raw else "has a chat template llama.cpp cannot apply"
    _warn_once(
        str(session.config.model_path),
        f"model {problem}; using {name!r} {why} (override with --chat-template)",
    )
    return TemplateChoice(template=name.encode(), name=name, source="architecture")


def _own_jinja(session: ModelSession, raw: bytes) -> TemplateChoice | None:
    """The model's own template as Jinja; None where it falls back (with a warning),
    ``ChatTemplateError`` where it is refused."""
    own = TemplateChoice(template=raw, name="model", source="model")
    label = template_name(own, session.config.model_path)
    if len(raw) > MAX_TEMPLATE_BYTES:
        size = f"is {len(raw):,} bytes, more than a chat template may be"
        too_large = UnsafeTemplateError(f"{size} ({MAX_TEMPLATE_BYTES:,})", label)
        raise ChatTemplateError(refused(too_large, own))
    text = raw.decode("utf-8", errors="replace")
    try:
        problem = jinja_problem(text, label)
    except UnsafeTemplateError as exc:
        raise ChatTemplateError(refused(exc, own)) from None
    if problem is None:
        return TemplateChoice(template=raw, name="model", source="model", jinja=text)
    _warn_once(str(session.config.model_path), f"model's chat template: {problem}")
    return None


def _warn_once(model: str, message: str) -> None:
    if (model, message) not in _warned:
        _warned.add((model, message))
        log.warning("%s", message)
