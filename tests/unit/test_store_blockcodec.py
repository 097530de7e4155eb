"""Block files as bytes (``formats/blockcodec.py``): plain safetensors, parsed strictly."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from localkv.storage.formats.blockcodec import (
    FORMAT_VERSION,
    check_metadata,
    check_tokens,
    checksum,
    decode,
    encode,
    parse_safetensors,
)
from localkv.storage.formats.planes import Q6_FORMAT
from localkv.storage.values import BlockCorrupt
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save
from support.store import make_chain

LIMIT = 1 << 30


def test_block_file_loads_with_safetensors_numpy() -> None:
    block = make_chain(list(range(10, 30)), 8)[1]
    raw = encode(block)
    loaded = st_load(raw)
    assert set(loaded) == {"k.0", "v.0", "k.1", "v.1", "tokens", "pos"}
    for name, arr in block.tensors.items():
        assert loaded[name].dtype == arr.dtype
        np.testing.assert_array_equal(loaded[name], arr)
    np.testing.assert_array_equal(loaded["tokens"], np.arange(18, 26, dtype=np.int32))
    np.testing.assert_array_equal(loaded["pos"], np.arange(8, 16, dtype=np.int32))
    header_len = struct.unpack_from("<Q", raw)[0]
    meta = __import__("json").loads(raw[8 : 8 + header_len])["__metadata__"]
    assert meta["format"] == FORMAT_VERSION
    assert meta["hash"] == block.hash and meta["parent"] == block.parent
    assert meta["identity"] == block.identity and meta["codec"] == "test"


def test_block_file_loads_with_safetensors_torch() -> None:
    torch_st = pytest.importorskip("safetensors.torch")
    block = make_chain(list(range(10, 30)), 8)[1]
    loaded = torch_st.load(encode(block))
    for name, arr in block.tensors.items():
        np.testing.assert_array_equal(loaded[name].numpy(), arr)


def test_checksum_is_xxh3_of_the_whole_file() -> None:
    import xxhash

    data = encode(make_chain(list(range(10, 30)), 8)[0])
    assert checksum(data) == "xxh3:" + xxhash.xxh3_128_hexdigest(data)
    assert len(checksum(data)) == 5 + 32
    flipped = bytearray(data)
    flipped[-3] ^= 1
    assert checksum(flipped) != checksum(data)


def test_plain_file_size_is_checked_against_the_index() -> None:
    data = encode(make_chain(list(range(10, 30)), 8)[0])
    with pytest.raises(BlockCorrupt, match="the index expects"):
        decode(data, len(data) + 1, LIMIT)
    with pytest.raises(BlockCorrupt, match="over the limit"):
        decode(data, len(data), len(data) - 1)
    assert decode(data, len(data), LIMIT).metadata["format"] == FORMAT_VERSION


def test_parse_matches_safetensors_and_is_read_only() -> None:
    tensors = {
        "a": np.arange(12, dtype=np.float16).reshape(3, 4),
        "b": np.arange(6, dtype=np.uint8).reshape(3, 2),
        "c": np.array([1.5, -2.0], dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.int32),
    }
    raw = st_save(tensors, metadata={"x": "y"})
    parsed = parse_safetensors(raw)
    assert parsed.metadata == {"x": "y"}
    reference = st_load(raw)
    assert set(parsed.tensors) == set(reference)
    for name, arr in reference.items():
        assert parsed.tensors[name].dtype == arr.dtype
        np.testing.assert_array_equal(parsed.tensors[name], arr)
        assert not parsed.tensors[name].flags.writeable


def test_round_trip_through_index_row_checks() -> None:
    from localkv.storage.values import BlockRow

    block = make_chain(list(range(50)), 16)[2]
    data = encode(block)
    row = BlockRow(
        hash=block.hash,
        parent=block.parent,
        identity=block.identity,
        namespace=block.namespace,
        start=block.start,
        tokens=block.tokens,
        ends=block.ends,
        tokens_sha="",
        file="",
        raw_bytes=len(data),
        stored_bytes=len(data),
        checksum="",
        probe=block.probe,
        prefill_seconds=block.prefill_seconds,
        created=0.0,
        last_used=0.0,
        hits=0,
    )
    got = decode(data, row.raw_bytes, LIMIT)
    assert check_metadata(got.metadata, row) == block.meta
    tokens = check_tokens(got.tensors["tokens"], got.tensors["pos"], row)
    np.testing.assert_array_equal(tokens, block.tokens)
    for name, arr in block.tensors.items():
        np.testing.assert_array_equal(got.tensors[name], arr)
    other = make_chain(list(range(50)), 16)[1]
    with pytest.raises(BlockCorrupt, match="metadata 'hash'"):
        check_metadata(decode(encode(other), len(encode(other)), LIMIT).metadata, row)
    with pytest.raises(BlockCorrupt, match="metadata 'format'"):
        check_metadata(got.metadata, row, file_format=Q6_FORMAT)
    with pytest.raises(BlockCorrupt, match="tokens differ"):
        check_tokens(got.tensors["tokens"] + 1, got.tensors["pos"], row)
    with pytest.raises(BlockCorrupt, match="positions"):
        check_tokens(got.tensors["tokens"], got.tensors["pos"] + 1, row)


@pytest.mark.parametrize(
    "header",
    [
        b"[]",
        b'{"a": {"dtype": "F16", "shape": [3], "data_offsets": [0, 4]}}',
        b'{"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}',
        b'{"a": {"dtype": "U8", "shape": [-4], "data_offsets": [0, 4]}}',
        b'{"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, '
        b'"b": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}',
        b'{"a": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}',
        b'{"__metadata__": {"k": 1}, "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}',
        b'{"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]',
    ],
)
def test_malformed_safetensors_raise_block_corrupt(header: bytes) -> None:
    raw = struct.pack("<Q", len(header)) + header + b"\1\2\3\4"
    with pytest.raises(BlockCorrupt, match="safetensors"):
        parse_safetensors(raw)


def test_safetensors_header_length_out_of_range() -> None:
    with pytest.raises(BlockCorrupt, match="header length"):
        parse_safetensors(struct.pack("<Q", 1 << 62) + b"{}")
    with pytest.raises(BlockCorrupt, match="shorter"):
        parse_safetensors(b"\1\2")


def _with_table(table: bytes, metadata: bytes = b"") -> bytes:
    header = b"{" + (b'"__metadata__": {"k": "' + metadata + b'"}, ' if metadata else b"")
    header += table + b"}"
    return struct.pack("<Q", len(header)) + header + bytes(8)


@pytest.mark.parametrize(
    "hostile",
    [
        b'"a": {"dtype": "U8", "shape": [8.0], "data_offsets": [0, 8]}',
        b'"a": {"dtype": "U8", "shape": [8], "data_offsets": [0.0, 8.0]}',
        b'"a": {"dtype": "U8", "shape": [2, 4], "data_offsets": [0, 8]}, "b": {"dtype": "U8", '
        b'"shape": [true, 0], "data_offsets": [8, 8]}',
    ],
)
def test_a_table_checked_before_is_reused_only_when_written_alike(hostile: bytes) -> None:
    # valid twins of each hostile table (equal to it under ==), parsed first
    for good in (
        b'"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}',
        b'"a": {"dtype": "U8", "shape": [2, 4], "data_offsets": [0, 8]}, "b": {"dtype": "U8", '
        b'"shape": [1, 0], "data_offsets": [8, 8]}',
    ):
        first = parse_safetensors(_with_table(good, b"one"))
        again = parse_safetensors(_with_table(good, b"two"))  # other metadata, same table
        assert again.metadata == {"k": "two"} and first.metadata == {"k": "one"}
        assert {n: t.shape for n, t in again.tensors.items()} == {
            n: t.shape for n, t in first.tensors.items()
        }
    with pytest.raises(BlockCorrupt, match="safetensors"):
        parse_safetensors(_with_table(hostile, b"one"))
