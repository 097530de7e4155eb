"""Recurrent states are kept at segment ends and every ``snapshot_interval`` tokens.

A real hybrid or recurrent model's state is tens of MB, so blocks between two
kept states hold attention rows only: a restore goes through them and ends at
a block that keeps a state. The interval is the model's (``snapshot_interval``);
here it is set wider than a block, as a real model's would be.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from localkv.storage import SnapshotStore
from support.tinyarch import TinyArchModels, build_tiny_arch_models
from support.tinymodels import tiny_config

from localkv.model.partial_state import MIN_ROW_BYTES, snapshot_interval
from localkv.model.sampling import SamplingParams
from localkv.prompt.request import Document
from localkv.runtime import Runtime

BLOCK = 256
EVERY = 3 * BLOCK
SYSTEM = "Answer from the document."
TEXT = "Alice was beginning to get very tired of sitting by her sister on the bank. "
GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def arch_models(
    tmp_path_factory: pytest.TempPathFactory, default_model_path: Path
) -> TinyArchModels:
    return build_tiny_arch_models(tmp_path_factory.mktemp("arch"), default_model_path)


def _doc(changed_at: int | None = None) -> Document:
    chapters = [f"Chapter {i}. {TEXT}" for i in range(90)]
    if changed_at is not None:
        chapters[changed_at] = f"Chapter {changed_at}. The Queen of Hearts shouted at everyone."
    return Document.from_text(" ".join(chapters), "doc.txt")


def _runtime(model: Path, cache: Path | None) -> Runtime:
    rt = Runtime(tiny_config(model, n_ctx=4096), cache_dir=cache, use_cache=cache is not None)
    rt.session.snapshot_interval = EVERY
    return rt


def _ask(model: Path, cache: Path | None, doc: Document) -> tuple[str, int, np.ndarray]:
    with _runtime(model, cache) as rt:
        answer = rt.ask([doc], "What?", system=SYSTEM, params=GREEDY)
        logits = rt.session.last_logits
        assert logits is not None
        return answer.text, answer.tokens.reused, logits.copy()


def test_the_interval_weighs_a_state_against_the_rows_between_states() -> None:
    assert snapshot_interval(10_000, 128, BLOCK) == BLOCK  # a tiny state: every block
    # a 55 MiB state: 4 blocks of 64 KiB rows per token outweigh it, 7 of 16 KiB rows
    # (weighed as 32 KiB: a state never costs more than that per token)
    assert snapshot_interval(55 << 20, 64 << 10, BLOCK) == 4 * BLOCK
    assert snapshot_interval(55 << 20, 16 << 10, BLOCK) == 7 * BLOCK
    # no attention rows at all: weighed against 32 KiB per token
    assert (
        snapshot_interval(160 << 20, 0, BLOCK) == -(-(160 << 20) // (BLOCK * MIN_ROW_BYTES)) * BLOCK
    )


@pytest.mark.parametrize("arch", ["lfm2", "mamba2", "qwen35"])
def test_states_are_kept_at_segment_ends_and_every_interval(
    arch: str, arch_models: TinyArchModels, tmp_path: Path
) -> None:
    model = arch_models.all()[arch]
    with _runtime(model, tmp_path) as rt:
        report = rt.prefill([_doc()], system=SYSTEM)
        ends = rt.build([_doc()], system=SYSTEM).boundaries
    with SnapshotStore.open(tmp_path) as store:
        rows = store.all_blocks()
    kept = sorted(r.end for r in rows if r.end_state)
    through = sorted(r.end for r in rows if not r.end_state)
    assert kept == sorted({*range(EVERY, report.tokens + 1, EVERY), *ends})
    assert through and all(e % BLOCK == 0 and e % EVERY for e in through)
    text, reused, logits = _ask(model, tmp_path, _doc())
    assert reused == report.tokens  # the document's end keeps its state
    uncached = _ask(model, None, _doc())
    assert text == uncached[0] and np.array_equal(
        logits.view(np.uint32), uncached[2].view(np.uint32)
    )


@pytest.mark.parametrize("arch", ["lfm2", "mamba2"])
def test_a_divergence_recomputes_at_most_one_interval(
    arch: str, arch_models: TinyArchModels, tmp_path: Path
) -> None:
    model = arch_models.all()[arch]
    with _runtime(model, tmp_path) as rt:
        rt.prefill([_doc()], system=SYSTEM)
        a = rt.build([_doc()], system=SYSTEM).tokens
        b = rt.build([_doc(changed_at=70)], system=SYSTEM).tokens
    p = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert p > EVERY + BLOCK
    text, reused, logits = _ask(model, tmp_path, _doc(changed_at=70))
    assert reused == p // EVERY * EVERY  # the last kept state before the change
    uncached = _ask(model, None, _doc(changed_at=70))
    assert text == uncached[0] and np.array_equal(
        logits.view(np.uint32), uncached[2].view(np.uint32)
    )
