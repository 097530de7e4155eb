"""Hostile block files and index rows: refused quickly, in bounded memory.

The bound: decoding a block file allocates at most its stored size (read
once, after ``fstat`` matched the index) plus the raw size the index records
(a plain file's own size, never over ``MAX_RAW_BLOCK_BYTES``), plus the parsed
header. A header that declares 1 TiB is refused without allocating it. The
tests measure the peak with tracemalloc (which sees Python and numpy buffers)
and require ``peak <= 2 * (stored + raw) + 1 MiB``.
"""

from __future__ import annotations

import json
import struct
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from localkv.storage.formats.blockcodec import checksum, decode, encode, parse_safetensors
from localkv.storage.store import MAX_RAW_BLOCK_BYTES, BlockCorrupt, SnapshotStore
from support.reliability import record
from support.store import make_chain, put_chain

MIB = 1 << 20


def _st(header: object, body: bytes = b"", header_len: int | None = None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(text) if header_len is None else header_len
    return struct.pack("<Q", n) + text + body


def _t(dtype: str = "F32", shape: object = (2,), offsets: object = (0, 8)) -> dict[str, object]:
    return {
        "dtype": dtype,
        "shape": list(shape) if isinstance(shape, tuple) else shape,
        "data_offsets": list(offsets) if isinstance(offsets, tuple) else offsets,
    }


SAFETENSORS: dict[str, bytes] = {
    "shorter than 8 bytes": b"\x01\x02",
    "header length 2**64-1": _st({}, header_len=2**64 - 1),
    "header length 2**40": _st({}, header_len=2**40),
    "header length past the end": _st({"a": _t()}, bytes(8), header_len=200),
    "header not JSON": _st(b"{not json"),
    "header not UTF-8": _st(b"\xff\xfe{}"),
    "header a list": _st([1, 2]),
    "header nested 100k deep": _st(b"[" * 100_000 + b"]" * 100_000),
    "metadata not strings": _st({"__metadata__": {"a": 1}}),
    "tensor not an object": _st({"a": 3}),
    "dtype unknown": _st({"a": _t("F8")}, bytes(8)),
    "dtype object": _st({"a": _t("O")}, bytes(8)),
    "dtype missing": _st({"a": {"shape": [2], "data_offsets": [0, 8]}}, bytes(8)),
    "shape negative": _st({"a": _t(shape=(-2,))}, bytes(8)),
    "shape float": _st({"a": _t(shape=[2.0])}, bytes(8)),
    "shape bool": _st({"a": _t(shape=[True, True])}, bytes(8)),
    "shape huge": _st({"a": _t(shape=(2**40, 2**40))}, bytes(8)),
    "shape 0 x 2**62": _st({"a": _t(shape=(0, 2**62, 2**62), offsets=(0, 0))}),
    "shape 64 dims": _st({"a": _t(shape=[1] * 64, offsets=(0, 4))}, bytes(4)),
    "shape not matching bytes": _st({"a": _t(shape=(3,))}, bytes(8)),
    "offsets out of range": _st({"a": _t(offsets=(0, 8000))}, bytes(8)),
    "offsets negative": _st({"a": _t(offsets=(-8, 0))}, bytes(8)),
    "offsets reversed": _st({"a": _t(offsets=(8, 0))}, bytes(8)),
    "offsets floats": _st({"a": _t(offsets=(0.0, 8.0))}, bytes(8)),
    "offsets three": _st({"a": _t(offsets=(0, 4, 8))}, bytes(8)),
    "offsets overlap": _st({"a": _t(), "b": _t(offsets=(4, 12))}, bytes(12)),
    "offsets same range twice": _st({"a": _t(), "b": _t()}, bytes(8)),
    "gap between tensors": _st({"a": _t(), "b": _t(offsets=(12, 20))}, bytes(20)),
    "trailing bytes": _st({"a": _t()}, bytes(16)),
}


@pytest.mark.parametrize("name", list(SAFETENSORS))
def test_hostile_safetensors_is_refused_in_bounded_memory(name: str) -> None:
    raw = SAFETENSORS[name]
    tracemalloc.start()
    try:
        with pytest.raises(BlockCorrupt) as info:
            parse_safetensors(raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.reason.startswith("safetensors")
    assert peak <= 2 * len(raw) + MIB, f"{name}: peak {peak}"


GOOD = _st({"a": _t()}, bytes(8))
PLAIN: dict[str, tuple[bytes, int]] = {
    "plain file, size differs from the index": (GOOD, len(GOOD) + 8),
    "empty": (b"", 0),
}


@pytest.mark.parametrize("name", list(PLAIN))
def test_hostile_plain_files_are_refused_in_bounded_memory(name: str) -> None:
    data, expected = PLAIN[name]
    tracemalloc.start()
    try:
        with pytest.raises(BlockCorrupt) as info:
            decode(data, expected, MAX_RAW_BLOCK_BYTES)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.reason
    assert peak <= 2 * (len(data) + expected) + MIB, f"{name}: {peak}"


def _forge(store: SnapshotStore, row_hash: str, data: bytes, raw: int) -> None:
    """Put ``data`` in a block's file and make the index agree on size and checksum."""
    row = store.match_chain([row_hash])[0]
    (store.root / row.file).write_bytes(data)
    with store.db.conn:
        store.db.execute(
            "UPDATE blocks SET stored_bytes = ?, raw_bytes = ?, checksum = ? WHERE hash = ?",
            (len(data), raw, checksum(data), row.hash),
        )


def test_hostile_files_that_the_index_agrees_with_are_refused(tmp_path: Path) -> None:
    """An attacker who rewrote the file *and* its row still gets a refusal, never a load."""
    blocks = make_chain(list(range(16 * 4)), 16)
    refused = 0
    start = time.perf_counter()
    with SnapshotStore.open(tmp_path / "cache") as store:
        put_chain(store, blocks)
        row = store.match_chain([blocks[1].hash])[0]
        cases: list[tuple[bytes, int]] = [(raw, len(raw)) for raw in SAFETENSORS.values()]
        cases += list(PLAIN.values())
        zstd = b"\x28\xb5\x2f\xfd" + bytes(60)  # starts as a zstd frame: no format read now
        cases.append((zstd, len(zstd)))
        cases.append((GOOD, len(GOOD)))  # valid safetensors, not a block file
        other = encode(blocks[2])  # a valid block file, but another block's
        cases.append((other, len(other)))
        for data, raw in cases:
            _forge(store, row.hash, data, raw)
            fresh = store.match_chain([row.hash])[0]
            with pytest.raises(BlockCorrupt):
                store.read_blocks([fresh])
            refused += 1
    record(
        "hostile.inputs",
        safetensors=len(SAFETENSORS),
        plain=len(PLAIN),
        through_store=refused,
        seconds=round(time.perf_counter() - start, 3),
    )


@pytest.mark.parametrize(
    "relpath", ["/etc/passwd", "../../outside.lkv", "blocks/../../outside.lkv", "", "blocks/x"]
)
def test_an_index_row_pointing_outside_the_root_is_refused_and_never_touched(
    tmp_path: Path, relpath: str
) -> None:
    outside = tmp_path / "outside.lkv"
    outside.write_bytes(b"precious")
    blocks = make_chain(list(range(32)), 16)
    with SnapshotStore.open(tmp_path / "a" / "cache") as store:
        put_chain(store, blocks)
        with store.db.conn:
            store.db.execute("UPDATE blocks SET file = ? WHERE hash = ?", (relpath, blocks[1].hash))
        row = store.match_chain([blocks[1].hash])[0]
        with pytest.raises(BlockCorrupt, match="index points at"):
            store.read_blocks([row])
        assert [h for h, _ in store.verify()] == [blocks[1].hash]
        store.gc(grace_seconds=0)
        store.verify(repair=True)
        store.quarantine(blocks[0].hash, "test")
    assert outside.read_bytes() == b"precious"
    assert Path("/etc/passwd").exists()


def test_peak_memory_of_a_normal_read_is_within_the_bound(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(1, 30000, 256)]
    (block,) = make_chain(tokens, 256)
    data = encode(block)
    raw = len(data)
    read: Callable[[], object] = lambda: decode(data, raw, MAX_RAW_BLOCK_BYTES)  # noqa: E731
    tracemalloc.start()
    try:
        read()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= 2 * (len(data) + raw) + MIB
