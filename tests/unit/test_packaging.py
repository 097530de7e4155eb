"""Every package folder is in pyproject's package list, so an installed localkv has it all."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _listed() -> tuple[set[str], dict[str, str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(config["packages"]), dict(config["package-dir"])


def test_every_package_folder_is_listed() -> None:
    listed, dirs = _listed()
    found = set()
    for name, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    assert found - listed == set(), "add these to [tool.setuptools] packages"
    assert listed - found == set(), "these are listed but have no __init__.py"


def test_a_folder_named_localkv_in_the_working_directory_is_not_imported(tmp_path: Path) -> None:
    """A script beside the clone (which ``git clone`` names ``localkv``) imports the
    installed package, not the clone's folder as an empty namespace package."""
    (tmp_path / "localkv").symlink_to(ROOT, target_is_directory=True)
    code = "import localkv, localkv.storage, localkv.tui; print(localkv.Runtime.__name__)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "Runtime"
