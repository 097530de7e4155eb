"""Every option is checked at the edge: a clear message and a usage exit, before any work."""

from __future__ import annotations

import subprocess
import sys
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
    assert result.exit_code == 2  # a usage error, as every bad setting is
    assert f"LOCALKV_BUDGET: not a size: {budget!r}" in result.stderr


def test_a_context_longer_than_memory_is_refused_in_its_own_terms(tmp_path: Path) -> None:
    # 16,777,216 tokens of the default model's f16 KV are about 360 GiB: more
    # than any machine these tests run on, so llama.cpp is never asked for it.
    doc = tmp_path / "doc.txt"
    doc.write_text("A document.", encoding="utf-8")
    result = CliRunner().invoke(cli, ["prefill", "--ctx", "16777216", str(doc)])
    assert result.exit_code == 1
    assert "a context of 16,777,216 tokens needs" in result.stderr
    assert "GiB for its KV cache" in result.stderr and "lower --ctx" in result.stderr
    assert "flash attention" not in result.stderr


def test_a_context_llama_cpp_rounds_up_says_so(tmp_path: Path) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("A short document about nothing much.", encoding="utf-8")
    command = [sys.executable, "-m", "localkv", "prefill", "--threads", "1", "--ctx", "300"]
    result = subprocess.run([*command, str(doc)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "llama.cpp rounded 300 tokens up to 512 (a multiple of 256)" in result.stderr


def test_a_file_that_is_not_a_model_gets_one_line_in_llama_cpp_s_words(tmp_path: Path) -> None:
    model = tmp_path / "notes.gguf"
    model.write_text("not a model at all", encoding="utf-8")
    doc = tmp_path / "doc.txt"
    doc.write_text("A document.", encoding="utf-8")
    command = [sys.executable, "-m", "localkv", "ask", "--model", str(model), str(doc), "Why?"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"Error: llama.cpp could not load {model}: "
        "invalid magic characters: 'not ', expected 'GGUF'"
    ]
    loud = subprocess.run(
        [sys.executable, "-m", "localkv", "-vv", *command[3:]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "ERROR localkv.llama: gguf_init_from_reader: invalid magic" in loud.stderr


def test_a_command_refused_while_its_model_opens_exits_with_its_usage_error(
    tmp_path: Path,
) -> None:
    # a command refused at once exits with its usage error, before any model loads
    command = [sys.executable, "-m", "localkv", "ask", "--threads", "1", "only-a-question"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "give at least one FILE and then the QUESTION" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_broken_model_named_on_the_command_line_is_reported_by_the_command(
    tmp_path: Path,
) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    doc = tmp_path / "doc.txt"
    doc.write_text("A document.", encoding="utf-8")
    command = [sys.executable, "-m", "localkv", "ask", "--model", str(bad), str(doc), "Why?"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "llama.cpp could not load" in result.stderr and str(bad) in result.stderr
    assert "Traceback" not in result.stderr
