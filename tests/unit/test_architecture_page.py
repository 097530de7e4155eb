"""docs/architecture.md names real places: every module, folder and test it points at exists.

The page tells a newcomer where each hop of the five flows happens; when a
module moves, this test lists the paths on the page that still name its old
place.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "architecture.md"
ROOTS = ("localkv", "storage", "tui", "tests", "benchmarks")
PATH = re.compile(rf"(?<![\w/.-])(?:{'|'.join(ROOTS)})/[\w/.-]*[\w/]")
FLOWS = (
    "A request becomes tokens",
    "A verified restore",
    "A block write",
    "`localkv ask`",
    "A protocol request",
)


def _named() -> dict[str, int]:
    """Each repository path the page names -> the first line it is named on."""
    found: dict[str, int] = {}
    for n, line in enumerate(PAGE.read_text(encoding="utf-8").splitlines(), 1):
        for path in PATH.findall(line):
            found.setdefault(path, n)
    return found


def test_the_page_walks_the_five_flows_through_modules() -> None:
    headings = re.findall(r"^### (.+)$", PAGE.read_text(encoding="utf-8"), re.MULTILINE)
    assert [h for h in headings if h in FLOWS] == list(FLOWS)
    modules = [p for p in _named() if p.endswith(".py")]
    assert any(p.startswith("storage/") for p in modules)
    assert any(p.startswith("localkv/server/protocols/") for p in modules)


def test_every_path_on_the_page_exists() -> None:
    missing = {path: line for path, line in _named().items() if not (REPO / path).exists()}
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
