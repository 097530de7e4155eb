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
import json
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


_NAMES = "sorted(n for n in dir(llama_cpp) if not n.startswith('_'))"


def _python(code: str) -> list[str]:
    """Lines a fresh interpreter prints for ``code`` (this one imported everything)."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout.splitlines()


def test_the_llama_cpp_package_is_whole_when_its_high_level_names_are_used() -> None:
    plain = _python(f"import json, llama_cpp; print(json.dumps({_NAMES}))")
    code = "import json, sys, localkv.model.native, llama_cpp\n"
    code += f"print(json.dumps({_NAMES})); print(llama_cpp.__version__)\n"
    code += "from llama_cpp import Llama, LlamaGrammar\n"
    code += f"print(json.dumps({_NAMES})); print(Llama is sys.modules['llama_cpp.llama'].Llama)\n"
    code += "print(all(getattr(llama_cpp, n) is getattr(sys.modules['llama_cpp.llama'], n)"
    code += " for n in vars(sys.modules['llama_cpp.llama']) if not n.startswith('_')))"
    before, version, after, same, every = _python(code)
    assert version == native.llama_cpp.__version__
    assert "llama_decode" in json.loads(before) and "Llama" not in json.loads(before)
    assert json.loads(after) == json.loads(plain[0])  # what `import llama_cpp` binds, and no more
    assert same == every == "True"
