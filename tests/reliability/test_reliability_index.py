"""The index can always be rebuilt: a lost, emptied or damaged ``index.db``, a read-only
cache, a cache that is not there, an index deleted during a prefill.

Everything runs through the CLI in real processes on the tiny model. After
``cache repair`` every snapshot whose files are intact is listed again and
``ask`` reuses it, verified, with the ``--no-cache`` answer; the damaged index
is in ``quarantine/``; every ``cache`` command facing a damaged index says so
in one line that names the repair, with no traceback.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from localkv.storage.store import SnapshotStore
from support.processes import run_until_a_block_is_saved
from support.reliability import record
from support.tinymodels import TinyModels

LIVENESS_S = 120  # a hang guard only
QUESTION = "Who is the story about?"
_ASK = ("--temperature", "0", "--max-tokens", "8", "--threads", "1")


@pytest.fixture()
def env(tmp_path: Path, tiny_models: TinyModels) -> dict[str, str]:
    return {
        **os.environ,
        "LOCALKV_MODEL": str(tiny_models.base),
        "LOCALKV_HOME": str(tmp_path / "cache"),
    }


def _run(
    env: dict[str, str], *args: str, preexec: Callable[[], None] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "localkv", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=LIVENESS_S,
        stdin=subprocess.DEVNULL,
        preexec_fn=preexec,
    )


def _json(done: subprocess.CompletedProcess[str]) -> dict:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _docs(tmp_path: Path, long_text: str) -> tuple[Path, Path]:
    a, b = tmp_path / "alpha.txt", tmp_path / "beta.txt"
    a.write_text(long_text[:3000], encoding="utf-8")
    b.write_text(long_text[3000:5000], encoding="utf-8")
    return a, b


def _cached(env: dict[str, str], a: Path, b: Path) -> tuple[dict[str, bool], str]:
    """Two snapshots (alpha pinned) and alpha's uncached answer."""
    pinned = _json(
        _run(env, "prefill", "--json", "--threads", "1", "--pin", "--label", "alpha", str(a))
    )
    other = _json(_run(env, "prefill", "--json", "--threads", "1", "--label", "beta", str(b)))
    uncached = _json(_run(env, "ask", "--json", "--no-cache", *_ASK, str(a), QUESTION))
    return {pinned["snapshot"]: True, other["snapshot"]: False}, uncached["answer"]


def _damage_page(index: Path) -> bytes:
    """Overwrite the root page of the blocks table with garbage; the damaged bytes."""
    with sqlite3.connect(index) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        sql = "SELECT rootpage FROM sqlite_master WHERE name = 'blocks'"
        (root_page,) = conn.execute(sql).fetchone()
    data = bytearray(index.read_bytes())
    data[(root_page - 1) * page : root_page * page] = np.random.default_rng(3).bytes(page)
    index.write_bytes(bytes(data))
    return bytes(data)


def _lose(index: Path, how: str) -> bytes | None:
    """Lose the index one way; the bytes that must be quarantined, if any."""
    for side in index.parent.glob("index.db-*"):
        side.unlink()
    if how == "deleted":
        index.unlink()
        return None
    if how == "emptied":
        index.write_bytes(b"")
        return None
    if how == "garbage":
        data = np.random.default_rng(4).bytes(64 << 10)
        index.write_bytes(data)
        return data
    return _damage_page(index)


