"""Damaged caches: every bad block is a BlockCorrupt with a reason, never a crash."""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from localkv.storage import NewSnapshot
from localkv.storage.formats.blockcodec import checksum
from localkv.storage.store import BlockCorrupt, BlockRow, SnapshotStore
from support.store import IDENTITY, make_chain, put_chain


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SnapshotStore]:
    with SnapshotStore.open(tmp_path / "cache") as s:
        yield s


def _stored(store: SnapshotStore, n_tokens: int = 64) -> list[BlockRow]:
    blocks = make_chain(list(range(n_tokens)), 16)
    put_chain(store, blocks)
    return store.match_chain([b.hash for b in blocks])


def _path(store: SnapshotStore, row: BlockRow) -> Path:
    return store.root / row.file


def _flip_byte(path: Path) -> None:
    """Flip a bit in the data section (the header of these small blocks is most of the file)."""
    data = bytearray(path.read_bytes())
    data[len(data) - 40] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 10])


def _huge_header(path: Path) -> None:
    """Same length, but the header length field declares 1 TiB."""
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", 1 << 40)
    path.write_bytes(bytes(data))


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "flipped byte": (_flip_byte, "checksum"),
    "truncated": (_truncate, "bytes, the index expects"),
    "deleted": (os.unlink, "missing"),
    "huge header length": (_huge_header, "header length"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_file_names_the_first_bad_block(store: SnapshotStore, damage: str) -> None:
    rows = _stored(store)
    mangle, reason = DAMAGE[damage]
    mangle(_path(store, rows[2]))
    mangle(_path(store, rows[3]))
    with pytest.raises(BlockCorrupt, match=reason) as info:
        store.read_blocks(rows)
    assert info.value.block_hash == rows[2].hash
    assert reason in info.value.reason
    assert len(store.read_blocks(rows[:2])) == 2  # the blocks before it still read
    assert store.has_block(rows[2].hash)  # reading never deletes
    assert sorted(h for h, _ in store.verify()) == sorted([rows[2].hash, rows[3].hash])


def test_huge_declared_size_is_refused_even_with_a_matching_checksum(
    store: SnapshotStore,
) -> None:
    rows = _stored(store)
    path = _path(store, rows[0])
    _huge_header(path)
    with store.db.conn:
        store.db.execute(
            "UPDATE blocks SET checksum = ? WHERE hash = ?",
            (checksum(path.read_bytes()), rows[0].hash),
        )
    with pytest.raises(BlockCorrupt, match="header length 1099511627776 out of range"):
        store.read_blocks(store.match_chain([rows[0].hash]))


def test_file_swapped_with_another_blocks_file(store: SnapshotStore) -> None:
    rows = _stored(store)
    a, b = _path(store, rows[1]), _path(store, rows[2])
    tmp = a.with_suffix(".swap")
    os.replace(a, tmp)
    os.replace(b, a)
    os.replace(tmp, b)
    with pytest.raises(BlockCorrupt) as info:
        store.read_blocks(rows)
    assert info.value.block_hash == rows[1].hash
    # Same sizes would pass the size check; the header's metadata (or the checksum) catches it.
    reason = info.value.reason
    assert any(s in reason for s in ("metadata 'hash'", "checksum", "bytes, the index expects"))


def test_swapped_file_with_matching_index_checksum_fails_on_metadata(
    store: SnapshotStore,
) -> None:
    rows = _stored(store)
    other = rows[2]
    shutil.copyfile(_path(store, other), _path(store, rows[1]))
    with store.db.conn:
        store.db.execute(
            "UPDATE blocks SET stored_bytes = ?, raw_bytes = ?, checksum = ? WHERE hash = ?",
            (other.stored_bytes, other.raw_bytes, other.checksum, rows[1].hash),
        )
    fresh = store.match_chain([r.hash for r in rows])
    with pytest.raises(BlockCorrupt, match="metadata 'hash'") as info:
        store.read_blocks(fresh)
    assert info.value.block_hash == rows[1].hash


def test_declared_size_differs_from_index(store: SnapshotStore) -> None:
    rows = _stored(store)
    with store.db.conn:
        store.db.execute(
            "UPDATE blocks SET raw_bytes = raw_bytes + 8 WHERE hash = ?", (rows[0].hash,)
        )
    with pytest.raises(BlockCorrupt, match=r"file of \d+ bytes, the index expects \d+ raw") as info:
        store.read_blocks(store.match_chain([r.hash for r in rows]))
    assert info.value.block_hash == rows[0].hash


def test_tokens_differ_from_index(store: SnapshotStore) -> None:
    rows = _stored(store)
    with store.db.conn:
        bad = (rows[1].tokens + 1).astype("<i4").tobytes()
        store.db.execute("UPDATE blocks SET tokens = ? WHERE hash = ?", (bad, rows[1].hash))
    with pytest.raises(BlockCorrupt, match="tokens differ"):
        store.read_blocks(store.match_chain([r.hash for r in rows]))
    assert store.verify()[0] == (rows[1].hash, "hash does not match parent, tokens and batch ends")


def test_symlinked_block_file_is_refused(store: SnapshotStore, tmp_path: Path) -> None:
    rows = _stored(store)
    path = _path(store, rows[0])
    outside = tmp_path / "outside.lkv"
    os.replace(path, outside)
    path.symlink_to(outside)
    with pytest.raises(BlockCorrupt, match="symlink"):
        store.read_blocks(rows[:1])


def test_index_path_outside_the_root_is_refused(store: SnapshotStore) -> None:
    rows = _stored(store)
    with store.db.conn:
        store.db.execute(
            "UPDATE blocks SET file = '../../etc/passwd' WHERE hash = ?", (rows[0].hash,)
        )
    with pytest.raises(BlockCorrupt, match="own path"):
        store.read_blocks(store.match_chain([rows[0].hash]))


def test_quarantine_moves_file_and_drops_descendants(store: SnapshotStore) -> None:
    rows = _stored(store)
    sid = store.put_snapshot(
        NewSnapshot(
            tip=rows[-1].hash,
            label="doc",
            source_path=None,
            source_sha256=None,
            n_tokens=64,
            identity=IDENTITY,
            namespace="",
        ),
        pinned=True,
    )
    _flip_byte(_path(store, rows[1]))
    with pytest.raises(BlockCorrupt) as info:
        store.read_blocks(rows)
    removed = store.quarantine(info.value.block_hash or "", info.value.reason)
    assert sorted(removed) == sorted(r.hash for r in rows[1:])
    assert [r.hash for r in store.match_chain([r.hash for r in rows])] == [rows[0].hash]
    assert not _path(store, rows[1]).exists()
    quarantined = sorted(p.name for p in (store.root / "quarantine").iterdir())
    assert len(quarantined) == 2
    assert quarantined[0].startswith(_path(store, rows[1]).name)
    note = next(p for p in (store.root / "quarantine").iterdir() if p.name.endswith(".reason"))
    assert "checksum" in note.read_text()
    for r in rows[2:]:
        assert not _path(store, r).exists()
    with pytest.raises(KeyError):
        store.get_snapshot(sid)  # its chain is broken
    assert len(store.read_blocks(rows[:1])) == 1


def test_verify_repair_quarantines(store: SnapshotStore) -> None:
    rows = _stored(store)
    _truncate(_path(store, rows[3]))
    bad = store.verify(repair=True)
    assert [h for h, _ in bad] == [rows[3].hash]
    assert store.verify() == []
    assert len(store.match_chain([r.hash for r in rows])) == 3


def _as_format(data: bytes, file_format: str) -> bytes:
    """The same safetensors file with another ``format`` in its metadata."""
    from safetensors.numpy import load as st_load
    from safetensors.numpy import save as st_save

    (n,) = struct.unpack_from("<Q", data)
    meta = json.loads(data[8 : 8 + n])["__metadata__"]
    return bytes(st_save(st_load(data), metadata={**meta, "format": file_format}))


@pytest.mark.parametrize(
    ("forge", "reason"),
    [
        (lambda d: _as_format(d, "lkv-block1"), "metadata 'format'"),
        (lambda d: _as_format(d, "lkv-planes1"), "metadata 'format'"),
        (lambda d: b"\x28\xb5\x2f\xfd" + d[4:], "header length"),  # starts as a zstd frame
    ],
    ids=["lkv-block1 metadata", "lkv-planes1 metadata", "zstd frame magic"],
)
def test_a_file_of_a_removed_format_is_refused(
    store: SnapshotStore, forge: Callable[[bytes], bytes], reason: str
) -> None:
    """The formats only earlier commits wrote are no longer read, even if the index agrees."""
    rows = _stored(store)
    path = _path(store, rows[1])
    data = forge(path.read_bytes())
    path.write_bytes(data)
    with store.db.conn:
        store.db.execute(
            "UPDATE blocks SET stored_bytes = ?, raw_bytes = ?, checksum = ? WHERE hash = ?",
            (len(data), len(data), checksum(data), rows[1].hash),
        )
    with pytest.raises(BlockCorrupt, match=reason) as info:
        store.read_blocks(store.match_chain([r.hash for r in rows]))
    assert info.value.block_hash == rows[1].hash


def test_a_crc32_checksum_in_the_index_is_refused(store: SnapshotStore) -> None:
    """Rows of the first format named a CRC-32; a file is now checked by its xxh3-128 only."""
    import zlib

    rows = _stored(store)
    data = _path(store, rows[1]).read_bytes()
    with store.db.conn:
        store.db.execute(
            "UPDATE blocks SET checksum = ? WHERE hash = ?",
            (f"crc32:{zlib.crc32(data):08x}", rows[1].hash),
        )
    with pytest.raises(BlockCorrupt, match="differs from the index's crc32:") as info:
        store.read_blocks(store.match_chain([r.hash for r in rows]))
    assert info.value.block_hash == rows[1].hash


def test_reading_into_targets_checks_the_whole_file(store: SnapshotStore) -> None:
    rows = _stored(store)
    block = store.read_blocks(rows[1:2])[0]
    size = block.tensors["v.1"].nbytes
    opened = store.open_blocks(rows[1:2])
    try:
        with pytest.raises(ValueError, match=r"targets of 'v\.1' hold"):
            store.fill_blocks(opened, [{"v.1": [np.empty(size - 1, dtype=np.uint8)]}])
        with pytest.raises(ValueError, match="does not hold"):
            store.fill_blocks(opened, [{"v.9": [np.empty(size, dtype=np.uint8)]}])
    finally:
        opened[0].close()
    # the flipped byte sits in a tensor that goes to a caller buffer: still caught
    path = _path(store, rows[1])
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    opened = store.open_blocks(rows[1:2])
    try:
        names = [n for n in block.tensors]
        targets = {n: [np.empty(block.tensors[n].nbytes, dtype=np.uint8)] for n in names}
        with pytest.raises(BlockCorrupt, match="checksum"):
            store.fill_blocks(opened, [targets])
    finally:
        opened[0].close()


def test_a_remembered_header_is_not_trusted_over_the_file(store: SnapshotStore) -> None:
    """Parsed headers are reused only while the file's header bytes are unchanged."""
    rows = _stored(store)
    assert store.read_blocks(rows[1:2])  # parses and remembers the header
    path = _path(store, rows[1])
    data = bytearray(path.read_bytes())
    at = data.index(b'"namespace":"')
    data[at : at + 13] = b'"namespacf":"'  # same length: only a re-parse sees it
    path.write_bytes(bytes(data))
    with store.db.conn:
        store.db.execute(
            "UPDATE blocks SET checksum = ? WHERE hash = ?", (checksum(data), rows[1].hash)
        )
    with pytest.raises(BlockCorrupt, match="metadata 'namespace'"):
        store.read_blocks(store.match_chain([r.hash for r in rows])[1:2])


def test_a_failed_parallel_read_has_finished_every_read_when_it_raises(
    store: SnapshotStore,
) -> None:
    """No read may still write into the caller's buffers once the error is raised."""
    rows = _stored(store)
    path = _path(store, rows[0])
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # a data byte: the checksum fails after the read
    path.write_bytes(bytes(data))
    expected = [b.tensors for b in store.read_blocks(rows[1:])]
    opened = store.open_blocks(rows)
    try:
        targets = [
            {n: [np.zeros(a.nbytes, dtype=np.uint8)] for n, a in tensors.items()}
            for tensors in [expected[0], *expected]
        ]
        with pytest.raises(BlockCorrupt, match="checksum") as info:
            store.fill_blocks(opened, targets)
        assert info.value.block_hash == rows[0].hash
        for placed, tensors in zip(targets[1:], expected, strict=True):
            for name, arr in tensors.items():
                np.testing.assert_array_equal(placed[name][0], arr.reshape(-1).view(np.uint8))
    finally:
        for o in opened:
            o.close()


@pytest.mark.parametrize("parallel", [True, False])
def test_then_runs_for_each_block_read_and_checked_only(
    store: SnapshotStore, parallel: bool
) -> None:
    """``fill_blocks``' ``then`` sees each good block once, with its index; a bad one not."""
    rows = _stored(store)
    path = _path(store, rows[1])
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # a data byte: the checksum fails after the read
    path.write_bytes(bytes(data))
    seen: list[tuple[int, str]] = []
    opened = store.open_blocks(rows)
    try:
        with pytest.raises(BlockCorrupt, match="checksum"):
            store.fill_blocks(
                opened,
                [None] * len(opened),
                parallel=parallel,
                then=lambda i, block: seen.append((i, block.hash)),
            )
    finally:
        for o in opened:
            o.close()
    expected = [(i, r.hash) for i, r in enumerate(rows) if i != 1]
    # in order on this thread, the blocks before the bad one; on the readers, every good one
    assert sorted(seen) == (expected if parallel else expected[:1])


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("probe_digest", "garbage"),
        ("parent", "sha256:zz"),
        ("hash", "nothex"),
        ("tokens", b"\x01\x02\x03"),  # not whole int32 values
        ("probe_top", b"\x00" * 7),
    ],
)
def test_a_malformed_index_row_is_reported_never_raised(
    store: SnapshotStore, column: str, value: object
) -> None:
    rows = _stored(store)
    with store.db.conn:
        store.db.execute(f"UPDATE blocks SET {column} = ? WHERE hash = ?", (value, rows[2].hash))
    hashes = [r.hash for r in rows]
    assert [r.hash for r in store.match_chain(hashes)] == hashes[:2]  # stops before it
    bad = dict(store.verify())
    assert (value if column == "hash" else rows[2].hash) in bad
    # a renamed row leaves its child without a parent: that is reported too
    assert set(bad) <= {rows[2].hash, value, rows[3].hash} and all(bad.values()), bad
    assert store.stats()["blocks"] == 4
    store.verify(repair=True)
    assert store.verify() == []
    assert [r.hash for r in store.match_chain(hashes)] == hashes[:2]
    assert store.stats()["blocks"] == 2  # the row and its descendant are gone
    assert store.gc(grace_seconds=0).orphan_files == 0  # their files went with them
