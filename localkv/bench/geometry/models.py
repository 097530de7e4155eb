"""Random-weight GGUFs with a real model's cache geometry on a narrow residual stream.

``build(geometry, dst, tokenizer_source)`` writes a model whose per-sequence
memory (``shapes.Geometry``: layers, KV heads and their size, sliding window,
recurrent state) is the real model's, byte for byte with llama.cpp's default
f16 cache, while the residual stream is ``N_EMBD`` wide, the FFN tiny and
there are as many query heads as KV heads: none of those changes a byte of
the cache, and they keep a 48-layer model small (tens of MB) and fast. The
tokenizer is a real model's (``tokenizer``). Matrices are F16, norms and
recurrent parameters F32. Tensor names and shapes follow llama.cpp's loader
(numpy shapes are the reverse of ggml's ``ne``).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt

from localkv.bench.geometry.shapes import Geometry, Ssm
from localkv.bench.geometry.tokenizer import read_tokenizer

__all__ = ["N_EMBD", "build"]

N_EMBD = 64
N_FF = 64
RMS_EPS = 1e-5
CONTEXT = 32768


class _Weights:
    def __init__(self, seed: int, n_embd: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.n_embd = n_embd
        self.tensors: dict[str, npt.NDArray[np.float32] | npt.NDArray[np.float16]] = {}

    def linear(self, name: str, n_out: int, n_in: int) -> None:
        w = self.rng.standard_normal((n_out, n_in), dtype=np.float32) / np.float32(np.sqrt(n_in))
        self.tensors[name] = w.astype(np.float16)

    def ones(self, name: str, *shape: int) -> None:
        self.tensors[name] = np.ones(shape, dtype=np.float32)

    def small(self, name: str, *shape: int, scale: float = 0.1) -> None:
        self.tensors[name] = self.rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)

    def attention(self, p: str, g: Geometry, norms: bool) -> None:
        width = g.n_head_kv * g.head_dim  # as many query heads as KV heads
        self.linear(p + "attn_q.weight", width, self.n_embd)
        self.linear(p + "attn_k.weight", width, self.n_embd)
        self.linear(p + "attn_v.weight", width, self.n_embd)
        self.linear(p + "attn_output.weight", self.n_embd, width)
        if norms:
            self.ones(p + "attn_q_norm.weight", g.head_dim)
            self.ones(p + "attn_k_norm.weight", g.head_dim)

    def ffn(self, p: str) -> None:
        self.linear(p + "ffn_gate.weight", N_FF, self.n_embd)
        self.linear(p + "ffn_up.weight", N_FF, self.n_embd)
        self.linear(p + "ffn_down.weight", self.n_embd, N_FF)

    def mamba2(self, p: str, s: Ssm) -> None:
        self.linear(
            p + "ssm_in.weight", 2 * s.d_inner + 2 * s.n_group * s.d_state + s.n_head, self.n_embd
        )
        self.small(p + "ssm_conv1d.weight", s.conv_dim, s.d_conv, scale=0.5)
        self.small(p + "ssm_conv1d.bias", s.conv_dim)
        self.small(p + "ssm_dt.bias", s.n_head)
        self.tensors[p + "ssm_a"] = -self.rng.uniform(0.5, 2.0, (s.n_head, 1)).astype(np.float32)
        self.tensors[p + "ssm_d"] = np.ones((s.n_head, 1), dtype=np.float32)
        self.ones(p + "ssm_norm.weight", s.n_group, s.d_inner // s.n_group)
        self.linear(p + "ssm_out.weight", self.n_embd, s.d_inner)


def _attention_keys(w: gguf.GGUFWriter, g: Geometry) -> None:
    w.add_head_count(g.n_head_kv)
    w.add_key_length(g.head_dim)
    w.add_value_length(g.head_dim)
    w.add_layer_norm_rms_eps(RMS_EPS)


def _llama(w: gguf.GGUFWriter, t: _Weights, g: Geometry) -> None:
    _attention_keys(w, g)
    w.add_head_count_kv(g.n_head_kv)
    w.add_feed_forward_length(N_FF)
    w.add_rope_dimension_count(g.head_dim)
    w.add_rope_freq_base(500000.0)
    for i in range(g.n_layer):
        p = f"blk.{i}."
        t.ones(p + "attn_norm.weight", t.n_embd)
        t.ones(p + "ffn_norm.weight", t.n_embd)
        t.attention(p, g, norms=False)
        t.ffn(p)


def _gemma3(w: gguf.GGUFWriter, t: _Weights, g: Geometry) -> None:
    _attention_keys(w, g)
    w.add_head_count_kv(g.n_head_kv)
    w.add_feed_forward_length(N_FF)
    w.add_rope_freq_base(1000000.0)
    w.add_sliding_window(g.window)  # llama.cpp's gemma3: five sliding layers, then a full one
    for i in range(g.n_layer):
        p = f"blk.{i}."
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            t.ones(p + norm + ".weight", t.n_embd)
        t.attention(p, g, norms=True)
        t.ffn(p)


def _nemotron_h(w: gguf.GGUFWriter, t: _Weights, g: Geometry) -> None:
    s = g.ssm
    if s is None:
        raise ValueError(f"{g.name}: a hybrid needs its recurrent shape")
    # a layer is recurrent where both its n_head_kv and its n_ff are 0
    _attention_keys(w, g)
    w.add_head_count_kv([g.n_head_kv if k == "full" else 0 for k in g.kinds])
    w.add_feed_forward_length([0] * g.n_layer)
    w.add_layer_norm_eps(RMS_EPS)
    w.add_ssm_conv_kernel(s.d_conv)
    w.add_ssm_inner_size(s.d_inner)
    w.add_ssm_state_size(s.d_state)
    w.add_ssm_time_step_rank(s.n_head)
    w.add_ssm_group_count(s.n_group)
    for i, kind in enumerate(g.kinds):
        p = f"blk.{i}."
        t.ones(p + "attn_norm.weight", t.n_embd)
        if kind == "ssm":
            t.mamba2(p, s)
        else:
            t.attention(p, g, norms=False)


_BUILDERS = {"llama": _llama, "gemma3": _gemma3, "nemotron_h": _nemotron_h}


def build(
    g: Geometry, dst: Path, tokenizer_source: Path, *, seed: int = 0, n_embd: int = N_EMBD
) -> Path:
    """Write ``g`` as a random-weight GGUF at ``dst`` with ``tokenizer_source``'s tokenizer."""
    if g.arch not in _BUILDERS:
        raise ValueError(f"{g.name}: no writer for architecture {g.arch!r}")
    tokenizer = read_tokenizer(tokenizer_source)
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"].value)
    dst.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(dst, g.arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(f"localkv-geometry-{g.name}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_vocab_size(n_vocab)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(g.n_layer)
    weights = _Weights(seed, n_embd)
    embd = weights.rng.standard_normal((n_vocab, n_embd), dtype=np.float32) * np.float32(0.5)
    weights.tensors["token_embd.weight"] = embd.astype(np.float16)
    _BUILDERS[g.arch](writer, weights, g)
    weights.ones("output_norm.weight", n_embd)
    for key, value in tokenizer.items():
        writer.add_key_value(key, value.value, value.type, sub_type=value.sub_type)
    for name, array in weights.tensors.items():
        writer.add_tensor(name, array)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return dst
