"""Hostile and careless inputs at the command line and in the chat: refused in one
line with the right exit status, never cut, never a traceback; listings print
what they hold without letting it drive the terminal; a new conversation never
touches the last one's snapshot.

Every command is a real ``localkv`` process on the tiny model (stdin, bytes
and environment as a user or a script would give them), then the cache is
read back through ``localkv cache ls --json`` and the history with SQLite.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from support.tinymodels import TinyModels

LIVENESS_S = 120  # far beyond what any of these takes; only a hang reaches it
CHAT = ["chat", "--plain", "--threads", "1", "--temperature", "0", "--max-tokens", "8"]


@pytest.fixture()
def env(tmp_path: Path, tiny_models: TinyModels) -> dict[str, str]:
    return {
        **os.environ,
        "LOCALKV_MODEL": str(tiny_models.base),
        "LOCALKV_HOME": str(tmp_path / "cache"),
    }


def _localkv(
    env: dict[str, str], *args: str | bytes, stdin: bytes = b""
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "localkv", *args],
        env=env,
        input=stdin,
        capture_output=True,
        timeout=LIVENESS_S,
    )
    out = done.stdout.decode("utf-8", "replace")
    err = done.stderr.decode("utf-8", "replace")
    assert "Traceback" not in err, err
    return subprocess.CompletedProcess(done.args, done.returncode, out, err)


def _snapshots(env: dict[str, str]) -> dict[str, dict[str, object]]:
    done = _localkv(env, "cache", "ls", "--json")
    assert done.returncode == 0, done.stderr
    return {str(s["label"]): s for s in json.loads(done.stdout)}


def _user_messages(env: dict[str, str]) -> list[str]:
    conn = sqlite3.connect(Path(env["LOCALKV_HOME"]) / "conversations.db")
    try:
        rows = conn.execute("SELECT messages FROM conversations ORDER BY rowid").fetchall()
    finally:
        conn.close()
    return [text for (messages,) in rows for role, text in json.loads(messages) if role == "user"]


@pytest.fixture()
def doc(tmp_path: Path, long_text: str) -> Path:
    path = tmp_path / "notes.txt"
    path.write_text(long_text[:3000], encoding="utf-8")
    return path


# ------------------------------------------------------ a new conversation
def test_new_right_after_a_turn_keeps_the_last_conversations_snapshot(
    env: dict[str, str], doc: Path
) -> None:
    script = f"Hello there\n/attach {doc}\nWhat is this about?\n/new\nGood morning\n/quit\n"
    done = _localkv(env, *CHAT, stdin=script.encode())
    assert done.returncode == 0, done.stderr
    snaps = _snapshots(env)
    assert set(snaps) == {"Hello there", "Good morning"}, snaps
    # the first conversation's snapshot holds its document too
    assert int(str(snaps["Hello there"]["tokens"])) > 500


def test_a_pinned_conversation_keeps_its_snapshot_and_pin_across_new_and_system(
    env: dict[str, str],
) -> None:
    assert _localkv(env, *CHAT, stdin=b"Hello there\n").returncode == 0
    first = _snapshots(env)["Hello there"]
    assert _localkv(env, "cache", "pin", str(first["id"])).returncode == 0
    script = b"And then?\n/system Be brief.\nGood morning\n/new\nGood evening\n/quit\n"
    done = _localkv(env, *CHAT, "--resume", stdin=script)
    assert done.returncode == 0, done.stderr
    snaps = _snapshots(env)
    assert set(snaps) == {"Hello there", "Good morning", "Good evening"}, snaps
    resumed = snaps["Hello there"]  # the resumed conversation's longer prefix replaced it
    assert resumed["pinned"] is True
    assert int(str(resumed["tokens"])) > int(str(first["tokens"]))
    assert snaps["Good morning"]["pinned"] is False
    assert snaps["Good evening"]["pinned"] is False


# ------------------------------------------------------------ NUL bytes
@pytest.fixture()
def late_nul(tmp_path: Path, long_text: str) -> Path:
    """A text file whose first NUL comes after 70,000 bytes of text."""
    path = tmp_path / "late-nul.txt"
    text = (long_text * 5)[:70_000]
    path.write_bytes(text.encode() + b"\0" + b" and what comes after it")
    return path


def test_a_nul_anywhere_in_a_document_is_refused_not_cut(
    env: dict[str, str], late_nul: Path, doc: Path
) -> None:
    done = _localkv(env, "prefill", "--threads", "1", "--ctx", "8192", str(late_nul))
    assert done.returncode == 1
    assert "NUL byte at byte 70,001" in done.stderr
    assert _snapshots(env) == {}
    system = _localkv(env, "ask", "--ctx", "8192", "--system", f"@{late_nul}", str(doc), "Why?")
    assert system.returncode == 2 and "NUL" in system.stderr, system.stderr
    chat = _localkv(env, *CHAT, "--ctx", "8192", "--doc", str(late_nul))
    assert chat.returncode == 1 and "NUL" in chat.stderr, chat.stderr


def test_a_nul_in_a_chat_line_or_attached_file_is_refused_and_the_chat_goes_on(
    env: dict[str, str], late_nul: Path
) -> None:
    script = f"Hello\0there\n/attach {late_nul}\n/system Be\0brief\nGood morning\n".encode()
    done = _localkv(env, *CHAT, "--ctx", "8192", stdin=script)
    assert done.returncode == 0, done.stderr
    assert "[not sent: the message holds a NUL character (at character 6)" in done.stderr
    assert "NUL byte at byte 70,001" in done.stderr
    assert "[not changed: the system prompt holds a NUL character" in done.stderr
    assert done.stderr.count("[TTFT") == 1  # "Good morning" was answered
    assert _user_messages(env) == ["Good morning"]


# ------------------------------------------------------- bytes, not UTF-8
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["ask", "{doc}", b"What is this \xff about?"], "the question is not valid UTF-8"),
        (["ask", "--system", b"Be \xfe brief", "{doc}", "Why?"], "system prompt is not valid"),
        (["prefill", "--label", b"notes \xff", "{doc}"], "the label is not valid UTF-8"),
        (["prefill", "--namespace", b"team\xff", "{doc}"], "the namespace is not valid"),
        (["chat", "--plain", "--system", b"\xffhi"], "the system prompt is not valid UTF-8"),
    ],
    ids=["question", "system", "label", "namespace", "chat-system"],
)
def test_arguments_that_are_not_utf8_are_usage_errors(
    env: dict[str, str], doc: Path, args: list[str | bytes], says: str
) -> None:
    argv = [str(doc) if a == "{doc}" else a for a in args]
    done = _localkv(env, *argv)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and "(byte 0x" in done.stderr


def test_invalid_utf8_on_plain_chat_input_refuses_that_line_only(env: dict[str, str]) -> None:
    done = _localkv(env, *CHAT, stdin=b"Hello \xff there\nGood morning\n/quit\n")
    assert done.returncode == 0, done.stderr
    assert "[not sent: the message is not valid UTF-8 (byte 0xff at character 7)]" in done.stderr
    assert done.stderr.count("[TTFT") == 1
    assert _user_messages(env) == ["Good morning"]


def test_a_file_name_that_is_not_utf8_still_names_its_snapshot(
    env: dict[str, str], doc: Path
) -> None:
    odd = os.fsencode(doc.parent) + b"/caf\xe9.txt"
    os.link(doc, odd)
    done = _localkv(env, "prefill", "--threads", "1", odd)
    assert done.returncode == 0, done.stderr
    assert "could not save the snapshot" not in done.stderr
    assert set(_snapshots(env)) == {"caf\ufffd.txt"}


# ----------------------------------------------------------- bad settings
@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("LOCALKV_FAULT", "garbage", "bad fault 'garbage'"),
        ("LOCALKV_FAULT", "before_write:kill@0", "@N (N >= 1) or @*"),
        ("LOCALKV_MIN_FREE", "abc", "not a size: 'abc'"),
        ("LOCALKV_MIN_FREE", "0", "less than 16 MiB"),
        ("LOCALKV_BUDGET", "5 apples", "not a size: '5 apples'"),
    ],
)
@pytest.mark.parametrize("command", [["cache", "ls"], ["prefill", "--threads", "1", "{doc}"]])
def test_a_malformed_setting_is_a_usage_error_before_any_work(
    env: dict[str, str], doc: Path, name: str, value: str, says: str, command: list[str]
) -> None:
    argv = [str(doc) if a == "{doc}" else a for a in command]
    done = _localkv({**env, name: value}, *argv)
    assert done.returncode == 2, done.stderr
    assert f"Error: {name}: " in done.stderr and says in done.stderr
    assert not (Path(env["LOCALKV_HOME"]) / "index.db").exists()  # nothing was done


@pytest.mark.parametrize("threads", ["100000", "5000", "513"])
def test_a_thread_count_llama_cpp_cannot_run_is_a_usage_error(
    env: dict[str, str], doc: Path, threads: str
) -> None:
    done = _localkv(env, "ask", "--threads", threads, str(doc), "Why?")
    assert done.returncode == 2
    assert "Invalid value for '--threads'" in done.stderr and "1<=x<=512" in done.stderr


@pytest.mark.parametrize(
    "args",
    [["prefill", "--namespace", "", "{doc}"], ["cache", "ls", "--namespace", " "]],
    ids=["prefill", "cache-ls"],
)
def test_an_empty_namespace_is_a_usage_error(
    env: dict[str, str], doc: Path, args: list[str]
) -> None:
    done = _localkv(env, *[str(doc) if a == "{doc}" else a for a in args])
    assert done.returncode == 2
    assert "a namespace cannot be empty" in done.stderr


def test_ask_help_says_how_much_of_a_file_is_read(env: dict[str, str]) -> None:
    done = _localkv(env, "ask", "--help")
    assert "``" not in done.stdout and "max_bytes" not in done.stdout
    assert "64 bytes per token" in " ".join(done.stdout.split())


# ------------------------------------------------------ terminal escapes
EVIL = "evil\x1b[2J\x1b]0;owned\x07[/bold]\u202e"  # clear, retitle, bell, markup, bidi


def _no_controls(text: str) -> None:
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text, repr(text)


def test_listings_show_labels_titles_and_names_with_controls_escaped(
    env: dict[str, str], doc: Path
) -> None:
    done = _localkv(env, "prefill", "--threads", "1", "--label", EVIL, str(doc))
    assert done.returncode == 0, done.stderr
    assert _localkv(env, *CHAT, stdin=b"Hi\x1b[2J there\n").returncode == 0
    (ident,) = [str(s["id"]) for s in _snapshots(env).values() if s["label"] == EVIL]
    escaped = "evil\\x1b[2J\\x1b]0;owned\\x07[/bold]\\u202e"
    for args in (["cache", "ls"], ["cache", "show", ident]):
        listing = _localkv({**env, "COLUMNS": "200"}, *args)  # no cell folded in two
        assert listing.returncode == 0, listing.stderr
        _no_controls(listing.stdout)
        assert escaped in listing.stdout
    history = _localkv(env, "history", "ls")
    _no_controls(history.stdout)
    assert "Hi\\x1b[2J there" in history.stdout
    plain = _localkv(env, *CHAT, stdin=b"/cache\n/history\n")
    _no_controls(plain.stdout)
    assert escaped in plain.stdout and "Hi\\x1b[2J there" in plain.stdout


def test_models_lists_a_file_name_with_controls_escaped(
    env: dict[str, str], tiny_models: TinyModels, tmp_path: Path
) -> None:
    shelf = tmp_path / "shelf"
    shelf.mkdir()
    os.link(tiny_models.base, shelf / "tiny\x1b[2J.gguf")
    done = _localkv({**env, "LOCALKV_MODELS": str(shelf)}, "models")
    assert done.returncode == 0, done.stderr
    _no_controls(done.stdout)
    assert "tiny\\x1b[2J" in done.stdout


def test_the_cache_screen_shows_a_label_with_controls_escaped(
    env: dict[str, str], doc: Path, tiny_models: TinyModels, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    from localkv.tui.app import build_app
    from localkv.tui.cache_screen import CacheScreen
    from support.tinymodels import tiny_config
    from textual.widgets import DataTable

    from localkv.runtime import Runtime

    done = _localkv(env, "prefill", "--threads", "1", "--label", EVIL, str(doc))
    assert done.returncode == 0, done.stderr
    monkeypatch.setenv("LOCALKV_HOME", env["LOCALKV_HOME"])
    runtime = Runtime(tiny_config(tiny_models.base), cache_dir=env["LOCALKV_HOME"])
    app = build_app(runtime)
    cells: list[str] = []

    async def main() -> None:
        async with app.run_test(size=(100, 24)) as pilot:
            await pilot.press("f2")
            for _ in range(600):  # liveness only
                screen = app.screen
                if isinstance(screen, CacheScreen) and screen.snapshots:
                    break
                await pilot.pause(0.05)
            table = app.screen.query_one(DataTable)
            cells.append(str(getattr(table.get_cell_at((0, 0)), "plain", "")))
        app.close_controller()

    try:
        asyncio.run(main())
    finally:
        runtime.close()
    assert cells == ["evil\\x1b[2J\\x1b]0;owned\\x07[/bold]\\u202e"]


# ------------------------------------------------------------------ smaller
_HOLDER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")  # another process's write lock, held until stdin closes
print("held", flush=True)
sys.stdin.read()
"""


def test_history_reads_do_not_wait_for_another_processs_write_lock(env: dict[str, str]) -> None:
    assert _localkv(env, *CHAT, stdin=b"Hello there\n").returncode == 0
    path = Path(env["LOCALKV_HOME"]) / "conversations.db"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        listing = _localkv(env, "history", "ls", "--json")
        assert listing.returncode == 0, listing.stderr
        (conversation,) = json.loads(listing.stdout)
        assert conversation["title"] == "Hello there"
        export = _localkv(env, "history", "export", conversation["id"])
        assert export.returncode == 0 and "Hello there" in export.stdout, export.stderr
    finally:
        holder.communicate("", timeout=LIVENESS_S)


def test_forgetting_a_file_that_is_gone_and_was_never_cached_is_an_error(
    env: dict[str, str], tmp_path: Path
) -> None:
    done = _localkv(env, "cache", "forget", str(tmp_path / "nonexistent.txt"))
    assert done.returncode == 1
    assert "no such file, and no snapshot was saved from it: nothing to forget" in done.stderr
