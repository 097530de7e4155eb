"""The block encodings ``localkv bench`` compares, on real llama.cpp states of the tiny model.

No timing assertions: the machine is shared. The checks: every encoding decodes
to the original bytes, the ratios are what the files hold, a corrupt file is
refused, and a decoder that gets a byte wrong reports no time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.tinymodels import TinyModels, tiny_config

from localkv.bench import codecs as bc
from localkv.bench import disk as benchdisk
from localkv.bench.report import fmt_encoding, fmt_encoding_cold
from localkv.kv import codec
from localkv.model.session import ModelSession

N_TOKENS = 600  # two whole blocks of 256 and a partial one
NAMES = ["raw", "zstd-1", "hi-plane zstd-1", "hi-plane q6"]


def _state(tiny_models: TinyModels, long_text: str, **overrides: object) -> bytes:
    with ModelSession(tiny_config(tiny_models.base, **overrides)) as s:
        tokens = s.tokenize(long_text)[:N_TOKENS]
        s.prefill(tokens)
        return s.capture_state()


@pytest.fixture(scope="module")
def f16_state(tiny_models: TinyModels, long_text: str) -> bytes:
    return _state(tiny_models, long_text)


@pytest.fixture(scope="module")
def q8_state(tiny_models: TinyModels, long_text: str) -> bytes:
    return _state(tiny_models, long_text, type_k="q8_0", type_v="q8_0", flash_attn="on")


def _by_name(results: list[bc.EncodingResult]) -> dict[str, bc.EncodingResult]:
    assert [r.name for r in results] == NAMES
    return {r.name: r for r in results}


def test_every_encoding_decodes_the_f16_state(f16_state: bytes, tmp_path: Path) -> None:
    results = _by_name(bc.compare(f16_state, tmp_path, workers=2, repeats=2))
    # evictions can be checked: posix_fadvise, /proc/self/io, files on a disk (not tmpfs)
    checkable = (
        benchdisk.EVICTION_AVAILABLE
        and benchdisk.storage_reads() is not None
        and benchdisk.file_system(tmp_path) not in benchdisk.IN_MEMORY_FILE_SYSTEMS
    )
    raw_kv = codec.parse(f16_state).nbytes
    for r in results.values():
        assert r.verified and r.decode is not None and r.decode.n == 2
        assert 0 < r.decode.min <= r.decode.median <= r.decode.max
        assert r.encode_s > 0
        assert "|" in fmt_encoding(r) and "NOT VERIFIED" not in fmt_encoding(r)
        cold = r.decode_cold
        assert cold is not None and cold.time.n == 2 and cold.time.min > 0
        assert cold.file_bytes == round(r.ratio * raw_kv)
        assert r.as_json()["decode_cold"] is not None
        assert "NOT VERIFIED" not in fmt_encoding_cold(r)
        if checkable:  # each decode fetched its files from storage, not the page cache
            assert cold.read_bytes is not None and cold.read_bytes.min >= cold.file_bytes / 2
            assert cold.dropped and "page cache" not in fmt_encoding_cold(r)
    assert results["raw"].ratio == 1.0  # the K and V rows, not a byte more
    # the tiny model's random f16 K/V compresses either way (it would not have to: the
    # default model's hi-plane beats zstd-1, here zstd-1 wins; no order is asserted)
    assert results["zstd-1"].ratio < 1.0
    assert results["hi-plane zstd-1"].ratio < 1.0
    assert results["hi-plane q6"].ratio < 1.0
    assert list(tmp_path.iterdir()) == []  # each encoding's files removed after it


def test_quantized_tensors_are_stored_as_zstd_1(q8_state: bytes, tmp_path: Path) -> None:
    """No f16 tensor to split: the hi-plane encodings write exactly zstd-1's files."""
    state = codec.parse(q8_state)
    assert {t for layer in state.layout() for t in (layer[0], layer[2])} == {8}  # Q8_0
    results = _by_name(bc.compare(q8_state, tmp_path, workers=2, repeats=1))
    assert all(r.verified for r in results.values())
    assert results["raw"].ratio == 1.0
    assert results["hi-plane zstd-1"].ratio == results["zstd-1"].ratio
    assert results["hi-plane q6"].ratio == results["zstd-1"].ratio


