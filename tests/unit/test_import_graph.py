"""No import circle among localkv's own modules, read from the project's import graph.

The graph is built with ``grimp`` (import-linter's) the way ``make imports``
sees the package: a tree of links where ``storage/`` and ``tui/`` sit inside
``localkv/`` as they do when installed. Every import that runs counts, one
made inside a function too: a module imported lazily to dodge a circle is
still in one. An import only for type checking does not run (it names a type
for the checker) and is left out. grimp sees only Python sources, so an import of
a compiled extension (``from .. import _planes``) reads as an import of its
package; such an edge goes to the extension, which imports nothing of ours.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_GRAPH = r"""
import json, grimp
graph = grimp.build_graph("localkv", exclude_type_checking_imports=True, cache_dir=None)
edges = {}
for importer in sorted(graph.modules):
    for imported in sorted(graph.find_modules_directly_imported_by(importer)):
        details = graph.get_import_details(importer=importer, imported=imported)
        edges.setdefault(importer, []).append(
            [imported, [[d["line_number"], d["line_contents"]] for d in details]]
        )
print(json.dumps({"modules": sorted(graph.modules), "edges": edges}))
"""


def _link_tree(root: Path) -> Path:
    """``make pkgtree``'s tree: localkv/'s entries, storage/ and tui/ linked under ``root``."""
    package = root / "localkv"
    package.mkdir()
    for entry in (REPO / "localkv").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    (package / "storage").symlink_to(REPO / "storage")
    (package / "tui").symlink_to(REPO / "tui")
    return root


def _is_extension(folder: Path, name: str) -> bool:
    """A compiled module: built (``NAME.*.so``) or its stub, with no Python source."""
    if (folder / f"{name}.py").exists() or (folder / name / "__init__.py").exists():
        return False
    return (folder / f"{name}.pyi").exists() or any(folder.glob(f"{name}.*.so"))


def _imports_only_extensions(package: str, lines: list[list[object]], tree: Path) -> bool:
    """Whether every import line names only compiled extensions of ``package``:
    ``from <package> import _ext`` or ``import <package>._ext``."""
    folder = tree.joinpath(*package.split("."))
    for _, text in lines:
        found = re.match(r"\s*(from\s+\S+\s+)?import\s+(.+)", str(text))
        if found is None:
            return False
        wanted = [n.split(" as ")[0].strip(" ()") for n in found.group(2).split(",")]
        if found.group(1) is None:  # import a.b.c: a module of the package, by its whole name
            prefix = package + "."
            wanted = [n.removeprefix(prefix) if n.startswith(prefix) else "" for n in wanted]
        if not all(n and "." not in n and _is_extension(folder, n) for n in wanted):
            return False
    return True


def _graph(tree: Path) -> dict[str, set[str]]:
    done = subprocess.run(
        [sys.executable, "-c", _GRAPH],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        check=True,
    )
    found = json.loads(done.stdout)
    graph: dict[str, set[str]] = {m: set() for m in found["modules"]}
    for importer, targets in found["edges"].items():
        for imported, lines in targets:
            if imported in graph and not _imports_only_extensions(imported, lines, tree):
                graph[importer].add(imported)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return out


def _shortest_cycle(graph: dict[str, set[str]], start: str, group: set[str]) -> list[str]:
    """The shortest path of imports from ``start`` back to itself within ``group``."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for imported in sorted(graph[module] & group):
                if imported == start:
                    return [*paths[module], start]
                if imported not in paths:
                    paths[imported] = [*paths[module], imported]
                    following.append(imported)
        frontier = following
    return [start]


def _described(graph: dict[str, set[str]], circles: list[list[str]]) -> str:
    lines = []
    for group in circles:
        lines.append(f"{len(group)} modules in a circle: {', '.join(group)}")
        seen: set[tuple[str, ...]] = set()
        for module in group:
            cycle = _shortest_cycle(graph, module, set(group))
            turn = cycle.index(min(cycle[:-1]))
            key = tuple(cycle[turn:-1] + cycle[:turn])
            if key not in seen:
                seen.add(key)
                lines.append("    " + " -> ".join([*key, key[0]]))
    return "\n".join(lines)


def test_no_import_circle_among_product_modules(tmp_path: Path) -> None:
    graph = _graph(_link_tree(tmp_path))
    assert "localkv.storage.store" in graph and "localkv.tui.app" in graph  # the whole house
    circles = _circles(graph)
    assert circles == [], "import circles:\n" + _described(graph, circles)


def test_a_circle_is_found_and_named_module_by_module() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    circles = _circles(graph)
    assert circles == [["a", "b", "c"]]
    assert "a -> b -> c -> a" in _described(graph, circles)
