"""The 6-bit code (``formats/q6.py``) and the compact files that hold it (``lkv-planes2``)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from localkv.storage.formats import planes, q6
from localkv.storage.formats.blockcodec import FORMAT_VERSION, encode, expand
from localkv.storage.store import BlockCorrupt, SnapshotStore
from safetensors.numpy import load as st_load
from support.store import put_chain
from test_store_compact import _forged, _meta, _noisy_chain, _rewrite


def _values(n: int, seed: int = 0) -> np.ndarray:
    """f16 values like a KV cache's, with some far-off ones (escapes)."""
    rng = np.random.default_rng(seed)
    v = (rng.standard_normal(n) * np.exp(rng.uniform(-9, 6, n))).astype(np.float16)
    far = rng.integers(0, n, size=max(1, n // 9))
    v[far] = rng.choice(np.array([1e-7, 3e4, -2e3, 6e-5, -0.0], dtype=np.float16), size=far.size)
    return v


def _decode(code: q6.Code, n: int, cuts: list[int], **how: bool) -> np.ndarray:
    bounds = [0, *cuts, n]
    outs = [np.full(2 * (b - a), 0xA5, np.uint8) for a, b in itertools.pairwise(bounds)]
    q6.decode_into([(*code, outs)], **how)
    return np.concatenate(outs).view("<u2")


WAYS = [
    pytest.param({"compiled": True, "vector": True}, id="avx2"),
    pytest.param({"compiled": True, "vector": False}, id="scalar"),
    pytest.param({"compiled": False}, id="numpy"),
]


def test_the_compiled_decoder_is_built() -> None:
    assert q6.compiled()  # setup.py builds it wherever llama-cpp-python builds


@pytest.mark.parametrize("how", WAYS)
@pytest.mark.parametrize("n", [1, 5, 63, 64, 65, 127, 128, 200, 1000, 4096 + 17])
def test_every_decoder_gives_back_the_values(how: dict[str, bool], n: int) -> None:
    values = _values(n, n)
    code = q6.encode(values)
    for cuts in ([], [n // 2], [1, n - 1] if n > 2 else [], [n // 3, n // 3 + 64]):
        cuts = sorted(c for c in cuts if 0 <= c <= n)
        got = _decode(code, n, cuts, **how)
        np.testing.assert_array_equal(got, values.view("<u2"))


def test_the_code_is_what_the_format_says() -> None:
    values = np.array([1.0, 2.0, 1.0, -3.5] * 20, dtype=np.float16)  # 80 values: 2 groups
    lo, index, table = q6.encode(values)
    hi = values.view("<u2") >> 8
    assert lo.tolist() == (values.view("<u2") & 0xFF).tolist()
    assert index.size == 2 * q6.GROUP_BYTES and table.size == q6.TABLE  # no escapes
    # the most frequent high byte first, ties in byte order
    assert table[:3].tolist() == sorted({int(h) for h in hi}, key=lambda h: (-np.sum(hi == h), h))
    group = index[: q6.GROUP_BYTES]
    idx = [int(np.flatnonzero(table[:63] == h)[0]) for h in hi[:64]]
    assert [group[j] & 15 for j in range(32)] == [i & 15 for i in idx[:32]]
    assert [group[j] >> 4 for j in range(32)] == [i & 15 for i in idx[32:64]]
    assert [(group[32 + (j & 15)] >> (2 * (j >> 4))) & 3 for j in range(64)] == [
        i >> 4 for i in idx
    ]


def test_more_than_63_high_bytes_are_escaped_in_order() -> None:
    values = np.arange(0, 200 * 256, 256, dtype="<u2").view(np.float16)  # 200 distinct high bytes
    lo, index, table = q6.encode(values)
    escaped = table[q6.TABLE :]
    assert escaped.size == 200 - 63
    assert escaped.tolist() == sorted(escaped.tolist())  # value order: here, ascending
    for how in ({"compiled": True}, {"compiled": False}):
        np.testing.assert_array_equal(
            _decode((lo, index, table), 200, [], **how), values.view("<u2")
        )


@pytest.mark.parametrize("how", WAYS)
def test_a_code_whose_escapes_do_not_match_is_refused(how: dict[str, bool]) -> None:
    values = _values(300)
    lo, index, table = q6.encode(values)
    assert table.size > q6.TABLE
    for bad in (table[:-1], np.append(table, np.uint8(1))):
        with pytest.raises(BlockCorrupt, match="escape"):
            _decode((lo, index, bad), 300, [], **how)
    with pytest.raises(BlockCorrupt, match="index bytes"):
        _decode((lo, index[:-1], table), 300, [], **how)
    with pytest.raises(BlockCorrupt, match="table"):
        _decode((lo, index, table[:40]), 300, [], **how)


def test_the_compiled_decoder_refuses_what_does_not_fit() -> None:
    from localkv.storage import _planes

    lo, index, table = q6.encode(_values(100))
    with pytest.raises(ValueError, match="outputs"):
        _planes.decode6([(lo, index, table, [np.zeros(199, np.uint8)])])
    with pytest.raises(ValueError, match="index bytes"):
        _planes.decode6([(lo, index[:10], table, [np.zeros(200, np.uint8)])])
    with pytest.raises(ValueError, match="overlaps"):
        buf = np.zeros(400, np.uint8)
        buf[:100] = lo
        _planes.decode6([(buf[:100], index, table, [buf[50:250]])])
    with pytest.raises((TypeError, BufferError)):
        _planes.decode6([(lo, index, table, [bytes(200)])])  # read-only


def test_compact_file_is_safetensors_with_a_6_bit_code() -> None:
    block = _noisy_chain()[0]
    data = encode(block, compact=True)
    loaded = st_load(data)
    split = [
        f"{t}.{i}" for t in "kv" for i in (0, 1) if block.tensors[f"{t}.{i}"].dtype == np.float16
    ]
    assert split
    whole = {name for name in block.tensors if name not in split}
    assert set(loaded) == {p for n in split for p in planes.parts(n)} | whole | {"tokens", "pos"}
    for name in split:
        arr = block.tensors[name]
        lo, index, table = (loaded[name + s] for s in (planes.LO, planes.Q6_INDEX, planes.Q6_TABLE))
        assert name not in loaded and lo.shape == arr.shape
        assert all(x.dtype == np.uint8 for x in (lo, index, table))
        assert index.shape == (-(-arr.size // q6.GROUP) * q6.GROUP_BYTES,)
        np.testing.assert_array_equal(
            _decode((lo.reshape(-1), index, table), arr.size, []), arr.reshape(-1).view("<u2")
        )
    meta = _meta(data)
    assert meta["format"] == planes.Q6_FORMAT
    assert len(data) < len(encode(block))


def test_expanded_file_is_the_plain_file() -> None:
    for block in _noisy_chain():
        plain = encode(block)
        expanded = expand(encode(block, compact=True))
        assert len(expanded) == len(plain)
        a, b = st_load(expanded), st_load(plain)
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])
        assert _meta(expanded) == _meta(plain) and _meta(plain)["format"] == FORMAT_VERSION


def test_q6_store_round_trip_split_targets_and_mixed_chain(tmp_path: Path) -> None:
    blocks = _noisy_chain()
    with SnapshotStore.open(tmp_path / "c") as store:
        put_chain(store, blocks[:2])
    with SnapshotStore.open(tmp_path / "c", compact=True) as store:
        put_chain(store, blocks[2:])
        rows = store.match_chain([b.hash for b in blocks])
        formats = [_meta((store.root / r.file).read_bytes())["format"] for r in rows]
        assert formats == [FORMAT_VERSION, FORMAT_VERSION, planes.Q6_FORMAT, planes.Q6_FORMAT]
        assert all(r.raw_bytes == len(encode(b)) for r, b in zip(rows, blocks, strict=True))
        for got, block in zip(store.read_blocks(rows), blocks, strict=True):
            for name, arr in block.tensors.items():
                np.testing.assert_array_equal(got.tensors[name].view(np.uint8), arr.view(np.uint8))
        opened = store.open_blocks(rows)
        try:
            outs, targets = [], []
            for block in blocks:
                k0 = block.tensors["k.0"]
                out = np.zeros(k0.nbytes, dtype=np.uint8)
                cut = (k0.shape[0] - 1) * k0.shape[1] * 2  # the final token's row apart
                targets.append({"k.0": [out[:cut], out[cut:]]})
                outs.append(out)
            store.fill_blocks(opened, targets)
        finally:
            for o in opened:
                o.close()
        for block, out in zip(blocks, outs, strict=True):
            np.testing.assert_array_equal(out, block.tensors["k.0"].reshape(-1).view(np.uint8))
        assert store.verify() == []


def _drop_an_escape(t: dict[str, np.ndarray]) -> None:
    t["k.0@tab"] = t["k.0@tab"][:-1].copy()


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (_drop_an_escape, "escape"),
        (lambda t: t.update({"k.0@tab": np.append(t["k.0@tab"], np.uint8(3))}), "escape"),
        (lambda t: t.update({"k.1@q6": t["k.1@q6"][:-48].copy()}), "index bytes"),
        (lambda t: t.update({"k.1@tab": t["k.1@tab"][:10].copy()}), "table"),
        (lambda t: t.pop("k.1@q6"), "lacks its U8 part"),
        (lambda t: t.update({"k.1@tab": t["k.1@tab"].astype(np.int16)}), "lacks its U8 part"),
        (lambda t: t.pop("k.1@lo"), "lacks its U8 low plane"),
        (lambda t: t.update({"stray": np.zeros(8, np.uint8)}), "one row per token"),
    ],
    ids=[
        "an escape short",
        "an escape over",
        "index cut",
        "table cut",
        "no index",
        "table not U8",
        "no low plane",
        "a stray tensor",
    ],
)
def test_forged_q6_files_with_a_matching_checksum_are_refused(
    tmp_path: Path, edit: object, reason: str
) -> None:
    blocks = _noisy_chain()
    with SnapshotStore.open(tmp_path / "c", compact=True) as store:
        put_chain(store, blocks)
        row = store.match_chain([blocks[1].hash])[0]
        assert st_load((store.root / row.file).read_bytes())["k.0@tab"].size > q6.TABLE
        _rewrite(store, row.hash, _forged((store.root / row.file).read_bytes(), edit))
        row = store.match_chain([blocks[1].hash])[0]
        with pytest.raises(BlockCorrupt, match=reason) as info:
            store.read_blocks([row])
        assert info.value.block_hash == row.hash
