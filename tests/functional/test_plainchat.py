"""``localkv chat`` in line mode, through the CLI and then the history database."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import sqlite_utils
from click.testing import CliRunner, Result
from support.tinymodels import TinyModels

from localkv.chat.commands import COMMANDS, HELP, PLAIN_HELP, Command, message_text, parse_command
from localkv.chat.formats import sync_line, turn_line
from localkv.cli import cli
from localkv.runtime.chatsession import SyncReport, TurnReport
from localkv.runtime.reports import CacheReport


@pytest.fixture()
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the cache (and the history next to it) at the test's directory."""
    path = tmp_path / "home"
    monkeypatch.setenv("LOCALKV_HOME", str(path))
    monkeypatch.delenv("LOCALKV_MODEL", raising=False)
    return path


def chat(tiny_models: TinyModels, text: str, *args: str, ctx: int = 2048) -> Result:
    options = ["--model", str(tiny_models.base), "--threads", "1", "--ctx", str(ctx)]
    options += ["--temperature", "0", "--max-tokens", "8"]
    return CliRunner().invoke(cli, ["chat", *options, *args], input=text, catch_exceptions=False)


def conversations(home: Path) -> list[dict[str, object]]:
    return list(sqlite_utils.Database(home / "conversations.db")["conversations"].rows)


def test_answers_streams_the_status_line_and_saves_the_conversation(
    tiny_models: TinyModels, home: Path
) -> None:
    result = chat(tiny_models, "Hello there\n/quit\nnever read\n", "--plain", "--system", "Hi.")
    assert result.exit_code == 0, result.output
    assert "TTFT" in result.stderr and "tok/s" in result.stderr
    assert result.stdout.strip()  # the answer
    rows = conversations(home)
    assert len(rows) == 1
    messages = json.loads(str(rows[0]["messages"]))
    assert [m[0] for m in messages] == ["system", "user", "assistant"]
    assert messages[1][1] == "Hello there" and rows[0]["title"] == "Hello there"


def test_without_a_terminal_chat_falls_back_to_line_mode(
    tiny_models: TinyModels, home: Path
) -> None:
    result = chat(tiny_models, "Hello\n")  # no --plain: CliRunner's stdin is not a TTY
    assert result.exit_code == 0, result.output
    assert "TTFT" in result.stderr
    assert "textual" not in result.output.lower()


def test_resume_restores_the_last_conversation_from_the_cache(
    tiny_models: TinyModels, home: Path
) -> None:
    assert chat(tiny_models, "First question\n").exit_code == 0
    result = chat(tiny_models, "Second question\n", "--resume")
    assert result.exit_code == 0, result.output
    match = re.search(r"resumed “First question”: restored ([\d,]+) tokens", result.stderr)
    assert match is not None, result.stderr
    assert int(match.group(1).replace(",", "")) > 10
    rows = conversations(home)
    assert len(rows) == 1  # the same conversation, continued
    roles = [m[0] for m in json.loads(str(rows[0]["messages"]))]
    assert roles == ["user", "assistant", "user", "assistant"]
    listed = CliRunner().invoke(cli, ["cache", "ls", "--json"], catch_exceptions=False)
    labels = [s["label"] for s in json.loads(listed.stdout)]
    assert labels == ["First question"]  # the resumed conversation's, not one per process


def test_attach_new_and_system_commands(
    tiny_models: TinyModels, home: Path, tmp_path: Path, long_text: str
) -> None:
    doc = tmp_path / "notes.txt"
    doc.write_text(long_text[:2000], encoding="utf-8")
    script = f"/attach {doc}\n/new\n/attach {doc}\n/system Be terse.\n/attach /no/such.txt\n"
    result = chat(tiny_models, script)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("[")]
    assert re.fullmatch(r"\[attached notes\.txt: prefilled [\d,]+ tokens\]", lines[0])
    assert lines[1:] == [
        "[new conversation]",
        "[attached notes.txt: restored from the cache]",
        "[new conversation]",
        "[/no/such.txt: no such file]",
    ]


