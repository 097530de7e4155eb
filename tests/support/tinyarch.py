"""Tiny random GGUFs of the architectures whose memory is not a plain KV cache.

- ``gemma3``: interleaved sliding-window attention (iSWA): five SWA layers then
  one full-attention layer, window ``SWA_WINDOW``;
- ``lfm2``: a hybrid of short-convolution (recurrent) layers and attention layers;
- ``nemotron_h``: a hybrid of Mamba2 layers, attention layers and MLP layers
  (a Mamba2-style hybrid, the second hybrid kind beside ``lfm2``);
- ``mamba2``: pure recurrent (Mamba2 layers only);
- ``qwen35``: Qwen3.5's hybrid of gated delta-net (linear attention) layers
  and gated full-attention layers with interleaved M-RoPE, whose KV cells
  carry llama.cpp's cell extension (2D position and token);
- ``lfm2`` with sliding-window attention layers (``lfm2-swa.gguf``): a hybrid
  whose memory localkv refuses to cache (``TinyArchModels.refused``).

Like ``tinymodels``, they borrow the default model's tokenizer, carry small
random F32 weights and build in well under a second. Tensor names and shapes
follow llama.cpp's loader (``llama-model.cpp``); numpy shapes are the reverse
of ggml's ``ne``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt

from support.tinymodels import TOKENIZER_KEY_PREFIX, _read_header, _write

SWA_WINDOW = 64  # small, so a 2,000-token document slides it many times
RMS_EPS = 1e-5
N_EMBD = 64
HEAD_DIM = 32
D_STATE = 16
D_CONV = 4

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class TinyArchModels:
    """One tiny model per memory kind, a second gemma3 with other weights, and a hybrid
    with sliding-window layers that the cache refuses."""

    gemma3: Path
    gemma3_other: Path
    lfm2: Path
    nemotron_h: Path
    mamba2: Path
    qwen35: Path
    lfm2_swa: Path

    def all(self) -> dict[str, Path]:
        return {
            "gemma3": self.gemma3,
            "lfm2": self.lfm2,
            "nemotron_h": self.nemotron_h,
            "mamba2": self.mamba2,
            "qwen35": self.qwen35,
        }

    def refused(self) -> dict[str, Path]:
        """The models whose memory the prefix cache does not hold."""
        return {"lfm2_swa": self.lfm2_swa}


def build_tiny_arch_models(directory: Path, tokenizer_source: Path) -> TinyArchModels:
    directory.mkdir(parents=True, exist_ok=True)
    return TinyArchModels(
        gemma3=build(directory / "tiny-gemma3.gguf", "gemma3", tokenizer_source),
        gemma3_other=build(directory / "tiny-gemma3-b.gguf", "gemma3", tokenizer_source, seed=1),
        lfm2=build(directory / "tiny-lfm2.gguf", "lfm2", tokenizer_source),
        nemotron_h=build(directory / "tiny-nemotron-h.gguf", "nemotron_h", tokenizer_source),
        mamba2=build(directory / "tiny-mamba2.gguf", "mamba2", tokenizer_source),
        qwen35=build(directory / "tiny-qwen35.gguf", "qwen35", tokenizer_source),
        lfm2_swa=build(directory / "tiny-lfm2-swa.gguf", "lfm2_swa", tokenizer_source),
    )


class _Weights:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.tensors: dict[str, F32] = {}

    def linear(self, name: str, n_out: int, n_in: int) -> None:
        w = self.rng.standard_normal((n_out, n_in), dtype=np.float32) / np.float32(np.sqrt(n_in))
        self.tensors[name] = w

    def ones(self, name: str, *shape: int) -> None:
        self.tensors[name] = np.ones(shape, dtype=np.float32)

    def small(self, name: str, *shape: int, scale: float = 0.1) -> None:
        self.tensors[name] = self.rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)

    def attention(self, p: str, n_head: int, n_head_kv: int, norms: bool) -> None:
        self.linear(p + "attn_q.weight", n_head * HEAD_DIM, N_EMBD)
        self.linear(p + "attn_k.weight", n_head_kv * HEAD_DIM, N_EMBD)
        self.linear(p + "attn_v.weight", n_head_kv * HEAD_DIM, N_EMBD)
        self.linear(p + "attn_output.weight", N_EMBD, n_head * HEAD_DIM)
        if norms:
            self.ones(p + "attn_q_norm.weight", HEAD_DIM)
            self.ones(p + "attn_k_norm.weight", HEAD_DIM)

    def gated_ffn(self, p: str, n_ff: int) -> None:
        self.linear(p + "ffn_gate.weight", n_ff, N_EMBD)
        self.linear(p + "ffn_up.weight", n_ff, N_EMBD)
        self.linear(p + "ffn_down.weight", N_EMBD, n_ff)

    def mamba2(self, p: str, d_inner: int, n_head: int) -> None:
        conv_dim = d_inner + 2 * D_STATE
        self.linear(p + "ssm_in.weight", 2 * d_inner + 2 * D_STATE + n_head, N_EMBD)
        self.small(p + "ssm_conv1d.weight", conv_dim, D_CONV, scale=0.5)
        self.small(p + "ssm_conv1d.bias", conv_dim)
        self.small(p + "ssm_dt.bias", n_head)
        self.tensors[p + "ssm_a"] = -self.rng.uniform(0.5, 2.0, (n_head, 1)).astype(np.float32)
        self.tensors[p + "ssm_d"] = np.ones((n_head, 1), dtype=np.float32)
        self.ones(p + "ssm_norm.weight", 1, d_inner)
        self.linear(p + "ssm_out.weight", N_EMBD, d_inner)


def _gemma3(w: gguf.GGUFWriter, t: _Weights) -> None:
    n_layer, n_ff = 6, 128
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_rope_freq_base(10000.0)
    for i in range(n_layer):
        p = f"blk.{i}."
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            t.ones(p + norm + ".weight", N_EMBD)
        t.attention(p, 2, 1, norms=True)
        t.gated_ffn(p, n_ff)
    t.ones("output_norm.weight", N_EMBD)


def _lfm2(w: gguf.GGUFWriter, t: _Weights) -> None:
    kinds = ["conv", "conv", "attn", "conv", "attn", "conv"]
    n_ff = 128
    w.add_block_count(len(kinds))
    w.add_feed_forward_length(n_ff)
    w.add_head_count(2)
    w.add_head_count_kv([1 if k == "attn" else 0 for k in kinds])
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_rope_freq_base(10000.0)
    w.add_uint32("lfm2.shortconv.l_cache", 3)
    for i, kind in enumerate(kinds):
        p = f"blk.{i}."
        t.ones(p + "attn_norm.weight", N_EMBD)
        t.ones(p + "ffn_norm.weight", N_EMBD)
        t.gated_ffn(p, n_ff)
        if kind == "attn":
            t.attention(p, 2, 1, norms=True)
        else:
            t.small(p + "shortconv.conv.weight", N_EMBD, 3, scale=0.5)
            t.linear(p + "shortconv.in_proj.weight", 3 * N_EMBD, N_EMBD)
            t.linear(p + "shortconv.out_proj.weight", N_EMBD, N_EMBD)
    t.ones("token_embd_norm.weight", N_EMBD)


def _ssm_keys(w: gguf.GGUFWriter, d_inner: int, n_head: int, n_group: int = 1) -> None:
    w.add_ssm_conv_kernel(D_CONV)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(D_STATE)
    w.add_ssm_time_step_rank(n_head)
    w.add_ssm_group_count(n_group)


def _mamba2(w: gguf.GGUFWriter, t: _Weights) -> None:
    n_layer, d_inner = 3, 2 * N_EMBD
    n_head = d_inner // 16
    w.add_block_count(n_layer)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_layer_norm_rms_eps(RMS_EPS)
    _ssm_keys(w, d_inner, n_head)
    for i in range(n_layer):
        p = f"blk.{i}."
        t.ones(p + "attn_norm.weight", N_EMBD)
        t.mamba2(p, d_inner, n_head)
    t.ones("output_norm.weight", N_EMBD)


def _nemotron_h(w: gguf.GGUFWriter, t: _Weights) -> None:
    kinds = ["ssm", "mlp", "attn", "ssm", "mlp", "ssm"]
    d_inner, n_ff = 2 * N_EMBD, 128
    n_head = d_inner // 16
    w.add_block_count(len(kinds))
    # llama.cpp takes a layer as recurrent iff its n_head_kv and n_ff are both 0.
    # head_count stays one number for all layers: llama.cpp reads key_length
    # only if layer 0's n_head is > 0, so a per-layer list starting with an SSM
    # layer's 0 gives a head size of 0 and a 0-wide attn_q.
    w.add_feed_forward_length([n_ff if k == "mlp" else 0 for k in kinds])
    w.add_head_count(2)
    w.add_head_count_kv([1 if k == "attn" else 0 for k in kinds])
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_layer_norm_eps(RMS_EPS)
    _ssm_keys(w, d_inner, n_head)
    for i, kind in enumerate(kinds):
        p = f"blk.{i}."
        t.ones(p + "attn_norm.weight", N_EMBD)
        if kind == "ssm":
            t.mamba2(p, d_inner, n_head)
        elif kind == "attn":
            t.attention(p, 2, 1, norms=False)
        else:
            t.linear(p + "ffn_up.weight", n_ff, N_EMBD)
            t.linear(p + "ffn_down.weight", N_EMBD, n_ff)
    t.ones("output_norm.weight", N_EMBD)


def _delta_net(t: _Weights, p: str, n_k_heads: int, n_v_heads: int) -> None:
    """A gated delta-net layer (llama.cpp ``llama_model_qwen35``; head size ``D_STATE``)."""
    key_dim, value_dim = D_STATE * n_k_heads, D_STATE * n_v_heads
    conv_dim = 2 * key_dim + value_dim
    t.linear(p + "attn_qkv.weight", conv_dim, N_EMBD)
    t.linear(p + "attn_gate.weight", value_dim, N_EMBD)
    t.small(p + "ssm_conv1d.weight", conv_dim, D_CONV, scale=0.5)
    t.small(p + "ssm_dt.bias", n_v_heads)
    t.tensors[p + "ssm_a"] = -t.rng.uniform(0.5, 2.0, n_v_heads).astype(np.float32)
    t.linear(p + "ssm_beta.weight", n_v_heads, N_EMBD)
    t.linear(p + "ssm_alpha.weight", n_v_heads, N_EMBD)
    t.ones(p + "ssm_norm.weight", D_STATE)
    t.linear(p + "ssm_out.weight", N_EMBD, value_dim)


def _qwen35(w: gguf.GGUFWriter, t: _Weights) -> None:
    n_layer, n_ff, n_k_heads, n_v_heads = 4, 128, 2, 4
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HEAD_DIM)
    # M-RoPE sections (temporal, height, width, extra) over HEAD_DIM / 2 rotary pairs
    w.add_rope_dimension_sections([6, 5, 5, 0])
    w.add_uint32("qwen35.full_attention_interval", 2)  # layers 1 and 3 attend
    _ssm_keys(w, D_STATE * n_v_heads, n_v_heads, n_k_heads)
    for i in range(n_layer):
        p = f"blk.{i}."
        t.ones(p + "attn_norm.weight", N_EMBD)
        t.ones(p + "post_attention_norm.weight", N_EMBD)
        t.gated_ffn(p, n_ff)
        if (i + 1) % 2:
            _delta_net(t, p, n_k_heads, n_v_heads)
            continue
        t.linear(p + "attn_q.weight", 2 * 2 * HEAD_DIM, N_EMBD)  # queries and their gates
        t.linear(p + "attn_k.weight", HEAD_DIM, N_EMBD)
        t.linear(p + "attn_v.weight", HEAD_DIM, N_EMBD)
        t.linear(p + "attn_output.weight", N_EMBD, 2 * HEAD_DIM)
        t.ones(p + "attn_q_norm.weight", HEAD_DIM)
        t.ones(p + "attn_k_norm.weight", HEAD_DIM)
    t.ones("output_norm.weight", N_EMBD)


def _lfm2_swa(w: gguf.GGUFWriter, t: _Weights) -> None:
    _lfm2(w, t)
    w.add_sliding_window(SWA_WINDOW)  # its attention layers slide: llama.cpp's hybrid iSWA


_BUILDERS: dict[str, Callable[[gguf.GGUFWriter, _Weights], None]] = {
    "gemma3": _gemma3,
    "lfm2": _lfm2,
    "mamba2": _mamba2,
    "nemotron_h": _nemotron_h,
    "qwen35": _qwen35,
    "lfm2_swa": _lfm2_swa,
}
_ARCHITECTURES = {"lfm2_swa": "lfm2"}  # builders of a variant: the GGUF's architecture


def build(
    dst: Path, arch: str, tokenizer_source: Path, *, seed: int = 0, window: int = SWA_WINDOW
) -> Path:
    """Write a tiny F32 ``arch`` GGUF with random weights and the source's tokenizer
    (``window``: the sliding window of an SWA architecture)."""
    tokenizer = {
        key: value
        for key, value in _read_header(tokenizer_source).metadata.items()
        if key.startswith(TOKENIZER_KEY_PREFIX)
    }
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"].value)
    writer = gguf.GGUFWriter(dst, _ARCHITECTURES.get(arch, arch))
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(f"localkv-tiny-{arch}")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(n_vocab)
    writer.add_context_length(8192)
    writer.add_embedding_length(N_EMBD)
    weights = _Weights(seed)
    embd = weights.rng.standard_normal((n_vocab, N_EMBD), dtype=np.float32)
    weights.tensors["token_embd.weight"] = embd * np.float32(0.5)
    _BUILDERS[arch](writer, weights)
    if arch == "gemma3":
        writer.add_sliding_window(window)
    for key, value in tokenizer.items():
        writer.add_key_value(key, value.value, value.type, sub_type=value.sub_type)
    for name, array in weights.tensors.items():
        writer.add_tensor(name, array)
    _write(writer)
    return dst
