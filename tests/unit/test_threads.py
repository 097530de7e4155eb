"""Decodes use the cores other work leaves free, only where the thread count changes no result."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from support.tinyarch import build_tiny_arch_models
from support.tinymodels import TinyModels, tiny_config

import localkv
from localkv.model import threads as thread_choice
from localkv.model.session import ModelSession, SessionConfig
from localkv.model.threads import RECHECK_S, fitting_threads
from localkv.prompt.request import Document
from localkv.runtime import Runtime

CORES = len(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(CORES < 2, reason="one core: one thread either way")


@pytest.fixture()
def load(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """The load a thread fit sees (tasks runnable besides this process), given to it
    (``$LOCALKV_OTHER_TASKS``) rather than read from the machine, which other work may
    be using: none until a test sets one."""

    def set_load(n: float) -> None:
        monkeypatch.setenv(thread_choice.ENV_OTHER_TASKS, str(n))

    set_load(0)
    return set_load


def test_one_thread_per_core_left_free() -> None:
    assert fitting_threads(2, 0) == 2
    assert fitting_threads(2, 0.5) == 2  # (a median between one moment's 0 and 1)
    assert fitting_threads(2, 1) == 1
    assert fitting_threads(2, 2) == 1
    assert fitting_threads(2, 9) == 1
    assert fitting_threads(16, 4) == 12
    assert fitting_threads(4, 1.5) == 3  # half up, at every count (not round()'s to even)
    assert fitting_threads(1, 0) == 1


def _prefill_logits(path: Path, n_threads: int | None, tokens: list[int]) -> np.ndarray:
    with ModelSession(SessionConfig(model_path=path, n_ctx=512, n_threads=n_threads)) as s:
        s.prefill(tokens[:-1], ends=[len(tokens) - 1])
        return s.decode_one(tokens[-1])


@needs_two
def test_flash_attention_off_gives_the_same_bits_at_every_thread_count(
    default_model_path: Path,
) -> None:
    """What lets the count follow the load: the uncached answer is the same with 1 or 2."""
    with ModelSession(SessionConfig(model_path=default_model_path, n_ctx=512)) as s:
        tokens = s.tokenize("The cache must restore exactly what was computed. " * 6)
    one = _prefill_logits(default_model_path, 1, tokens)
    two = _prefill_logits(default_model_path, 2, tokens)
    assert one.tobytes() == two.tobytes()


@needs_two
@pytest.mark.parametrize("kind", ["gemma3", "lfm2", "mamba2", "qwen35"])
def test_every_memory_kind_gives_the_same_bits_at_every_thread_count(
    kind: str, default_model_path: Path, tmp_path: Path
) -> None:
    """Sliding-window, hybrid and recurrent memory too (their count follows the load as well)."""
    path = build_tiny_arch_models(tmp_path, default_model_path).all()[kind]
    with ModelSession(SessionConfig(model_path=path, n_ctx=512)) as s:
        assert s.threads.adapt
        tokens = s.tokenize("Every state must come back exactly as it was computed. " * 4)
    assert _prefill_logits(path, 1, tokens).tobytes() == _prefill_logits(path, 2, tokens).tobytes()


@needs_two
def test_a_busy_machine_decodes_with_fewer_threads_and_an_idle_one_with_all(
    tiny_models: TinyModels, load: Callable[[float], None]
) -> None:
    with ModelSession(SessionConfig(model_path=tiny_models.base, n_ctx=512)) as s:
        assert s.threads.adapt
        tokens = s.tokenize("one two three four five six")
        load(CORES)
        time.sleep(RECHECK_S)  # past the last look
        s.prefill(tokens)
        assert s.threads.current < CORES
        load(0)
        time.sleep(RECHECK_S + 0.2)
        s.reset()
        s.prefill(tokens)
        assert s.threads.current == CORES


@pytest.mark.parametrize("kw", [{"n_threads": 2}, {"flash_attn": "on"}])
def test_the_count_stays_where_the_user_chose_it_or_it_changes_results(
    tiny_models: TinyModels, kw: dict[str, object], load: Callable[[float], None]
) -> None:
    config = SessionConfig(model_path=tiny_models.base, n_ctx=512, **kw)  # type: ignore[arg-type]
    load(CORES)
    with ModelSession(config) as s:
        assert not s.threads.adapt
        time.sleep(RECHECK_S)
        s.prefill(s.tokenize("one two three four"))
        assert s.threads.current == s.n_threads


@needs_two
def test_a_cache_saved_with_all_cores_restores_exactly_on_a_busy_machine(
    default_model_path: Path, tmp_path: Path, load: Callable[[float], None]
) -> None:
    """Saved at two threads, asked with the machine busy (one thread): verified, same answer."""
    doc = Document.from_text("The lighthouse keeper logs the tides every hour. " * 30, "notes.txt")
    params = localkv.SamplingParams(max_tokens=8, temperature=0)
    options = {"n_ctx": 1024, "cache_dir": tmp_path / "cache"}
    with localkv.Runtime.open(default_model_path, **options) as rt:  # type: ignore[arg-type]
        cold = rt.ask([doc], "What does the keeper log?", params=params)
        rt.wait_for_saves()
        assert rt.session.threads.current == CORES
    load(CORES)
    with localkv.Runtime.open(default_model_path, **options) as rt:  # type: ignore[arg-type]
        time.sleep(RECHECK_S)
        warm = rt.ask([doc], "What does the keeper log?", params=params)
        threads = rt.session.threads.current
    assert threads < CORES
    assert warm.cache.hit and warm.cache.verified and warm.tokens.reused > 0
    assert warm.text == cold.text


def _readers() -> int:
    return sum(t.name.startswith("localkv-read") for t in threading.enumerate())


@needs_two
def test_a_busy_machine_reads_a_restore_on_its_own_thread_and_restores_the_same(
    tiny_models: TinyModels, tmp_path: Path, load: Callable[[float], None]
) -> None:
    """Reader threads only while cores are free (a hand-off waits for a time slice when
    other work holds them); the restore is verified and the same bits either way."""
    cfg = tiny_config(tiny_models.base, block_size=16, n_ctx=512, n_threads=None)
    tokens = [int(t) for t in np.random.default_rng(5).integers(200, 40000, 8 * 16 + 3)]
    request = [*tokens, 7]
    with Runtime(cfg, cache_dir=tmp_path) as rt:
        assert rt.session.threads.adapt and rt.cache is not None
        rt.session.prefill(tokens, boundaries=[len(tokens)])
        rt.cache.write(rt.cache.prepare(rt.session, [len(tokens)], 0.001))
        stored = rt.session.capture_state()
    seen = {}
    for busy in (True, False):
        load(CORES if busy else 0)
        with Runtime(cfg, cache_dir=tmp_path) as rt:
            assert rt.cache is not None
            time.sleep(RECHECK_S)  # past the look taken as it opened
            before = _readers()
            ends = rt.session.schedule(len(request), [len(tokens), len(request)])
            result = rt.cache.restore(rt.session, request, ends)
            started = _readers() - before
            threads = rt.session.threads.current
            assert result.verified and result.reused == len(tokens)
            seen[busy] = (rt.session.capture_state(), rt.session.decode_one(request[-1]))
        if busy:
            assert threads < CORES and started == 0
        else:
            assert threads == CORES and started > 0
    assert seen[True][0] == seen[False][0] == stored
    assert seen[True][1].tobytes() == seen[False][1].tobytes()
