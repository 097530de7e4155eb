"""Compact block files (``lkv-planes2``) in a store: expansion, round trips, forgeries.

The 6-bit code itself and the file's tensors are tested in ``test_store_q6.py``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from localkv.storage.formats import planes
from localkv.storage.formats.blockcodec import FORMAT_VERSION, checksum, encode, expand
from localkv.storage.store import BlockCorrupt, SnapshotStore
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save
from support.store import make_chain, put_chain


def _meta(data: bytes) -> dict[str, str]:
    (n,) = struct.unpack_from("<Q", data)
    return dict(json.loads(data[8 : 8 + n])["__metadata__"])


def _noisy_chain(n: int = 64, block: int = 16):  # type: ignore[no-untyped-def]
    """Blocks whose F16 values have random low bytes, as a real KV cache does."""
    rng = np.random.default_rng(7)
    blocks = make_chain(list(range(n)), block)
    for b in blocks:
        for name, arr in b.tensors.items():
            if arr.dtype == np.float16:
                noisy = (rng.standard_normal((arr.shape[0], 256)) * 3).astype(np.float16)
                object.__setattr__(b, "tensors", {**b.tensors, name: noisy})
    return blocks


def test_expanded_compact_file_is_the_plain_file() -> None:
    for block in _noisy_chain():
        plain = encode(block)
        expanded = expand(encode(block, compact=True))
        assert len(expanded) == len(plain)
        a, b = st_load(expanded), st_load(plain)
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].dtype == b[name].dtype
            np.testing.assert_array_equal(a[name].view(np.uint8), b[name].view(np.uint8))
        assert _meta(expanded) == _meta(plain)
        assert _meta(expanded)["format"] == FORMAT_VERSION
        assert expand(plain) == plain


def test_expanded_compact_file_loads_with_safetensors_torch() -> None:
    torch_st = pytest.importorskip("safetensors.torch")
    block = _noisy_chain()[0]
    loaded = torch_st.load(expand(encode(block, compact=True)))
    np.testing.assert_array_equal(loaded["k.0"].numpy(), block.tensors["k.0"])


def test_compact_store_round_trip_and_sizes(tmp_path: Path) -> None:
    blocks = _noisy_chain()
    with SnapshotStore.open(tmp_path / "c", compact=True) as store:
        assert put_chain(store, blocks) == len(blocks)
        rows = store.match_chain([b.hash for b in blocks])
        for row, block in zip(rows, blocks, strict=True):
            assert row.raw_bytes == len(encode(block))
            assert row.stored_bytes == (store.root / row.file).stat().st_size < row.raw_bytes
        for got, block in zip(store.read_blocks(rows), blocks, strict=True):
            assert got.tensors.keys() == block.tensors.keys()
            for name, arr in block.tensors.items():
                assert got.tensors[name].dtype == arr.dtype
                np.testing.assert_array_equal(got.tensors[name].view(np.uint8), arr.view(np.uint8))
            assert got.meta == block.meta
        assert store.verify() == []


def test_compact_blocks_fill_split_targets(tmp_path: Path) -> None:
    """Targets cut a tensor in two parts (as a restore does for the final token)."""
    blocks = _noisy_chain()
    with SnapshotStore.open(tmp_path / "c", compact=True) as store:
        put_chain(store, blocks)
        rows = store.match_chain([b.hash for b in blocks])
        opened = store.open_blocks(rows)
        try:
            targets = []
            outs = []
            for block in blocks:
                k0 = block.tensors["k.0"]
                out = np.zeros(k0.nbytes, dtype=np.uint8)
                cut = (k0.shape[0] - 1) * k0.shape[1] * 2
                targets.append({"k.0": [out[:cut], out[cut:]]})
                outs.append(out)
            got = store.fill_blocks(opened, targets)
        finally:
            for o in opened:
                o.close()
        for block, out, read in zip(blocks, outs, got, strict=True):
            np.testing.assert_array_equal(out, block.tensors["k.0"].reshape(-1).view(np.uint8))
            assert "k.0" not in read.tensors
            np.testing.assert_array_equal(read.tensors["k.1"], block.tensors["k.1"])


def test_plain_and_compact_blocks_join_in_one_chain(tmp_path: Path) -> None:
    blocks = _noisy_chain()
    with SnapshotStore.open(tmp_path / "c") as store:
        put_chain(store, blocks[:2])
    with SnapshotStore.open(tmp_path / "c", compact=True) as store:
        put_chain(store, blocks[2:])
        rows = store.match_chain([b.hash for b in blocks])
        assert [r.stored_bytes == r.raw_bytes for r in rows] == [True, True, False, False]
        for got, block in zip(store.read_blocks(rows), blocks, strict=True):
            np.testing.assert_array_equal(got.tensors["k.1"], block.tensors["k.1"])


def _rewrite(store: SnapshotStore, row_hash: str, data: bytes) -> None:
    """Replace a block's file and make the index's checksum and size agree with it."""
    row = store.match_chain([row_hash])[0]
    (store.root / row.file).write_bytes(data)
    with store.db.conn:
        store.db.execute(
            "UPDATE blocks SET stored_bytes = ?, checksum = ? WHERE hash = ?",
            (len(data), checksum(data), row_hash),
        )


def _forged(data: bytes, edit) -> bytes:  # type: ignore[no-untyped-def]
    tensors = {k: np.array(v) for k, v in st_load(data).items()}
    edit(tensors)
    return bytes(st_save(tensors, metadata=_meta(data)))


@pytest.mark.parametrize(
    ("name", "edit", "reason"),
    [
        ("a plane is missing", lambda t: t.pop("k.1@lo"), "lacks its U8 low plane"),
        (
            "a plane has the wrong dtype",
            lambda t: t.update({"k.0@lo": t["k.0@lo"].astype(np.int16)}),
            "lacks its U8 low plane",
        ),
        (
            "whole and split",
            lambda t: t.update({"k.0": np.zeros(2, np.float16)}),
            "lacks its U8 low plane",
        ),
    ],
)
def test_forged_compact_files_with_a_matching_checksum_are_refused(
    tmp_path: Path, name: str, edit: object, reason: str
) -> None:
    blocks = _noisy_chain()
    with SnapshotStore.open(tmp_path / "c", compact=True) as store:
        put_chain(store, blocks)
        row = store.match_chain([blocks[1].hash])[0]
        _rewrite(store, row.hash, _forged((store.root / row.file).read_bytes(), edit))
        row = store.match_chain([blocks[1].hash])[0]
        with pytest.raises(BlockCorrupt, match=reason) as info:
            store.read_blocks([row])
        assert info.value.block_hash == row.hash


@pytest.mark.parametrize("where", ["header", "low plane", "high plane"])
def test_a_flipped_byte_in_a_compact_file_fails_the_checksum(tmp_path: Path, where: str) -> None:
    blocks = _noisy_chain()
    high = "k.0" + planes.Q6_INDEX
    with SnapshotStore.open(tmp_path / "c", compact=True) as store:
        put_chain(store, blocks)
        row = store.match_chain([blocks[0].hash])[0]
        path = store.root / row.file
        data = bytearray(path.read_bytes())
        (n,) = struct.unpack_from("<Q", data)
        header = json.loads(data[8 : 8 + n])
        at = {
            "header": 20,
            "low plane": 8 + n + header["k.0@lo"]["data_offsets"][0] + 3,
            "high plane": 8 + n + header[high]["data_offsets"][1] - 3,
        }[where]
        data[at] ^= 0x10
        path.write_bytes(bytes(data))
        with pytest.raises(BlockCorrupt) as info:
            store.read_blocks([row])
        assert "checksum" in info.value.reason or "metadata" in info.value.reason


def test_reading_a_compact_block_stays_in_bounded_memory(tmp_path: Path) -> None:
    import tracemalloc

    blocks = _noisy_chain(64, 64)
    with SnapshotStore.open(tmp_path / "c", compact=True) as store:
        put_chain(store, blocks)
        row = store.match_chain([blocks[0].hash])[0]
        tracemalloc.start()
        try:
            store.read_blocks([row])
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak <= 2 * (row.stored_bytes + row.raw_bytes) + (1 << 20), peak