def test_v_transposed_state_decodes_token_major(
    tiny_models: TinyModels, long_text: str, tmp_path: Path
) -> None:
    raw = _state(tiny_models, long_text, flash_attn="off")
    assert codec.parse(raw).v_trans
    results = bc.compare(raw, tmp_path, block_size=100, workers=3, repeats=1)
    assert all(r.verified for r in results)


def test_files_hold_what_the_ratio_counts(f16_state: bytes, tmp_path: Path) -> None:
    state = codec.parse(f16_state)
    layout = bc.Layout.of(state)
    assert layout.nbytes == state.nbytes
    expected = layout.assemble(state)
    views = layout.views(expected)
    assert np.array_equal(views[0], state.layers[0].k)
    assert np.array_equal(views[-1], state.layers[-1].v)
    with bc.Workers(2) as pool:
        for enc in bc.ENCODINGS:
            encoded = bc.encode(enc, state, tmp_path / enc.name, pool)
            assert [(b.start, b.stop) for b in encoded.blocks] == [(0, 256), (256, 512), (512, 600)]
            on_disk = sum(p.stat().st_size for p in (tmp_path / enc.name).iterdir())
            assert on_disk == encoded.stored_bytes
            out = np.zeros_like(expected)
            bc.decode(encoded, out, pool)
            assert np.array_equal(out, expected)
    raw_files = sorted((tmp_path / "raw").iterdir())
    assert raw_files[0].read_bytes() == b"".join(v[:256].tobytes() for v in views)


@pytest.mark.parametrize("encoding", bc.ENCODINGS, ids=NAMES)
def test_a_corrupt_block_file_is_refused(
    encoding: bc.Encoding, f16_state: bytes, tmp_path: Path
) -> None:
    state = codec.parse(f16_state)
    with bc.Workers(2) as pool:
        encoded = bc.encode(encoding, state, tmp_path, pool)
        path = encoded.blocks[1].path
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        out = np.empty(encoded.layout.nbytes, dtype=np.uint8)
        with pytest.raises(bc.BlockMismatch, match="block-00001"):
            bc.decode(encoded, out, pool)


class _FlipsOneBit(bc.Zstd):
    """Decodes, then gets one byte of the last tensor wrong."""

    name = "zstd-1, one bit flipped"

    def decode_block(
        self, layout: bc.Layout, block: bc.StoredBlock, dst: list[np.ndarray], local: bc._Local
    ) -> None:
        super().decode_block(layout, block, dst, local)
        if block.start == 0:
            dst[-1][7] ^= 0x80


class _SkipsATensor(bc.Raw):
    """Reads every tensor but the last: what was in the buffer stays there."""

    name = "raw, last tensor skipped"

    def decode_block(
        self, layout: bc.Layout, block: bc.StoredBlock, dst: list[np.ndarray], local: bc._Local
    ) -> None:
        with open(block.path, "rb") as f:
            for d in dst[:-1]:
                f.readinto(memoryview(d))


@pytest.mark.parametrize("broken", [_FlipsOneBit(), _SkipsATensor()], ids=["flip", "skip"])
def test_a_wrong_decoder_reports_no_time(
    broken: bc.Encoding, f16_state: bytes, tmp_path: Path
) -> None:
    (result,) = bc.compare(f16_state, tmp_path, workers=2, repeats=3, encodings=[broken])
    assert result.name == broken.name
    assert not result.verified and result.decode is None and result.decode_cold is None
    assert fmt_encoding(result).endswith("| NOT VERIFIED")
    assert fmt_encoding_cold(result) == "NOT VERIFIED"


def test_bad_arguments_are_refused(f16_state: bytes, tmp_path: Path) -> None:
    state = codec.parse(f16_state)
    with pytest.raises(ValueError, match="repeats"):
        bc.measure(bc.Raw(), state, tmp_path, repeats=0)
    with bc.Workers(1) as pool:
        encoded = bc.encode(bc.Raw(), state, tmp_path, pool)
        with pytest.raises(ValueError, match="uint8 buffer"):
            bc.decode(encoded, np.empty(10, dtype=np.uint8), pool)
