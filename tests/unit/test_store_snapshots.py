"""Snapshots, removal, eviction under a budget, gc and statistics."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from localkv.storage import NewSnapshot
from localkv.storage.removal.budget import parse_size
from localkv.storage.store import Block, SnapshotStore
from support.store import IDENTITY, block_files, make_chain, put_chain


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SnapshotStore]:
    with SnapshotStore.open(tmp_path / "cache") as s:
        yield s


def _doc(store: SnapshotStore, tokens: list[int], label: str, pinned: bool = False) -> str:
    blocks = make_chain(tokens, 16)
    put_chain(store, blocks)
    return store.put_snapshot(
        NewSnapshot(
            tip=blocks[-1].hash,
            label=label,
            source_path=f"{label}.txt",
            source_sha256="ab" * 32,
            n_tokens=len(tokens),
            identity=IDENTITY,
            namespace="",
        ),
        pinned=pinned,
    )


def _hashes(blocks: list[Block]) -> set[str]:
    return {b.hash for b in blocks}


def _stored(store: SnapshotStore) -> set[str]:
    return {r[0] for r in store.db.execute("SELECT hash FROM blocks").fetchall()}


def _total(store: SnapshotStore) -> int:
    return int(store.db.execute("SELECT SUM(stored_bytes) FROM blocks").fetchone()[0] or 0)


SYSTEM = list(range(32))
DOC_A = [*SYSTEM, *range(1000, 1040)]
DOC_B = [*SYSTEM, *range(2000, 2050)]


def test_snapshot_ids_lookup_and_pinning(store: SnapshotStore) -> None:
    a = _doc(store, DOC_A, "a")
    assert _doc(store, DOC_A, "a") == a  # same tip, label, namespace: same id
    b = _doc(store, DOC_A, "other label")
    assert a != b
    snap = store.get_snapshot(a[:6])
    assert (snap.id, snap.label, snap.n_tokens, snap.pinned) == (a, "a", 72, False)
    assert snap.source_path == "a.txt" and snap.tip == make_chain(DOC_A, 16)[-1].hash
    with pytest.raises(KeyError, match="no snapshot"):
        store.get_snapshot("zzzz")
    with pytest.raises(KeyError, match="no snapshot"):
        store.get_snapshot("")
    ids = [_doc(store, SYSTEM, f"label {i}") for i in range(17)]  # two share a first digit
    shared = next(i[0] for i in ids if sum(j[0] == i[0] for j in ids) > 1)
    with pytest.raises(KeyError, match="ambiguous"):
        store.get_snapshot(shared)
    for i in ids:
        store.remove_snapshot(i)
    store.pin(a)
    assert store.get_snapshot(a).pinned
    store.unpin(a)
    assert not store.get_snapshot(a).pinned
    assert [s.id for s in store.snapshots("")] == [a, b]
    assert store.snapshots("elsewhere") == []
    with pytest.raises(ValueError, match="tip block ends"):
        store.put_snapshot(
            NewSnapshot(
                tip=make_chain(DOC_A, 16)[-1].hash,
                label="x",
                source_path=None,
                source_sha256=None,
                n_tokens=71,
                identity=IDENTITY,
                namespace="",
            )
        )
    with pytest.raises(ValueError, match="not stored"):
        store.put_snapshot(
            NewSnapshot(
                tip="sha256:" + "0" * 64,
                label="x",
                source_path=None,
                source_sha256=None,
                n_tokens=1,
                identity=IDENTITY,
                namespace="",
            )
        )


def test_remove_snapshot_keeps_blocks_another_snapshot_needs(store: SnapshotStore) -> None:
    a = _doc(store, DOC_A, "a")
    _doc(store, DOC_B, "b")
    chain_a, chain_b = make_chain(DOC_A, 16), make_chain(DOC_B, 16)
    only_a = _hashes(chain_a) - _hashes(chain_b)
    expected = sum(r.stored_bytes for r in store.match_chain([b.hash for b in chain_a])[2:])
    freed = store.remove_snapshot(a)
    assert freed == expected > 0
    assert _stored(store) == _hashes(chain_b)
    assert not only_a & _stored(store)
    assert len(block_files(store.root)) == len(chain_b)
    assert len(store.read_blocks(store.chain_of(chain_b[-1].hash))) == len(chain_b)
    with pytest.raises(KeyError):
        store.get_snapshot(a)


def test_remove_snapshot_also_removes_unnamed_extensions(store: SnapshotStore) -> None:
    sys_id = _doc(store, SYSTEM, "system")
    put_chain(store, make_chain([*SYSTEM, *range(50)], 16))  # a chat turn, no snapshot
    store.remove_snapshot(sys_id)
    assert _stored(store) == set()
    assert block_files(store.root) == []


def test_eviction_never_breaks_a_pinned_chain(store: SnapshotStore) -> None:
    pinned = _doc(store, DOC_A, "a", pinned=True)
    b = _doc(store, DOC_B, "b")
    put_chain(store, make_chain([*range(500, 600)], 16))  # unrelated, unnamed
    chain_a = _hashes(make_chain(DOC_A, 16))
    freed = store.evict(0)
    assert freed > 0
    assert _stored(store) == chain_a  # everything else could go, nothing of a did
    assert len(store.read_blocks(store.chain_of(make_chain(DOC_A, 16)[-1].hash))) == 5
    assert store.get_snapshot(pinned).pinned
    with pytest.raises(KeyError):
        store.get_snapshot(b)  # its tip was evicted
    assert len(block_files(store.root)) == len(chain_a)


def test_eviction_takes_tips_first_and_stops_at_budget(store: SnapshotStore) -> None:
    blocks = make_chain(list(range(160)), 16)
    put_chain(store, blocks)
    total = _total(store)
    sizes = [r.stored_bytes for r in store.match_chain([b.hash for b in blocks])]
    budget = total - sizes[-1] - sizes[-2] // 2
    freed = store.evict(budget)
    assert freed == sizes[-1] + sizes[-2]
    assert _total(store) <= budget
    # The chain shrank from its tip: what remains is still a prefix chain.
    left = store.match_chain([b.hash for b in blocks])
    assert [r.hash for r in left] == [b.hash for b in blocks[:8]]
    assert store.evict(budget) == 0


def test_eviction_prefers_stale_cheap_leaves(store: SnapshotStore) -> None:
    old = make_chain(list(range(3000, 3016)), 16)
    new = make_chain(list(range(4000, 4016)), 16)
    put_chain(store, old + new)
    with store.db.conn:
        store.db.execute(
            "UPDATE blocks SET last_used = ? WHERE hash = ?", (time.time() - 86400, old[0].hash)
        )
    store.evict(_total(store) - 1)
    assert _stored(store) == {new[0].hash}


def test_budget_from_env(monkeypatch: pytest.MonkeyPatch, store: SnapshotStore) -> None:
    monkeypatch.setenv("LOCALKV_BUDGET", "5G")
    assert store.default_budget() == 5 << 30
    monkeypatch.delenv("LOCALKV_BUDGET")
    assert 0 < store.default_budget() <= 20 << 30
    assert parse_size("123") == 123
    assert parse_size("1.5MiB") == 1_572_864
    with pytest.raises(ValueError):
        parse_size("lots")


def test_gc_removes_orphans_temp_files_and_rows_without_files(store: SnapshotStore) -> None:
    a = make_chain(DOC_A, 16)
    put_chain(store, a)
    (store.root / "tmp" / "x.lkv.123.tmp").write_bytes(b"partial")
    orphan = store.root / "blocks" / "ff" / ("f" * 64 + ".lkv")
    orphan.parent.mkdir(mode=0o700, exist_ok=True)
    orphan.write_bytes(b"no row")
    (store.root / a[2].hash[7:9]).exists()
    row2 = store.match_chain([b.hash for b in a])[2]
    (store.root / row2.file).unlink()
    young = store.gc()  # default grace: recent orphans stay; a temp file no writer
    assert young.temp_files == 1 and young.orphan_files == 0  # holds goes at once
    assert young.missing_files == len(a) - 2  # the row and its descendants
    report = store.gc(grace_seconds=0)
    assert report.temp_files == 0 and report.orphan_files == 1
    assert not any((store.root / "tmp").iterdir())
    assert _stored(store) == {a[0].hash, a[1].hash}
    assert {p.name for p in block_files(store.root)} == {
        store.layout.block_relpath(h).split("/")[-1] for h in (a[0].hash, a[1].hash)
    }
    assert store.verify() == []
    assert store.gc(grace_seconds=0) == type(report)(
        temp_files=0, orphan_files=0, missing_files=0, bytes_freed=0
    )


def test_stats(store: SnapshotStore) -> None:
    _doc(store, DOC_A, "a")
    sid = store.snapshots()[0].id
    store.record_event("hit", None, 64, 0.63, snapshot=sid)
    store.record_event("hit", None, 32, 0.25)  # a prefix no snapshot names
    store.record_event("hit", None, 32, 0.5, snapshot="gone")  # a snapshot since removed
    store.record_event("miss", "identity: model", 10, 0.0)
    store.record_event("miss", "identity: model", 10, 0.0)
    store.record_event("miss", "cold", 5, 0.0)
    with pytest.raises(ValueError):
        store.record_event("maybe", None, 0, 0.0)
    stats = store.stats()
    assert stats["hits"] == 3 and stats["misses"] == 3
    # a snapshot's hits are the hits naming it; the rest name no listed snapshot
    assert store.get_snapshot(sid).hits == 1 and stats["hits_without_snapshot"] == 2
    assert stats["misses_by_reason"] == {"identity: model": 2, "cold": 1}
    assert stats["blocks"] == 5 and stats["snapshots"] == 1
    assert (
        stats["stored_bytes"]
        == _total(store)
        == sum(p.stat().st_size for p in block_files(store.root))
    )
    assert stats["raw_bytes"] > 0
    # the seconds saved are the hits' own estimates, summed
    assert stats["saved_prefill_seconds"] == pytest.approx(0.63 + 0.25 + 0.5)


def test_reopen_keeps_everything_and_close_is_idempotent(tmp_path: Path) -> None:
    store = SnapshotStore.open(tmp_path / "c")
    sid = _doc(store, DOC_A, "a")
    store.close()
    store.close()
    with SnapshotStore.open(tmp_path / "c") as again:
        snap = again.get_snapshot(sid)
        assert len(again.read_blocks(again.chain_of(snap.tip))) == 5
        assert again.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert again.db.execute("SELECT COUNT(*) FROM _migrations").fetchone()[0] >= 1
    assert os.stat(tmp_path / "c" / "index.db").st_mode & 0o777 == 0o600
