"""Fixtures of the agent-client set (``-m agents``): a Gemma 3 270M server per test."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from agentkit import Served


@pytest.fixture
def served(gemma3_path: Path, tmp_path: Path) -> Iterator[Served]:
    """A running server on Gemma 3 270M whose cache survives ``restart()``."""
    server = Served(gemma3_path, tmp_path).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """The directory the client works in: a small git project of its own."""
    where = tmp_path / "project"
    where.mkdir()
    (where / "greet.py").write_text(
        'def greet(name):\n    return f"Hello, {name}!"\n', encoding="utf-8"
    )
    subprocess.run(["git", "init", "-q", str(where)], check=True, timeout=60)
    return where
