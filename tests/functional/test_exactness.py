"""A cache hit is the uncached computation, bit for bit, whatever wrote the cache.

A property test over random documents, segmentations and writers: the first
request stores blocks (a prefill, an ask, a chat turn, a partial restore then a
prefill, a prefill cancelled midway); a second request sharing a prefix with it
restores what it can and prefills the rest. Its logits after the prompt must be
bit-identical to those of its own uncached run in the same session. llama.cpp's
kernels are not batch-size invariant, so a block computed in other batches than
the second request's uncached run would batch it differs in the last bits and
fails here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from support.tinymodels import TinyModels, tiny_config

from localkv.model.sampling import SamplingParams
from localkv.prompt.request import Document, Request
from localkv.runtime import Runtime
from localkv.runtime.chatsession import ChatSession, ChatState

SEEDS = range(16)
GREEDY = SamplingParams(temperature=0, max_tokens=6)


@dataclass(frozen=True)
class Case:
    system: str | None
    documents: list[Document]
    question: str


def _text(rng: random.Random, words: list[str], n: int) -> str:
    return " ".join(rng.choice(words) for _ in range(n))


def _case(rng: random.Random, words: list[str]) -> Case:
    system = _text(rng, words, rng.randrange(3, 120)) if rng.random() < 0.7 else None
    docs = [
        Document.from_text(_text(rng, words, rng.randrange(20, 400)), f"d{i}.txt")
        for i in range(rng.randrange(1, 4))
    ]
    return Case(system, docs, _text(rng, words, rng.randrange(3, 20)) + "?")


def _sharing(rng: random.Random, words: list[str], case: Case) -> Case:
    """A second request that shares a prefix with ``case``, ending anywhere in it."""
    kind = rng.choice(["same", "fewer", "cut", "more", "question"])
    docs = list(case.documents)
    if kind == "fewer" and len(docs) > 1:
        docs = docs[: rng.randrange(1, len(docs))]
    elif kind == "cut":  # a document edited somewhere: the prefix ends mid-segment
        i = rng.randrange(len(docs))
        text = docs[i].text
        at = rng.randrange(1, len(text))
        docs[i] = Document.from_text(text[:at] + " " + _text(rng, words, 30), docs[i].name)
        docs = docs[: i + 1]
    elif kind == "more":
        docs.append(Document.from_text(_text(rng, words, rng.randrange(20, 300)), "extra.txt"))
    question = case.question if kind == "same" else _text(rng, words, 8) + "?"
    return Case(case.system, docs, question)


def _write(rt: Runtime, rng: random.Random, words: list[str], case: Case) -> str:
    """Store blocks for ``case`` in one of the ways a user's work does; name the way."""
    how = rng.choice(["prefill", "ask", "chat", "partial", "cancelled"])
    if how == "prefill":
        rt.prefill(case.documents, system=case.system)
    elif how == "ask":
        rt.ask(case.documents, case.question, system=case.system, params=GREEDY)
    elif how == "chat":
        chat = ChatSession(rt, None)
        chat.reset(case.system)
        chat.send(_text(rng, words, 6), GREEDY)  # a turn before the documents
        for doc in case.documents:
            chat.attach(doc)
        chat.send(case.question, GREEDY)
    elif how == "partial":  # something sharing a prefix first, then this request
        other = _sharing(rng, words, case)
        rt.prefill(other.documents, system=other.system)
        rt.wait_for_saves()
        rt.prefill(case.documents, system=case.system)
    else:
        n = rt.build(case.documents, system=case.system).tokens
        batches = [0]
        stop_after = rng.randrange(1, max(2, len(n) // 64))

        def cancel() -> bool:
            batches[0] += 1
            return batches[0] > stop_after

        report = rt.prefill(case.documents, system=case.system, cancel=cancel)
        assert report.cancelled == (report.prefilled < len(n))
    rt.wait_for_saves()
    return how


def _cached_and_uncached(rt: Runtime, request: Request) -> tuple[np.ndarray, np.ndarray, int]:
    ends = rt.schedule(request)
    rt.restore(request.tokens, ends)
    reused = rt.session.n_tokens
    rt.session.prefill(request.tokens[reused:], ends=ends)
    cached = rt.session.last_logits
    rt.session.reset()
    rt.session.prefill(request.tokens, ends=ends)
    uncached = rt.session.last_logits
    assert cached is not None and uncached is not None
    return cached, uncached, reused


@pytest.mark.parametrize("seed", SEEDS)
def test_a_cached_prompt_gives_the_uncached_logits_bit_for_bit(
    tiny_models: TinyModels, tmp_path: Path, long_text: str, seed: int
) -> None:
    rng = random.Random(seed)
    words = long_text.split()[:2000]
    case = _case(rng, words)
    second = _sharing(rng, words, case)
    with Runtime(tiny_config(tiny_models.q8_0, n_ctx=4096), cache_dir=tmp_path) as rt:
        how = _write(rt, rng, words, case)
        request = rt.build(second.documents, system=second.system, question=second.question)
        cached, uncached, reused = _cached_and_uncached(rt, request)
    diff = float(np.max(np.abs(cached - uncached)))
    assert np.array_equal(cached, uncached), f"written by {how}, reused {reused}: diff {diff}"


@pytest.mark.parametrize("seed", range(6))
def test_a_resumed_conversation_gives_the_live_logits_bit_for_bit(
    tiny_models: TinyModels, tmp_path: Path, long_text: str, seed: int
) -> None:
    """Generated tokens were decoded one by one: a resume computes them the same way."""
    rng = random.Random(1000 + seed)
    words = long_text.split()[:2000]
    case = _case(rng, words)
    with Runtime(tiny_config(tiny_models.q8_0, n_ctx=4096), cache_dir=tmp_path) as rt:
        chat = ChatSession(rt, None)
        chat.reset(case.system)
        for doc in case.documents[:1]:
            chat.attach(doc)
        chat.send(case.question, SamplingParams(temperature=0, max_tokens=rng.randrange(1, 40)))
        saved = ChatState(
            system=chat.state.system,
            messages=list(chat.state.messages),
            tokens=list(chat.state.tokens),
            boundaries=list(chat.state.boundaries),
            documents=list(chat.state.documents),
            generated=list(chat.state.generated),
        )
        assert saved.generated, "the answer's tokens are recorded as generated"
        rt.wait_for_saves()
        resumed = ChatSession(rt, saved)
        resumed.runtime.session.reset()
        report = resumed.sync()
        assert report.cache is not None and report.cache.reused > 0
        cached = rt.session.last_logits
        rt.session.reset()
        rt.session.prefill(saved.tokens, ends=resumed.schedule())
        uncached = rt.session.last_logits
    assert cached is not None and uncached is not None
    assert np.array_equal(cached, uncached)
