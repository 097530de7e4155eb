"""One server conversation, one snapshot row; and a prompt too long for the server's ``--ctx``.

Real ``localkv serve`` processes on the tiny model: questions after one system
prompt leave one row in ``cache ls``, another system prompt another row, and
the row a new question replaced leaves the shared prefix for the next one,
whose answer is the uncached one.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

from click.testing import CliRunner
from support.server import ServerProcess
from support.server import post as support_post
from support.tinymodels import TinyModels

from localkv.cli import cli


def tiny_args(tiny_models: TinyModels) -> list[str]:
    return ["--model", str(tiny_models.base), "--threads", "1", "--ctx", "2048"]


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    return support_post(server, path, json.dumps(body).encode())


def ask(server: ServerProcess, system: str, *turns: str) -> dict[str, Any]:
    """A chat request: ``system``, then user and assistant turns in turn, the last a user's."""
    messages = [{"role": "system", "content": system}]
    roles = ["user", "assistant"]
    messages += [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)]
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 4}
    status, answer = post(server, "/v1/chat/completions", body)
    assert status == 200, answer
    return answer  # type: ignore[no-any-return]


def rows(server: ServerProcess | None = None) -> list[str]:
    """The labels of the server's rows: as the running ``server`` lists them once its saves
    are done, else as ``cache ls`` does."""
    if server is not None:
        with urllib.request.urlopen(server.base_url + "/v1/localkv/cache", timeout=60) as r:
            listed = json.loads(r.read())["data"]
    else:
        done = CliRunner().invoke(cli, ["cache", "ls", "--json"])
        assert done.exit_code == 0, done.output
        listed = json.loads(done.stdout)
    return sorted(s["label"] for s in listed if s["label"].startswith("server: "))


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def text(answer: dict[str, Any]) -> str:
    return str(answer["choices"][0]["message"]["content"])


def test_questions_after_one_system_prompt_leave_one_row(
    tmp_path: Path, tiny_models: TinyModels, long_text: str
) -> None:
    alice, bob = "Alice's notes. " + long_text[:3000], "Bob's notes. " + long_text[:3000]
    with ServerProcess(tiny_args(tiny_models), tmp_path / "server.log") as proc:
        first = ask(proc, alice, "Who is Alice?")  # nothing cached: the uncached answer
        second = ask(proc, alice, "Where is the rabbit?")
        assert cached(second) > 500  # the system prompt
        assert rows(proc) == ["server: Alice's notes. Chapter 0. Alice was…"]
        ask(proc, bob, "Who is Bob?")
        ask(proc, alice, "Who is Alice?", text(first), "And then?")  # another conversation
    assert rows() == [
        "server: Alice's notes. Chapter 0. Alice was…",
        "server: Alice's notes. Chapter 0. Alice was… · Who is Alice? · 2 turns",
        "server: Bob's notes. Chapter 0. Alice was…",
    ]
    with ServerProcess(tiny_args(tiny_models), tmp_path / "server.log") as proc:
        again = ask(proc, alice, "Who is Alice?")  # the first question's row was replaced:
        assert again["localkv"]["source"] == "disk" and cached(again) > 500  # the stem stayed
        assert text(again) == text(first)
        assert len(rows(proc)) == 3


def test_a_prompt_too_long_names_the_servers_ctx_in_every_protocol(
    tmp_path: Path, tiny_models: TinyModels, long_text: str
) -> None:
    messages = [{"role": "user", "content": long_text * 2}]
    chat = {"model": "tiny", "messages": messages, "max_tokens": 2}
    with ServerProcess(tiny_args(tiny_models), tmp_path / "server.log") as proc:
        status, openai = post(proc, "/v1/chat/completions", chat)
        assert status == 413 and "context of 2,048 tokens" in openai["error"]["message"]
        assert "--ctx" in openai["error"]["message"]
        status, anthropic = post(proc, "/v1/messages", chat)  # Claude Code's words alone
        assert status == 413 and anthropic["error"]["message"].endswith("> 2047 maximum")
        status, ollama = post(proc, "/api/chat", {**chat, "stream": False})
        assert status == 413 and "--ctx" in ollama["error"], ollama
        status, responses = post(proc, "/v1/responses", {"model": "tiny", "input": long_text * 2})
        assert status == 413 and "--ctx" in responses["error"]["message"], responses
        status, prefill = post(proc, "/v1/localkv/prefill", {"documents": [long_text * 2]})
        said = prefill["error"]["message"]
        assert status == 413 and "--ctx" in said and "context of 2,048 tokens" in said, said
