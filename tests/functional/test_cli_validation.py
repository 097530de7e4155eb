"""Every option is checked at the edge: a clear message and a usage exit, before any work."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from localkv.cli import cli


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--seed", "-1", "-1 is not in the range x>=0"),
        ("--temperature", "nan", "nan is not a finite number"),
        ("--temperature", "inf", "inf is not a finite number"),
        ("--top-p", "nan", "nan is not a finite number"),
    ],
)
def test_sampling_options_refuse_what_cannot_sample(
    tmp_path: Path, option: str, value: str, says: str
) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("A document.", encoding="utf-8")
    result = CliRunner().invoke(cli, ["ask", option, value, str(doc), "Why?"])
    assert result.exit_code == 2
    assert says in result.stderr


@pytest.mark.parametrize("budget", ["-5M", "abc", "5 apples"])
def test_a_malformed_budget_is_refused_before_any_work(
    monkeypatch: pytest.MonkeyPatch, budget: str
) -> None:
    monkeypatch.setenv("LOCALKV_BUDGET", budget)
    result = CliRunner().invoke(cli, ["cache", "stats"])
    assert result.exit_code == 1
    assert f"LOCALKV_BUDGET: not a size: {budget!r}" in result.stderr
