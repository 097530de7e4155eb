"""Tests of the tiny test models, run through the real llama.cpp (no mocks)."""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import gguf
import llama_cpp
import numpy as np
import numpy.typing as npt
import pytest
from support.tinymodels import TinyModels, _read_header, build_tiny_llama

Logits = npt.NDArray[np.float32]

N_THREADS = 1  # tiny models decode fastest on one thread, more spin-wait on busy CPUs
N_VOCAB = 49152
PROMPT = "The quick brown fox jumps over the lazy dog while it rains in the city. " * 10
PROMPT_LENGTH = 100
TEXTS = (
    "Hello world",
    "<|im_start|>user\nHéllo, wörld! 你好 🤗 1234 tabs\tand  spaces<|im_end|>\n",
)
FA_ON = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
FA_OFF = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
F16 = llama_cpp.GGML_TYPE_F16
Q8_0 = llama_cpp.GGML_TYPE_Q8_0


@contextlib.contextmanager
def open_model(path: Path) -> Iterator[llama_cpp.llama_model_p]:
    params = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(os.fsencode(path), params)
    if not model:
        pytest.fail(f"llama.cpp could not load {path}")
    try:
        yield model
    finally:
        llama_cpp.llama_model_free(model)


@contextlib.contextmanager
def open_context(
    model: llama_cpp.llama_model_p,
    *,
    flash_attn: int = FA_OFF,
    type_k: int = F16,
    type_v: int = F16,
) -> Iterator[llama_cpp.llama_context_p]:
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = 256
    params.n_threads = params.n_threads_batch = N_THREADS
    params.flash_attn_type = flash_attn
    params.type_k = type_k
    params.type_v = type_v
    context = llama_cpp.llama_init_from_model(model, params)
    if not context:
        pytest.fail(f"no context with flash_attn={flash_attn} type_k={type_k} type_v={type_v}")
    try:
        yield context
    finally:
        llama_cpp.llama_free(context)


def vocab_of(model: llama_cpp.llama_model_p) -> llama_cpp.llama_vocab_p:
    vocab: llama_cpp.llama_vocab_p | None = llama_cpp.llama_model_get_vocab(model)
    assert vocab is not None
    return vocab


def tokenize(model: llama_cpp.llama_model_p, text: str) -> list[int]:
    data = text.encode()
    tokens = (llama_cpp.llama_token * (len(data) + 1))()
    n_tokens = llama_cpp.llama_tokenize(
        vocab_of(model), data, len(data), tokens, len(tokens), False, True
    )
    assert n_tokens >= 0
    return list(tokens[:n_tokens])


def final_logits(context: llama_cpp.llama_context_p, tokens: Sequence[int]) -> Logits:
    """Decode ``tokens`` into an emptied KV cache; return the logits after the last one."""
    memory = llama_cpp.llama_get_memory(context)
    assert memory is not None
    llama_cpp.llama_memory_clear(memory, True)
    batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
    try:
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == len(tokens) - 1
        batch.n_tokens = len(tokens)
        status = llama_cpp.llama_decode(context, batch)
        assert status == 0, f"llama_decode failed with status {status}"
    finally:
        llama_cpp.llama_batch_free(batch)
    row = llama_cpp.llama_get_logits_ith(context, len(tokens) - 1)
    return np.ctypeslib.as_array(row, shape=(N_VOCAB,)).copy()


def model_logits(path: Path, tokens: Sequence[int], **context_options: int) -> Logits:
    with open_model(path) as model, open_context(model, **context_options) as context:
        return final_logits(context, tokens)


def meta_value(model: llama_cpp.llama_model_p, key: str) -> str:
    buffer = ctypes.create_string_buffer(256)
    length = llama_cpp.llama_model_meta_val_str(model, key.encode(), buffer, len(buffer))
    assert length >= 0, f"{key} is missing"
    return buffer.value.decode()


def max_abs_diff(a: Logits, b: Logits) -> float:
    return float(np.max(np.abs(a - b)))


@pytest.fixture(scope="module")
def prompt_tokens(tiny_models: TinyModels) -> list[int]:
    with open_model(tiny_models.base) as model:
        tokens = tokenize(model, PROMPT)[:PROMPT_LENGTH]
    assert len(tokens) == PROMPT_LENGTH
    return tokens


@pytest.fixture(scope="module")
def base_logits(tiny_models: TinyModels, prompt_tokens: list[int]) -> Logits:
    return model_logits(tiny_models.base, prompt_tokens)


