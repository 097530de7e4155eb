"""A request's grammar cannot hold the server: real server processes on the tiny model.

``(a|a|aa)*(a?){400}b`` is a 40-character pattern that llama.cpp, given the
schema converter's literal translation, reads so many ways at once that one
token took minutes inside a native call: the worker stayed busy long after
its client left, and SIGTERM waited for it. Patterns are now a deterministic
automaton (``localkv.model.sampling.pattern``), the ones that cannot be made
one within bounds are a 400 naming the field, and a stop cancels the running
request. The bounds below are liveness limits far above the work they allow,
not timings.
"""

from __future__ import annotations

import contextlib
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.server import ServerProcess
from support.tinymodels import TinyModels

AMBIGUOUS = "^(a|a|aa)*(a?){400}b$"
# the same ambiguity, then 1,000 digits (a token each in this vocabulary): a long answer
LONG = "^(a|a|aa)*(a?){400}[0-9]{1000}$"
HOSTILE = "^((a?){30}){30}$"  # 900 optional characters read every way: refused
ANSWER_S = 60.0  # liveness: far above the answers' work; the old stall took minutes a token
FREED_S = 30.0  # liveness: a cancelled answer stops at its next token
EXIT_S = 60.0  # liveness: far above the default --stop-grace


def serve(tmp_path: Path, tiny_models: TinyModels, name: str) -> ServerProcess:
    args = ["--model", str(tiny_models.base), "--threads", "1", "--ctx", "4096"]
    return ServerProcess(args, tmp_path / f"{name}.log", global_args=("-v",))


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_models: TinyModels
) -> Iterator[ServerProcess]:
    with serve(tmp_path_factory.mktemp("grammar"), tiny_models, "server") as proc:
        yield proc
        assert "Traceback" not in proc.log()


def string_schema(pattern: str) -> dict[str, Any]:
    return {"type": "string", "pattern": pattern}


def openai_body(pattern: str, max_tokens: int = 16) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Spell it."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "spelling", "schema": string_schema(pattern)},
        },
    }


def tool_body(pattern: str) -> dict[str, Any]:
    parameters = {
        "type": "object",
        "properties": {"word": string_schema(pattern)},
        "required": ["word"],
    }
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Spell it."}],
        "max_tokens": 32,
        "temperature": 0,
        "tools": [{"type": "function", "function": {"name": "spell", "parameters": parameters}}],
        "tool_choice": {"type": "function", "function": {"name": "spell"}},
    }


def ollama_body(pattern: str) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Spell it."}],
        "format": string_schema(pattern),
        "stream": False,
        "options": {"num_predict": 16, "temperature": 0},
    }


FACES = {
    "response_format": ("/v1/chat/completions", openai_body),
    "tool parameters": ("/v1/chat/completions", tool_body),
    "ollama format": ("/api/chat", ollama_body),
}


def post(proc: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(proc.base_url + path, json=body, timeout=ANSWER_S)


def running(proc: ServerProcess) -> int:
    return int(httpx.get(proc.base_url + "/health", timeout=10).json()["queue"]["running"])


@pytest.mark.parametrize("face", FACES)
def test_the_ambiguous_pattern_is_answered_within_a_bound(server: ServerProcess, face: str) -> None:
    path, body = FACES[face]
    r = post(server, path, body(AMBIGUOUS))  # before: a timeout, the worker held for minutes
    assert r.status_code == 200, r.text
    if face == "response_format":
        text = r.json()["choices"][0]["message"]["content"]
        assert re.fullmatch(r'"a*(b" ?)?', text), text  # all of it, or as far as it got
    elif face == "ollama format":
        text = r.json()["message"]["content"]
        assert re.fullmatch(r'"a*(b" ?)?', text), text


@pytest.mark.parametrize("face", FACES)
def test_a_pattern_too_ambiguous_to_bound_is_a_400_naming_the_field(
    server: ServerProcess, face: str
) -> None:
    path, body = FACES[face]
    r = post(server, path, body(HOSTILE))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    message = error if isinstance(error, str) else error["message"]
    assert "too ambiguous" in message and HOSTILE in message, message
    if face == "response_format":
        assert error["param"] == "response_format"
    elif face == "tool parameters":
        assert error["param"] == "tools[0].function.parameters"
    else:
        assert "format" in message
    assert running(server) == 0


@contextlib.contextmanager
def answering(proc: ServerProcess) -> Iterator[Iterator[str]]:
    """A streamed answer under ``LONG``, open once its text is under way: its lines."""
    body = {**openai_body(LONG, max_tokens=3000), "stream": True}
    with httpx.stream(
        "POST", proc.base_url + "/v1/chat/completions", json=body, timeout=ANSWER_S
    ) as r:
        assert r.status_code == 200
        lines, texts, began = r.iter_lines(), 0, time.monotonic()
        while texts < 8:  # eight tokens in: well into the answer (keep-alives come between)
            assert time.monotonic() - began < ANSWER_S, f"{texts} tokens in {ANSWER_S:g} s"
            texts += bool(re.search(r'"content": ?"[^"]', next(lines)))
        yield lines


def test_a_client_that_leaves_frees_the_worker(server: ServerProcess) -> None:
    with answering(server):  # before: no second token for minutes
        pass
    left = time.monotonic()
    while running(server):
        assert time.monotonic() - left < FREED_S, "the worker is still busy"
        time.sleep(0.05)
    freed_s = time.monotonic() - left
    log = server.log()
    stopped = re.findall(r"POST /v1/chat/completions \S+ .*generated=(\d+) \(\w+, cancelled\)", log)
    assert stopped and int(stopped[-1]) < 1000, log[-2000:]  # it stopped before its answer ended
    again = post(server, "/v1/chat/completions", openai_body("^[a-z]{3}$", max_tokens=8))
    assert again.status_code == 200
    assert re.fullmatch(r'"[a-z]{0,3}"? ?', again.json()["choices"][0]["message"]["content"])
    print(f"the worker was free {freed_s:.2f} s after the client left")


def test_sigterm_during_a_long_answer_exits_within_the_grace_period(
    tmp_path: Path, tiny_models: TinyModels
) -> None:
    with serve(tmp_path, tiny_models, "sigterm") as proc, answering(proc) as lines:
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        code = proc.proc.wait(EXIT_S)  # before: it waited for the answer, for minutes
        exit_s = time.monotonic() - sent
        rest = [line for line in lines if line]  # what the server sent before it closed
    assert code == 0, proc.log()[-2000:]
    assert re.search(r"generated=\d+ \(\w+, cancelled\)", proc.log()), proc.log()[-2000:]
    assert rest[-1] == "data: [DONE]", rest[-3:]  # the answer ended, cut short
    print(f"SIGTERM to exit: {exit_s:.2f} s")
