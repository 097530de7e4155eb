"""Tiny random llama-architecture GGUF models for fast tests.

The models borrow the real tokenizer (every ``tokenizer.*`` key) of an existing GGUF, so
tokenization matches that model exactly, but carry a few small random F32 weights. They
build in well under a second, load in milliseconds and decode quickly on a CPU, yet behave
like a real llama model: the logits depend on the whole context, another seed gives other
weights of the same shapes, the weights quantize to Q8_0, and a LoRA adapter built for them
changes the logits in proportion to its scale.

The default head size is 64. A quantized (Q8_0) KV cache needs a head size that is a
multiple of the Q8_0 block size (32), and 64 is supported by every flash-attention backend.

GGUF headers are parsed here rather than with ``gguf.GGUFReader``, which takes seconds to
decode a 49k-token vocabulary; the tests check the result against GGUFReader.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import llama_cpp
import numpy as np
import numpy.typing as npt

from localkv.model.session import SessionConfig

ARCHITECTURE = "llama"
TOKENIZER_KEY_PREFIX = "tokenizer."
LORA_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output")
RMS_NORM_EPS = 1e-5
EMBEDDING_SCALE = 0.5

Weights = dict[str, npt.NDArray[np.float32]]


@dataclass(frozen=True)
class TinyModels:
    """Paths of a family of tiny models that share a tokenizer and tensor shapes."""

    base: Path
    other_weights: Path
    q8_0: Path
    lora: Path


def build_tiny_models(directory: Path, tokenizer_source: Path) -> TinyModels:
    """Build the base model, a differently seeded twin, its Q8_0 quantization and a LoRA."""
    directory.mkdir(parents=True, exist_ok=True)
    base = build_tiny_llama(directory / "tiny-base.gguf", tokenizer_source, seed=0)
    other = build_tiny_llama(directory / "tiny-other-weights.gguf", tokenizer_source, seed=1)
    return TinyModels(
        base=base,
        other_weights=other,
        q8_0=quantize_q8_0(base, directory / "tiny-base-q8_0.gguf"),
        lora=build_lora(base, directory / "tiny-lora.gguf"),
    )


@dataclass(frozen=True)
class _Shape:
    n_vocab: int
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def build_tiny_llama(  # noqa: PLR0913 - to take a value type
    dst: Path,
    tokenizer_source: Path,
    *,
    seed: int = 0,
    n_layer: int = 2,
    n_embd: int = 128,
    n_head: int = 2,
    n_head_kv: int = 1,
    n_ff: int = 256,
    context_length: int = 4096,
    rope_freq_base: float = 10000.0,
    name: str = "localkv-tiny",
) -> Path:
    """Write an F32 llama GGUF with random weights and the tokenizer of ``tokenizer_source``.

    The same arguments always give the same file; ``seed`` alone changes the weights. Keep
    ``n_embd`` and ``n_ff`` multiples of 32 so that the model quantizes to Q8_0, and the head
    size ``n_embd // n_head`` a multiple of 32 so that it can use a Q8_0 KV cache.
    """
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must be divisible by n_head, and n_head by n_head_kv")
    tokenizer = {
        key: value
        for key, value in _read_header(tokenizer_source).metadata.items()
        if key.startswith(TOKENIZER_KEY_PREFIX)
    }
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"].value)
    shape = _Shape(n_vocab, n_layer, n_embd, n_head, n_head_kv, n_ff)
    writer = gguf.GGUFWriter(dst, ARCHITECTURE)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_hyperparameters(writer, shape, context_length, rope_freq_base)
    for key, value in tokenizer.items():
        writer.add_key_value(key, value.value, value.type, sub_type=value.sub_type)
    for tensor_name, array in _random_weights(shape, np.random.default_rng(seed)).items():
        writer.add_tensor(tensor_name, array)
    _write(writer)
    return dst


def _add_hyperparameters(
    writer: gguf.GGUFWriter, shape: _Shape, context_length: int, rope_freq_base: float
) -> None:
    writer.add_vocab_size(shape.n_vocab)
    writer.add_context_length(context_length)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(rope_freq_base)
    writer.add_layer_norm_rms_eps(RMS_NORM_EPS)


def _random_weights(shape: _Shape, rng: np.random.Generator) -> Weights:
    """Random weights in numpy order (``[n_out, n_in]``, the reverse of ggml's ``ne``).

    Linear layers are scaled by ``1/sqrt(n_in)`` so that activations stay near unit size and
    the attention scores are spread out enough for every earlier token to matter. The output
    projection is tied to ``token_embd``, as in SmolLM2.
    """

    def linear(n_out: int, n_in: int) -> npt.NDArray[np.float32]:
        return rng.standard_normal((n_out, n_in), dtype=np.float32) / np.float32(np.sqrt(n_in))

    def ones() -> npt.NDArray[np.float32]:
        return np.ones(shape.n_embd, dtype=np.float32)

    n_q = shape.n_head * shape.head_dim
    n_kv = shape.n_head_kv * shape.head_dim
    embeddings = rng.standard_normal((shape.n_vocab, shape.n_embd), dtype=np.float32)
    weights: Weights = {"token_embd.weight": embeddings * np.float32(EMBEDDING_SCALE)}
    for layer in range(shape.n_layer):
        prefix = f"blk.{layer}."
        weights[prefix + "attn_norm.weight"] = ones()
        weights[prefix + "attn_q.weight"] = linear(n_q, shape.n_embd)
        weights[prefix + "attn_k.weight"] = linear(n_kv, shape.n_embd)
        weights[prefix + "attn_v.weight"] = linear(n_kv, shape.n_embd)
        weights[prefix + "attn_output.weight"] = linear(shape.n_embd, n_q)
        weights[prefix + "ffn_norm.weight"] = ones()
        weights[prefix + "ffn_gate.weight"] = linear(shape.n_ff, shape.n_embd)
        weights[prefix + "ffn_up.weight"] = linear(shape.n_ff, shape.n_embd)
        weights[prefix + "ffn_down.weight"] = linear(shape.n_embd, shape.n_ff)
    weights["output_norm.weight"] = ones()
    return weights


def _write(writer: gguf.GGUFWriter) -> None:
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def quantize_q8_0(src: Path, dst: Path) -> Path:
    """Quantize ``src`` to Q8_0 with llama.cpp's own quantizer (1-d norms stay F32)."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    params.nthread = min(4, os.cpu_count() or 1)
    status = llama_cpp.llama_model_quantize(
        os.fsencode(src), os.fsencode(dst), ctypes.byref(params)
    )
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}) failed with status {status}")
    return dst


