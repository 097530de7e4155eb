"""The top-level fields of a Responses request: which are mapped, ignored or refused.

Mapped: ``input``, ``instructions``, ``tools`` and ``tool_choice``
(``responses.tools``), ``text.format`` (a grammar: JSON, or a schema's),
``max_output_tokens``, ``temperature``, ``top_p``, ``stream``; localkv's
extensions ``top_k``, ``seed`` and ``stop`` as on ``/v1/chat/completions``;
each checked under its own name (``server.fields``). Echoed in the response:
``metadata`` (checked as OpenAI checks it), ``parallel_tool_calls``, ``user``.
Accepted and ignored: ``model`` (the loaded model answers), ``store`` (nothing
is stored, whatever it says), ``include`` (``reasoning.encrypted_content`` is
honoured: see ``responses.reasoning``), ``reasoning`` (the template decides
whether the model reasons), ``prompt_cache_key`` and ``prompt_cache_retention``
(the cache is keyed by the prompt's tokens, kept on disk), ``service_tier``,
``safety_identifier``, ``stream_options``, ``truncation: "disabled"`` and Codex
CLI's ``client_metadata``.
Refused with a 400 naming the field: ``previous_response_id`` and
``conversation`` (the server is stateless: send the whole input), ``background``,
``prompt``, ``max_tool_calls``, ``top_logprobs``, ``truncation: "auto"`` and
the rest; an unknown field is a 400 ``unknown_parameter``.
"""

from __future__ import annotations

from typing import Any

from localkv.server.errors import bad_request
from localkv.server.fields import integer, json_grammar, number, seed, stop_list, top_p
from localkv.server.requests import Sampling

__all__ = ["check_fields", "sampling"]

MAPPED = {
    "model", "input", "instructions", "tools", "tool_choice", "text", "max_output_tokens",
    "temperature", "top_p", "stream", "top_k", "seed", "stop", "metadata",
    "parallel_tool_calls", "user",
}  # fmt: skip
IGNORED = {
    "store", "include", "reasoning", "prompt_cache_key", "prompt_cache_retention",
    "service_tier", "safety_identifier", "stream_options", "truncation", "client_metadata",
}  # fmt: skip
STATELESS = (
    "this server is stateless (it stores no responses): send the whole conversation in "
    "'input'; its prefix is served from the cache, so resending it is cheap"
)
REFUSED = {
    "previous_response_id": STATELESS,
    "conversation": STATELESS,
    "background": "background responses need stored responses; this server stores none",
    "prompt": "prompt templates are not supported: send 'instructions' and 'input'",
    "max_tool_calls": "'max_tool_calls' is not supported",
    "top_logprobs": "logprobs are not supported",
    "context_management": "'context_management' is not supported",
    "moderation": "'moderation' is not supported",
    "prompt_cache_options": "'prompt_cache_options' is not supported: the cache is automatic",
}
MAX_METADATA = 16


def check_fields(body: dict[str, Any]) -> None:
    """A 400 for an unknown field, a refused one, or bad ``metadata``/``truncation``."""
    for name in body:
        if name in REFUSED:
            if body[name] in (None, False, 0):
                continue  # the default, sent explicitly
            message = f"'{name}' is not supported: {REFUSED[name]}"
            raise bad_request(message, name, "unsupported_parameter")
        if name not in MAPPED and name not in IGNORED:
            raise bad_request(f"Unknown parameter: '{name}'.", name, "unknown_parameter")
    if body.get("truncation") not in (None, "disabled"):
        raise bad_request(
            "'truncation' must be 'disabled': a prompt longer than the context is refused",
            "truncation",
        )
    _check_metadata(body.get("metadata"))
    for name in ("stream", "store", "parallel_tool_calls"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise bad_request(f"'{name}' must be true or false", name)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad_request("'user' must be a string", "user")
    include = body.get("include")
    if include is not None and (
        not isinstance(include, list) or not all(isinstance(i, str) for i in include)
    ):
        raise bad_request("'include' must be an array of strings", "include")


def _check_metadata(metadata: object) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise bad_request("'metadata' must be an object of strings", "metadata")
    if len(metadata) > MAX_METADATA:
        raise bad_request(f"'metadata' holds at most {MAX_METADATA} keys", "metadata")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise bad_request(
                f"metadata[{key[:64]!r}]: keys are up to 64 characters, values strings "
                "of up to 512",
                "metadata",
            )


def sampling(body: dict[str, Any]) -> Sampling:
    """What the request asks of generation, each field checked under its own name."""
    temperature = number(body.get("temperature"), "temperature", 0.0, 2.0)
    nucleus = top_p(body.get("top_p"), "top_p")
    return Sampling(
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if nucleus is None else nucleus,
        top_k=integer(body.get("top_k"), "top_k", 0) or 0,
        seed=seed(body.get("seed"), "seed"),
        max_tokens=integer(body.get("max_output_tokens"), "max_output_tokens", 1),
        stop=stop_list(body.get("stop"), "stop"),
        grammar=_text_grammar(body.get("text")),
    )


def _text_grammar(text: object) -> str | None:
    """The grammar ``text.format`` asks for: None for plain text, else JSON's."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("'text' must be an object with 'format'", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if not isinstance(fmt, dict) or kind not in ("text", "json_object", "json_schema"):
        raise bad_request(
            "text.format must be {'type': 'text'}, {'type': 'json_object'} or "
            "{'type': 'json_schema', 'name': ..., 'schema': {...}}",
            "text.format",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return json_grammar(None, "text.format")
    for name, kinds in (("name", str), ("description", str), ("strict", bool)):
        if fmt.get(name) is not None and not isinstance(fmt[name], kinds):
            raise bad_request(f"text.format.{name} must be a {kinds.__name__}", "text.format")
    # strict or not, the answer is held to the schema (none: any JSON object)
    return json_grammar(fmt.get("schema"), "text.format.schema", "text.format")