def test_doc_option_and_a_full_context(tiny_models: TinyModels, home: Path, tmp_path: Path) -> None:
    doc = tmp_path / "notes.txt"
    doc.write_text("The report is due on Friday. " * 5, encoding="utf-8")
    long = "tell me more about the report " * 60
    result = chat(tiny_models, f"{long}\nStill here?\n", "--doc", str(doc), ctx=256)
    assert result.exit_code == 0, result.output
    assert "[attached notes.txt: prefilled" in result.stderr
    assert "[context full:" in result.stderr and "Type /new" in result.stderr
    assert result.stderr.count("TTFT") == 1  # the next message was answered


def test_a_missing_document_or_model_is_a_clean_error(
    tiny_models: TinyModels, home: Path, tmp_path: Path
) -> None:
    result = chat(tiny_models, "", "--doc", str(tmp_path / "missing.txt"))
    assert result.exit_code == 1
    assert "missing.txt: no such file" in result.stderr and "Traceback" not in result.output
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a model" * 100)
    for model in (garbage, tmp_path / "absent.gguf"):
        result = CliRunner().invoke(cli, ["chat", "--plain", "--model", str(model)], input="hi\n")
        assert result.exit_code == 1, result.output
        assert result.stderr.startswith("Error: ") and "Traceback" not in result.output
        assert str(model) in result.stderr


def test_the_line_mode_chat_and_history_import_without_textual() -> None:
    code = (
        "import sys, localkv.cli, localkv.chat.plain, localkv.history.store; "
        "bad = [m for m in sys.modules if m == 'textual' or m.startswith('textual.')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_line_mode_takes_the_app_s_commands(tiny_models: TinyModels, home: Path) -> None:
    script = "/HELP\n/system\n/frobnicate now\n/attach\n/history\n/cache\n//hi\n/exit\nnever\n"
    result = chat(tiny_models, script, "--system", "Be brief.")
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if line.startswith("[")]
    assert notes[:3] == [
        "[system prompt: Be brief.]",
        "[unknown command /frobnicate; /help lists the commands]",
        "[usage: /attach PATH]",
    ]
    assert notes[3].startswith("[TTFT")  # "//hi" was sent as "/hi"; /exit quit after it
    assert PLAIN_HELP in result.stdout and "No saved conversations yet." in result.stdout
    assert "No cache snapshots yet." in result.stdout
    messages = json.loads(str(conversations(home)[0]["messages"]))
    assert [m[1] for m in messages if m[0] == "user"] == ["/hi"]


def test_the_command_parser_both_faces_use() -> None:
    assert parse_command("hello") is None and parse_command("//etc") is None
    assert message_text("//etc") == "/etc" and message_text(" hi ") == "hi"
    assert parse_command("  /Attach   my notes.txt ") == Command("attach", "my notes.txt", True)
    assert parse_command("/exit") == Command("quit", "", True)
    assert parse_command("/usr/bin") == Command("usr/bin", "", False)
    assert all(f"`/{name}" in HELP and f"/{name}" in PLAIN_HELP for name in COMMANDS)


def _cache(**fields: object) -> CacheReport:
    report = dict(hit=True, verified=True, snapshot="s", miss_reason=None, reused=1820)
    report.update(restore_s=0.045, saved_s=3.1, common=1820)
    report.update(fields)
    return CacheReport(**report)  # type: ignore[arg-type]