def build_lora(
    base: Path,
    dst: Path,
    *,
    seed: int = 1,
    rank: int = 4,
    alpha: float = 8.0,
) -> Path:
    """Write a random F32 LoRA adapter for the attention projections of the model ``base``.

    For a base weight of ggml shape ``[n_in, n_out]`` llama.cpp expects ``<name>.lora_a`` of
    ggml shape ``[n_in, rank]`` and ``<name>.lora_b`` of ``[rank, n_out]`` (numpy shapes are
    the reverse), and adds ``scale * alpha / rank * B @ A`` to the weight.
    """
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(dst, ARCHITECTURE)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for tensor_name, (n_in, n_out) in _lora_targets(base):
        lora_a = rng.standard_normal((rank, n_in), dtype=np.float32) / np.float32(np.sqrt(n_in))
        lora_b = rng.standard_normal((n_out, rank), dtype=np.float32) / np.float32(rank)
        writer.add_tensor(f"{tensor_name}.lora_a", lora_a)
        writer.add_tensor(f"{tensor_name}.lora_b", lora_b)
    _write(writer)
    return dst


def _lora_targets(base: Path) -> Iterator[tuple[str, tuple[int, int]]]:
    """Yield ``(name, (n_in, n_out))`` of every base tensor that the adapter adapts."""
    header = _read_header(base)
    architecture = header.metadata["general.architecture"].value
    if architecture != ARCHITECTURE.encode():
        raise ValueError(f"{base} is a {architecture!r} model, not {ARCHITECTURE!r}")
    for name, shape in header.tensor_shapes.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in LORA_TARGETS:
            n_in, n_out = shape
            yield name, (n_in, n_out)


@dataclass(frozen=True)
class _Header:
    """Metadata (strings left as raw bytes) and tensor shapes (ggml ``ne``) of a GGUF."""

    metadata: dict[str, gguf.GGUFValue]
    tensor_shapes: dict[str, tuple[int, ...]]


