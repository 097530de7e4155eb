"""The house rules that keep the rooms livable, checked on the code itself.

Each entry point runs in its own subprocess and must not load the chat app,
textual, the benchmark or matplotlib; the command list ``localkv --help``
shows without importing the commands agrees with the commands; and every
module and function stays within the size a reader can hold in mind. The
bounds flag a module or folder for review (STYLE.md: one concept per module,
not a line count); they are not a reason to split a concept in two.
"""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import click
import pytest

from localkv.cli import COMMANDS

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("textual", "localkv.tui", "localkv.bench", "matplotlib")
PACKAGES = (REPO / "localkv", REPO / "storage", REPO / "tui")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60
MAX_MODULES_PER_FOLDER = 20
MAX_TOP_LEVEL_MODULES = 8

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


def test_modules_stay_short() -> None:
    long = {
        str(p.relative_to(REPO)): n
        for p in _modules()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


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


def test_folders_hold_few_modules() -> None:
    crowded = {}
    for root in PACKAGES:
        for folder in [root, *(d for d in root.rglob("*") if d.is_dir())]:
            n = len(list(folder.glob("*.py")))
            if n > MAX_MODULES_PER_FOLDER:
                crowded[str(folder.relative_to(REPO))] = n
    assert crowded == {}
    assert len(list((REPO / "localkv").glob("*.py"))) <= MAX_TOP_LEVEL_MODULES


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