@pytest.mark.parametrize("how", ["deleted", "emptied", "garbage", "damaged page"])
def test_repair_restores_every_intact_snapshot(
    env: dict[str, str], tmp_path: Path, long_text: str, how: str
) -> None:
    a, b = _docs(tmp_path, long_text)
    snaps, uncached = _cached(env, a, b)
    cache = Path(env["LOCALKV_HOME"])
    damaged = _lose(cache / "index.db", how)
    report = _json(_run(env, "cache", "repair", "--json"))
    assert sorted(report["snapshots_added"]) == sorted(snaps)
    assert report["skipped_blocks"] == [] and report["skipped_snapshots"] == []
    if damaged is not None:
        moved = Path(report["quarantined_index"])
        assert moved.parent == cache / "quarantine" and moved.read_bytes() == damaged
        assert report["index_problem"]
    listed = {r["id"]: r for r in json.loads(_run(env, "cache", "ls", "--json").stdout)}
    assert {i: r["pinned"] for i, r in listed.items()} == snaps
    assert sorted(r["label"] for r in listed.values()) == ["alpha", "beta"]
    asked = _json(_run(env, "ask", "--json", *_ASK, str(a), QUESTION))
    assert asked["cache"]["hit"] and asked["cache"]["verified"]
    assert asked["cache"]["snapshot"] in snaps
    assert asked["answer"] == uncached
    verify = _run(env, "cache", "verify", "--json")
    assert verify.returncode == 0 and json.loads(verify.stdout)["ok"] is True
    record("index.repair", how=how, blocks=report["blocks_added"])


@pytest.mark.parametrize("how", ["garbage", "damaged page"])
def test_verify_reports_a_damaged_index_as_not_ok(
    env: dict[str, str], tmp_path: Path, long_text: str, how: str
) -> None:
    a, _ = _docs(tmp_path, long_text)
    _json(_run(env, "prefill", "--json", "--threads", "1", str(a)))
    _lose(Path(env["LOCALKV_HOME"]) / "index.db", how)
    as_json = _run(env, "cache", "verify", "--json")
    assert as_json.returncode == 1
    out = json.loads(as_json.stdout)
    assert out["ok"] is False and "localkv cache repair" in out["problems"][0]["reason"]
    text = _run(env, "cache", "verify")
    assert text.returncode == 1 and text.stdout.startswith("BAD  index: ")
    assert "Traceback" not in text.stderr + as_json.stderr


@pytest.mark.parametrize(
    "args",
    [["ls"], ["show", "abc"], ["stats"], ["gc"], ["pin", "abc"], ["unpin", "abc"], ["rm", "abc"]],
    ids=lambda a: a[0],
)
def test_each_cache_command_facing_a_garbage_index_says_repair_in_one_line(
    env: dict[str, str], args: list[str]
) -> None:
    cache = Path(env["LOCALKV_HOME"])
    SnapshotStore.open(cache).close()
    (cache / "index.db").write_bytes(np.random.default_rng(5).bytes(32 << 10))
    done = _run(env, "cache", *args)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "localkv cache repair" in lines[0], done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("how", ["garbage", "damaged page"])
def test_ask_and_prefill_with_a_damaged_index_answer_uncached_and_say_so(
    env: dict[str, str], tmp_path: Path, long_text: str, how: str
) -> None:
    a, b = _docs(tmp_path, long_text)
    _, uncached = _cached(env, a, b)
    _lose(Path(env["LOCALKV_HOME"]) / "index.db", how)
    asked = _run(env, "ask", *_ASK, str(a), QUESTION)
    assert asked.returncode == 0 and asked.stdout.strip() == uncached.strip()
    told = [line for line in asked.stderr.splitlines() if "localkv cache repair" in line]
    assert len(told) == 1 and told[0].startswith("cache miss (") and "damaged" in told[0]
    prefilled = _run(env, "prefill", "--threads", "1", str(b))
    # a prefill that can save nothing fails with the reason
    assert prefilled.returncode == 1 and "snapshot " not in prefilled.stdout
    told = [line for line in prefilled.stderr.splitlines() if "localkv cache repair" in line]
    assert len(told) == 1, prefilled.stderr
    assert "Traceback" not in asked.stderr + prefilled.stderr


