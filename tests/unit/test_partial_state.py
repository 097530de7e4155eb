"""What llama.cpp 0.3.36 writes for SWA, hybrid and recurrent memory (measured, tiny models)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.tinyarch import SWA_WINDOW, TinyArchModels, build_tiny_arch_models
from support.tinymodels import tiny_config

from localkv.cache.restore.load import _tip_rows
from localkv.kv import codec, partial
from localkv.model.native import llama_cpp
from localkv.model.partial_state import classify, read_state_ext
from localkv.model.session import ModelSession

KINDS = {
    "gemma3": "swa",
    "lfm2": "hybrid",
    "nemotron_h": "hybrid",
    "mamba2": "recurrent",
    "qwen35": "hybrid",
}


@pytest.fixture(scope="module")
def arch_models(
    tmp_path_factory: pytest.TempPathFactory, default_model_path: Path
) -> TinyArchModels:
    return build_tiny_arch_models(tmp_path_factory.mktemp("arch"), default_model_path)


def _session(path: Path, n: int) -> tuple[ModelSession, list[int]]:
    s = ModelSession(tiny_config(path))
    tokens = s.tokenize("Alice sat by her sister on the bank, reading nothing. " * 40)[:n]
    s.prefill(tokens)
    return s, tokens


@pytest.mark.parametrize("arch", list(KINDS))
def test_a_full_state_is_the_attention_part_then_the_partial_part(
    arch: str, arch_models: TinyArchModels
) -> None:
    kind = KINDS[arch]
    s, tokens = _session(arch_models.all()[arch], 300)
    with s:
        assert s.memory_kind == kind
        full = read_state_ext(s.ctx, 0)
        alone = read_state_ext(s.ctx, partial.PARTIAL_ONLY).tobytes()
        attention, tail = partial.split(full, kind)
        assert tail == alone
        assert np.array_equal(partial.join(np.frombuffer(attention, np.uint8), tail), full)
        info = partial.check_partial(alone, kind, len(tokens))
        assert info.last == len(tokens) - 1
        if kind == "swa":  # only the window's cells; the base section holds every cell
            assert info.first == len(tokens) - SWA_WINDOW
            assert codec.parse(attention).n_tokens == len(tokens)
        else:  # one recurrent cell, at the last position
            assert info.first == info.last
        with pytest.raises(codec.StateFormatError):
            partial.check_partial(alone, kind, len(tokens) - 1)
        with pytest.raises(codec.StateFormatError):
            partial.check_partial(alone[:20], kind, len(tokens))


@pytest.mark.parametrize("arch", ["lfm2", "nemotron_h", "mamba2", "qwen35"])
def test_recurrent_memory_refuses_a_partial_trim(arch: str, arch_models: TinyArchModels) -> None:
    s, _ = _session(arch_models.all()[arch], 100)
    with s:
        assert not llama_cpp.llama_memory_seq_rm(s.memory, 0, 50, -1)


def test_memory_that_cannot_be_cached_is_refused_by_architecture_and_reason() -> None:
    with pytest.raises(codec.StateFormatError, match=r"^jamba: hybrid memory with sliding-window"):
        classify("jamba", recurrent=False, hybrid=True, n_swa=128)
    assert classify("lfm2", recurrent=False, hybrid=True, n_swa=0) == "hybrid"
    assert classify("gemma3", recurrent=False, hybrid=False, n_swa=512) == "swa"
    assert classify("mamba2", recurrent=True, hybrid=False, n_swa=0) == "recurrent"
    assert classify("llama", recurrent=False, hybrid=False, n_swa=0) == "kv"


def test_a_restore_drops_the_partial_state_it_is_about_to_overwrite(
    arch_models: TinyArchModels,
) -> None:
    """The last block's partial rows are read into one reused array per thread: an older
    restore's partial part in ``session.partials`` (a view of it) goes before the reuse."""
    s, _ = _session(arch_models.gemma3, 300)
    with s:
        first = _tip_rows(s, (4, 8), 32)
        s.partials = {10: first.reshape(-1)[:20], 20: np.zeros(20, np.uint8)}
        again = _tip_rows(s, (2, 8), 16)
        assert np.may_share_memory(first, again)
        assert list(s.partials) == [20]
