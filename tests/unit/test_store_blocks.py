"""Blocks in the store: round trip, content addressing, sharing, lookup."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from localkv.storage import NewSnapshot
from localkv.storage.chain import chain_next, chain_root, tokens_sha
from localkv.storage.index.blockindex import BlockIndex
from localkv.storage.store import Block, Probe, SnapshotStore
from support.store import (
    IDENTITY,
    OTHER_IDENTITY,
    block_files,
    grid_hashes,
    logits_for,
    make_chain,
    put_chain,
    put_in_process,
)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SnapshotStore]:
    with SnapshotStore.open(tmp_path / "cache") as s:
        yield s


def test_put_read_round_trip_float16_and_uint8(store: SnapshotStore) -> None:
    blocks = make_chain(list(range(1000, 1050)), 16)
    assert put_chain(store, blocks) == 4
    rows = store.match_chain([b.hash for b in blocks])
    assert [r.hash for r in rows] == [b.hash for b in blocks]
    got = store.read_blocks(rows)
    for want, have in zip(blocks, got, strict=True):
        assert (have.hash, have.parent, have.start) == (want.hash, want.parent, want.start)
        assert have.meta == want.meta
        assert have.probe.digest == want.probe.digest
        np.testing.assert_array_equal(have.tokens, want.tokens)
        assert set(have.tensors) == set(want.tensors)
        for name, arr in want.tensors.items():
            assert have.tensors[name].dtype == arr.dtype
            np.testing.assert_array_equal(have.tensors[name], arr)
    assert got[0].tensors["k.0"].dtype == np.float16
    assert got[0].tensors["v.0"].dtype == np.uint8
    assert rows[-1].n_tokens == 2 and rows[-1].end == 50


def test_put_twice_writes_nothing_new(store: SnapshotStore) -> None:
    blocks = make_chain(list(range(64)), 16)
    put_chain(store, blocks)
    before = {p: p.stat().st_mtime_ns for p in block_files(store.root)}
    n_rows = store.db.execute("SELECT COUNT(*) FROM blocks").fetchone()[0]
    assert put_chain(store, make_chain(list(range(64)), 16)) == 0
    assert {p: p.stat().st_mtime_ns for p in block_files(store.root)} == before
    assert store.db.execute("SELECT COUNT(*) FROM blocks").fetchone()[0] == n_rows == 4
    assert not any((store.root / "tmp").iterdir())


def test_shared_prefix_of_two_documents_is_stored_once(store: SnapshotStore) -> None:
    system = list(range(32))
    doc_a = make_chain([*system, *range(500, 540)], 16)
    doc_b = make_chain([*system, *range(900, 920)], 16)
    assert doc_a[:2] and doc_a[0].hash == doc_b[0].hash and doc_a[1].hash == doc_b[1].hash
    assert put_chain(store, doc_a) == len(doc_a)
    assert put_chain(store, doc_b) == len(doc_b) - 2
    a = store.put_snapshot(
        NewSnapshot(
            tip=doc_a[-1].hash,
            label="a",
            source_path="a.txt",
            source_sha256=None,
            n_tokens=72,
            identity=IDENTITY,
            namespace="",
        )
    )
    b = store.put_snapshot(
        NewSnapshot(
            tip=doc_b[-1].hash,
            label="b",
            source_path="b.txt",
            source_sha256=None,
            n_tokens=52,
            identity=IDENTITY,
            namespace="",
        )
    )
    assert a != b
    assert len(block_files(store.root)) == len(doc_a) + len(doc_b) - 2
    assert [r.hash for r in store.chain_of(doc_b[-1].hash)] == [x.hash for x in doc_b]


def test_match_chain_stops_at_first_missing_block(store: SnapshotStore) -> None:
    tokens = list(range(80))
    put_chain(store, make_chain(tokens[:48], 16))
    hashes = grid_hashes(chain_root(IDENTITY, ""), tokens, 16)
    assert len(hashes) == 5
    assert [r.start for r in store.match_chain(hashes)] == [0, 16, 32]
    changed = grid_hashes(chain_root(IDENTITY, ""), [*tokens[:20], 7, *tokens[21:]], 16)
    assert [r.start for r in store.match_chain(changed)] == [0]
    assert store.match_chain(grid_hashes(chain_root(IDENTITY, "other"), tokens, 16)) == []
    assert store.match_chain(grid_hashes(chain_root(OTHER_IDENTITY, ""), tokens, 16)) == []
    # A stored block that does not follow the previous one does not extend the run.
    assert [r.hash for r in store.match_chain([hashes[1], hashes[0]])] == [hashes[1]]
    assert [r.hash for r in store.match_chain([hashes[0], hashes[2]])] == [hashes[0]]


def test_children_include_shorter_tip_blocks(store: SnapshotStore) -> None:
    base = list(range(16))
    put_chain(store, make_chain([*base, 1, 2, 3, 4, 5], 16))
    put_chain(store, make_chain([*base, 1, 2, 9], 16))
    put_chain(store, make_chain([*base, *range(16)], 16))
    first = store.children(None, IDENTITY, "")
    assert [r.start for r in first] == [0]
    kids = store.children(first[0].hash, IDENTITY, "")
    assert sorted(r.tokens.tolist() for r in kids) == sorted(
        [[1, 2, 3, 4, 5], [1, 2, 9], list(range(16))]
    )
    assert store.children(first[0].hash, OTHER_IDENTITY, "") == []
    assert store.children(None, IDENTITY, "ns") == []


def test_same_first_block_under_another_identity(store: SnapshotStore) -> None:
    tokens = list(range(40))
    put_chain(store, make_chain(tokens, 16, identity=OTHER_IDENTITY))
    put_chain(store, make_chain(tokens, 16, identity="sha256:" + "3" * 64, namespace="elsewhere"))
    sha = tokens_sha(tokens[:16])
    assert store.same_first_block_elsewhere(sha, IDENTITY, "") == [OTHER_IDENTITY]
    assert store.same_first_block_elsewhere(sha, OTHER_IDENTITY, "") == []
    assert store.same_first_block_elsewhere(tokens_sha(tokens[16:32]), IDENTITY, "") == []


def test_identities(store: SnapshotStore) -> None:
    assert store.get_identity(IDENTITY) is None
    store.put_identity(IDENTITY, '{"model": "x"}')
    store.put_identity(IDENTITY, '{"model": "x"}')
    assert store.get_identity(IDENTITY) == '{"model": "x"}'
    with pytest.raises(ValueError, match="other JSON"):
        store.put_identity(IDENTITY, '{"model": "y"}')


def test_a_stored_identity_takes_no_write_transaction(tmp_path: Path) -> None:
    with SnapshotStore.open(tmp_path / "s") as store:
        store.put_identity(IDENTITY, '{"model": "x"}')
        other = sqlite3.connect(store.layout.index, timeout=0.0)
        other.execute("BEGIN IMMEDIATE")  # another process writing
        try:
            store._index.conn.execute("PRAGMA busy_timeout = 0")  # a wait would fail, not hang
            store.put_identity(IDENTITY, '{"model": "x"}')  # read, found: no write
            with pytest.raises(ValueError, match="other JSON"):
                store.put_identity(IDENTITY, '{"model": "y"}')
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                store.put_identity("f" * 64, '{"model": "z"}')  # a new one is a write
        finally:
            other.rollback()
            other.close()
        assert store.get_identity("f" * 64) is None


def test_reads_of_a_migrated_index_do_not_import_sqlite_utils(tmp_path: Path) -> None:
    BlockIndex(tmp_path / "index.db").close()  # created and migrated
    code = (
        "import sys; from pathlib import Path\n"
        "from localkv.storage.index.blockindex import BlockIndex\n"
        f"index = BlockIndex(Path({str(tmp_path / 'index.db')!r}))\n"
        "assert index.all_blocks() == [] and index.get_identity('x') is None\n"
        "assert 'sqlite_utils' not in sys.modules, 'imported by a read'\n"
        "with index.write() as db:\n"
        "    db.execute('SELECT 1')\n"
        "assert 'sqlite_utils' in sys.modules\n"
        "index.close()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_bad_blocks_are_refused(store: SnapshotStore) -> None:
    blocks = make_chain(list(range(32)), 16)
    with pytest.raises(ValueError, match="not stored"):
        store.put_block(blocks[1])  # parent missing
    forged = Block(
        hash=chain_next(chain_root(IDENTITY, ""), [1, 2], [1, 2]),
        parent=None,
        identity=IDENTITY,
        namespace="",
        start=0,
        tokens=np.array([1, 3], dtype=np.int32),
        ends=np.array([1, 2]),
        tensors={},
        probe=Probe.from_logits(logits_for(0)),
        meta={},
        prefill_seconds=0.0,
    )
    with pytest.raises(ValueError, match="chain hash"):
        store.put_block(forged)
    with pytest.raises(ValueError, match="rows"):
        Block(**{**_fields(blocks[0]), "tensors": {"k.0": np.zeros((3, 4), np.float16)}})
    with pytest.raises(ValueError, match="reserved"):
        Block(**{**_fields(blocks[0]), "tensors": {"pos": np.zeros((16, 4), np.float16)}})
    with pytest.raises(ValueError, match="reserved"):
        Block(**{**_fields(blocks[0]), "meta": {"hash": "x"}})
    with pytest.raises(ValueError, match="first block"):
        Block(**{**_fields(blocks[0]), "start": 16})
    assert block_files(store.root) == []


def _fields(b: Block) -> dict[str, object]:
    return {name: getattr(b, name) for name in Block.__slots__}  # type: ignore[attr-defined]


def test_probe_matches_only_identical_logits() -> None:
    logits = logits_for(7, vocab=1000)
    probe = Probe.from_logits(logits)
    assert probe.matches(logits.copy())
    nudged = logits.copy()
    nudged[500] = np.nextafter(nudged[500], np.float32(10))
    assert not probe.matches(nudged)
    assert probe.top_ids.shape == probe.top_logits.shape == (64,)
    assert probe.top_ids[0] == int(np.argmax(logits))
    assert np.all(np.diff(probe.top_logits) <= 0)
    again = Probe.from_row(probe.digest, probe.top_bytes())
    np.testing.assert_array_equal(again.top_ids, probe.top_ids)
    np.testing.assert_array_equal(again.top_logits, probe.top_logits)


def test_touch_counts_hits(store: SnapshotStore) -> None:
    blocks = make_chain(list(range(32)), 16)
    put_chain(store, blocks)
    sid = store.put_snapshot(
        NewSnapshot(
            tip=blocks[-1].hash,
            label="s",
            source_path=None,
            source_sha256=None,
            n_tokens=32,
            identity=IDENTITY,
            namespace="",
        )
    )
    store.touch([b.hash for b in blocks])
    store.touch([blocks[0].hash])
    rows = store.match_chain([b.hash for b in blocks])
    assert [r.hits for r in rows] == [2, 1]
    assert rows[0].last_used >= rows[0].created
    # touching blocks counts their hits; a snapshot's are the hits that name it
    assert store.get_snapshot(sid).hits == 0


def test_lookup_over_ten_thousand_blocks(tmp_path: Path) -> None:
    with SnapshotStore.open(tmp_path / "big") as store:
        blocks = make_chain(list(range(10_000)), 1)
        rows = []
        for b in blocks:
            rows.append(_row_for(store, b))
        # bulk-load the index through a second connection; files are not needed here
        loader = BlockIndex(store.layout.index)
        try:
            with loader.write() as db:
                for row in rows:
                    loader.insert_block(db, row)
        finally:
            loader.close()
        hashes = grid_hashes(chain_root(IDENTITY, ""), list(range(10_000)), 1)
        assert len(store.match_chain(hashes)) == 10_000
        broken = grid_hashes(
            chain_root(IDENTITY, ""), [*range(6_000), -5, *range(6_001, 10_000)], 1
        )
        assert len(store.match_chain(broken)) == 6_000
        assert len(store.chain_of(hashes[-1])) == 10_000
        assert [r.start for r in store.children(hashes[4_999], IDENTITY, "")] == [5_000]


def _row_for(store: SnapshotStore, b: Block):  # type: ignore[no-untyped-def]
    from localkv.storage.values import BlockRow

    return BlockRow(
        hash=b.hash,
        parent=b.parent,
        identity=b.identity,
        namespace=b.namespace,
        start=b.start,
        tokens=b.tokens,
        ends=b.ends,
        tokens_sha=tokens_sha(b.tokens),
        file=store.layout.block_relpath(b.hash),
        raw_bytes=1,
        stored_bytes=1,
        checksum="xxh3:" + "0" * 32,
        probe=b.probe,
        prefill_seconds=0.0,
        created=0.0,
        last_used=0.0,
        hits=0,
    )


def test_concurrent_puts_from_threads(store: SnapshotStore) -> None:
    from concurrent.futures import ThreadPoolExecutor

    first = make_chain(list(range(16)), 16)
    store.put_block(first[0])
    tails = [make_chain([*range(16), *range(k, k + 8)], 16)[1] for k in range(12)]
    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(store.put_block, tails + tails))
    assert sum(results) == 12
    assert len(store.children(first[0].hash, IDENTITY, "")) == 12
    assert len(block_files(store.root)) == 13
    assert not os.listdir(store.root / "tmp")


def test_two_processes_share_one_store(tmp_path: Path) -> None:
    import multiprocessing

    root = tmp_path / "shared"
    tokens = [list(range(64)), [*range(32), *range(500, 564)]]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        saved = pool.starmap(put_in_process, [(str(root), t, 16) for t in tokens * 2])
    # 4 + 6 blocks, the first 2 shared: 8 distinct blocks, each inserted exactly once.
    assert sum(saved) == 8
    with SnapshotStore.open(root) as store:
        for t in tokens:
            hashes = grid_hashes(chain_root(IDENTITY, ""), t, 16)
            assert len(store.read_blocks(store.match_chain(hashes))) == len(hashes)
        assert store.verify() == []
        assert len(block_files(root)) == 8


def test_put_replaces_a_stale_file_that_no_row_names(store: SnapshotStore) -> None:
    blocks = make_chain(list(range(32)), 16)
    store.put_block(blocks[0])
    stale = store.root / store.layout.block_relpath(blocks[1].hash)
    stale.parent.mkdir(mode=0o700, exist_ok=True)
    stale.write_bytes(b"left by a crashed writer")
    assert store.put_block(blocks[1])
    got = store.read_blocks(store.match_chain([b.hash for b in blocks]))
    np.testing.assert_array_equal(got[1].tensors["k.1"], blocks[1].tensors["k.1"])
    assert not os.listdir(store.root / "tmp")
