"""The state codec against real llama.cpp states: round trips, slices, refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.tinyarch import build
from support.tinymodels import TinyModels, tiny_config

from localkv.kv import codec, partial, section
from localkv.model.session import ModelSession

LAYOUTS = [
    ("f16", "f16", "on"),
    ("f16", "f16", "off"),
    ("q8_0", "f16", "on"),
    ("q8_0", "f16", "off"),
    ("q8_0", "q8_0", "on"),
]


@pytest.fixture(scope="module")
def prompt(tiny_models: TinyModels, long_text: str) -> list[int]:
    with ModelSession(tiny_config(tiny_models.base)) as s:
        return s.tokenize(long_text)[:700]


@pytest.mark.parametrize(("type_k", "type_v", "flash"), LAYOUTS)
def test_round_trip_is_byte_identical(
    tiny_models: TinyModels, prompt: list[int], type_k: str, type_v: str, flash: str
) -> None:
    cfg = tiny_config(tiny_models.base, type_k=type_k, type_v=type_v, flash_attn=flash)
    with ModelSession(cfg) as s:
        s.prefill(prompt)
        raw = s.capture_state()
        state = codec.parse(raw)
        assert state.n_tokens == len(prompt)
        assert state.v_trans == (flash == "off")
        assert np.array_equal(state.positions, np.arange(len(prompt)))
        rebuilt = codec.assemble(state)
        assert bytes(rebuilt) == raw
        # through llama.cpp and back: get -> parse -> assemble -> set -> get
        s.load_state(rebuilt, prompt)
        assert s.capture_state() == raw


@pytest.mark.parametrize(("type_k", "type_v", "flash"), LAYOUTS)
def test_slice_restores_the_state_of_a_shorter_prefill(
    tiny_models: TinyModels, prompt: list[int], type_k: str, type_v: str, flash: str
) -> None:
    """Slicing at k equals prefilling k tokens (same block boundaries), next logits included."""
    k = 300
    cfg = tiny_config(tiny_models.base, type_k=type_k, type_v=type_v, flash_attn=flash)
    with ModelSession(cfg) as s:
        s.prefill(prompt, boundaries=[k])
        full = s.capture()
        s.restore(full.slice(0, k), prompt[:k])
        restored = s.decode_one(prompt[k])
        s.reset()
        s.prefill(prompt[:k])
        sliced_raw = s.capture_state()
        uncached = s.decode_one(prompt[k])
    assert bytes(codec.assemble(full.slice(0, k))) == sliced_raw
    assert np.array_equal(restored, uncached)


@pytest.mark.parametrize(("type_k", "type_v", "flash"), [*LAYOUTS[:2], ("f32", "f32", "off")])
def test_an_assembly_filled_row_by_row_is_llama_cpps_own_state(
    tiny_models: TinyModels, prompt: list[int], type_k: str, type_v: str, flash: str
) -> None:
    """What a restore fills in place (K rows, V rows or, transposed, V columns) is the state."""
    cfg = tiny_config(tiny_models.base, type_k=type_k, type_v=type_v, flash_attn=flash)
    with ModelSession(cfg) as s:
        s.prefill(prompt)
        raw = s.capture_state()
    state = codec.parse(raw)
    n = state.n_tokens
    out, k_rows, v_rows = codec.assembly(state.layout(), n, v_trans=state.v_trans)
    for layer, k, v in zip(state.layers, k_rows, v_rows, strict=True):
        k[...] = layer.k
        if state.v_trans:
            assert v.shape == (layer.v_row_bytes // layer.v_elem_bytes, n)
            v[...] = layer.v.view(v.dtype).T  # the codec keeps V token-major
        else:
            v[...] = layer.v
    assert bytes(out) == raw


def test_concat_of_slices_is_the_whole(tiny_models: TinyModels, prompt: list[int]) -> None:
    with ModelSession(tiny_config(tiny_models.base, flash_attn="off")) as s:
        s.prefill(prompt)
        raw = s.capture_state()
    state = codec.parse(raw)
    parts = [state.slice(0, 256), state.slice(256, 512), state.slice(512, 700)]
    assert bytes(codec.assemble(codec.concat(parts))) == raw


def test_parse_refuses_what_it_does_not_know(tiny_models: TinyModels, prompt: list[int]) -> None:
    with ModelSession(tiny_config(tiny_models.base)) as s:
        s.prefill(prompt[:40])
        raw = s.capture_state()
    bad_magic = b"\0\0\0\0" + raw[4:]
    with pytest.raises(codec.StateFormatError, match="magic"):
        codec.parse(bad_magic)
    with pytest.raises(codec.StateFormatError, match="truncated"):
        codec.parse(raw[:-10])
    with pytest.raises(codec.StateFormatError, match="trailing"):
        codec.parse(raw + b"\0")
    two_streams = raw[:8] + (2).to_bytes(4, "little") + raw[12:]
    with pytest.raises(codec.StateFormatError, match="streams"):
        codec.parse(two_streams)
    # an unknown ggml type id for layer 0's K
    state = codec.parse(raw)
    k_type_at = 16 + 12 * state.n_tokens + 8
    unknown_type = raw[:k_type_at] + (99).to_bytes(4, "little") + raw[k_type_at + 4 :]
    with pytest.raises(codec.StateFormatError, match="unknown ggml type"):
        codec.parse(unknown_type)


# --------------------------------------------------------------- cells with llama.cpp's extension


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    """The tiny qwen35 model: M-RoPE, so its KV cells carry ``llama_kv_cell_ext``."""
    return build(
        tmp_path_factory.mktemp("qwen35") / "tiny-qwen35.gguf", "qwen35", default_model_path
    )


def _qwen35_state(path: Path, prompt: list[int], flash: str) -> tuple[bytes, bytes, ModelSession]:
    """(the whole state, its attention part) after prefilling ``prompt``; the open session."""
    s = ModelSession(tiny_config(path, flash_attn=flash))
    s.prefill(prompt)
    raw = s.capture_state()
    return raw, bytes(partial.split(raw, "hybrid")[0]), s


@pytest.mark.parametrize("flash", ["on", "off"])
def test_text_cells_carry_their_position_twice_and_their_token(
    qwen35: Path, prompt: list[int], flash: str
) -> None:
    """Measured: a text cell is pos, n_seq_id, x = pos, y = pos, tok = its token, seq_id."""
    _, attention, s = _qwen35_state(qwen35, prompt, flash)
    with s:
        assert s.cell_ext
        n = len(prompt)
        assert section.kv_section(attention, 8, end=len(attention)) == (len(attention), 24)
        cells = np.frombuffer(attention, "<i4", 6 * n, 16).reshape(n, 6)
        pos = np.arange(n)
        expected = np.stack([pos, np.ones(n), pos, pos, np.array(prompt), np.zeros(n)], axis=1)
        assert np.array_equal(cells, expected)


@pytest.mark.parametrize("flash", ["on", "off"])
def test_extended_cells_round_trip_byte_identical(
    qwen35: Path, prompt: list[int], flash: str
) -> None:
    """get -> parse -> assemble -> set -> get, for the whole hybrid state."""
    raw, attention, s = _qwen35_state(qwen35, prompt, flash)
    with s:
        tail = bytes(partial.split(raw, "hybrid")[1])
        state = codec.parse(attention)
        assert state.cell_ext and state.v_trans == (flash == "off")
        assert np.array_equal(state.cell_tokens, prompt)
        assert bytes(codec.assemble(state)) == attention
        rebuilt = partial.join(codec.assemble(state), tail)
        s.load_state(rebuilt, prompt)
        assert s.capture_state() == raw
        # a block's rows hold no cell tokens: the assembly takes them from the sequence
        blocks = [
            _without_cell_tokens(state.slice(a, min(a + 256, len(prompt)))) for a in (0, 256, 512)
        ]
        bare = codec.assemble(blocks, cell_ext=True)
        assert bytes(bare) != attention  # tokens not named yet
        s.load_state(partial.join(bare, tail), prompt)
        assert s.capture_state() == raw


def _without_cell_tokens(state: codec.KVState) -> codec.KVState:
    return codec.KVState(positions=state.positions, v_trans=state.v_trans, layers=state.layers)


def test_an_assembly_names_the_tokens_before_the_state_is_loaded(
    qwen35: Path, prompt: list[int]
) -> None:
    raw, attention, s = _qwen35_state(qwen35, prompt, "on")
    with s:
        tail = bytes(partial.split(raw, "hybrid")[1])
        state = codec.parse(attention)
        n = len(prompt)
        buf, k_rows, v_rows = s.restore_buffer(state.layout(), n, len(tail) - partial.HEADER)
        for i, layer in enumerate(state.layers):
            k_rows[i][:] = layer.k
            v_rows[i][:] = layer.v
        s.load_state(partial.join_into(buf, tail), prompt)
        assert s.capture_state() == raw
        with pytest.raises(codec.StateFormatError, match="cannot hold"):
            section.name_cell_tokens(np.frombuffer(raw, np.uint8).copy(), prompt[:-1])


def test_cells_the_codec_cannot_reproduce_are_refused_with_the_reason(
    qwen35: Path, prompt: list[int]
) -> None:
    raw, attention, s = _qwen35_state(qwen35, prompt[:40], "on")
    s.close()
    image = bytearray(attention)
    image[16 + 24 * 5 + 8 : 16 + 24 * 5 + 12] = (7).to_bytes(4, "little")  # cell 5's x
    with pytest.raises(codec.StateFormatError, match="2D positions"):
        codec.parse(bytes(image))
    with pytest.raises(codec.StateFormatError, match="2D positions"):
        partial.split(bytes(image) + bytes(partial.split(raw, "hybrid")[1])[8:], "hybrid")
    with pytest.raises(codec.StateFormatError, match="truncated"):
        codec.parse(attention[:-10])
