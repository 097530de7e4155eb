"""A block's detached tensor (``partial``): apart from the index checksum, checked by its own.

A restore needs a sliding-window or recurrent state from a chain's last block
only, so a read may leave that tensor unread (``discard``); every byte it does
use is still checked, and a read that keeps the tensor checks its digest.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import xxhash
from localkv.storage.formats.blockcodec import checksum
from localkv.storage.formats.planes import LO
from localkv.storage.store import Block, BlockCorrupt, BlockRow, SnapshotStore
from localkv.storage.values import DETACHED, DETACHED_XXH3
from support.store import make_chain, put_chain

BLOCK = 16
PARTIAL_WIDTH = 40


@pytest.fixture(params=[False, True], ids=["plain", "compact"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SnapshotStore]:
    with SnapshotStore.open(tmp_path / "cache", compact=request.param) as s:
        yield s


def _with_partial(block: Block, extra: str = DETACHED) -> Block:
    rng = np.random.default_rng(block.start)
    rows = rng.integers(1, 255, (block.tokens.shape[0], PARTIAL_WIDTH), dtype=np.uint8)
    return replace(block, tensors={**block.tensors, extra: rows})


def _stored(store: SnapshotStore, extra: str = DETACHED) -> list[BlockRow]:
    blocks = [_with_partial(b, extra) for b in make_chain(list(range(3 * BLOCK)), BLOCK)]
    put_chain(store, blocks)
    return store.match_chain([b.hash for b in blocks])


def _spans(path: Path) -> tuple[int, dict[str, tuple[int, int]], dict[str, str]]:
    """The data section's offset, each tensor's byte range in it, and the metadata."""
    data = path.read_bytes()
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__")
    return 8 + n, {k: tuple(v["data_offsets"]) for k, v in header.items()}, meta


def _flip(path: Path, tensor: str) -> None:
    body, spans, _ = _spans(path)
    begin, end = spans[tensor]
    data = bytearray(path.read_bytes())
    data[body + (begin + end) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _read(store: SnapshotStore, rows: list[BlockRow], discard: bool) -> list[Block]:
    opened = store.open_blocks(rows)
    try:
        drops = [{DETACHED} if discard else set() for _ in rows]
        return store.fill_blocks(opened, [None] * len(rows), drops)
    finally:
        for o in opened:
            o.close()


def test_the_index_checksum_leaves_the_detached_tensor_out(store: SnapshotStore) -> None:
    rows = _stored(store)
    path = store.root / rows[0].file
    body, spans, meta = _spans(path)
    data = path.read_bytes()
    begin, end = spans[DETACHED]
    assert meta[DETACHED_XXH3] == xxhash.xxh3_128_hexdigest(data[body + begin : body + end])
    rest = data[: body + begin] + data[body + end :]
    assert rows[0].checksum == checksum(data) == "xxh3:" + xxhash.xxh3_128_hexdigest(rest)
    blocks = _read(store, rows, discard=False)
    assert [b.tensors[DETACHED].shape for b in blocks] == [(BLOCK, PARTIAL_WIDTH)] * 3
    assert all(DETACHED_XXH3 not in b.meta for b in blocks)  # the format's, not the caller's


def test_a_discarding_read_leaves_it_unread_and_a_keeping_read_checks_it(
    store: SnapshotStore,
) -> None:
    rows = _stored(store)
    _flip(store.root / rows[1].file, DETACHED)
    blocks = _read(store, rows, discard=True)
    assert [DETACHED in b.tensors for b in blocks] == [False] * 3
    with pytest.raises(BlockCorrupt, match="differs from its checksum") as info:
        _read(store, rows, discard=False)
    assert info.value.block_hash == rows[1].hash
    assert [h for h, _ in store.verify()] == [rows[1].hash]


@pytest.mark.parametrize("where", ["k.0", "tokens"])
def test_a_discarding_read_still_checks_every_byte_it_uses(
    store: SnapshotStore, where: str
) -> None:
    rows = _stored(store)
    path = store.root / rows[2].file
    if where in _spans(path)[1]:
        _flip(path, where)
    else:  # a compact file splits k.0 into planes: flip its low plane
        _flip(path, where + LO)
    with pytest.raises(BlockCorrupt) as info:
        _read(store, rows, discard=True)
    assert info.value.block_hash == rows[2].hash


def test_the_detached_digest_is_covered_by_the_index_checksum(store: SnapshotStore) -> None:
    rows = _stored(store)
    path = store.root / rows[0].file
    meta = _spans(path)[2]
    data = path.read_bytes()
    digest = meta[DETACHED_XXH3].encode()
    forged = digest[:-1] + (b"0" if digest[-1:] != b"0" else b"1")
    path.write_bytes(data.replace(digest, forged))
    with pytest.raises(BlockCorrupt, match="checksum"):
        _read(store, rows, discard=True)


def test_another_discarded_tensor_is_still_read_and_checked(store: SnapshotStore) -> None:
    rows = _stored(store, extra="scratchpad")  # covered by the index checksum
    assert DETACHED_XXH3 not in _spans(store.root / rows[0].file)[2]
    opened = store.open_blocks(rows)
    try:
        blocks = store.fill_blocks(opened, [None] * 3, [{"scratchpad"}] * 3)
    finally:
        for o in opened:
            o.close()
    assert ["scratchpad" in b.tensors for b in blocks] == [False] * 3
    _flip(store.root / rows[0].file, "scratchpad")
    opened = store.open_blocks(rows)
    try:
        with pytest.raises(BlockCorrupt, match="checksum"):
            store.fill_blocks(opened, [None] * 3, [{"scratchpad"}] * 3)
    finally:
        for o in opened:
            o.close()