_SCALAR_FORMATS = {
    gguf.GGUFValueType.UINT8: "B",
    gguf.GGUFValueType.INT8: "b",
    gguf.GGUFValueType.BOOL: "?",
    gguf.GGUFValueType.UINT16: "H",
    gguf.GGUFValueType.INT16: "h",
    gguf.GGUFValueType.UINT32: "I",
    gguf.GGUFValueType.INT32: "i",
    gguf.GGUFValueType.FLOAT32: "f",
    gguf.GGUFValueType.UINT64: "Q",
    gguf.GGUFValueType.INT64: "q",
    gguf.GGUFValueType.FLOAT64: "d",
}


def _read_header(path: Path) -> _Header:
    """Parse the header of a little-endian GGUF v2/v3 file."""
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", data, 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path} is not a little-endian GGUF v2/v3 file")
        offset = 24
        metadata: dict[str, gguf.GGUFValue] = {}
        for _ in range(n_kv):
            key, offset = _read_value(data, offset, gguf.GGUFValueType.STRING)
            metadata[key.decode()], offset = _read_typed_value(data, offset)
        tensor_shapes: dict[str, tuple[int, ...]] = {}
        for _ in range(n_tensors):
            name, offset = _read_value(data, offset, gguf.GGUFValueType.STRING)
            (n_dims,) = struct.unpack_from("<I", data, offset)
            tensor_shapes[name.decode()] = struct.unpack_from(f"<{n_dims}Q", data, offset + 4)
            offset += 4 + 8 * n_dims + 4 + 8  # the dims, then the ggml type and data offset
    return _Header(metadata, tensor_shapes)


def _read_typed_value(data: Any, offset: int) -> tuple[gguf.GGUFValue, int]:
    """Decode a metadata value that is preceded by its type; return it and its end."""
    value_type = gguf.GGUFValueType(struct.unpack_from("<I", data, offset)[0])
    sub_type = None
    if value_type == gguf.GGUFValueType.ARRAY:
        sub_type = gguf.GGUFValueType(struct.unpack_from("<I", data, offset + 4)[0])
    value, end = _read_value(data, offset + 4, value_type)
    return gguf.GGUFValue(value, value_type, sub_type), end


def _read_value(data: Any, offset: int, value_type: int) -> tuple[Any, int]:
    """Decode the metadata value of ``value_type`` at ``offset``; return it and its end."""
    if value_type == gguf.GGUFValueType.STRING:
        (length,) = struct.unpack_from("<Q", data, offset)
        return data[offset + 8 : offset + 8 + length], offset + 8 + length
    if value_type == gguf.GGUFValueType.ARRAY:
        item_type, count = struct.unpack_from("<IQ", data, offset)
        offset += 12
        if item_type in _SCALAR_FORMATS:
            layout = struct.Struct(f"<{count}{_SCALAR_FORMATS[gguf.GGUFValueType(item_type)]}")
            return list(layout.unpack_from(data, offset)), offset + layout.size
        items = []
        for _ in range(count):
            item, offset = _read_value(data, offset, item_type)
            items.append(item)
        return items, offset
    layout = struct.Struct("<" + _SCALAR_FORMATS[gguf.GGUFValueType(value_type)])
    return layout.unpack_from(data, offset)[0], offset + layout.size


def build_tiny_with_template(directory: Path, source: Path, template: str | None) -> Path:
    """A tiny model whose GGUF carries ``template`` as ``tokenizer.chat_template`` (None:
    no chat template at all), with the tokenizer of ``source``."""
    directory.mkdir(parents=True, exist_ok=True)
    keys = _read_header(source).metadata
    tokenizer = directory / "tokenizer.gguf"
    writer = gguf.GGUFWriter(tokenizer, "llama")
    for key, value in keys.items():
        if key.startswith("tokenizer.") and key != "tokenizer.chat_template":
            writer.add_key_value(key, value.value, value.type, sub_type=value.sub_type)
    if template is not None:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return build_tiny_llama(directory / "tiny.gguf", tokenizer)


def tiny_config(path: Path, **overrides: object) -> SessionConfig:
    """A session config for the tiny models: one thread (the CI machine has two, shared)."""
    options: dict[str, object] = {"n_ctx": 2048, "n_threads": 1}
    options.update(overrides)
    return SessionConfig(model_path=path, **options)  # type: ignore[arg-type]
