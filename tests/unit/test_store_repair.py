"""Rebuilding the index from block files and snapshot manifests (``storage/repair.py``).

Real files and a real SQLite index: a store is filled, its index is lost or
damaged, and ``repair`` must bring back every row a sound file carries, the
snapshots of the manifests (label, source, pin), and skip with a reason every
file that fails a check, or that was written before files carried their row.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from localkv.storage import NewSnapshot, manifests
from localkv.storage.formats.blockcodec import encode
from localkv.storage.index.health import IndexDamaged, check_index
from localkv.storage.paths import CacheLayout
from localkv.storage.repair import recover_row, repair
from localkv.storage.store import MAX_RAW_BLOCK_BYTES, BlockCorrupt, SnapshotStore
from support.store import IDENTITY, make_chain, put_chain


def _filled(root: Path, *, compact: bool = False) -> tuple[list[str], dict[str, tuple]]:
    """Two chains and three snapshots; returns the block hashes and each snapshot's fields."""
    a = make_chain(list(range(100, 164)), 16)
    b = make_chain(list(range(100, 132)) + list(range(900, 920)), 16)
    with SnapshotStore.open(root, compact=compact) as store:
        store.put_identity(IDENTITY, json.dumps({"model": "tiny"}))
        put_chain(store, a)
        put_chain(store, b)
        ids = [
            store.put_snapshot(
                NewSnapshot(
                    tip=a[-1].hash,
                    label="alpha",
                    source_path="/docs/a.txt",
                    source_sha256="aa" * 32,
                    n_tokens=64,
                    identity=IDENTITY,
                    namespace="",
                )
            ),
            store.put_snapshot(
                NewSnapshot(
                    tip=b[-1].hash,
                    label="beta",
                    source_path=None,
                    source_sha256=None,
                    n_tokens=52,
                    identity=IDENTITY,
                    namespace="",
                ),
                pinned=True,
            ),
            store.put_snapshot(
                NewSnapshot(
                    tip=a[1].hash,
                    label="half",
                    source_path="/docs/a.txt",
                    source_sha256=None,
                    n_tokens=32,
                    identity=IDENTITY,
                    namespace="",
                )
            ),
        ]
        store.unpin(ids[1])
        store.pin(ids[2])
        snaps = {
            s.id: (s.tip, s.label, s.source_path, s.source_sha256, s.n_tokens, s.pinned)
            for s in store.snapshots()
        }
        hashes = sorted(r.hash for r in store.all_blocks())
    assert len(snaps) == 3
    return hashes, snaps


def _state(root: Path) -> tuple[list[str], dict[str, tuple], str | None]:
    with SnapshotStore.open(root) as store:
        hashes = sorted(r.hash for r in store.all_blocks())
        snaps = {
            s.id: (s.tip, s.label, s.source_path, s.source_sha256, s.n_tokens, s.pinned)
            for s in store.snapshots()
        }
        bad = store.verify()
        assert bad == []
        return hashes, snaps, store.get_identity(IDENTITY)


@pytest.mark.parametrize("compact", [False, True], ids=["plain", "compact"])
@pytest.mark.parametrize("loss", ["deleted", "emptied", "garbage"])
def test_a_lost_index_is_rebuilt_with_every_block_and_snapshot(
    tmp_path: Path, loss: str, compact: bool
) -> None:
    root = tmp_path / "cache"
    hashes, snaps = _filled(root, compact=compact)
    index = root / "index.db"
    garbage = np.random.default_rng(1).bytes(50_000)
    {"deleted": index.unlink, "emptied": lambda: index.write_bytes(b""),
     "garbage": lambda: index.write_bytes(garbage)}[loss]()  # fmt: skip
    if loss == "garbage":
        with pytest.raises(IndexDamaged, match="cache repair"):
            SnapshotStore.open(root)
    report = repair(root, MAX_RAW_BLOCK_BYTES)
    assert report.blocks_added == len(hashes) and report.skipped_blocks == []
    assert sorted(report.snapshots_added) == sorted(snaps)
    assert _state(root) == (hashes, snaps, json.dumps({"model": "tiny"}))
    if loss == "garbage":
        moved = Path(report.quarantined_index or "")
        assert moved.parent == root / "quarantine" and moved.read_bytes() == garbage
    else:
        assert report.quarantined_index is None
    again = repair(root, MAX_RAW_BLOCK_BYTES)  # a sound index: nothing to add
    assert (again.blocks_added, again.snapshots_added, again.index_problem) == (0, [], None)