def _drop_override() -> None:
    """In the child: root loses the capabilities that ignore file permissions."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP, kept across exec
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    stats = {p: p.stat() for p in root.rglob("*")}
    return {str(p.relative_to(root)): (st.st_size, st.st_mtime_ns) for p, st in stats.items()}


def test_a_read_only_cache_restores_verified_and_saves_nothing(
    env: dict[str, str], tmp_path: Path, long_text: str
) -> None:
    a, b = _docs(tmp_path, long_text)
    snaps, uncached = _cached(env, a, b)
    cache = Path(env["LOCALKV_HOME"])
    preexec = _drop_override if os.geteuid() == 0 else None
    paths = [cache, *cache.rglob("*")]
    for p in reversed(paths):
        p.chmod(0o500 if p.is_dir() else 0o400)
    before = _tree(cache)
    try:
        asked = _run(env, "ask", *_ASK, str(a), QUESTION, preexec=preexec)
        listed = _run(env, "cache", "ls", "--json", preexec=preexec)
        probe = _run(env, "cache", "gc", preexec=preexec)  # nothing it could remove
    finally:
        for p in paths:
            p.chmod(0o700 if p.is_dir() else 0o600)
    assert asked.returncode == 0, asked.stderr
    assert asked.stdout.strip() == uncached.strip()
    assert "(verified)" in asked.stderr
    warned = [line for line in asked.stderr.splitlines() if "read-only" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: the cache at")
    assert listed.returncode == 0 and {r["id"] for r in json.loads(listed.stdout)} == set(snaps)
    assert "Traceback" not in asked.stderr + listed.stderr + probe.stderr
    assert _tree(cache) == before


@pytest.mark.parametrize("args", [["ls"], ["stats"], ["verify"], ["show", "abc"]], ids=str)
def test_read_only_commands_never_create_the_cache_directory(
    env: dict[str, str], tmp_path: Path, args: list[str]
) -> None:
    missing = tmp_path / "x" / "nonexistent"
    done = _run(env, "cache", *args, "--cache-dir", str(missing))
    assert done.returncode == (1 if args[0] == "show" else 0), done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "x").exists()


def test_a_prefill_that_loses_its_index_says_so_and_repair_recovers_it(
    env: dict[str, str], tmp_path: Path, long_text: str
) -> None:
    doc = tmp_path / "long.txt"
    doc.write_text(long_text[:14000], encoding="utf-8")
    cache = Path(env["LOCALKV_HOME"])
    args = ["prefill", "--json", "--threads", "1", str(doc)]
    proc = run_until_a_block_is_saved(env, args, LIVENESS_S)
    os.kill(proc.pid, signal.SIGSTOP)  # the first block is saved: the index goes now
    running = proc.poll() is None
    for path in cache.glob("index.db*"):
        path.unlink()
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=LIVENESS_S)
    assert running, "the prefill ended before its index could be deleted"
    assert proc.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["snapshot"] is None
    assert "was deleted or replaced while this ran" in err and "cache repair" in err
    report = _json(_run(env, "cache", "repair", "--json"))
    assert report["blocks_added"] >= 4 and len(report["snapshots_added"]) == 1
    again = _json(_run(env, "prefill", "--json", "--threads", "1", str(doc)))
    assert again["prefilled"] == 0 and again["reused"] == again["tokens"]


def test_gc_after_a_lost_index_keeps_the_block_files_for_repair(
    env: dict[str, str], tmp_path: Path, long_text: str
) -> None:
    a, b = _docs(tmp_path, long_text)
    snaps, uncached = _cached(env, a, b)
    cache = Path(env["LOCALKV_HOME"])
    _lose(cache / "index.db", "deleted")
    files = sorted(cache.glob("blocks/*/*.lkv"))
    past = time.time() - 7200  # older than gc's grace period for files without rows
    for f in files:
        os.utime(f, (past, past))
    swept = _run(env, "cache", "gc", "--json")
    assert swept.returncode == 0, swept.stderr
    assert "cache repair" in swept.stderr
    assert sorted(cache.glob("blocks/*/*.lkv")) == files
    report = _json(_run(env, "cache", "repair", "--json"))
    assert sorted(report["snapshots_added"]) == sorted(snaps)
    asked = _json(_run(env, "ask", "--json", *_ASK, str(a), QUESTION))
    assert asked["cache"]["hit"] and asked["cache"]["verified"]
    assert asked["answer"] == uncached


def test_repair_of_a_cache_that_is_not_there_says_so_and_creates_nothing(
    env: dict[str, str], tmp_path: Path
) -> None:
    missing = tmp_path / "no" / "cache"
    done = _run(env, "cache", "repair", "--cache-dir", str(missing))
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and done.stderr.strip()
    assert not missing.exists()
