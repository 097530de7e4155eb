"""The state codec against real llama.cpp states: round trips, slices, refusals."""

from __future__ import annotations

import numpy as np
import pytest
from support.tinymodels import TinyModels, tiny_config

from localkv.kv import codec
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
