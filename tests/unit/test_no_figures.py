"""No comment or docstring in the product's code carries a measured figure.

Figures measured on a machine go stale in code and start to disagree with the
pages the benchmarks write; a comment says what the code does and why, and
names the benchmark (``benchmarks/...``) whose page holds the number. Design
parameters (a block of 256 tokens, a timeout) are not measurements: they are
code, and a comment may state them, but not with a time unit.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREES = ("localkv", "storage", "tui")

FIGURES = {
    "says 'measured'": re.compile(r"\bmeasured\b", re.IGNORECASE),
    "a time in ms or µs": re.compile(r"\d(?:[\d,]*\d)?(?:\.\d+)?\s?(?:ms|µs|us|msec)\b"),
    "a median in seconds": re.compile(
        r"median.*\d(?:\.\d+)?\s?s\b|\d(?:\.\d+)?\s?s\b.*median", re.IGNORECASE
    ),
    "a speed-up": re.compile(  # (\u00d7: the multiplication sign)
        r"\d(?:\.\d+)?\s?[x\u00d7]\s+(?:faster|slower|sooner|quicker)\b|\d\u00d7"
    ),
    "a share sooner or faster": re.compile(
        r"\d+(?:\.\d+)?\s?%\s+(?:faster|slower|sooner|quicker|less time)\b"
    ),
}


def _docstrings(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, text) of each line of every module, class and function docstring, and of
    every string standing alone as a statement (an attribute's docstring)."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for stmt in body:
            if (
                isinstance(stmt, ast.Expr)
                and isinstance(stmt.value, ast.Constant)
                and isinstance(stmt.value.value, str)
            ):
                for i, line in enumerate(stmt.value.value.splitlines()):
                    yield stmt.lineno + i, line


def _comments(source: str) -> Iterator[tuple[int, str]]:
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string


def figures_in(path: Path, name: str) -> list[str]:
    """``name:line: what: text`` for each comment or docstring line of ``path`` with a figure."""
    source = path.read_text(encoding="utf-8")
    texts = [*_comments(source), *_docstrings(ast.parse(source, str(path)))]
    return [
        f"{name}:{line}: {what}: {text.strip()}"
        for line, text in sorted(texts)
        for what, pattern in FIGURES.items()
        if pattern.search(text)
    ]


def test_the_scan_finds_figures_in_comments_and_docstrings_only(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""A module.\n\nReads in 12 ms (median of 5), measured on 2 cores."""\n'
        "BLOCK = 256  # tokens per block: a design choice\n"
        "TIMEOUT_S = 5.0  # 2.5x faster than the old way\n"
        "def f() -> str:\n"
        '    """Loads ~30% sooner."""\n'
        '    return "took 40 ms, measured"  # a string the program prints is no docstring\n',
        encoding="utf-8",
    )
    kinds = [line.split(": ")[1] for line in figures_in(sample, "sample.py")]
    assert kinds == [
        "says 'measured'",
        "a time in ms or µs",
        "a speed-up",
        "a share sooner or faster",
    ]


def test_no_comment_or_docstring_carries_a_measured_figure() -> None:
    paths = [path for tree in TREES for path in sorted((ROOT / tree).rglob("*.py"))]
    found = [hit for path in paths for hit in figures_in(path, str(path.relative_to(ROOT)))]
    assert not found, "figures belong in the benchmarks' pages:\n" + "\n".join(found)