def test_read_header_matches_gguf_reader(tmp_path: Path) -> None:
    path = tmp_path / "every-type.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo 🤗")
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_array("t.strs", ["a", "Ġb", "ü"])
    writer.add_key_value("t.ints", [3, -1], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
    writer.add_array("t.floats", [0.5, -2.25])
    writer.add_array("t.bools", [True, False])
    writer.add_tensor("a", np.zeros((3, 5), dtype=np.float32))
    writer.add_tensor("b.weight", np.zeros(7, dtype=np.float32))
    writer.add_tensor("c", np.zeros((2, 3, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    header = _read_header(path)
    reader = gguf.GGUFReader(path)
    fields = {name: field for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    assert fields.keys() == header.metadata.keys()
    for name, field in fields.items():
        value = header.metadata[name]
        assert field.types[0] == value.type, name
        assert field.types[-1] == (value.sub_type or value.type), name
        assert field.contents() == _decoded(value.value), name
    assert header.tensor_shapes == {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}


def _decoded(value: object) -> object:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list):
        return [_decoded(item) for item in value]
    return value


def test_build_is_deterministic_per_seed(
    tiny_models: TinyModels, default_model_path: Path, tmp_path: Path
) -> None:
    again = build_tiny_llama(tmp_path / "again.gguf", default_model_path, seed=0)
    assert again.read_bytes() == tiny_models.base.read_bytes()
    base, other = _read_header(tiny_models.base), _read_header(tiny_models.other_weights)
    assert other.metadata == base.metadata
    assert other.tensor_shapes == base.tensor_shapes
    assert tiny_models.other_weights.read_bytes() != tiny_models.base.read_bytes()


def test_all_tokenizer_metadata_is_copied(
    tiny_models: TinyModels, default_model_path: Path
) -> None:
    def tokenizer_keys(path: Path) -> dict[str, gguf.GGUFValue]:
        metadata = _read_header(path).metadata
        return {key: value for key, value in metadata.items() if key.startswith("tokenizer.")}

    expected = tokenizer_keys(default_model_path)
    assert {"tokenizer.ggml.merges", "tokenizer.chat_template"} <= expected.keys()
    assert len(expected["tokenizer.ggml.tokens"].value) == N_VOCAB
    assert tokenizer_keys(tiny_models.base) == expected


@pytest.mark.parametrize("variant", ["base", "other_weights", "q8_0"])
def test_model_loads_with_expected_shape(tiny_models: TinyModels, variant: str) -> None:
    with open_model(getattr(tiny_models, variant)) as model:
        assert llama_cpp.llama_vocab_n_tokens(vocab_of(model)) == N_VOCAB
        assert llama_cpp.llama_model_n_layer(model) == 2
        assert llama_cpp.llama_model_n_embd(model) == 128
        assert llama_cpp.llama_model_n_head(model) == 2
        assert llama_cpp.llama_model_n_head_kv(model) == 1
        assert meta_value(model, "general.name") == "localkv-tiny"


def test_q8_0_model_is_quantized(tiny_models: TinyModels) -> None:
    with open_model(tiny_models.base) as base, open_model(tiny_models.q8_0) as q8_0:
        assert meta_value(base, "general.file_type") == str(gguf.LlamaFileType.ALL_F32.value)
        assert meta_value(q8_0, "general.file_type") == str(llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0)
        assert llama_cpp.llama_model_n_params(q8_0) == llama_cpp.llama_model_n_params(base)
        assert llama_cpp.llama_model_size(q8_0) * 3 < llama_cpp.llama_model_size(base)


@pytest.mark.default_model
@pytest.mark.parametrize("text", TEXTS)
def test_tokenization_matches_default_model(
    tiny_models: TinyModels, default_model_path: Path, text: str
) -> None:
    with open_model(default_model_path) as model:
        expected = tokenize(model, text)
    assert len(expected) > 1
    for path in (tiny_models.base, tiny_models.other_weights, tiny_models.q8_0):
        with open_model(path) as model:
            assert tokenize(model, text) == expected, path.name


@pytest.mark.default_model
def test_vocabulary_matches_default_model(
    tiny_models: TinyModels, default_model_path: Path
) -> None:
    with open_model(default_model_path) as default, open_model(tiny_models.base) as tiny:
        assert _vocabulary(tiny) == _vocabulary(default)
        template = llama_cpp.llama_model_chat_template(tiny, None)
        assert template is not None
        assert template == llama_cpp.llama_model_chat_template(default, None)


def _vocabulary(model: llama_cpp.llama_model_p) -> tuple[list[tuple[bytes, int]], list[int]]:
    """Every token's piece and attributes, and the special token ids."""
    vocab = vocab_of(model)
    buffer = ctypes.create_string_buffer(256)
    entries = []
    for token in range(llama_cpp.llama_vocab_n_tokens(vocab)):
        length = llama_cpp.llama_token_to_piece(vocab, token, buffer, len(buffer), 0, True)
        assert 0 <= length <= len(buffer)
        entries.append((buffer.raw[:length], llama_cpp.llama_vocab_get_attr(vocab, token)))
    specials = [llama_cpp.llama_vocab_bos(vocab), llama_cpp.llama_vocab_eos(vocab)]
    return entries, specials


def test_logits_are_finite_and_spread(base_logits: Logits) -> None:
    assert base_logits.shape == (N_VOCAB,)
    assert np.isfinite(base_logits).all()
    assert float(np.std(base_logits)) > 1.0


@pytest.mark.parametrize("position", [0, 10, 50])
def test_logits_depend_on_earlier_tokens(
    tiny_models: TinyModels, prompt_tokens: list[int], base_logits: Logits, position: int
) -> None:
    changed = list(prompt_tokens)
    changed[position] = prompt_tokens[position] + 1
    logits = model_logits(tiny_models.base, changed)
    assert max_abs_diff(logits, base_logits) > 1e-3


def test_other_weights_give_other_logits(
    tiny_models: TinyModels, prompt_tokens: list[int], base_logits: Logits
) -> None:
    logits = model_logits(tiny_models.other_weights, prompt_tokens)
    assert np.isfinite(logits).all()
    assert max_abs_diff(logits, base_logits) > 1.0


def test_q8_0_logits_differ_but_stay_close(
    tiny_models: TinyModels, prompt_tokens: list[int], base_logits: Logits
) -> None:
    logits = model_logits(tiny_models.q8_0, prompt_tokens)
    assert max_abs_diff(logits, base_logits) > 1e-3
    assert np.corrcoef(logits, base_logits)[0, 1] > 0.99


@pytest.mark.parametrize(
    ("flash_attn", "type_k", "type_v"),
    [
        (FA_ON, F16, F16),
        (FA_OFF, Q8_0, F16),
        (FA_ON, Q8_0, F16),
        (FA_ON, F16, Q8_0),
        (FA_ON, Q8_0, Q8_0),
    ],
    ids=["fa-f16", "no-fa-k-q8_0", "fa-k-q8_0", "fa-v-q8_0", "fa-kv-q8_0"],
)
def test_attention_variants_match_reference(
    tiny_models: TinyModels,
    prompt_tokens: list[int],
    base_logits: Logits,
    flash_attn: int,
    type_k: int,
    type_v: int,
) -> None:
    """The reference ``base_logits`` come from an F16 KV cache without flash attention."""
    options = {"flash_attn": flash_attn, "type_k": type_k, "type_v": type_v}
    logits = model_logits(tiny_models.base, prompt_tokens, **options)
    assert np.isfinite(logits).all()
    tolerance = 0.05 if type_k == type_v == F16 else 0.5
    assert max_abs_diff(logits, base_logits) < tolerance


@pytest.mark.parametrize("variant", ["base", "q8_0"])
def test_lora_changes_logits_and_scale_matters(
    tiny_models: TinyModels, prompt_tokens: list[int], variant: str
) -> None:
    with open_model(getattr(tiny_models, variant)) as model:
        adapter = llama_cpp.llama_adapter_lora_init(model, os.fsencode(tiny_models.lora))
        assert adapter, "llama.cpp rejected the LoRA adapter"
        try:
            with open_context(model) as context:
                logits = {
                    scale: _logits_with_lora(context, adapter, scale, prompt_tokens)
                    for scale in (None, 0.5, 1.0)
                }
                unadapted = _logits_with_lora(context, adapter, None, prompt_tokens)
        finally:
            llama_cpp.llama_adapter_lora_free(adapter)
    assert max_abs_diff(logits[1.0], logits[None]) > 1e-2
    assert max_abs_diff(logits[0.5], logits[None]) > 1e-2
    assert max_abs_diff(logits[1.0], logits[0.5]) > 1e-2
    np.testing.assert_allclose(unadapted, logits[None], atol=1e-5)


def _logits_with_lora(
    context: llama_cpp.llama_context_p,
    adapter: llama_cpp.llama_adapter_lora_p,
    scale: float | None,
    tokens: Sequence[int],
) -> Logits:
    """Apply ``adapter`` at ``scale`` (``None``: no adapter) and decode ``tokens``."""
    if scale is None:
        status = llama_cpp.llama_set_adapters_lora(context, None, 0, None)
    else:
        # The binding annotates adapters as c_void_p; they really are POINTER(c_void_p).
        adapters = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(cast(Any, adapter))
        scales = (ctypes.c_float * 1)(scale)
        status = llama_cpp.llama_set_adapters_lora(context, adapters, 1, scales)
    assert status == 0
    return final_logits(context, tokens)
