"""Every number and name a person reads is the truth: first runs, files named with
``@``, units, the model of each snapshot. Through the CLI, then the database."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import sqlite_utils
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


def test_chat_system_at_file_reads_the_file_as_ask_does(
    tiny_models: TinyModels, home: Path, tmp_path: Path
) -> None:
    garden = tmp_path / "garden.txt"
    garden.write_text("You are a gardener. Answer briefly.\n", encoding="utf-8")
    options = [*model(tiny_models), "--temperature", "0", "--max-tokens", "4", "--plain"]
    result = CliRunner().invoke(
        cli, ["chat", *options, "--system", f"@{garden}"], input="Hello\n/system\n"
    )
    assert result.exit_code == 0, result.output
    assert "system prompt: You are a gardener." in result.output
    rows = list(sqlite_utils.Database(home / "conversations.db")["conversations"].rows)
    messages = json.loads(str(rows[0]["messages"]))
    assert messages[0] == ["system", "You are a gardener. Answer briefly.\n"]


@pytest.mark.parametrize("content", [None, b"a\x00b"], ids=["missing", "nul"])
def test_chat_system_at_file_refuses_what_ask_refuses(
    tiny_models: TinyModels, home: Path, tmp_path: Path, content: bytes | None
) -> None:
    path, doc = tmp_path / "system.txt", tmp_path / "doc.txt"
    doc.write_text("A short document.", encoding="utf-8")
    if content is not None:
        path.write_bytes(content)
    for command in (["ask", str(doc), "Q?"], ["chat", "--plain"]):
        args = [command[0], *model(tiny_models), "--system", f"@{path}", *command[1:]]
        result = CliRunner().invoke(cli, args, input="Hello\n")
        assert result.exit_code == 2, result.output
        assert "cannot read the system prompt file" in result.output
    assert not (home / "conversations.db").exists() or not list(
        sqlite_utils.Database(home / "conversations.db")["conversations"].rows
    )


def test_cache_show_and_stats_print_sizes_and_dates_as_ls_does(
    tiny_models: TinyModels, home: Path, docs: list[Path]
) -> None:
    localkv("prefill", *model(tiny_models), str(docs[0]))
    listing = json.loads(localkv("cache", "ls", "--json").stdout)
    ident, size = listing[0]["id"], listing[0]["bytes_on_disk"]
    shown = localkv("cache", "show", ident).stdout
    assert re.search(rf"bytes_on_disk: [\d.]+ [KM]iB \({size:,} bytes\)", shown), shown
    assert re.search(r"created: \d{4}-\d\d-\d\d \d\d:\d\d$", shown, re.M), shown
    assert not re.search(r"\d{10}\.\d", shown)  # no raw timestamps
    raw = json.loads(localkv("cache", "show", ident, "--json").stdout)
    assert raw["bytes_on_disk"] == size and isinstance(raw["created"], float)
    stats = localkv("cache", "stats").stdout
    assert re.search(r"stored_bytes: [\d.]+ [KM]iB \([\d,]+ bytes\)", stats), stats
    assert json.loads(localkv("cache", "stats", "--json").stdout)["stored_bytes"] > 0


def test_cache_ls_and_the_chats_cache_list_name_each_snapshots_model(
    tiny_models: TinyModels, home: Path, docs: list[Path]
) -> None:
    localkv("prefill", *model(tiny_models), str(docs[0]))
    alone = localkv("cache", "ls").stdout.splitlines()
    assert alone[0] == "snapshots of tiny-base" and alone[1].split()[:3] == [
        "id",
        "label",
        "tokens",
    ]
    other = ["--model", str(tiny_models.other_weights), "--threads", "1"]
    localkv("prefill", *other, str(docs[0]))
    listing = json.loads(localkv("cache", "ls", "--json").stdout)
    assert sorted(r["model"] for r in listing) == ["tiny-base", "tiny-other-weights"]
    table = localkv("cache", "ls").stdout.splitlines()
    assert table[0].split()[:3] == ["id", "label", "model"]
    rows = [line.split() for line in table[1:-1] if not line[0].isspace()]  # a long name folds
    assert sorted(row[2][:9] for row in rows) == ["tiny-base", "tiny-othe"]
    shown = localkv("cache", "show", listing[0]["id"]).stdout
    assert re.search(r"model: tiny-(base|other-weights)$", shown, re.M)
    options = [*model(tiny_models), "--temperature", "0", "--max-tokens", "2", "--plain"]
    chat = CliRunner().invoke(cli, ["chat", *options], input="/cache\n")
    assert chat.exit_code == 0, chat.output
    assert "apple.txt · tiny-base · " in chat.output and "0 hits" in chat.output
    assert "tiny-other-weights" not in chat.output
    assert "1 snapshot of other models not listed" in chat.output


def test_a_resumed_chats_hit_survives_its_snapshots_replacement(
    tiny_models: TinyModels, home: Path, docs: list[Path]
) -> None:
    options = [*model(tiny_models), "--temperature", "0", "--max-tokens", "8", "--plain"]
    first = CliRunner().invoke(cli, ["chat", *options, "--doc", str(docs[0])], input="Hi\n")
    assert first.exit_code == 0, first.output
    before = json.loads(localkv("cache", "stats", "--json").stdout)
    again = CliRunner().invoke(cli, ["chat", *options, "--resume"], input="More\n")
    assert again.exit_code == 0, again.output
    assert re.search(r"resumed “Hi”: restored [\d,]+ tokens", again.stderr), again.stderr
    stats = json.loads(localkv("cache", "stats", "--json").stdout)
    assert stats["hits"] == before["hits"] + 1
    assert stats["hits_without_snapshot"] == before["hits_without_snapshot"] == 0
    listing = json.loads(localkv("cache", "ls", "--json").stdout)
    chats = [s for s in listing if s["label"] == "Hi"]
    assert len(chats) == 1 and chats[0]["hits"] >= 1  # the resume's, on the newer tip
    assert sum(s["hits"] for s in listing) == stats["hits"]


@pytest.mark.default_model
def test_gemma3_270m_kept_is_the_next_reused_and_the_snapshot_counts_each_restore(
    gemma3_path: Path, home: Path, tmp_path: Path, long_text: str
) -> None:
    doc = tmp_path / "gemma.txt"
    doc.write_text(long_text[:6000], encoding="utf-8")
    args = ["--model", str(gemma3_path), "--threads", "2", "--ctx", "4096", "--json"]
    pre = json.loads(localkv("prefill", *args, str(doc)).stdout.splitlines()[-1])
    assert pre["kept"] == pre["tokens"] > 1000
    for question in ("Who?", "Where?"):
        ask = ["ask", *args, "--max-tokens", "2", str(doc), question]
        out = json.loads(localkv(*ask).stdout.splitlines()[-1])
        assert out["tokens"]["reused"] == pre["kept"] and out["cache"]["verified"] is True
        assert out["cache"]["snapshot"] == pre["snapshot"], out
    (snap,) = json.loads(localkv("cache", "ls", "--json").stdout)
    stats = json.loads(localkv("cache", "stats", "--json").stdout)
    assert snap["hits"] == stats["hits"] == 2 and stats["hits_without_snapshot"] == 0


def test_prefill_in_a_terminal_says_it_is_loading_the_model(
    tiny_models: TinyModels, home: Path, docs: list[Path]
) -> None:
    main, other = os.openpty()  # stderr is a terminal, as a user's is
    env = {**os.environ, "LOCALKV_HOME": str(home), "COLUMNS": "100"}
    args = [sys.executable, "-m", "localkv", "prefill", *model(tiny_models), str(docs[0])]
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=other, env=env) as proc:
        os.close(other)
        seen = b""
        with contextlib.suppress(OSError):  # EIO once the process has closed it
            while chunk := os.read(main, 4096):
                seen += chunk
        assert proc.wait(timeout=600) == 0
    os.close(main)
    assert f"loading {tiny_models.base}".encode() in seen.replace(b"\r\n", b""), seen


def test_the_prefill_rate_counts_only_prefilled_tokens_and_its_time_left_agrees() -> None:
    from localkv.cli.documents import progress_rate

    assert progress_rate(1000, 3000, 1000, 0.0) == ""  # the first report: restored tokens
    assert progress_rate(1256, 3000, 1000, 0.2) == "1,280 tok/s, 0:00:01 left"
    assert progress_rate(2000, 3000, 0, 100.0) == "20 tok/s, 0:00:50 left"


def test_prefill_counts_the_blocks_cache_show_counts(
    tiny_models: TinyModels, home: Path, docs: list[Path]
) -> None:
    args = [*model(tiny_models), "--system", "Answer from the document.", str(docs[0])]
    text = localkv("prefill", *args).stdout
    listing = json.loads(localkv("cache", "ls", "--json").stdout)
    shown = json.loads(localkv("cache", "show", "--json", listing[0]["id"]).stdout)
    assert f"; {shown['blocks']} blocks (" in text, text
    again = json.loads(localkv("prefill", *args, "--json").stdout.splitlines()[-1])
    assert again["blocks"] == shown["blocks"]


def test_models_help_says_the_table_and_json_use_the_same_words() -> None:
    text = " ".join(localkv("models", "--help").stdout.split())
    assert 'SOURCE is "source", MEMORY "memory", CACHE "cacheable", with the same words' in text
    assert "sliding-window (layers that attend to a window)" in text


def test_the_side_panel_describes_the_model_as_localkv_models_does(
    tiny_models: TinyModels, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from support.tinymodels import tiny_config

    from localkv.model.find import FoundModel, describe
    from localkv.runtime import Runtime

    listed = describe(FoundModel(name="tiny-base", source="path", path=tiny_models.base))
    with Runtime(tiny_config(tiny_models.base), cache_dir=home) as rt:
        assert rt.model_info().description == listed.label() == "llama 6.59M F32"


def test_history_export_json_marks_an_attached_document(
    tiny_models: TinyModels, home: Path, docs: list[Path]
) -> None:
    options = [*model(tiny_models), "--temperature", "0", "--max-tokens", "4", "--plain"]
    chat = CliRunner().invoke(cli, ["chat", *options, "--doc", str(docs[0])], input="Hi\n")
    assert chat.exit_code == 0, chat.output
    (row,) = json.loads(localkv("history", "ls", "--json").stdout)
    exported = json.loads(localkv("history", "export", row["id"]).stdout)
    roles = [(m["role"], m.get("document")) for m in exported["messages"]]
    assert roles == [("user", "apple.txt"), ("user", None), ("assistant", None)]
    assert exported["messages"][0]["content"].startswith("Document apple.")


def test_the_apps_help_table_has_a_header_row() -> None:
    from localkv.chat.commands import HELP

    rows = [line for line in HELP.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in rows[0].strip("|").split("|")]
    assert header == ["Command", "What it does"] and set(rows[1]) <= set("|-")


@pytest.mark.parametrize(
    ("command", "says"),
    [
        (["cache", "ls"], "with their model"),
        (["cache", "ls"], "labelled `server: ...`"),
        (["cache", "show"], "as `cache ls` prints them; --json keeps raw numbers"),
        (["cache", "stats"], "counts as not_cached_yet, not as a miss"),
        (["chat"], "System prompt: TEXT, or @FILE to read it."),
        (["serve"], "labelled `server: <first words>`"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_every_help_says_what_the_command_now_does(command: list[str], says: str) -> None:
    text = " ".join(localkv(*command, "--help").stdout.split())
    assert says in text, text
