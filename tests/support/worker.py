"""A process that works on a cache directory for the reliability tests (not a test module).

    python tests/support/worker.py ROLE ROOT LOG ARGS...

Roles:

- ``script SEED N``: a fixed script whose end state does not depend on where an
  earlier run of it was killed: write documents 0..N-1 (pinning document 1),
  remove document 0's snapshot, write N..N+1, evict everything unpinned, write
  N+2..N+3, gc. Each finished step is logged (``B hash``, ``S id``, ``P phase``).
- ``write SEED FIRST COUNT``: write documents FIRST..FIRST+COUNT-1 with snapshots.
- ``read SECONDS SEED...``: read random documents of these seeds and compare every
  loaded block with the oracle; a failed read must be a block that is gone.
- ``gc SECONDS GRACE``: run gc in a loop.
- ``churn SECONDS SEED``: remove random snapshots and evict to a small budget.

Readers print one JSON line of counts; any wrong data exits with status 3.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path

from localkv.storage import NewSnapshot
from localkv.storage.store import BlockCorrupt, SnapshotStore

from support.reliability import BLOCK, doc_tokens, oracle_mismatch
from support.store import make_chain


class Log:
    """Lines appended with O_APPEND writes: complete in the kernel even if killed after."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def __call__(self, *words: object) -> None:
        os.write(self.fd, (" ".join(map(str, words)) + "\n").encode())


def write_doc(store: SnapshotStore, log: Log, seed: int, i: int, pinned: bool = False) -> None:
    blocks = make_chain(doc_tokens(seed, i), BLOCK)
    for b in blocks:
        try:
            store.put_block(b)
        except ValueError:  # a churn process evicted its parent meanwhile: the API says so
            log("X", b.hash)
            return
        log("B", b.hash)
    tip = blocks[-1]
    try:
        snap = store.put_snapshot(
            NewSnapshot(
                tip=tip.hash,
                label=f"doc {seed}/{i}",
                source_path=None,
                source_sha256=None,
                n_tokens=tip.end,
                identity=tip.identity,
                namespace=tip.namespace,
            ),
            pinned=pinned,
        )
    except ValueError:  # its tip was evicted by a churn process already
        log("X", tip.hash)
        return
    log("S", snap)


def script(store: SnapshotStore, log: Log, seed: int, n: int) -> None:
    for i in range(n):
        write_doc(store, log, seed, i, pinned=i == 1)
    log("P", "remove")
    with contextlib.suppress(KeyError):  # removed by an earlier run of this script
        store.remove_snapshot(store.get_snapshot(_snap_id(store, seed, 0)).id)
    log("P", "write2")
    for i in range(n, n + 2):
        write_doc(store, log, seed, i)
    log("P", "evict")
    store.evict(0)
    log("P", "write3")
    for i in range(n + 2, n + 4):
        write_doc(store, log, seed, i)
    log("P", "gc")
    store.gc(grace_seconds=0)
    log("P", "done")


def _snap_id(store: SnapshotStore, seed: int, i: int) -> str:
    for s in store.snapshots():
        if s.label == f"doc {seed}/{i}":
            return s.id
    raise KeyError(i)


def read(store: SnapshotStore, seconds: float, seeds: list[int]) -> dict[str, int]:
    counts = {"reads": 0, "blocks": 0, "clean_misses": 0}
    rng = random.Random()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seed = rng.choice(seeds)
        hashes = [b.hash for b in make_chain(doc_tokens(seed, rng.randrange(12)), BLOCK)]
        rows = store.match_chain(hashes)
        counts["reads"] += 1
        try:
            blocks = store.read_blocks(rows)
        except BlockCorrupt as exc:
            row = next(r for r in rows if r.hash == exc.block_hash)
            now = store.match_chain([row.hash])
            if now and now[0].checksum == row.checksum:
                print(f"FAIL: stored block {row.hash} refused: {exc.reason}", flush=True)
                sys.exit(3)
            counts["clean_misses"] += 1  # removed while we read it
            continue
        for block in blocks:
            problem = oracle_mismatch(block)
            if problem is not None:
                print(f"FAIL: block {block.hash} loaded wrong: {problem}", flush=True)
                sys.exit(3)
            counts["blocks"] += 1
    return counts


def churn(store: SnapshotStore, seconds: float, seed: int) -> dict[str, int]:
    counts = {"removed": 0, "evictions": 0}
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        snaps = store.snapshots()
        if snaps:
            try:
                store.remove_snapshot(rng.choice(snaps).id)
                counts["removed"] += 1
            except KeyError:
                pass  # removed by someone else meanwhile
        total = store.stats()["stored_bytes"]
        if store.evict(total // 2):
            counts["evictions"] += 1
        time.sleep(rng.uniform(0.0, 0.05))
    return counts


def main(argv: list[str]) -> int:
    role, root, log_path, *args = argv
    log = Log(log_path)
    with SnapshotStore.open(Path(root)) as store:
        if role == "script":
            script(store, log, int(args[0]), int(args[1]))
            return 0
        if role == "write":
            seed, first, count = map(int, args)
            for i in range(first, first + count):
                write_doc(store, log, seed, i)
            return 0
        if role == "read":
            counts = read(store, float(args[0]), [int(a) for a in args[1:]])
        elif role == "gc":
            deadline = time.monotonic() + float(args[0])
            runs = 0
            while time.monotonic() < deadline:
                store.gc(grace_seconds=float(args[1]))
                runs += 1
                time.sleep(0.01)
            counts = {"gc_runs": runs}
        elif role == "churn":
            counts = churn(store, float(args[0]), int(args[1]))
        else:
            raise SystemExit(f"unknown role {role}")
    print(json.dumps(counts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