def test_one_cache_report_formatter_for_turns_attaches_and_resumes() -> None:
    sync = SyncReport(cache=_cache(), prefilled=12, prefill_s=0.5)
    assert sync_line(sync) == (
        "restored 1,820 tokens (verified) in 45 ms · prefilled 12 in 0.50 s · saved ≈ 3.1 s"
    )
    turn = TurnReport(
        text="x", generated=3, sync=sync, ttft_s=0.05, tokens_per_s=31.0, stopped=True
    )
    assert turn_line(turn) == (
        "TTFT 0.05 s · 31 tok/s · restored 1,820 tokens (verified) in 45 ms · "
        "prefilled 12 · saved ≈ 3.1 s · stopped"
    )
    unchecked = SyncReport(cache=_cache(verified=None, common=1823), prefilled=3, prefill_s=0.1)
    for line in (sync_line(unchecked), turn_line(dataclasses.replace(turn, sync=unchecked))):
        assert "(verified)" not in line
        assert "recomputed 3 common tokens (exact)" in line
    missed = SyncReport(
        cache=_cache(hit=False, miss_reason="no stored prefix", reused=0, common=0),
        prefilled=9,
        prefill_s=0.2,
    )
    assert sync_line(missed) == "cache miss: no stored prefix · prefilled 9 in 0.20 s"
    assert sync_line(SyncReport(cache=None, prefilled=0, prefill_s=0.0, cancelled=True)) == (
        "already in memory · cancelled"
    )
    restored = SyncReport(
        cache=_cache(), prefilled=0, prefill_s=0.0
    )  # a resume that restored every token
    assert "prefilled" not in sync_line(restored) and "restored 1,820 tokens" in sync_line(restored)
    assert turn_line(
        dataclasses.replace(
            turn, sync=SyncReport(cache=None, prefilled=4, prefill_s=0.0), stopped=False
        )
    ) == ("TTFT 0.05 s · 31 tok/s · prefilled 4")


LONG_QUESTION = "Tell me everything about the fox and the dog and the long road home. " * 25


def test_resume_in_a_smaller_context_exits_naming_the_ctx_it_needs(
    tiny_models: TinyModels, home: Path
) -> None:
    assert chat(tiny_models, f"{LONG_QUESTION}\n", ctx=1024).exit_code == 0
    (row,) = conversations(home)
    assert 256 < int(str(row["n_tokens"])) <= 1024
    result = chat(tiny_models, "And then?\n", "--resume", ctx=256)
    assert result.exit_code == 1, result.output
    assert result.stdout == "" and "Traceback" not in result.output
    (line,) = result.stderr.splitlines()  # one line, before the chat starts
    assert line.startswith("Error: cannot resume: “Tell me everything about the fox")
    assert f"{row['n_tokens']:,} tokens" in line and "context of 256 tokens" in line
    assert line.endswith("resume with --ctx 1024"), line  # the context it was made with
    assert len(conversations(home)) == 1  # nothing was written


def test_a_chat_stopped_before_its_first_answer_lists_its_question(
    tiny_models: TinyModels, home: Path
) -> None:
    from localkv.history.store import ConversationStore
    from localkv.runtime.chatsession import ChatState

    with ConversationStore.open(home) as store:  # as a chat killed while answering leaves it
        store.write(ChatState(tokens=[1], boundaries=[]), None, 0, model=None, pending="Hi there")
    listed = CliRunner().invoke(cli, ["history", "ls", "--json"], catch_exceptions=False)
    (info,) = json.loads(listed.stdout)
    assert (info["title"], info["messages"], info["pending"]) == ("Hi there", 1, "Hi there")
    table = CliRunner().invoke(cli, ["history", "ls"], catch_exceptions=False)
    row = table.stdout.splitlines()[1].split()
    assert row[3] == "1", table.stdout  # messages: the question it holds
    result = chat(tiny_models, "/history\n")
    assert "Hi there · 1 message ·" in result.stdout, result.stdout
    assert " 0 messages" not in result.stdout


def test_the_cache_command_lists_snapshot_ids_as_cache_ls_shows_them(
    tiny_models: TinyModels, home: Path
) -> None:
    result = chat(tiny_models, "Hello there\n/cache\n")
    assert result.exit_code == 0, result.output
    listed = CliRunner().invoke(cli, ["cache", "ls", "--json"], catch_exceptions=False)
    (snap,) = json.loads(listed.stdout)
    (line,) = [line for line in result.stdout.splitlines() if "Hello there ·" in line]
    assert line.startswith(f"{snap['id'][:8]}  Hello there ·"), line
    pinned = CliRunner().invoke(cli, ["cache", "pin", line.split()[0]], catch_exceptions=False)
    assert pinned.exit_code == 0, pinned.output
