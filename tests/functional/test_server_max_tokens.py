"""``serve --max-tokens N`` bounds every answer, in every protocol: a real server process.

A request that gives no limit (Codex sends no ``max_output_tokens``, aider's
Ollama route no ``num_predict``) stops after N tokens with the protocol's own
"length" reason instead of running until the context is full; a larger limit
asked for is capped to N, a smaller one is honoured. ``0`` lifts the bound.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.server import ServerProcess
from support.tinymodels import TinyModels

LIMIT = 8
ASK = "Write a long story."
MESSAGES = [{"role": "user", "content": ASK}]


def tiny_args(tiny_models: TinyModels, ctx: int, *extra: str) -> list[str]:
    return ["--model", str(tiny_models.base), "--threads", "1", "--ctx", str(ctx), *extra]


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_models: TinyModels
) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("max-tokens") / "server.log"
    args = tiny_args(tiny_models, 2048, "--max-tokens", str(LIMIT))
    with ServerProcess(args, log, global_args=("-vv",)) as proc:
        yield proc


def post(proc: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(proc.base_url + path, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


# each route: its path, its body with the limit asked (None: no limit field), and the
# (finish reason, generated tokens) of its reply
Route = tuple[
    str, Callable[[int | None], dict[str, Any]], Callable[[dict[str, Any]], tuple[Any, int]]
]


def _limited(field: str, limit: int | None, body: dict[str, Any]) -> dict[str, Any]:
    return body if limit is None else {**body, field: limit}


def _ollama(limit: int | None, body: dict[str, Any]) -> dict[str, Any]:
    options: dict[str, Any] = {"temperature": 0}
    if limit is not None:
        options["num_predict"] = limit
    return {**body, "model": "tiny", "stream": False, "options": options}


ROUTES: dict[str, Route] = {
    "openai chat": (
        "/v1/chat/completions",
        lambda n: _limited("max_tokens", n, {"messages": MESSAGES, "temperature": 0}),
        lambda r: (r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"]),
    ),
    "openai completions": (
        "/v1/completions",
        lambda n: _limited("max_tokens", n, {"prompt": ASK, "temperature": 0}),
        lambda r: (r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"]),
    ),
    "responses": (
        "/v1/responses",
        lambda n: _limited("max_output_tokens", n, {"input": ASK, "temperature": 0}),
        lambda r: (
            (r["status"], (r["incomplete_details"] or {}).get("reason")),
            r["usage"]["output_tokens"],
        ),
    ),
    "ollama chat": (
        "/api/chat",
        lambda n: _ollama(n, {"messages": MESSAGES}),
        lambda r: (r["done_reason"], r["eval_count"]),
    ),
    "ollama generate": (
        "/api/generate",
        lambda n: _ollama(n, {"prompt": ASK}),
        lambda r: (r["done_reason"], r["eval_count"]),
    ),
}
LENGTH = {
    "openai chat": "length",
    "openai completions": "length",
    "responses": ("incomplete", "max_output_tokens"),
    "ollama chat": "length",
    "ollama generate": "length",
}


# A Responses answer cut at the server's limit, for a request that set none, is
# ``completed``: ``incomplete`` says the request's own ``max_output_tokens`` was reached
# (and Codex, which sets none, would run the turn again on it).
UNASKED = {**LENGTH, "responses": ("completed", None)}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_request_without_a_limit_stops_at_the_servers(server: ServerProcess, route: str) -> None:
    path, body, reply = ROUTES[route]
    assert reply(post(server, path, body(None))) == (UNASKED[route], LIMIT)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_larger_limit_asked_for_is_capped_and_a_smaller_one_honoured(
    server: ServerProcess, route: str
) -> None:
    path, body, reply = ROUTES[route]
    assert reply(post(server, path, body(10 * LIMIT))) == (LENGTH[route], LIMIT)
    assert reply(post(server, path, body(3))) == (LENGTH[route], 3)
    assert f"{10 * LIMIT} tokens asked: capped to the server's limit of {LIMIT}" in server.log()


def test_anthropic_max_tokens_is_capped_and_a_smaller_one_honoured(server: ServerProcess) -> None:
    def ask(limit: int) -> tuple[str, int]:
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": limit, "temperature": 0}
        r = post(server, "/v1/messages", body)
        return r["stop_reason"], r["usage"]["output_tokens"]

    # what Claude Code asks for: cut at the server's limit, short of the request's own,
    # the answer ended its turn (``max_tokens`` would make the client ask again for more)
    assert ask(32000) == ("end_turn", LIMIT)
    assert ask(3) == ("max_tokens", 3)


def test_a_streamed_answer_without_a_limit_stops_at_the_servers(server: ServerProcess) -> None:
    body = {"messages": MESSAGES, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    finished = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
    assert finished[-1] == "length"
    assert events[-1]["usage"]["completion_tokens"] == LIMIT


def test_the_limit_comes_from_the_environment_and_0_lifts_it(
    tmp_path: Path, tiny_models: TinyModels
) -> None:
    ctx = 256
    body = {"messages": MESSAGES, "temperature": 0}
    env = {"LOCALKV_MAX_TOKENS": "5"}
    with ServerProcess(tiny_args(tiny_models, ctx), tmp_path / "env.log", env=env) as proc:
        assert post(proc, "/v1/chat/completions", body)["usage"]["completion_tokens"] == 5
    args = tiny_args(tiny_models, ctx, "--max-tokens", "0")
    with ServerProcess(args, tmp_path / "none.log", env=env) as proc:  # the option wins
        usage = post(proc, "/v1/chat/completions", body)["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == ctx  # the context is full
