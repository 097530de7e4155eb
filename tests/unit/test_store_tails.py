"""Tail tensors: a block's last rows, read as a suffix and checked group by group.

A sliding-window restore needs a suffix of some blocks' sliding-layer rows, so a
read may start the tails at any row: earlier groups stay unread, and every byte
read is checked (the rest of the file by the index's checksum, the tails by
their group digests in the header the checksum covers).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from localkv.storage.repair import repair
from localkv.storage.store import MAX_RAW_BLOCK_BYTES, Block, BlockCorrupt, BlockRow, SnapshotStore
from localkv.storage.values import TAIL_GROUP
from support.store import make_chain, put_chain

BLOCK = 40
TAIL = 37  # not a multiple of the group, so the last group is short
WIDTH = 24


@pytest.fixture(params=[False, True], ids=["plain", "compact"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SnapshotStore]:
    with SnapshotStore.open(tmp_path / "cache", compact=request.param) as s:
        yield s


def _tails(block: Block) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(block.start + 1)
    return {
        "w.k.0": rng.standard_normal((TAIL, WIDTH // 2)).astype(np.float16),
        "w.v.0": rng.integers(0, 255, (TAIL, WIDTH), dtype=np.uint8),
        "w.k.1": rng.standard_normal((TAIL, WIDTH // 2)).astype(np.float16),
    }


def _stored(store: SnapshotStore) -> tuple[list[Block], list[BlockRow]]:
    blocks = [
        replace(b, tensors={**b.tensors, **_tails(b)}, end_state=i != 1)
        for i, b in enumerate(make_chain(list(range(3 * BLOCK)), BLOCK))
    ]
    put_chain(store, blocks)
    return blocks, store.match_chain([b.hash for b in blocks])


def _read_from(store: SnapshotStore, row: BlockRow, first: int) -> dict[str, np.ndarray]:
    opened = store.open_blocks([row])
    try:
        out = {
            name: np.zeros((TAIL - first, *spec.shape[1:]), dtype=spec.dtype)
            for name, spec in opened[0].specs.items()
            if name.startswith("w.")
        }
        store.fill_blocks(opened, [{n: [a] for n, a in out.items()}], tails=[first])
    finally:
        for o in opened:
            o.close()
    return out


def _flip_tail_row(store: SnapshotStore, row: BlockRow, tensor: str, tail_row: int) -> None:
    path = store.layout.root / row.file
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8 : 8 + n])
    begin, end = header[tensor]["data_offsets"]
    row_bytes = (end - begin) // TAIL
    data[8 + n + begin + tail_row * row_bytes] ^= 0x10
    os.chmod(path, 0o600)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("first", [0, 1, TAIL_GROUP, TAIL_GROUP + 3, TAIL - 1, TAIL])
def test_a_suffix_of_the_tails_reads_back_exactly(store: SnapshotStore, first: int) -> None:
    blocks, rows = _stored(store)
    got = _read_from(store, rows[0], first)
    for name, arr in _tails(blocks[0]).items():
        assert np.array_equal(got[name], arr[first:]), name


def test_a_whole_read_returns_the_tails_and_the_end_state(store: SnapshotStore) -> None:
    blocks, rows = _stored(store)
    assert [r.end_state for r in rows] == [True, False, True]
    back = store.read_blocks(rows)
    for block, read in zip(blocks, back, strict=True):
        assert read.end_state == block.end_state
        for name, arr in _tails(block).items():
            assert np.array_equal(read.tensors[name], arr)


def test_damage_in_a_tail_group_read_is_caught_and_an_unread_group_is_not_read(
    store: SnapshotStore,
) -> None:
    _, rows = _stored(store)
    _flip_tail_row(store, rows[0], "w.v.0", 2)  # group 0
    _read_from(store, rows[0], TAIL_GROUP)  # group 0 is not read: nothing to check
    with pytest.raises(BlockCorrupt, match="tail rows 0"):
        _read_from(store, rows[0], TAIL_GROUP - 1)  # row 15 is in group 0: it is read
    with pytest.raises(BlockCorrupt):
        store.read_blocks(rows[:1])  # a whole read checks every group
    assert [h for h, _ in store.verify()] == [rows[0].hash]


def test_damage_in_the_rows_before_the_suffix_within_its_group_is_caught(
    store: SnapshotStore,
) -> None:
    _, rows = _stored(store)
    _flip_tail_row(store, rows[2], "w.k.1", TAIL_GROUP + 1)
    with pytest.raises(BlockCorrupt, match="tail rows 16"):
        _read_from(store, rows[2], TAIL_GROUP + 5)


def test_a_forged_tail_digest_fails_the_index_checksum(store: SnapshotStore) -> None:
    _, rows = _stored(store)
    path = store.layout.root / rows[1].file
    data = bytearray(path.read_bytes())
    at = data.index(b'"tail_xxh3":"') + len(b'"tail_xxh3":"')
    data[at] = ord("0") if data[at] != ord("0") else ord("1")
    os.chmod(path, 0o600)
    path.write_bytes(bytes(data))
    with pytest.raises(BlockCorrupt, match="checksum"):
        _read_from(store, rows[1], TAIL - 1)


def test_tails_cannot_hold_more_rows_than_the_block(tmp_path: Path) -> None:
    block = make_chain(list(range(BLOCK)), BLOCK)[0]
    wide = {"w.k.0": np.zeros((BLOCK + 1, 4), dtype=np.float16)}
    with pytest.raises(ValueError, match="tail tensors"):
        replace(block, tensors={**block.tensors, **wide})
    uneven = {"w.k.0": np.zeros((3, 4), np.float16), "w.v.0": np.zeros((4, 4), np.uint8)}
    with pytest.raises(ValueError, match="tail tensors"):
        replace(block, tensors={**block.tensors, **uneven})


def test_repair_rebuilds_the_end_state_from_the_files(tmp_path: Path) -> None:
    with SnapshotStore.open(tmp_path / "cache") as store:
        _, rows = _stored(store)
    (tmp_path / "cache" / "index.db").unlink()
    for name in ("index.db-wal", "index.db-shm"):
        (tmp_path / "cache" / name).unlink(missing_ok=True)
    repair(tmp_path / "cache", MAX_RAW_BLOCK_BYTES)
    with SnapshotStore.open(tmp_path / "cache") as store:
        back = store.match_chain([r.hash for r in rows])
    assert [r.end_state for r in back] == [True, False, True]
    assert [r.checksum for r in back] == [r.checksum for r in rows]


def test_a_read_that_wants_no_tail_row_reads_none(store: SnapshotStore) -> None:
    _, rows = _stored(store)
    _flip_tail_row(store, rows[0], "w.k.0", TAIL - 1)  # in the last, short group
    _read_from(store, rows[0], TAIL)
    with pytest.raises(BlockCorrupt, match="tail rows 32"):
        _read_from(store, rows[0], TAIL - 1)
