"""The house rules that keep the rooms livable, checked on the code itself.

Each entry point runs in its own subprocess and must not load the chat app,
textual, the benchmark or matplotlib; the command list ``localkv --help``
shows without importing the commands agrees with the commands; every function
fits on a screen; a module past ``REVIEW_MODULE_LINES`` is flagged for review
(STYLE.md: one concept per module, sized by the concept, not a line count): it
passes once it is listed in ``REVIEWED_LONG_MODULES`` with the reason it is one
concept, never by being split to a count; and every room directly under
``localkv/`` is a layer of the import contracts.
"""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import click
import pytest

from localkv.cli import COMMANDS

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("textual", "localkv.tui", "localkv.bench", "matplotlib")
PACKAGES = (REPO / "localkv", REPO / "storage", REPO / "tui")
REVIEW_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60
# Modules past REVIEW_MODULE_LINES that a review kept whole: path -> why it is one concept.
REVIEWED_LONG_MODULES: dict[str, str] = {}

_PROBE = """
import json, sys
sys.argv = ["localkv", *json.loads(sys.argv[1])]
from localkv.cli import main
try:
    main()
except SystemExit:
    pass
print("\\n" + json.dumps(sorted(sys.modules)))
"""


@pytest.mark.parametrize(
    "args",
    [["--help"], ["ask", "--help"], ["prefill", "--help"], ["cache", "--help"], ["--version"]],
    ids=" ".join,
)
def test_entry_points_load_no_app_bench_or_plotting(args: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    modules = json.loads(done.stdout.strip().splitlines()[-1])
    assert "localkv.cli" in modules
    loaded = [m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)]
    assert loaded == []


def test_the_api_and_the_store_import_headless() -> None:
    code = "import sys, json, localkv, localkv.storage; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    modules = json.loads(done.stdout)
    assert [m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)] == []


@pytest.mark.parametrize("name", list(COMMANDS))
def test_the_lazy_command_list_agrees_with_each_command(name: str) -> None:
    target, short = COMMANDS[name]
    module, _, attr = target.partition(":")
    command = getattr(importlib.import_module(module), attr)
    assert isinstance(command, click.Command)
    assert command.name == name
    assert (command.help or "").strip().splitlines()[0] == short


def _modules() -> list[Path]:
    return sorted(p for root in PACKAGES for p in root.rglob("*.py"))


def test_a_long_module_is_reviewed() -> None:
    """A module past the bound fails until a review lists it with its reason."""
    long = {
        str(p.relative_to(REPO))
        for p in _modules()
        if len(p.read_text(encoding="utf-8").splitlines()) > REVIEW_MODULE_LINES
    }
    assert sorted(long - set(REVIEWED_LONG_MODULES)) == []
    assert sorted(set(REVIEWED_LONG_MODULES) - long) == [], "no longer long: drop it from the list"


def test_functions_fit_on_a_screen() -> None:
    """Schema migrations (``mNNN_...``) are data and exempt."""
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                migration = node.name[:1] == "m" and node.name[1:4].isdigit()
                if n > MAX_FUNCTION_LINES and not migration:
                    long[f"{path.relative_to(REPO)}:{node.name}"] = n
    assert long == {}


# Value types whose first fields stay positional (before ``_: KW_ONLY``): name -> why.
POSITIONAL_FIELDS = {
    "localkv/prompt/template.py:Message": "a role, then its text: Message('user', text)",
}


def _init_fields(cls: ast.ClassDef) -> list[ast.AnnAssign]:
    fields = []
    for node in cls.body:
        if not isinstance(node, ast.AnnAssign) or "ClassVar" in ast.unparse(node.annotation):
            continue
        value = node.value
        no_init = isinstance(value, ast.Call) and any(
            k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False
            for k in value.keywords
        )
        if not no_init:
            fields.append(node)
    return fields


def _value_types() -> list[tuple[str, ast.ClassDef, ast.expr | None]]:
    """(path:name, class, its @dataclass decorator or None for a NamedTuple)."""
    found = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            where = f"{path.relative_to(REPO)}:{node.name}"
            if any(ast.unparse(b).endswith("NamedTuple") for b in node.bases):
                found.append((where, node, None))
            for dec in node.decorator_list:
                named = dec.func if isinstance(dec, ast.Call) else dec
                if ast.unparse(named).endswith("dataclass"):
                    found.append((where, node, dec))
    return found


