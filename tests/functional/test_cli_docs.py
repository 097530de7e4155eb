"""``localkv prefill`` / ``localkv ask`` through the CLI, then through the SQLite index."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.tinymodels import TinyModels

from localkv.cli import cli

SYSTEM = "Answer from the document."


@pytest.fixture()
def env(tmp_path: Path, tiny_models: TinyModels) -> dict[str, str]:
    """Environment pointing the model at the tiny model and the cache at tmp_path, on a
    machine that is idle as far as localkv can tell (whatever else runs on it)."""
    return {
        **os.environ,
        "LOCALKV_MODEL": str(tiny_models.base),
        "LOCALKV_HOME": str(tmp_path / "cache"),
        "LOCALKV_OTHER_TASKS": "0",
    }


@pytest.fixture()
def docs(tmp_path: Path, long_text: str) -> tuple[Path, Path]:
    a = tmp_path / "a.txt"
    b = tmp_path / "b.txt"
    a.write_text(long_text[:2000], encoding="utf-8")
    b.write_text(long_text[2000:3500], encoding="utf-8")
    return a, b


def run(env: dict[str, str], *args: str) -> CliRunnerResult:
    result = CliRunner().invoke(cli, list(args), env=env)
    return CliRunnerResult(result.exit_code, result.stdout, result.stderr)


class CliRunnerResult:
    def __init__(self, code: int, out: str, err: str) -> None:
        self.code, self.out, self.err = code, out, err

    def json(self) -> dict[str, object]:
        return json.loads(self.out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def subprocess_ask(env: dict[str, str], *args: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", "localkv", "ask", "--threads", "1", "--json", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _index_rows(env: dict[str, str], table: str) -> list[tuple[object, ...]]:
    db = Path(env["LOCALKV_HOME"]) / "index.db"
    if not db.exists():
        return []
    with sqlite3.connect(db) as conn:
        return list(conn.execute(f"SELECT * FROM {table}"))


def test_prefill_then_ask_in_a_new_process(env: dict[str, str], docs: tuple[Path, Path]) -> None:
    a, _ = docs
    pre = run(env, "prefill", "--threads", "1", "--system", SYSTEM, "--json", str(a))
    assert pre.code == 0, pre.err
    report = pre.json()
    assert set(report) >= {
        "snapshot",
        "tokens",
        "reused",
        "prefilled",
        "blocks",
        "new_blocks",
        "bytes_on_disk",
        "seconds",
    }
    assert report["prefilled"] == report["tokens"] and report["reused"] == 0
    snapshots = _index_rows(env, "snapshots")
    assert [row[0] for row in snapshots] == [report["snapshot"]]
    # the snapshot's chain (as `cache show` counts it), and the system prompt's own
    # shorter block beside it: every block written
    assert len(_index_rows(env, "blocks")) == report["new_blocks"] == report["blocks"] + 1

    question = ["--system", SYSTEM, "--temperature", "0", "--max-tokens", "24"]
    cached = subprocess_ask(env, *question, str(a), "What is this about?")
    uncached = subprocess_ask(env, *question, "--no-cache", str(a), "What is this about?")
    tokens, cache = cached["tokens"], cached["cache"]
    assert isinstance(tokens, dict) and isinstance(cache, dict)
    assert cache["hit"] is True and cache["verified"] is True
    assert cache["snapshot"] == report["snapshot"]
    assert tokens["reused"] >= report["tokens"]
    assert cached["answer"] == uncached["answer"]
    assert uncached["cache"] == {  # type: ignore[comparison-overlap]
        "hit": False,
        "verified": None,
        "snapshot": None,
        "miss_reason": "cache disabled",
        "common": 0,
        "recomputed": 0,
        "saved_s": 0.0,
    }
    assert (cache["common"], cache["recomputed"]) == (tokens["reused"], 0)
    timing = cached["timing"]
    assert isinstance(timing, dict)
    names = {"restore_s", "prefill_s", "ttft_s", "total_s", "since_start_s", "openmp", "threads"}
    assert set(timing) == names
    assert timing["threads"] == 1  # as --threads says
    openmp = timing["openmp"]  # the wait llama.cpp ran with: chosen from the load unless given
    given = {name: env.get(name) or None for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if any(given.values()) and not env.get("LOCALKV_OPENMP_CHOSEN"):  # not localkv's own choice
        assert openmp == {**given, "chosen": "user"}
    else:  # no other work (LOCALKV_OTHER_TASKS): a short spin
        assert openmp == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "3000", "chosen": "idle"}
    # the first text as the user sees it: after the process started, so after the engine's own
    assert timing["since_start_s"] > timing["ttft_s"] > 0
    hits = [row for row in _index_rows(env, "events") if row[0] == "hit"]
    assert hits


def test_two_documents_in_order_and_reversed(env: dict[str, str], docs: tuple[Path, Path]) -> None:
    a, b = docs
    pre = run(env, "prefill", "--threads", "1", "--system", SYSTEM, "--json", str(a), str(b))
    assert pre.code == 0, pre.err
    n = pre.json()["tokens"]
    opts = ["--threads", "1", "--system", SYSTEM, "--max-tokens", "2", "--json"]
    same = run(env, "ask", *opts, str(a), str(b), "Which came first?")
    assert same.code == 0, same.err
    assert same.json()["tokens"]["reused"] == n  # type: ignore[index]
    swapped = run(env, "ask", *opts, str(b), str(a), "Which came first?")
    reused = swapped.json()["tokens"]["reused"]  # type: ignore[index]
    system_only = run(env, "prefill", "--no-cache", "--system", SYSTEM, "--json", str(b)).json()
    # [system][B][A] shares the system prompt and the next turn's header with [system][A][B]
    assert 0 < reused < 20
    assert system_only["tokens"] > reused  # nowhere near a document's worth


def test_prefill_prints_what_it_saved(env: dict[str, str], docs: tuple[Path, Path]) -> None:
    a, _ = docs
    first = run(env, "prefill", "--threads", "1", str(a))
    assert first.code == 0, first.err
    assert "saved" in first.out and "blocks" in first.out and "snapshot" in first.out
    second = run(env, "prefill", "--threads", "1", str(a), "--json")
    assert second.json()["new_blocks"] == 0


def test_stdin_is_a_document(env: dict[str, str], long_text: str) -> None:
    result = CliRunner().invoke(
        cli, ["prefill", "--threads", "1", "--json", "-"], input=long_text[:800], env=env
    )
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["tokens"] > 100


def test_latin1_document_is_read_with_a_warning(env: dict[str, str], tmp_path: Path) -> None:
    doc = tmp_path / "latin1.txt"
    doc.write_bytes("Caf\xe9 cr\xe8me, na\xefve fa\xe7ade. ".encode("latin-1") * 20)
    result = run(env, "prefill", "--threads", "1", "--json", str(doc))
    assert result.code == 0, result.err
    assert "Latin-1" in result.err


BAD_INPUTS = [
    (["prefill", "missing.txt"], 1, "missing.txt: no such file"),
    (["prefill", "{dir}"], 1, "is a directory"),
    # unreadable even for root, which reads any mode-000 file: the read fails with EIO
    (["prefill", "/proc/self/mem"], 1, "cannot read it"),
    (["prefill", "{binary}"], 1, "looks binary"),
    (["prefill", "{empty}"], 1, "the document is empty"),
    (["prefill", "--ctx", "256", "{long}"], 1, "raise it with --ctx"),
    (["prefill", "--model", "nope.gguf", "{long}"], 1, "model file not found"),
    (["prefill", "--lora", "nope.gguf", "{long}"], 1, "LoRA adapter not found"),
    (["prefill", "--ctx", "0", "{long}"], 2, "--ctx"),
    (["prefill", "--ctx", "16", "{long}"], 2, "16 is not in the range 256<=x<=16777216"),
    (["prefill", "--ctx", "100000000", "{long}"], 2, "not in the range 256<=x<=16777216"),
    (["prefill", "--type-k", "f17", "{long}"], 2, "--type-k"),
    (["ask", "--temperature", "-1", "{long}", "q?"], 2, "--temperature"),
    (["ask", "{long}", "   "], 2, "the question is empty"),
    (["ask", "{long}"], 2, "give at least one FILE and then the QUESTION"),
]


@pytest.mark.parametrize(("args", "code", "message"), BAD_INPUTS)
def test_bad_input_gets_a_clear_error_and_changes_nothing(
    env: dict[str, str], tmp_path: Path, long_text: str, args: list[str], code: int, message: str
) -> None:
    files = {
        "dir": tmp_path,
        "binary": tmp_path / "x.bin",
        "empty": tmp_path / "empty.txt",
        "long": tmp_path / "long.txt",
    }
    files["binary"].write_bytes(b"\x7fELF\x00\x01\x02" * 100)
    files["empty"].write_text(" \n\n", encoding="utf-8")
    files["long"].write_text(long_text[:4000], encoding="utf-8")
    argv = [a.format(**{k: str(v) for k, v in files.items()}) for a in args]
    before = (_index_rows(env, "blocks"), _index_rows(env, "snapshots"))
    result = run(env, *argv)
    assert result.code == code
    assert message in result.err, result.err
    assert "Traceback" not in result.err + result.out
    assert (_index_rows(env, "blocks"), _index_rows(env, "snapshots")) == before


def test_cache_verify_deep_recomputes_and_agrees(
    env: dict[str, str], docs: tuple[Path, Path]
) -> None:
    a, b = docs
    assert run(env, "prefill", "--threads", "1", "--system", SYSTEM, str(a), str(b)).code == 0
    result = run(env, "cache", "verify", "--deep", "--threads", "1", "--json")
    assert result.code == 0, result.out + result.err
    report = result.json()
    assert report["ok"] is True and report["problems"] == []
    deep = report["deep"]
    assert isinstance(deep, list) and len(deep) == 1 and deep[0]["ok"] is True


def test_cache_verify_deep_catches_a_forged_probe(
    env: dict[str, str], docs: tuple[Path, Path]
) -> None:
    a, _ = docs
    assert run(env, "prefill", "--threads", "1", str(a)).code == 0
    db = Path(env["LOCALKV_HOME"]) / "index.db"
    with sqlite3.connect(db) as conn:  # another probe recorded for the first block
        conn.execute(
            "UPDATE blocks SET probe_digest = ? WHERE parent IS NULL", ("sha256:" + "0" * 64,)
        )
    result = run(env, "cache", "verify", "--deep", "--threads", "1", "--json")
    assert result.code == 1
    assert result.json()["deep"][0]["ok"] is False  # type: ignore[index]


def test_compact_cache_from_the_flag_and_the_environment(
    env: dict[str, str], docs: tuple[Path, Path]
) -> None:
    a, b = docs
    pre = run(env, "prefill", "--threads", "1", "--compact-cache", "--json", str(a))
    assert pre.code == 0, pre.err
    stats = run(env, "cache", "stats", "--json").json()
    assert isinstance(stats["stored_bytes"], int) and isinstance(stats["raw_bytes"], int)
    assert stats["stored_bytes"] < 0.9 * stats["raw_bytes"]
    # another document, compact through the environment; the first is restored from
    # its compact blocks, verified, and answers as without the cache
    compact_env = {**env, "LOCALKV_COMPACT_CACHE": "1"}
    question = ["--temperature", "0", "--max-tokens", "16"]
    cached = subprocess_ask(compact_env, *question, str(a), str(b), "Which came first?")
    uncached = subprocess_ask(env, *question, "--no-cache", str(a), str(b), "Which came first?")
    assert cached["cache"]["hit"] is True and cached["cache"]["verified"] is True  # type: ignore[index]
    assert cached["answer"] == uncached["answer"]
    rows = _index_rows(env, "blocks")
    db = Path(env["LOCALKV_HOME"]) / "index.db"
    with sqlite3.connect(db) as conn:
        sizes = list(conn.execute("SELECT stored_bytes, raw_bytes FROM blocks"))
    assert len(sizes) == len(rows) > pre.json()["blocks"]  # type: ignore[operator]
    assert all(stored < raw for stored, raw in sizes)
