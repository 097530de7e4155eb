"""Every page or data file under docs/ that the code, benchmarks or tests name exists.

A benchmark's ``--write-docs`` example, a help text and a docstring that points
a reader at a page all name it by its path from the repository root; when a
page moves, this test lists the places that still name the old path.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("localkv", "storage", "tui", "benchmarks", "tests")
NAMED = re.compile(r"(?<![\w/.])docs/[\w./-]+\.(?:md|json|png)")


def _named() -> dict[str, list[str]]:
    """Each docs/ path named in a source file or the Makefile -> where it is named."""
    files = [p for d in SOURCES for p in sorted((REPO / d).rglob("*.py"))]
    found: dict[str, list[str]] = {}
    for path in [*files, REPO / "Makefile"]:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for name in NAMED.findall(line):
                found.setdefault(name, []).append(f"{path.relative_to(REPO)}:{n}")
    return found


def test_the_code_names_docs_pages() -> None:
    assert "docs/performance/benchmarks.md" in _named()


def test_every_docs_path_the_code_names_exists() -> None:
    missing = {name: where for name, where in _named().items() if not (REPO / name).exists()}
    assert not missing, missing
