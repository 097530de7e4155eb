"""Concurrency: real CLI processes prefill, ask and gc one cache directory at once.

No "database is locked" (or any traceback) reaches the user, every prefill's
snapshot is there afterwards (no lost write), every answer equals the
uncached one, and blocks evicted while a process reads them are a clean miss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from localkv.storage.store import SnapshotStore
from support.reliability import finish, integrity_ok, long_run, record, worker
from support.tinymodels import TinyModels

SYSTEM = "Answer from the document."
ASK = ["--temperature", "0", "--max-tokens", "8"]
BAD_WORDS = ("database is locked", "Traceback", "Error:")


def _cli(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "localkv", *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _prefill(env: dict[str, str], doc: Path) -> subprocess.Popen[str]:
    return _cli(env, "prefill", "--threads", "1", "--json", str(doc), "--system", SYSTEM)


def _ask(env: dict[str, str], doc: Path, *extra: str) -> subprocess.Popen[str]:
    return _cli(
        env,
        "ask",
        "--threads",
        "1",
        "--json",
        *ASK,
        *extra,
        str(doc),
        "What happens?",
        "--system",
        SYSTEM,
    )


def _done(proc: subprocess.Popen[str]) -> dict[str, object]:
    code, out, err = finish(proc, timeout=300)
    assert code == 0, err
    for word in BAD_WORDS:
        assert word not in err, err
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.fixture()
def setup(
    tmp_path: Path, tiny_models: TinyModels, long_text: str
) -> tuple[dict[str, str], list[Path], dict[str, str]]:
    env = {
        **os.environ,
        "LOCALKV_MODEL": str(tiny_models.base),
        "LOCALKV_HOME": str(tmp_path / "cache"),
    }
    env.pop("LOCALKV_FAULT", None)
    docs = []
    for i in range(3):
        doc = tmp_path / f"doc{i}.txt"
        doc.write_text(long_text[i * 1200 : i * 1200 + 1500], encoding="utf-8")
        docs.append(doc)
    procs = [_ask(env, d, "--no-cache") for d in docs]
    uncached = {str(d): str(_done(p)["answer"]) for d, p in zip(docs, procs, strict=True)}
    return env, docs, uncached


def _wave(
    env: dict[str, str], docs: list[Path], uncached: dict[str, str], churn: bool
) -> dict[str, int]:
    root = Path(env["LOCALKV_HOME"])
    a, b, c = docs
    if churn:  # asks read while another process removes and evicts what they read
        procs = [_ask(env, a), _ask(env, b), _prefill(env, c)]
        helpers = [worker("churn", root, 3.0, 1)]
        listing = []
    else:
        procs = [_prefill(env, a), _prefill(env, b), _ask(env, c)]
        helpers = [worker("gc", root, 3.0, 3600)]
        listing = [_cli(env, "cache", "gc", "--json")]
    results = [_done(p) for p in procs]
    counts = {"processes": len(procs) + len(helpers) + len(listing), "removed": 0, "evictions": 0}
    for p in listing + helpers:
        code, out, err = finish(p)
        assert code == 0 and not any(w in err for w in BAD_WORDS), err
        if p in helpers:
            for key, value in json.loads(out.strip().splitlines()[-1]).items():
                counts[key] = counts.get(key, 0) + value
    # every answer equals the uncached one, whatever the other processes did meanwhile
    asked = [(a, results[0]), (b, results[1])] if churn else [(c, results[2])]
    for doc, result in asked:
        assert result["answer"] == uncached[str(doc)]
    if not churn:  # nothing removes snapshots: both prefills' are there
        with SnapshotStore.open(root) as store:
            ids = {s.id for s in store.snapshots()}
        assert {results[0]["snapshot"], results[1]["snapshot"]} <= ids
    assert integrity_ok(root) == "ok"
    with SnapshotStore.open(root) as store:
        assert store.verify() == []
    if churn:
        return counts
    # and afterwards the cache is used, still giving the uncached answer
    again = [_ask(env, d) for d in (a, b)]
    for d, p in zip((a, b), again, strict=True):
        answer = _done(p)
        assert answer["answer"] == uncached[str(d)]
        assert answer["cache"]["hit"] is True  # type: ignore[index]
    counts["processes"] += len(again)
    return counts


def test_processes_prefill_ask_and_gc_at_once(
    setup: tuple[dict[str, str], list[Path], dict[str, str]],
) -> None:
    env, docs, uncached = setup
    start = time.perf_counter()
    total: dict[str, int] = {}
    for churn in (True, False):
        for key, value in _wave(env, docs, uncached, churn).items():
            total[key] = total.get(key, 0) + value
    record("concurrency.cli", waves=2, seconds=round(time.perf_counter() - start, 1), **total)


@long_run
def test_many_waves_with_eviction(setup: tuple[dict[str, str], list[Path], dict[str, str]]) -> None:
    env, docs, uncached = setup
    total: dict[str, int] = {}
    for wave in range(8):
        for key, value in _wave(env, docs, uncached, churn=wave % 2 == 1).items():
            total[key] = total.get(key, 0) + value
    record("concurrency.cli.long", waves=8, **total)
