"""Every number and name a person reads is the truth: first runs, files named with
``@``, units, the model of each snapshot. Through the CLI, then the database."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from support.tinymodels import TinyModels

from localkv.cli import cli


@pytest.fixture()
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "home"
    monkeypatch.setenv("LOCALKV_HOME", str(path))
    return path


@pytest.fixture()
def docs(tmp_path: Path, long_text: str) -> list[Path]:
    """Two documents of about 650 tokens each, sharing only the template's first tokens."""
    out = []
    for name in ("apple", "pear"):
        path = tmp_path / f"{name}.txt"
        path.write_text(f"Document {name}. " + long_text[:2600], encoding="utf-8")
        out.append(path)
    return out


def localkv(*args: str, code: int = 0) -> Result:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result


def model(tiny: TinyModels) -> list[str]:
    return ["--model", str(tiny.base), "--threads", "1"]


def test_a_new_documents_first_ask_is_not_cached_yet_and_no_miss(
    tiny_models: TinyModels, home: Path, docs: list[Path]
) -> None:
    localkv("prefill", *model(tiny_models), str(docs[0]))
    first = localkv("ask", *model(tiny_models), "--max-tokens", "2", str(docs[1]), "What?")
    assert re.search(r"^not cached yet; prefilled [\d,]+ tokens$", first.stderr, re.M), first.stderr
    assert "cache miss" not in first.stderr and "batch" not in first.stderr
    again = localkv("ask", *model(tiny_models), "--max-tokens", "2", "--json", str(docs[1]), "Q?")
    assert json.loads(again.stdout.splitlines()[-1])["cache"]["hit"] is True
    stats = json.loads(localkv("cache", "stats", "--json").stdout)
    assert stats["misses_by_reason"] == {} and stats["misses"] == 0
    assert stats["not_cached_yet"] == 2  # the prefill's and the first ask's
    assert stats["hits"] == 1


def test_a_first_run_in_another_namespace_names_it(
    tiny_models: TinyModels, home: Path, docs: list[Path]
) -> None:
    args = ("--max-tokens", "2", "--namespace", "alpha", "--json", str(docs[0]), "What?")
    out = json.loads(localkv("ask", *model(tiny_models), *args).stdout.splitlines()[-1])
    assert out["cache"]["miss_reason"] == "not cached yet in namespace 'alpha'"
