"""A system prompt that a chat format merges into the first user turn (``gemma``) still
ends a segment where its text ends, so a new question after it reuses it whole.

Gemma's format writes the system prompt inside the first user turn: two requests with
the same system prompt and different questions share their tokens up to the end of the
system text, in the middle of a message. That end is a segment end (the batches, and so
the cached state, agree up to it), found from the prompt alone and only where it changes
no token. On a sliding-window model, whose live state cannot be cut back, the disk
restores there: a follow-up question and two documents in turn reuse the whole system
prompt rather than its last whole block, to the bits an uncached run computes. A system
prompt that differs in its last token, or a longer one that goes on like the first
request's question, reuses less than the first system prompt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.server import ServerProcess, post
from support.tinyarch import build
from support.tinymodels import TinyModels, tiny_config

from localkv.model.session import ModelSession
from localkv.prompt.template import ChatTemplate, Message
from localkv.runtime import Runtime
from localkv.runtime.chatsession import ChatSession
from localkv.server.conversation import AnswerMemory, build_prompt
from localkv.server.limits import Budget

NOTES = "Alice was beginning to get very tired of sitting by her sister on the bank."
BLOCK = 256


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    return build(tmp_path_factory.mktemp("swa") / "gemma3.gguf", "gemma3", default_model_path)


GEMMA3_JINJA = Path(__file__).parent.parent / "fixtures" / "templates" / "gemma3.jinja"


@pytest.fixture(
    params=[("gemma3", "gemma"), ("llama", "gemma"), ("gemma3", str(GEMMA3_JINJA))],
    ids=["swa-gemma", "kv-gemma", "swa-gemma3.jinja"],
)
def model(
    request: pytest.FixtureRequest, gemma3: Path, tiny_models: TinyModels
) -> tuple[Path, str]:
    """A sliding-window model and a plain-KV one, with llama.cpp's ``gemma`` format or
    Gemma 3's own Jinja template: each writes the system prompt into the first user turn."""
    name, template = request.param
    return (gemma3 if name == "gemma3" else tiny_models.base), template


def notes(word: str, chapters: int = 30) -> str:
    """A system prompt of a few hundred tokens, ending mid-block."""
    return f"{word} notes. " + " ".join(f"Chapter {i}. {NOTES}" for i in range(chapters))


def chat_messages(system: str, question: str) -> list[Message]:
    return [Message("system", system), Message("user", question)]


def system_end(model: tuple[Path, str], system: str, question: str) -> int:
    """How many of the request's tokens end with the system text."""
    session = ModelSession(tiny_config(model[0], n_ctx=4096))
    template = ChatTemplate(session, model[1])
    prompt = build_prompt(template, chat_messages(system, question), AnswerMemory(), Budget(4096))
    tokens = prompt.state.tokens
    return next(
        n
        for n in range(len(tokens))
        if session.detokenize(tokens[:n], special=True).endswith(system)
    )


def test_the_system_text_ends_a_segment_without_changing_a_token(gemma3: Path) -> None:
    session = ModelSession(tiny_config(gemma3, n_ctx=4096))
    template = ChatTemplate(session, "gemma")
    system = notes("Segment", 3)
    tokens, inner = template.message_parts([Message("system", system)], Message("user", "Who?"))
    # the same tokens as the message's own rendering, with one end inside them
    assert tokens == template.message_tokens([Message("system", system)], Message("user", "Who?"))
    assert len(inner) == 1
    assert session.detokenize(tokens[: inner[0]], special=True).endswith(system)
    assert not session.detokenize(tokens[: inner[0] - 1], special=True).endswith(system)
    # a request's prompt: after BOS (the system message alone renders nothing), where the
    # system text ends, after the assistant's opening
    prompt = build_prompt(template, chat_messages(system, "Who?"), AnswerMemory(), Budget(4096))
    start = len(template.start_tokens())
    assert prompt.state.boundaries == [start, start + inner[0], len(prompt.state.tokens)]
    assert prompt.reach[start + inner[0]] == 0  # the system message's end
    # the format gives a system prompt a turn of its own: no end inside a message
    chatml = ChatTemplate(session, "chatml")
    _, none = chatml.message_parts([Message("system", system)], Message("user", "Who?"))
    assert none == []


