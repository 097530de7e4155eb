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
