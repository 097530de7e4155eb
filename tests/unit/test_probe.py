"""The probe: restoring n-1 tokens and decoding token n-1 alone reproduces the logits exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.tinymodels import TinyModels, tiny_config

from localkv.model.session import ModelSession, SessionConfig


def _probe_check(first: SessionConfig, second: SessionConfig, tokens: list[int]) -> None:
    n = len(tokens)
    with ModelSession(first) as a:
        result = a.prefill(tokens)
        probe = result.probes[n - 1]
        assert set(result.probes) == {255, 511, n - 1} & set(range(n))
        a.truncate(n - 1)
        state = a.capture()
    with ModelSession(second) as b:
        b.restore(state, tokens[: n - 1])
        again = b.decode_one(tokens[n - 1])
    assert np.array_equal(again, probe), f"max diff {np.abs(again - probe).max()}"


@pytest.mark.parametrize(
    ("flash", "other"),
    [
        # another process may open the model with another n_ctx, batch and thread count
        ("off", {"n_ctx": 1024, "n_batch": 128, "n_threads": 2}),
        # with flash attention on, only the thread count must match (see identity)
        ("on", {"n_ctx": 1024, "n_batch": 128}),
    ],
)
def test_probe_is_bit_identical_on_tiny_model(
    tiny_models: TinyModels, long_text: str, flash: str, other: dict[str, object]
) -> None:
    with ModelSession(tiny_config(tiny_models.base)) as s:
        tokens = s.tokenize(long_text)[:600]
    base = tiny_config(tiny_models.base, flash_attn=flash)
    _probe_check(base, tiny_config(tiny_models.base, flash_attn=flash, **other), tokens)


def test_probe_detects_a_changed_earlier_token(tiny_models: TinyModels, long_text: str) -> None:
    cfg = tiny_config(tiny_models.base)
    with ModelSession(cfg) as s:
        tokens = s.tokenize(long_text)[:300]
        probe = s.prefill(tokens).probes[299]
        changed = list(tokens)
        changed[100] = tokens[101]
        s.reset()
        s.prefill(changed[:299])
        assert not np.array_equal(s.decode_one(changed[299]), probe)


@pytest.mark.default_model
def test_probe_is_bit_identical_on_default_model(default_model_path: Path, long_text: str) -> None:
    cfg = SessionConfig(model_path=default_model_path, n_ctx=1024)
    with ModelSession(cfg) as s:
        tokens = s.tokenize(long_text)[:520]
    _probe_check(cfg, SessionConfig(model_path=default_model_path, n_ctx=2048, n_batch=256), tokens)
