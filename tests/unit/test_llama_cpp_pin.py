"""The llama-cpp-python package ``localkv.model.native`` imports in halves is the pinned one.

``native._bindings_first`` builds the ``llama_cpp`` package from its ctypes
bindings alone, for one known ``__init__``. When the pin in pyproject.toml or
the installed package changes, this fails until that import is reviewed for
the new version and ``BINDINGS_FIRST_FOR`` names it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

from localkv.model import native

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _pinned() -> str:
    found = re.findall(r'"llama-cpp-python==([^"]+)"', PYPROJECT.read_text(encoding="utf-8"))
    assert len(found) == 1, "pyproject.toml pins llama-cpp-python once"
    return found[0]


def _installed_init_digest() -> str:
    spec = importlib.util.find_spec("llama_cpp")
    assert spec is not None and spec.origin is not None
    return hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest()


def test_the_bindings_first_import_was_written_for_the_pinned_llama_cpp_python() -> None:
    version, digest = native.BINDINGS_FIRST_FOR
    assert _pinned() == version, "the pin moved: review native._bindings_first for it"
    assert importlib.metadata.version("llama-cpp-python") == version
    assert _installed_init_digest() == digest, "llama_cpp/__init__.py is not the one reviewed"


def test_the_pinned_package_is_imported_bindings_first() -> None:
    code = "import sys, localkv.model.native as n\n"
    code += "print(n.BINDINGS_FIRST, 'llama_cpp.llama' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["True", "False"]
