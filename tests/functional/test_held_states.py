"""Held states (``cache.restore.held``): memory that cannot be cut back, resumed exactly.

A sliding window, a hybrid or a recurrent state cannot be cut back, so a question
about a document restores the document from the disk; the next questions resume
the state that restore left in memory, with no read and no probe. Its
answer and final logits must be an uncached run's, bit for bit, and a held state
must never be resumed for other tokens or in another context.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.tinyarch import TinyArchModels
from support.tinymodels import tiny_config

from localkv.cache.restore.held import HeldStates
from localkv.model.sampling import SamplingParams
from localkv.model.session import ModelSession
from localkv.prompt.request import Document
from localkv.runtime import Runtime

GREEDY = SamplingParams(temperature=0, max_tokens=8)
QUESTIONS = ["What was Alice doing?", "Who was reading the book?", "Where was the bank?"]
TEXT = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of "
    "having nothing to do: once or twice she had peeped into the book her sister was reading. "
)


def _doc(first: str = "Chapter") -> Document:
    return Document.from_text(" ".join(f"{first} {i}. {TEXT}" for i in range(12)), "doc.txt")


def _uncached(path: Path, doc: Document, question: str) -> tuple[str, np.ndarray]:
    with Runtime(tiny_config(path, n_ctx=2048), use_cache=False) as rt:
        answer = rt.ask([doc], question, params=GREEDY)
        logits = rt.session.last_logits
        assert logits is not None
        return answer.text, logits.copy()


@pytest.mark.parametrize("arch", ["gemma3", "lfm2", "mamba2"])
def test_a_document_asked_again_resumes_its_held_state_bit_for_bit(
    arch: str, arch_models: TinyArchModels, tmp_path: Path
) -> None:
    path = arch_models.all()[arch]
    doc = _doc()
    with Runtime(tiny_config(path, n_ctx=2048), cache_dir=tmp_path) as rt:
        assert rt.cache is not None
        rt.cache.held.max_bytes = 1 << 30  # room for them, whatever this machine has free
        n_doc = rt.prefill([doc]).tokens
        got = []
        for question in QUESTIONS:
            answer = rt.ask([doc], question, params=GREEDY)
            logits = rt.session.last_logits
            assert logits is not None
            got.append((answer, logits.copy()))
        other = rt.ask([_doc("Part")], QUESTIONS[0], params=GREEDY)  # other tokens
    first, second, third = (answer.cache for answer, _ in got)
    # the first restores the document from the disk (its probe decoded); the others resume
    assert first.reused == second.reused == third.reused >= n_doc - 1
    assert first.steps["probe"] > 0
    assert second.steps["probe"] == third.steps["probe"] == 0
    assert second.verified is third.verified is True
    assert other.cache.reused == 0 or other.cache.steps.get("probe", 0) > 0
    for (answer, logits), question in zip(got, QUESTIONS, strict=True):
        text, expected = _uncached(path, doc, question)
        assert answer.text == text
        assert np.array_equal(logits.view(np.uint32), expected.view(np.uint32))


def test_a_held_state_resumes_only_in_the_context_that_took_it(
    arch_models: TinyArchModels,
) -> None:
    cfg = tiny_config(arch_models.all()["gemma3"], n_ctx=1024)
    with ModelSession(cfg) as one, ModelSession(cfg) as two:
        one.prefill(list(range(10, 60)), boundaries=[50])
        taken = one.checkpoint()
        with pytest.raises(ValueError, match="context that took it"):
            two.resume(taken)
        one.reset()
        one.resume(taken)
        assert one.tokens == list(range(10, 60)) and one.capture_state() == taken.state.tobytes()


def test_held_states_are_bounded_by_count_and_bytes(arch_models: TinyArchModels) -> None:
    cfg = tiny_config(arch_models.all()["gemma3"], n_ctx=1024)
    with ModelSession(cfg) as session:
        taken = []
        for n in (20, 30, 40, 50, 60):
            session.reset()
            session.prefill(list(range(10, 10 + n)), boundaries=[n])
            taken.append(session.checkpoint())
    held = HeldStates(max_bytes=10 * taken[-1].nbytes, keep=4)
    for i, checkpoint in enumerate(taken):
        assert held.put(f"tip{i}", checkpoint)
    assert len(held) == 4 and held.get("tip0") is None  # the least recently used went
    assert held.get("tip1") is not None  # now the most recently used
    small = HeldStates(max_bytes=taken[1].nbytes + taken[2].nbytes)
    assert small.put("a", taken[1]) and small.put("b", taken[2]) and small.put("c", taken[0])
    assert small.get("a") is None and small.nbytes <= small.max_bytes
    assert not small.put("big", taken[-1]) or taken[-1].nbytes <= small.max_bytes


def test_no_state_is_held_over_the_bound_and_each_question_restores_from_the_disk(
    arch_models: TinyArchModels, tmp_path: Path
) -> None:
    doc = _doc()
    with Runtime(tiny_config(arch_models.all()["gemma3"], n_ctx=2048), cache_dir=tmp_path) as rt:
        assert rt.cache is not None
        rt.cache.held.max_bytes = 0  # no memory to hold one in
        rt.prefill([doc])
        reports = [rt.ask([doc], question, params=GREEDY).cache for question in QUESTIONS]
        assert len(rt.cache.held) == 0
    assert all(r.steps["probe"] > 0 and not r.held and r.verified for r in reports)