def ask(server: ServerProcess, system: str, question: str) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": 8,
        "temperature": 0,
    }
    status, reply = post(server, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, reply
    return reply


def serve_args(model: tuple[Path, str]) -> list[str]:
    path, template = model
    return ["--model", str(path), "--threads", "1", "--ctx", "4096", "--chat-template", template]


def test_a_follow_up_and_two_documents_reuse_the_whole_system_prompt(
    model: tuple[Path, str], tmp_path: Path
) -> None:
    one, two = notes("Follow"), notes("Second")
    end_one = system_end(model, one, "Who is tired?")
    end_two = system_end(model, two, "Who is tired?")
    assert end_one % BLOCK and end_one > BLOCK and end_two % BLOCK
    # (system prompt, question, the fewest tokens reused, the most)
    plan = [
        (one, "Who is tired?", 0, 0),
        (one, "Where is the sister?", end_one, end_one),  # a follow-up
        (two, "Who is tired?", 0, 0),
        (one, "What is on the bank?", end_one, end_one),  # two documents in turn
        (two, "Where is the sister?", end_two, end_two),
        # the same length, another last token: less than its system prompt
        (one[:-1] + "!", "Who is tired?", 0, end_one - 1),
        # a longer system prompt that goes on as the last request's question did
        (one[:-1] + "!\n\nWho is tired? Not Alice.", "Why?", 0, end_one - 1),
    ]
    with ServerProcess(serve_args(model), tmp_path / "cached.log") as server:
        cached = [ask(server, system, question) for system, question, _, _ in plan]
    with ServerProcess([*serve_args(model), "--no-cache"], tmp_path / "uncached.log") as server:
        uncached = [ask(server, system, question) for system, question, _, _ in plan]
    reused = [reply["localkv"]["cached_tokens"] for reply in cached]
    for got, (_, _, low, high) in zip(reused, plan, strict=True):
        assert low <= got <= high, (reused, end_one, end_two)
    assert reused[5] < end_one and reused[6] < end_one
    for warm, cold in zip(cached, uncached, strict=True):
        assert warm["localkv"]["verified"] in (True, None)
        assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]


def test_a_restore_at_the_system_end_gives_the_uncached_logits(
    model: tuple[Path, str], tmp_path: Path
) -> None:
    """The state restored where the system text ends, then the new question, is the
    uncached run's: the last logits are the same bits."""
    config = tiny_config(model[0], n_ctx=4096, chat_template=model[1])
    system = notes("Exact")
    with Runtime(config, cache_dir=tmp_path) as rt:
        first = build_prompt(
            rt.template, chat_messages(system, "Who is tired?"), AnswerMemory(), Budget(4096)
        )
        chat = ChatSession(rt, first.state)
        chat.sync()
        chat.save()
    with Runtime(config, cache_dir=tmp_path) as rt:
        second = build_prompt(
            rt.template, chat_messages(system, "Where is she?"), AnswerMemory(), Budget(4096)
        )
        state = second.state
        report = ChatSession(rt, state).sync()
        end = system_end(model, system, "Where is she?")
        assert end % BLOCK  # mid-block
        assert report.cache is not None and report.cache.verified is True
        assert report.reused == end
        cached = rt.session.last_logits
        assert cached is not None
        cached = cached.copy()
    with Runtime(config, use_cache=False) as rt:
        rt.session.prefill(state.tokens, ends=ChatSession(rt, state).schedule())
        uncached = rt.session.last_logits
    assert uncached is not None
    assert np.array_equal(cached.view(np.uint32), uncached.view(np.uint32))
