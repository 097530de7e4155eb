"""A sliding-window model behind ``localkv serve``: every answer leaves its snapshot.

The tiny gemma3 model (window narrower than a block): an answer's tokens are each
decoded alone, and so is its closing, so nothing in the batches alone makes the
turn's end a point a restore can end at; the schedule marks it (an empty batch,
a settle). Through every protocol the answer is then saved and named, ``cache ls``
lists it, and a restarted server restores the conversation through its last
answer, verified, to the bits an uncached run computes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from support.server import ServerProcess, post
from support.tinyarch import build
from support.tinymodels import tiny_config

from localkv.cli import cli
from localkv.model.sampling import SamplingParams
from localkv.prompt.template import Message
from localkv.runtime import Runtime
from localkv.runtime.chatsession import ChatSession, ChatState

NOTES = "Alice was beginning to get very tired of sitting by her sister on the bank. "
WARNING = "could not save the snapshot"


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    return build(tmp_path_factory.mktemp("swa") / "gemma3.gguf", "gemma3", default_model_path)


def serve_args(model: Path) -> list[str]:
    # a built-in format: an answer's text is tokenized alone when a client sends it back
    return ["--model", str(model), "--threads", "1", "--ctx", "4096", "--chat-template", "chatml"]


def system(word: str) -> str:
    return f"{word} notes. " + " ".join(f"Chapter {i}. {NOTES}" for i in range(12))


# each protocol's path, its request for (system prompt, user message), and a reply's
# prompt tokens, generated tokens and cached tokens
Counts = Callable[[dict[str, Any]], tuple[int, int, int]]


def _openai(reply: dict[str, Any]) -> tuple[int, int, int]:
    usage = reply["usage"]
    return usage["prompt_tokens"], usage["completion_tokens"], reply["localkv"]["cached_tokens"]


def _responses(reply: dict[str, Any]) -> tuple[int, int, int]:
    usage = reply["usage"]
    return usage["input_tokens"], usage["output_tokens"], reply["localkv"]["cached_tokens"]


def _anthropic(reply: dict[str, Any]) -> tuple[int, int, int]:
    usage = reply["usage"]
    prompt = (
        usage["input_tokens"]
        + usage["cache_creation_input_tokens"]
        + usage["cache_read_input_tokens"]
    )
    return prompt, usage["output_tokens"], reply["localkv"]["cached_tokens"]


def _ollama(reply: dict[str, Any]) -> tuple[int, int, int]:
    return reply["prompt_eval_count"], reply["eval_count"], reply["localkv"]["cached_tokens"]


PROTOCOLS: dict[str, tuple[str, Callable[[str, str], dict[str, Any]], Counts]] = {
    "OpenAI": (
        "/v1/chat/completions",
        lambda s, u: {
            "messages": [{"role": "system", "content": s}, {"role": "user", "content": u}],
            "max_tokens": 4,
        },
        _openai,
    ),
    "Responses": (
        "/v1/responses",
        lambda s, u: {"instructions": s, "input": u, "max_output_tokens": 4},
        _responses,
    ),
    "Anthropic": (
        "/v1/messages",
        lambda s, u: {"system": s, "messages": [{"role": "user", "content": u}], "max_tokens": 4},
        _anthropic,
    ),
    "Ollama": (
        "/api/chat",
        lambda s, u: {
            "messages": [{"role": "system", "content": s}, {"role": "user", "content": u}],
            "options": {"num_predict": 4},
            "stream": False,
        },
        _ollama,
    ),
}


def ask(server: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, reply = post(server, path, json.dumps({"model": "tiny", **body}).encode())
    assert status == 200, reply
    return reply


def listed() -> dict[str, dict[str, Any]]:
    result = CliRunner().invoke(cli, ["cache", "ls", "--json"])
    assert result.exit_code == 0, result.output
    return {snap["label"]: snap for snap in json.loads(result.stdout)}


def test_every_answer_in_every_protocol_is_saved_and_listed(gemma3: Path, tmp_path: Path) -> None:
    counts: dict[str, tuple[int, int]] = {}
    with ServerProcess(serve_args(gemma3), tmp_path / "server.log") as server:
        for name, (path, body, read) in PROTOCOLS.items():
            prompt, generated, _ = read(ask(server, path, body(system(name), "Who is tired?")))
            counts[f"server: {name} notes. Chapter 0. Alice was…"] = (prompt, generated)
        done = ask(server, "/v1/completions", {"prompt": system("Completion"), "max_tokens": 4})
        completion = done["usage"]["prompt_tokens"]
    assert WARNING not in server.log()
    snapshots = listed()
    for label, (prompt, generated) in counts.items():
        # the answer and the turn's closing tokens: what the next request starts with
        assert snapshots[label]["tokens"] > prompt + generated, (label, snapshots[label])
    label = "server: Completion notes. Chapter 0. Alice was…"
    assert snapshots[label]["tokens"] == completion  # a completion's prompt, as before


def test_a_restarted_server_restores_the_conversation_through_its_last_answer(
    gemma3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # one-token answers: their text is tokenized back to the id sampled, so a server
    # that has forgotten the answer (restarted) still sends the model the same tokens
    messages = [{"role": "system", "content": system("Restart")}]
    turns: list[tuple[int, int, int]] = []
    for question in ("Who is tired?", "Where is she?", "Why?"):
        messages.append({"role": "user", "content": question})
        with ServerProcess(serve_args(gemma3), tmp_path / "server.log") as server:
            reply = ask(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
        turns.append(_openai(reply))
        assert reply["localkv"]["source"] == ("disk" if len(turns) > 1 else "none")
        assert reply["localkv"]["verified"] is (True if len(turns) > 1 else None)
        messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    for (prompt, generated, _), (_, _, cached) in pairwise(turns):
        assert cached >= prompt + generated  # every token through the last answer
    assert WARNING not in (tmp_path / "server.log").read_text()
    # the same last turn on an empty cache: the same answer
    monkeypatch.setenv("LOCALKV_HOME", str(tmp_path / "cold"))
    with ServerProcess(serve_args(gemma3), tmp_path / "cold.log") as server:
        cold = ask(server, "/v1/chat/completions", {"messages": messages[:-1], "max_tokens": 1})
    assert cold["localkv"]["cached_tokens"] == 0
    assert cold["choices"][0]["message"]["content"] == messages[-1]["content"]


def test_a_conversation_restored_through_its_answer_gives_the_uncached_logits(
    gemma3: Path, tmp_path: Path
) -> None:
    """The state restored at a turn's end is the state the uncached run computes: the
    next question's logits are the same bits."""
    config = tiny_config(gemma3, n_ctx=4096)
    with Runtime(config, cache_dir=tmp_path) as rt:
        chat = ChatSession(rt)
        chat.reset(system("Exact"))
        chat.send("Who is tired?", SamplingParams(temperature=1.0, seed=3, max_tokens=24))
        turn_end = len(chat.state.tokens)
        state = ChatState(
            system=chat.state.system,
            messages=list(chat.state.messages),
            tokens=list(chat.state.tokens),
            boundaries=list(chat.state.boundaries),
            generated=list(chat.state.generated),
        )
    with Runtime(config, cache_dir=tmp_path) as rt:
        resumed = ChatSession(rt, state)
        question = rt.template.message_tokens(state.messages, Message("user", "Why?"))
        state.messages.append(Message("user", "Why?"))
        state.tokens += question + rt.template.assistant_start_tokens(state.messages)
        state.boundaries.append(len(state.tokens))
        report = resumed.sync()
        assert report.cache is not None and report.cache.verified is True
        assert report.cache.reused == turn_end  # through the answer and its closing tokens
        cached = rt.session.last_logits
        assert cached is not None
        cached = cached.copy()
    with Runtime(config, use_cache=False) as rt:
        rt.session.prefill(state.tokens, ends=ChatSession(rt, state).schedule())
        uncached = rt.session.last_logits
    assert uncached is not None
    assert np.array_equal(cached.view(np.uint32), uncached.view(np.uint32))