def test_value_types_of_more_than_three_fields_are_built_by_keyword() -> None:
    """STYLE.md: ``CacheReport(False, None, None, reason, 0, 0.0, 0.0)`` tells the reader
    nothing. A dataclass of more than three fields is declared ``kw_only=True`` (or keeps
    the few positional fields listed above), so Python refuses a positional call; a
    NamedTuple, positional by nature, keeps to three fields or becomes a dataclass."""
    positional = {}
    for where, cls, dec in _value_types():
        fields = _init_fields(cls)
        if len([f for f in fields if "KW_ONLY" not in ast.unparse(f.annotation)]) <= 3:
            continue
        if dec is None:
            positional[where] = "NamedTuple"
            continue
        kw_only = isinstance(dec, ast.Call) and any(
            k.arg == "kw_only" and isinstance(k.value, ast.Constant) and k.value.value is True
            for k in dec.keywords
        )
        marks = [i for i, f in enumerate(fields) if "KW_ONLY" in ast.unparse(f.annotation)]
        leading = 0 if kw_only else (marks[0] if marks else len(fields))
        if leading and where not in POSITIONAL_FIELDS:
            positional[where] = f"{leading} positional fields"
    assert positional == {}


# Functions annotated to return a tuple of three or more: path:name -> why it has no name.
ANONYMOUS_TUPLES = {
    "localkv/prompt/template.py:work": "counters read as one vector: callers subtract two readings",
}


def _tuple_size(node: ast.expr | None) -> int:
    """The most elements of any ``tuple[...]`` in an annotation (``tuple[int, ...]``: 0)."""
    if node is None:
        return 0
    most = 0
    for sub in ast.walk(node):
        if isinstance(sub, ast.Subscript) and ast.unparse(sub.value) in ("tuple", "Tuple"):
            elts = sub.slice.elts if isinstance(sub.slice, ast.Tuple) else [sub.slice]
            if not any(isinstance(e, ast.Constant) and e.value is Ellipsis for e in elts):
                most = max(most, len(elts))
    return most


def test_no_function_returns_an_anonymous_tuple_of_three_or_more() -> None:
    """Three values or more come back as a value type named for what it is (a frozen
    dataclass, or a NamedTuple of up to three fields), so a reader of the call site
    need not open the function to know which is which."""
    anonymous = set()
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            if function and _tuple_size(node.returns) >= 3:
                anonymous.add(f"{path.relative_to(REPO)}:{node.name}")
    assert sorted(anonymous - set(ANONYMOUS_TUPLES)) == []
    assert sorted(set(ANONYMOUS_TUPLES) - anonymous) == [], "named now: drop it from the list"


def test_every_room_under_localkv_is_a_layer() -> None:
    """A module or package put directly under localkv/ is outside every layer of the
    import contracts (and so may import anything) until pyproject.toml names it."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    contracts = config["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers")["layers"]
    named = {part.strip() for layer in layers for part in layer.split("|")}
    rooms = {
        f"localkv.{p.stem}"
        for p in (REPO / "localkv").iterdir()
        if (p.suffix == ".py" and p.stem not in ("__init__", "__main__"))
        or (p.is_dir() and (p / "__init__.py").exists())
    }
    assert sorted(rooms - named) == []


def test_a_command_missing_its_extra_says_how_to_install_it() -> None:
    code = (
        "import sys; sys.modules['zstandard'] = None; sys.argv = ['localkv', 'bench', '--help']\n"
        "from localkv.cli import main\nmain()"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 1
    assert "`localkv bench` needs zstandard: pip install 'localkv[bench]'" in done.stderr
    assert "Traceback" not in done.stderr


NATIVE = ("llama_cpp", "numpy", "sqlite_utils")


@pytest.mark.parametrize("args", [["--help"], ["--version"]], ids=" ".join)
def test_the_command_list_loads_neither_llama_cpp_nor_numpy_nor_the_store(args: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    modules = json.loads(done.stdout.strip().splitlines()[-1])
    assert [m for m in modules if m.split(".")[0] in NATIVE] == []


def test_the_settings_checked_before_a_command_are_the_ones_listed() -> None:
    from localkv.cli import SETTINGS, _settings

    assert sorted(SETTINGS) == sorted(_settings())


def test_every_package_is_installed() -> None:
    """pyproject names the packages one by one (storage/ and tui/ under localkv): none left out."""
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    listed = set(config["tool"]["setuptools"]["packages"])
    names = {"localkv": "localkv", "storage": "localkv.storage", "tui": "localkv.tui"}
    found = set()
    for root in PACKAGES:
        for init in root.rglob("__init__.py"):
            parts = init.parent.relative_to(REPO).parts
            found.add(".".join((names[parts[0]], *parts[1:])))
    assert found - listed == set()
    assert listed - found == set()
