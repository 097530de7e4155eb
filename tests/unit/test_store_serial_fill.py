"""Reading opened blocks on the caller's thread (``parallel=False``): the same blocks, no readers.

A restore on a busy machine reads this way (``localkv.cache.restore.pieces.parallel_reads``):
the result and the checks must be the parallel read's.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from localkv.storage.store import Block, BlockCorrupt, BlockRow, SnapshotStore
from support.store import make_chain, put_chain

BLOCK = 16


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SnapshotStore]:
    with SnapshotStore.open(tmp_path / "cache") as s:
        yield s


def _stored(store: SnapshotStore) -> list[BlockRow]:
    blocks = make_chain(list(range(4 * BLOCK)), BLOCK)
    put_chain(store, blocks)
    return store.match_chain([b.hash for b in blocks])


def _fill(store: SnapshotStore, rows: list[BlockRow], parallel: bool) -> list[Block]:
    opened = store.open_blocks(rows)
    try:
        return store.fill_blocks(opened, [None] * len(rows), parallel=parallel)
    finally:
        for o in opened:
            o.close()


def _readers() -> int:
    return sum(t.name.startswith("localkv-read") for t in threading.enumerate())


def test_a_serial_fill_reads_the_same_blocks_on_this_thread(store: SnapshotStore) -> None:
    rows = _stored(store)
    assert len(rows) == 4
    before = _readers()
    serial = _fill(store, rows, parallel=False)
    assert _readers() == before  # no reader thread was started for it
    parallel = _fill(store, rows, parallel=True)
    assert _readers() > before  # (the parallel read's own, which the store keeps)
    assert [b.hash for b in serial] == [b.hash for b in parallel] == [r.hash for r in rows]
    for a, b in zip(serial, parallel, strict=True):
        assert np.array_equal(a.tokens, b.tokens)
        assert a.tensors.keys() == b.tensors.keys()
        for name in a.tensors:
            assert np.array_equal(a.tensors[name], b.tensors[name])


def test_a_serial_fill_names_the_first_damaged_block(store: SnapshotStore) -> None:
    rows = _stored(store)
    for row in (rows[1], rows[3]):
        path = store.layout.root / row.file
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x40  # in the data: the checksum catches it as it is read
        path.write_bytes(bytes(data))
    for parallel in (False, True):
        with pytest.raises(BlockCorrupt) as caught:
            _fill(store, rows, parallel=parallel)
        assert caught.value.block_hash == rows[1].hash
