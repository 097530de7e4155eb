"""Chat history loses nothing: concurrent chats, unusable files, damaged rows, signals.

Every test drives ``localkv chat --plain`` (and ``localkv history``) as real
processes on the tiny model, then reads ``conversations.db`` with SQLite.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.tinymodels import TinyModels

WAIT_S = 120  # liveness only: a hung process fails the test instead of blocking it
DROP_PRIVILEGES = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]


def _env(home: Path) -> dict[str, str]:
    env = {**os.environ, "LOCALKV_HOME": str(home)}
    env.pop("LOCALKV_MODEL", None)
    return env


def _chat_cmd(model: Path, *args: str, max_tokens: int = 8) -> list[str]:
    cmd = [sys.executable, "-m", "localkv", "chat", "--plain", "--model", str(model)]
    cmd += ["--threads", "1", "--ctx", "2048", "--temperature", "0"]
    return [*cmd, "--max-tokens", str(max_tokens), *args]


def _run(home: Path, cmd: list[str], text: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, input=text, env=_env(home), capture_output=True, text=True, timeout=WAIT_S
    )


def _localkv(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return _run(home, [sys.executable, "-m", "localkv", *args])


def _rows(home: Path) -> list[dict[str, object]]:
    conn = sqlite3.connect(home / "conversations.db")
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute("SELECT * FROM conversations ORDER BY rowid")]
    finally:
        conn.close()


def _messages(row: dict[str, object]) -> list[list[str]]:
    return json.loads(str(row["messages"]))  # type: ignore[no-any-return]


def _answered(home: Path, question: str) -> bool:
    """Some saved conversation holds ``question`` and an answer right after it."""
    for row in _rows(home):
        msgs = _messages(row)
        for (role, text), following in itertools.pairwise(msgs):
            if role == "user" and text == question and following[0] == "assistant":
                return True
    return False


class _Chat:
    """A running ``chat --plain``: lines in, stdout and stderr collected by threads."""

    def __init__(self, home: Path, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(
            cmd,
            env=_env(home),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self._pump, args=(stream, sink), daemon=True).start()

    @staticmethod
    def _pump(stream: object, sink: list[str]) -> None:
        while piece := stream.read(1):  # type: ignore[attr-defined]
            sink.append(piece)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait_for(self, test: object, what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not test():  # type: ignore[operator]
            if self.proc.poll() is not None and not test():  # type: ignore[operator]
                time.sleep(0.2)  # the pumps may still be draining
                if test():  # type: ignore[operator]
                    return
                pytest.fail(f"the chat ended before {what}: {self.stderr}")
            if time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"no {what} in {WAIT_S} s: {self.stderr}")
            time.sleep(0.02)

    def turns(self, n: int) -> None:
        self.wait_for(lambda: self.stderr.count("[TTFT") >= n, f"{n} answers")

    def finish(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(timeout=WAIT_S)


# ------------------------------------------------------------------ concurrency
def test_two_resumed_chats_on_one_conversation_lose_nothing(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    assert _run(home, _chat_cmd(tiny_models.base), "First question\n").returncode == 0
    (original,) = _rows(home)
    a = _Chat(home, _chat_cmd(tiny_models.base, "--resume"))
    b = _Chat(home, _chat_cmd(tiny_models.base, "--resume"))
    for chat in (a, b):  # both read the conversation at the same revision
        chat.wait_for(lambda chat=chat: "[resumed “First question”" in chat.stderr, "resume")
    for n, (chat, name) in enumerate([(a, "A"), (b, "B"), (a, "A"), (b, "B")]):
        chat.send(f"from {name} {n}")
        chat.turns(n // 2 + 1)
    assert a.finish() == 0 and b.finish() == 0
    assert "forked" in b.stderr and "forked" not in a.stderr, b.stderr
    for question in ["First question", "from A 0", "from B 1", "from A 2", "from B 3"]:
        assert _answered(home, question), question
    rows = {str(r["id"]): r for r in _rows(home)}
    assert len(rows) == 2
    fork = next(r for i, r in rows.items() if i != original["id"])
    assert fork["forked_from"] == original["id"]
    assert [m[1] for m in _messages(fork) if m[0] == "user"] == [
        "First question",
        "from B 1",
        "from B 3",
    ]


# ------------------------------------------------------------ unusable history
def _garbage(home: Path, path: Path) -> None:
    path.write_bytes(os.urandom(4096))


def _directory(home: Path, path: Path) -> None:
    path.mkdir()


def _fifo(home: Path, path: Path) -> None:
    os.mkfifo(path)


def _symlink(home: Path, path: Path) -> None:
    elsewhere = home.parent / "elsewhere.db"
    sqlite3.connect(elsewhere).close()
    path.symlink_to(elsewhere)


def _read_only_file(home: Path, path: Path) -> None:
    path.chmod(0o400)


def _read_only_dir(home: Path, path: Path) -> None:
    home.chmod(0o500)


DAMAGE = [_garbage, _directory, _fifo, _symlink, _read_only_file, _read_only_dir]


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__.strip("_"))
def test_an_unusable_history_is_a_warning_and_resume_fails_with_the_reason(
    tiny_models: TinyModels, tmp_path: Path, damage: object
) -> None:
    home = tmp_path / "home"
    path = home / "conversations.db"
    read_only = damage in (_read_only_file, _read_only_dir)
    prefix: list[str] = []
    if read_only:
        assert _run(home, _chat_cmd(tiny_models.base), "Hello\n").returncode == 0
        if os.geteuid() == 0:  # root writes anywhere: drop the capabilities that allow it
            if shutil.which("setpriv") is None:
                pytest.skip("running as root without setpriv: cannot make a file read-only")
            prefix = DROP_PRIVILEGES
    else:
        home.mkdir(mode=0o700)
    damage(home, path)  # type: ignore[operator]
    try:
        chat = _run(home, [*prefix, *_chat_cmd(tiny_models.base)], "Hello again\n")
        resumed = _run(home, [*prefix, *_chat_cmd(tiny_models.base, "--resume")], "Hi\n")
    finally:
        home.chmod(0o700)
        if path.is_file() and not path.is_symlink():
            path.chmod(0o600)
    assert chat.returncode == 0, chat.stderr
    assert "[conversations are not saved: " in chat.stderr and "conversations.db" in chat.stderr
    assert "TTFT" in chat.stderr  # the chat itself went on
    assert resumed.returncode == 1, resumed.stderr
    (line,) = [x for x in resumed.stderr.splitlines() if x.startswith("Error:")]
    assert line.startswith("Error: cannot resume: the saved conversations cannot be read: ")
    assert "conversations.db" in line and "Traceback" not in resumed.stderr
    assert "TTFT" not in resumed.stderr  # nothing was answered into a blank chat


# ------------------------------------------------------------------ damaged rows
def _seed(home: Path, model: Path, *questions: str) -> list[str]:
    """One conversation per question, oldest first; their ids."""
    for question in questions:
        done = _run(home, _chat_cmd(model), f"{question}\n")
        assert done.returncode == 0, done.stderr
    return [str(r["id"]) for r in _rows(home)]


@pytest.mark.parametrize(
    ("column", "value", "reason"),
    [
        ("messages", "not json [", "messages are not a JSON list"),
        ("tokens", b"\x01\x02\x03\x04\x05", "a tokens blob of 5 bytes"),
        ("messages", '[["user"]]', "a message is not [role, text]"),
    ],
)
def test_damaged_rows_are_skipped_with_a_report_and_the_others_resume(
    tiny_models: TinyModels, tmp_path: Path, column: str, value: object, reason: str
) -> None:
    home = tmp_path / "home"
    _, older, newest = _seed(home, tiny_models.base, "Q one", "Q two", "Q three")
    with sqlite3.connect(home / "conversations.db") as conn:
        conn.execute(f"UPDATE conversations SET {column} = ? WHERE id = ?", [value, newest])
    resumed = _run(home, _chat_cmd(tiny_models.base, "--resume"), "")
    assert resumed.returncode == 0, resumed.stderr
    assert f"skipped the damaged saved conversation {newest}: {reason}" in resumed.stderr
    assert "[resumed “Q two”: restored" in resumed.stderr and "Traceback" not in resumed.stderr
    listed = _localkv(home, "history", "ls")
    assert listed.returncode == 0 and newest not in listed.stdout and older in listed.stdout
    assert f"warning: skipped the damaged saved conversation {newest}" in listed.stderr
    export = _localkv(home, "history", "export", newest)
    assert export.returncode == 1 and "Traceback" not in export.stderr
    assert export.stderr.strip() == f"Error: saved conversation {newest} is damaged: " + (
        export.stderr.split("is damaged: ", 1)[-1].strip()
    )
    assert _localkv(home, "history", "rm", newest).returncode == 0  # a damaged one can go


def test_a_dropped_table_is_reported_and_the_chat_saves_again(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    _seed(home, tiny_models.base, "Q one")
    with sqlite3.connect(home / "conversations.db") as conn:
        conn.execute("DROP TABLE conversations")
    resumed = _run(home, _chat_cmd(tiny_models.base, "--resume"), "Still there?\n")
    assert resumed.returncode == 0, resumed.stderr
    assert "conversations table was missing" in resumed.stderr
    assert "[no saved conversation to resume: this is a new one]" in resumed.stderr
    assert _answered(home, "Still there?")


# ---------------------------------------------------------------------- signals
def _answer_then(home: Path, model: Path, sig: signal.Signals) -> tuple[_Chat, int]:
    chat = _Chat(home, _chat_cmd(model, max_tokens=1500))
    chat.send("Tell me a story")
    chat.wait_for(lambda: len(chat.out) >= 20, "an answer streaming")
    chat.proc.send_signal(sig)
    return chat, chat.proc.wait(timeout=WAIT_S)


def test_sigkill_during_an_answer_keeps_the_question(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    _, code = _answer_then(home, tiny_models.base, signal.SIGKILL)
    assert code == -signal.SIGKILL
    (row,) = _rows(home)
    assert row["pending"] == "Tell me a story" and row["title"] == "Tell me a story"
    resumed = _run(home, _chat_cmd(tiny_models.base, "--resume"), "And then?\n")
    assert resumed.returncode == 0, resumed.stderr
    assert "“Tell me a story”, was never answered" in resumed.stderr
    (row,) = _rows(home)
    assert row["pending"] is None
    roles = [(m[0], m[1]) for m in _messages(row)]
    assert roles[:3] == [("user", "Tell me a story"), ("assistant", ""), ("user", "And then?")]
    assert roles[3][0] == "assistant"


@pytest.mark.parametrize(("name", "code"), [("SIGTERM", 143), ("SIGHUP", 129)])
def test_a_stop_signal_keeps_the_question_and_the_partial_answer(
    tiny_models: TinyModels, tmp_path: Path, name: str, code: int
) -> None:
    home = tmp_path / "home"
    chat, returned = _answer_then(home, tiny_models.base, getattr(signal, name))
    assert returned == code, chat.stderr
    (row,) = _rows(home)
    assert row["pending"] is None
    (question, answer) = _messages(row)
    assert question == ["user", "Tell me a story"] and answer[0] == "assistant"
    assert len(answer[1]) > 0 and "stopped" in chat.stderr
    resumed = _run(home, _chat_cmd(tiny_models.base, "--resume"), "")
    assert resumed.returncode == 0 and "[resumed “Tell me a story”" in resumed.stderr


# ---------------------------------------------------------------------- models
def test_resuming_with_another_model_names_the_model_it_needs(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    _seed(home, tiny_models.base, "Hello")
    for extra in ([], ["--no-cache"]):  # by content hash, or by file name without the cache
        cmd = _chat_cmd(tiny_models.other_weights, "--resume", *extra)
        other = _run(home, cmd, "Hi\n")
        assert other.returncode == 1, other.stderr
        assert "cannot resume: “Hello” was made with the model tiny-base.gguf" in other.stderr
        assert "not tiny-other-weights.gguf" in other.stderr and "llama_decode" not in other.stderr
        assert "TTFT" not in other.stderr
    with sqlite3.connect(home / "conversations.db") as conn:  # a row saved before models were
        conn.execute("UPDATE conversations SET model = NULL, model_sha256 = NULL, identity = NULL")
    old = _run(home, _chat_cmd(tiny_models.other_weights, "--resume"), "Hi\n")
    assert old.returncode == 0 and "[resumed “Hello”" in old.stderr, old.stderr


# --------------------------------------------------------------------- history
def test_history_ls_export_and_rm(tiny_models: TinyModels, tmp_path: Path) -> None:
    home = tmp_path / "home"
    first, second = _seed(home, tiny_models.base, "First one", "Second one")
    listed = _localkv(home, "history", "ls")
    assert listed.returncode == 0, listed.stderr
    shown = [line.split()[0] for line in listed.stdout.splitlines()[1:]]
    assert shown == [second, first] and "tiny-base.gguf · First one" in listed.stdout
    rows = json.loads(_localkv(home, "history", "ls", "--json").stdout)
    assert [r["id"] for r in rows] == shown and rows[0]["model"]["file"] == "tiny-base.gguf"
    exported = json.loads(_localkv(home, "history", "export", shown[1]).stdout)
    assert exported["messages"][0] == {"role": "user", "content": "First one"}
    out = tmp_path / "first.md"
    done = _localkv(home, "history", "export", first[:6], "--format", "markdown", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert out.read_text().startswith("# First one\n") and "## Assistant" in out.read_text()
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert _localkv(home, "history", "rm", first).stdout.strip() == f"deleted {first}"
    assert [str(r["id"]) for r in _rows(home)] == [second]
    for args in (["rm", first], ["export", "nope"], ["export", ""]):
        bad = _localkv(home, "history", *args)
        assert bad.returncode == 1 and "Traceback" not in bad.stderr
        assert (
            bad.stderr.startswith("Error: no saved conversation ")
            and len(bad.stderr.strip().splitlines()) == 1
        )
    bad = _localkv(home, "history", "export", second, "--format", "pdf")
    assert bad.returncode == 2 and "pdf" in bad.stderr
    nowhere = tmp_path / "absent" / "cache"
    for args in (["ls"], ["ls", "--json"], ["export", second], ["rm", second]):
        result = _localkv(home, "history", *args, "--cache-dir", str(nowhere))
        assert result.returncode == (0 if args[0] == "ls" else 1), result.stderr
    assert not nowhere.parent.exists()  # reading created nothing


def test_the_app_lists_the_model_and_shows_why_another_model_cannot_resume(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    import asyncio

    from localkv.tui.app import build_app
    from localkv.tui.history_screen import HistoryScreen
    from support.tinymodels import tiny_config
    from textual.widgets import DataTable

    from localkv.history.store import ConversationStore
    from localkv.runtime import Runtime

    home = tmp_path / "home"
    _seed(home, tiny_models.base, "Hello")
    runtime = Runtime(tiny_config(tiny_models.other_weights), cache_dir=home)
    with runtime, ConversationStore.open(home) as history:
        app = build_app(runtime, history=history, resume=True)

        async def main() -> tuple[list[str], list[str]]:
            async with app.run_test(size=(100, 30)) as pilot:
                deadline = time.monotonic() + WAIT_S
                while not app.screen.query(".note.error") and time.monotonic() < deadline:
                    await pilot.pause(0.05)
                notes = [str(n.content) for n in app.screen.query(".note.error")]
                await pilot.press("f3")
                assert isinstance(app.screen, HistoryScreen)
                table = app.screen.query_one(DataTable)
                row = [str(cell) for cell in table.get_row_at(0)]
                await pilot.press("escape")
            app.close_controller()
            return notes, row

        notes, row = asyncio.run(main())
    assert any("was made with the model tiny-base.gguf" in n for n in notes), notes
    assert row[:2] == ["Hello", "tiny-base.gguf"]
