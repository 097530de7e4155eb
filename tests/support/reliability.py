"""Helpers for the reliability tests: the oracle, invariant checks, worker processes.

The oracle: every block the tests write is ``make_chain`` of a token list that
``doc_tokens(seed, i)`` derives from two numbers, so a block's tensors and
probe are a pure function of its tokens and start. Whatever a reader loads
can be compared with what the writer meant to write, and must be equal.

``record`` appends figures (runs, kills, corruptions...) as JSON lines to
``$LOCALKV_RELIABILITY_LOG`` when it is set; docs/performance/reliability.md quotes them.
This module holds no tests.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
from localkv.storage import NewSnapshot
from localkv.storage.store import Block, BlockRow, SnapshotStore

from support.store import logits_for, make_chain, tensors_for

BLOCK = 16
WORKER = Path(__file__).with_name("worker.py")
ENV_LOG = "LOCALKV_RELIABILITY_LOG"
F = TypeVar("F", bound=Callable[..., Any])


def long_run(fn: F) -> F:
    """Mark a long run: it runs only under ``pytest -m reliability_long``, skipped otherwise."""
    skip = pytest.mark.skipif(
        "'reliability_long' not in (config.getoption('markexpr') or '')",
        reason="long reliability run: pytest -m reliability_long",
    )
    return pytest.mark.reliability_long(skip(fn))  # type: ignore[no-any-return]


def record(test: str, **figures: object) -> None:
    """Append one test's figures to ``$LOCALKV_RELIABILITY_LOG`` (if set)."""
    path = os.environ.get(ENV_LOG)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"test": test, **figures}) + "\n")


def doc_tokens(seed: int, i: int) -> list[int]:
    """A token list of 20..120 tokens; documents of one seed share their first 16-48."""
    rng = np.random.default_rng([seed, i])
    shared = np.random.default_rng(seed).integers(1, 5000, 48)
    head = int(rng.integers(0, 4)) * BLOCK
    tail = rng.integers(1, 5000, int(rng.integers(20, 121)))
    return [int(t) for t in np.concatenate([shared[:head], tail])]


def expected_block(tokens: np.ndarray, start: int) -> tuple[dict[str, np.ndarray], str]:
    """The tensors and probe digest the writer of these tokens at ``start`` meant."""
    probe = logits_for(start + int(tokens[-1]))
    from localkv.storage.values import Probe

    return tensors_for(np.asarray(tokens, dtype=np.int32), start), Probe.digest_of(probe)


def oracle_mismatch(block: Block) -> str | None:
    """Why a loaded block differs from the oracle, or None if it is exactly right."""
    tensors, digest = expected_block(block.tokens, block.start)
    if block.probe.digest != digest:
        return "probe differs"
    if sorted(block.tensors) != sorted(tensors):
        return f"tensor names {sorted(block.tensors)}"
    for name, want in tensors.items():
        got = block.tensors[name]
        if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
            return f"tensor {name} differs"
    return None


def integrity_ok(root: Path) -> str:
    conn = sqlite3.connect(root / "index.db")
    try:
        return str(conn.execute("PRAGMA integrity_check").fetchone()[0])
    finally:
        conn.close()


def check_store(root: Path, *, gc: bool = True) -> dict[str, int]:
    """Assert every invariant of a quiescent cache; return counts.

    ``PRAGMA integrity_check`` is ok; every indexed block reads, verifies and
    equals the oracle; every snapshot's chain is complete; after ``gc`` no temp
    file, orphan file or row without a file is left.
    """
    assert integrity_ok(root) == "ok"
    with SnapshotStore.open(root) as store:
        assert store.verify() == []  # before gc: no row lost its file, no file is bad
        if gc:
            store.gc(grace_seconds=0)
        rows = store.all_blocks()
        assert store.verify() == []
        checked = 0
        for row in rows:
            (block,) = store.read_blocks([row])
            problem = oracle_mismatch(block)
            assert problem is None, f"{row.hash}: {problem}"
            checked += 1
        for snap in store.snapshots():
            chain = store.chain_of(snap.tip)
            assert chain and chain[0].start == 0 and chain[-1].end == snap.n_tokens
        if gc:
            assert list((root / "tmp").iterdir()) == []
            named = {r.file for r in rows}
            on_disk = {
                str(p.relative_to(root)) for p in (root / "blocks").rglob("*") if not p.is_dir()
            }
            assert on_disk == named, f"orphans {on_disk - named}, missing {named - on_disk}"
        return {"blocks": checked, "snapshots": len(store.snapshots())}


def logged(path: Path) -> list[list[str]]:
    """The worker's log: one list of words per line (complete lines only)."""
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    return [line.split() for line in text.split("\n")[:-1] if line]


def worker(
    role: str, root: Path, *args: object, fault: str | None = None, log: Path | None = None
) -> subprocess.Popen[str]:
    """Start ``support/worker.py ROLE ROOT ARGS...`` (with ``$LOCALKV_FAULT``)."""
    env = {k: v for k, v in os.environ.items() if k != "LOCALKV_FAULT"}
    if fault:
        env["LOCALKV_FAULT"] = fault
    # the tests folder, so the worker imports ``support.*`` as the tests do
    env["PYTHONPATH"] = os.pathsep.join([str(WORKER.parent.parent), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(WORKER), role, str(root), str(log or os.devnull)]
    cmd += [str(a) for a in args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def seed_store(root: Path, seed: int, n_docs: int) -> list[Block]:
    """Write ``n_docs`` documents (with snapshots) in this process; return their blocks."""
    out: list[Block] = []
    with SnapshotStore.open(root) as store:
        for i in range(n_docs):
            blocks = make_chain(doc_tokens(seed, i), BLOCK)
            for b in blocks:
                store.put_block(b)
            tip = blocks[-1]
            store.put_snapshot(
                NewSnapshot(
                    tip=tip.hash,
                    label=f"doc {seed}/{i}",
                    source_path=None,
                    source_sha256=None,
                    n_tokens=tip.end,
                    identity=tip.identity,
                    namespace=tip.namespace,
                )
            )
            out.extend(blocks)
    return out


def rows_of(store: SnapshotStore, hashes: Sequence[str]) -> list[BlockRow]:
    found = store.get_blocks(hashes)
    return [found[h] for h in hashes if h in found]