def test_a_damaged_page_fails_the_integrity_check_and_is_rebuilt(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    hashes, snaps = _filled(root)
    with sqlite3.connect(root / "index.db") as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        (blocks_root,) = conn.execute(
            "SELECT rootpage FROM sqlite_master WHERE name = 'blocks'"
        ).fetchone()
    data = bytearray((root / "index.db").read_bytes())
    data[(blocks_root - 1) * page : blocks_root * page] = np.random.default_rng(2).bytes(page)
    (root / "index.db").write_bytes(bytes(data))
    assert check_index(root / "index.db") is not None
    report = repair(root, MAX_RAW_BLOCK_BYTES)
    assert report.index_problem is not None
    assert Path(report.quarantined_index or "").read_bytes() == bytes(data)
    assert _state(root)[:2] == (hashes, snaps)


def test_damaged_and_old_files_are_skipped_with_a_reason(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    blocks = make_chain(list(range(64)), 16)
    with SnapshotStore.open(root) as store:
        put_chain(store, blocks)
        snap = store.put_snapshot(
            NewSnapshot(
                tip=blocks[-1].hash,
                label="all",
                source_path=None,
                source_sha256=None,
                n_tokens=64,
                identity=IDENTITY,
                namespace="",
            )
        )
        rows = store.match_chain([b.hash for b in blocks])
    (root / "index.db").unlink()
    # block 2: one byte of K/V data flipped; block 0 stays sound
    path = root / rows[2].file
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(BlockCorrupt, match="data section differs"):
        recover_row(CacheLayout(root), rows[2].file, MAX_RAW_BLOCK_BYTES)
    report = repair(root, MAX_RAW_BLOCK_BYTES)
    reasons = dict(report.skipped_blocks)
    assert "data section differs from its checksum" in reasons[rows[2].file]
    assert "parent block was not recovered" in reasons[rows[3].file]
    assert report.blocks_added == 2
    assert dict(report.skipped_snapshots)[snap].startswith("all: its blocks were not all")
    with SnapshotStore.open(root) as store:
        assert [r.hash for r in store.match_chain([b.hash for b in blocks])] == [
            blocks[0].hash,
            blocks[1].hash,
        ]
        assert store.snapshots() == []


def test_a_file_written_before_files_carried_their_row_is_not_recovered(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    block = make_chain(list(range(16)), 16)[0]
    with SnapshotStore.open(root) as store:
        put_chain(store, [block])
        row = store.match_chain([block.hash])[0]
    # the same block as an earlier version wrote it: no probe_top, prefill_seconds, data_xxh3
    header_len = int.from_bytes(encode(block)[:8], "little")
    header = json.loads(encode(block)[8 : 8 + header_len])
    for key in ("probe_top", "prefill_seconds", "data_xxh3"):
        del header["__metadata__"][key]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    body = encode(block)[8 + header_len :]
    (root / row.file).write_bytes(len(text).to_bytes(8, "little") + text + body)
    (root / "index.db").unlink()
    report = repair(root, MAX_RAW_BLOCK_BYTES)
    assert report.blocks_added == 0
    assert (
        "written before block files carried their index row"
        in dict(report.skipped_blocks)[row.file]
    )


def test_manifests_follow_the_snapshots(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    blocks = make_chain(list(range(48)), 16)
    with SnapshotStore.open(root) as store:
        put_chain(store, blocks)
        keep = store.put_snapshot(
            NewSnapshot(
                tip=blocks[-1].hash,
                label="keep",
                source_path="/d/k.txt",
                source_sha256=None,
                n_tokens=48,
                identity=IDENTITY,
                namespace="",
            )
        )
        drop = store.put_snapshot(
            NewSnapshot(
                tip=blocks[0].hash,
                label="drop",
                source_path="/d/x.txt",
                source_sha256=None,
                n_tokens=16,
                identity=IDENTITY,
                namespace="",
            )
        )
        gone = store.put_snapshot(
            NewSnapshot(
                tip=blocks[1].hash,
                label="gone",
                source_path="/d/g.txt",
                source_sha256="ab" * 32,
                n_tokens=32,
                identity=IDENTITY,
                namespace="",
            )
        )
        store.pin(keep)
        listed = {row.id: row for row, _ in manifests.read_all(store.layout)[0]}
        assert set(listed) == {keep, drop, gone} and listed[keep].pinned
        store.remove_snapshot(drop)
        store.forget("/d/g.txt", None)
        names = sorted(os.listdir(root / "snapshots"))
        assert names == [f"{keep}.json"]
        assert oct((root / "snapshots" / names[0]).stat().st_mode & 0o777) == "0o600"
