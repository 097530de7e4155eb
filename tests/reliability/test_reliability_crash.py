"""Crash safety: writers, readers and gc killed with SIGKILL at named and random points.

After every kill the cache must pass ``check_store``: SQLite's integrity check,
every indexed block present and equal to what its writer meant (the oracle),
every snapshot's chain complete, and after gc no temp or orphan file. Writes
that returned before the kill are still there, and running the killed script
again ends in exactly the state of a run that was never killed.

The fast set kills at every named point once or twice and runs two random
rounds; ``-m reliability_long`` runs many more (see docs/performance/reliability.md).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
from localkv.storage import faults
from localkv.storage.store import SnapshotStore
from support.reliability import (
    check_store,
    finish,
    logged,
    long_run,
    record,
    seed_store,
    worker,
)

SEED = 7
N_DOCS = 4
OLD = time.time() - 7200


def _plant_debris(root: Path) -> None:
    """A stale temp file and an orphan block file, so gc has work (and points) to hit."""
    SnapshotStore.open(root).close()
    (root / "tmp" / "stale.tmp").write_bytes(b"x" * 100)
    fan = root / "blocks" / "ff"
    fan.mkdir(mode=0o700, exist_ok=True)
    (fan / ("f" * 64 + ".lkv")).write_bytes(b"y" * 100)
    for p in (root / "tmp" / "stale.tmp", fan / ("f" * 64 + ".lkv")):
        os.utime(p, (OLD, OLD))


def _state(root: Path) -> tuple[list[str], list[tuple[str, bool]]]:
    with SnapshotStore.open(root) as store:
        blocks = sorted(r.hash for r in store.all_blocks())
        snaps = sorted((s.label, s.pinned) for s in store.snapshots())
    return blocks, snaps


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], list[object]]:
    """The end state of the script run once without faults."""
    root = tmp_path_factory.mktemp("reference") / "cache"
    _plant_debris(root)
    code, _, err = finish(worker("script", root, SEED, N_DOCS))
    assert code == 0, err
    return _state(root)  # type: ignore[return-value]


def _kill_at(tmp_path: Path, point: str, nth: int, reference: object) -> dict[str, object]:
    root = tmp_path / "cache"
    _plant_debris(root)
    log = tmp_path / "log"
    code, _, err = finish(
        worker("script", root, SEED, N_DOCS, fault=f"{point}:kill@{nth}", log=log)
    )
    assert code == -signal.SIGKILL, f"not killed at {point}@{nth}: rc {code}\n{err}"
    lines = logged(log)
    if all(w[0] != "P" for w in lines):  # killed while writing: what returned is there
        with SnapshotStore.open(root) as store:
            assert all(store.has_block(w[1]) for w in lines if w[0] == "B")
            labels = {s.id for s in store.snapshots()}
            assert all(w[1] in labels for w in lines if w[0] == "S")
    counts = check_store(root)
    code, _, err = finish(worker("script", root, SEED, N_DOCS))
    assert code == 0, err
    assert _state(root) == reference
    check_store(root)
    return {"logged_steps": len(lines), **counts}


NAMED = [(p, 1) for p in sorted(faults.POINTS)] + [
    ("before_commit", 6),
    ("after_commit", 11),
    ("before_rename", 4),
]


@pytest.mark.parametrize(("point", "nth"), NAMED)
def test_kill_at_a_named_point_loses_nothing(
    tmp_path: Path, point: str, nth: int, reference: object
) -> None:
    figures = _kill_at(tmp_path, point, nth, reference)
    record("crash.named", point=point, nth=nth, kills=1, **figures)


def _random_round(root: Path, rng: random.Random, n_writers: int, churn: bool) -> dict[str, int]:
    """Writers killed at random moments while readers, gc (and churn) run beside them."""
    logs = [root.parent / f"w{i}.log" for i in range(n_writers)]
    for log in logs:  # this round's writes only: an earlier round's churn removed some
        log.unlink(missing_ok=True)
    writers = [worker("write", root, 100 + i, 0, 12, log=logs[i]) for i in range(n_writers)]
    seconds = 1.5
    seeds = [SEED, *(100 + i for i in range(n_writers))]
    others = [worker("read", root, seconds, *seeds), worker("gc", root, seconds, 3600)]
    if churn:
        others.append(worker("churn", root, seconds, rng.randrange(1000)))
    time.sleep(rng.uniform(0.4, 1.2))
    for w in writers:
        if rng.random() < 0.8:
            w.send_signal(signal.SIGKILL)
    kills = 0
    for w in writers:
        code, _, err = finish(w)
        assert code in (0, -signal.SIGKILL), err
        kills += code == -signal.SIGKILL
    reads = 0
    for p in others:
        code, out, err = finish(p)
        assert code == 0, out + err  # status 3: a reader loaded wrong data
        reads += int(json.loads(out.splitlines()[-1]).get("reads", 0))
    if not churn:  # nothing removes blocks: every write that returned is there
        with SnapshotStore.open(root) as store:
            for log in logs:
                for words in logged(log):
                    assert words[0] != "B" or store.has_block(words[1])
    check_store(root)
    return {"kills": kills, "processes": len(writers) + len(others), "reads": reads}


def _random_rounds(tmp_path: Path, rounds: int, churn_every: int) -> dict[str, int]:
    rng = random.Random(1234)
    root = tmp_path / "cache"
    seed_store(root, SEED, 6)
    total = {"rounds": 0, "kills": 0, "processes": 0, "reads": 0}
    for r in range(rounds):
        got = _random_round(root, rng, 2, churn=churn_every > 0 and r % churn_every == 1)
        for k, v in got.items():
            total[k] += v
        total["rounds"] += 1
    return total


def test_random_kills_beside_readers_and_gc(tmp_path: Path) -> None:
    record("crash.random", **_random_rounds(tmp_path, 1, churn_every=0))


@long_run
def test_many_random_kills(tmp_path: Path) -> None:
    record("crash.random.long", **_random_rounds(tmp_path, 30, churn_every=3))


@long_run
@pytest.mark.parametrize("point", sorted(faults.POINTS))
def test_kill_at_a_named_point_at_many_moments(
    tmp_path: Path, point: str, reference: object
) -> None:
    kills = 0
    for nth in range(3, 40, 6):
        run = tmp_path / str(nth)
        run.mkdir()
        root = run / "cache"
        _plant_debris(root)
        code, _, err = finish(worker("script", root, SEED, N_DOCS, fault=f"{point}:kill@{nth}"))
        assert code in (0, -signal.SIGKILL), err
        kills += code == -signal.SIGKILL
        check_store(root)
        assert finish(worker("script", root, SEED, N_DOCS))[0] == 0
        assert _state(root) == reference
    record("crash.named.long", point=point, kills=kills)
