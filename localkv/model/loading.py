"""Loading a model and creating its llama.cpp context, owned by the caller's ``ExitStack``.

``open_native`` checks the configuration llama.cpp would not check itself
(quantized KV types on the model's head size), loads the model, creates the
context and the batch, attaches LoRA adapters, and registers every handle's
free on the stack, so the session that owns the stack frees each once.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localkv.model.config import FLASH_ATTN_TYPES, LoraSpec, SessionConfig
from localkv.model.devices import Offload, offload_of, offloads
from localkv.model.native import (
    ggml_type_id,
    llama_cpp,
    recent_errors,
    sync_log_detail,
)
from localkv.model.threads import context_threads

__all__ = [
    "ModelLoadError",
    "Native",
    "flash_attn_setting",
    "open_native",
]

log = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """The model, a LoRA adapter or the context could not be created."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Native:
    """The native handles of one session and the sizes llama.cpp settled on."""

    model: Any
    vocab: Any
    n_vocab: int
    ctx: Any
    memory: Any
    n_ctx: int
    n_batch: int  # llama.cpp may lower the batch size (never above n_ctx): what it took
    batch: Any
    n_threads: int
    flash_attn: str  # the setting passed to llama.cpp (``flash_attn_setting``)
    offload: Offload  # the devices and the split of layers (``devices.offload_of``)
    n_seq_max: int = 1  # 2: a restore may load a state in pieces (``state.append_state``)


# ``auto`` on a CPU: flash attention off while its scratch stays this small.
AUTO_OFF_SCRATCH = 1 << 30
_UNQUANTIZED = ("f16", "f32", "bf16")


def flash_attn_setting(cfg: SessionConfig, model: Any) -> str:
    """The flash attention setting passed to llama.cpp for ``cfg`` on ``model``.

    ``on`` and ``off`` are passed as asked. ``auto`` on a CPU, with an unquantized V
    cache, is ``off`` while the scratch that attention without it needs (``n_ctx`` x
    ``n_batch`` x heads floats) stays within ``AUTO_OFF_SCRATCH``: llama.cpp's CPU
    flash attention is slower for every batch size and context length
    (``benchmarks/faces.py --flash-attn on`` against ``off``). Elsewhere --
    offloaded to a GPU, a quantized V, a larger scratch -- ``auto`` lets llama.cpp
    decide (where supported: on). With flash attention on, CPU logits depend on the
    thread count (``benchmarks/numerics.py``), so the identity records the thread
    count whenever it is on (see ``localkv.cache.identity``).
    """
    if cfg.flash_attn != "auto":
        return cfg.flash_attn
    if offloads(cfg.n_gpu_layers):
        return "auto"
    if cfg.type_v.lower() not in _UNQUANTIZED:
        return "auto"  # a quantized V needs flash attention
    return "off" if attention_scratch(cfg, model) <= AUTO_OFF_SCRATCH else "auto"


def attention_scratch(cfg: SessionConfig, model: Any) -> int:
    """Bytes of the K x Q product attention without flash attention keeps for a batch."""
    n_batch = min(cfg.n_batch, context_tokens(cfg.n_ctx))
    n_head = max(1, int(llama_cpp.llama_model_n_head(model)))
    return context_tokens(cfg.n_ctx) * n_batch * n_head * 4


def open_native(cfg: SessionConfig, stack: contextlib.ExitStack) -> Native:
    """Load ``cfg``'s model and create its context; frees go on ``stack``."""
    path = Path(cfg.model_path)
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = 2**31 - 1 if cfg.n_gpu_layers < 0 else cfg.n_gpu_layers
    sync_log_detail()  # llama.cpp's info lines, as the logging now set up wants them
    recent_errors()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise ModelLoadError(f"llama.cpp could not load {path}: {_load_reason()}")
    stack.callback(llama_cpp.llama_model_free, model)
    vocab = llama_cpp.llama_model_get_vocab(model)
    _check_kv_types(cfg, model)
    _check_kv_memory(cfg, model)
    threads = context_threads(cfg.n_threads)
    flash_attn = flash_attn_setting(cfg, model)
    n_seq = 2 if _plain_kv(model) else 1
    # no layer on a device: nothing computes there, large batches included
    offload = offload_of(
        cfg.n_gpu_layers,
        int(llama_cpp.llama_model_n_layer(model)),
        op_offload=cfg.n_gpu_layers != 0,
    )
    cparams = _context_params(cfg, threads, flash_attn, n_seq)
    cparams.op_offload = offload.op_offload
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        raise ModelLoadError(_context_failure(cfg))
    stack.callback(llama_cpp.llama_free, ctx)
    _attach_loras(cfg.loras, model, ctx, stack)
    n_ctx = int(llama_cpp.llama_n_ctx(ctx))
    _note_context(cfg.n_ctx, n_ctx, int(llama_cpp.llama_model_n_ctx_train(model)))
    n_batch = min(cfg.n_batch, int(llama_cpp.llama_n_batch(ctx)), n_ctx)
    batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
    stack.callback(llama_cpp.llama_batch_free, batch)
    return Native(
        model=model,
        vocab=vocab,
        n_vocab=int(llama_cpp.llama_vocab_n_tokens(vocab)),
        ctx=ctx,
        memory=llama_cpp.llama_get_memory(ctx),
        n_ctx=n_ctx,
        n_batch=n_batch,
        batch=batch,
        n_threads=threads,
        flash_attn=flash_attn,
        offload=offload,
        n_seq_max=n_seq,
    )


# A plain KV cache gets a second sequence in the same (unified) cells, through which
# a restore loads a state a piece at a time (``model.state.append_state``): never a
# second copy of the whole state. The same bits as with one sequence (tested).
def _plain_kv(model: Any) -> bool:
    if llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model):
        return False
    return int(llama_cpp.llama_model_n_swa(model)) == 0


def _context_params(cfg: SessionConfig, threads: int, flash_attn: str, n_seq: int) -> Any:
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = cfg.n_ctx
    cparams.n_batch = cfg.n_batch
    cparams.n_ubatch = cfg.n_batch
    cparams.n_seq_max = n_seq
    cparams.kv_unified = True  # one set of cells for all sequences, as with one
    cparams.n_threads = threads
    cparams.n_threads_batch = threads
    cparams.type_k = ggml_type_id(cfg.type_k)
    cparams.type_v = ggml_type_id(cfg.type_v)
    cparams.flash_attn_type = FLASH_ATTN_TYPES[flash_attn]
    cparams.rope_freq_base = cfg.rope_freq_base
    cparams.rope_freq_scale = cfg.rope_freq_scale
    cparams.no_perf = True
    return cparams


def _check_kv_types(cfg: SessionConfig, model: Any) -> None:
    # llama.cpp does not always check this itself: with flash attention off a
    # quantized K cache on a head size its block does not divide gives wrong
    # logits or aborts the process.
    head = int(llama_cpp.llama_model_n_embd(model)) // max(
        1, int(llama_cpp.llama_model_n_head(model))
    )
    for name, kind in (("type_k", cfg.type_k), ("type_v", cfg.type_v)):
        block = 32 if kind.startswith("q") else 1
        if head % block:
            raise ModelLoadError(
                f"{name}={kind} needs a head size divisible by {block}; this model's is {head}"
            )


# llama.cpp rounds the context up to a multiple of this many tokens (0.3.36:
# 16 and 256 give 256, 257 gives 512, 9000 gives 9216).
CONTEXT_STEP = 256

# Bytes per element of a KV cache type: quantized types pack 32 values.
_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
_TYPE_BYTES |= {"q4_1": 20 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32}


def context_tokens(n_ctx: int) -> int:
    """The context length llama.cpp creates for a request of ``n_ctx`` tokens."""
    return -(-n_ctx // CONTEXT_STEP) * CONTEXT_STEP


def kv_bytes_per_token(cfg: SessionConfig, model: Any) -> int:
    """About how many bytes of K and V one token takes over all layers."""
    head = int(llama_cpp.llama_model_n_embd(model)) // max(
        1, int(llama_cpp.llama_model_n_head(model))
    )
    width = head * int(llama_cpp.llama_model_n_head_kv(model))
    per_value = _TYPE_BYTES[cfg.type_k.lower()] + _TYPE_BYTES[cfg.type_v.lower()]
    return int(int(llama_cpp.llama_model_n_layer(model)) * width * per_value)


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _check_kv_memory(cfg: SessionConfig, model: Any) -> None:
    # llama.cpp reserves the whole KV cache up front; a context that cannot fit
    # in this machine's memory fails there with a message about buffers, or
    # succeeds on overcommit and is killed later. Say it in the user's terms.
    need = context_tokens(cfg.n_ctx) * kv_bytes_per_token(cfg, model)
    have = _physical_memory()
    if have is not None and need > have:
        raise ModelLoadError(
            f"a context of {cfg.n_ctx:,} tokens needs {need / 2**30:,.1f} GiB for its KV cache "
            f"(type_k={cfg.type_k}, type_v={cfg.type_v}); this machine has "
            f"{have / 2**30:,.1f} GiB of memory: lower --ctx"
        )


def _load_reason() -> str:
    """The first thing llama.cpp said went wrong while loading, in a few words."""
    for line in recent_errors():
        reason = re.sub(r"^(\w+: )+", "", line.strip())  # llama.cpp's function names
        if reason:
            return reason
    return "not a GGUF model llama.cpp can load"


def _context_failure(cfg: SessionConfig) -> str:
    text = (
        f"llama.cpp could not create a context of {cfg.n_ctx:,} tokens "
        f"(type_k={cfg.type_k}, type_v={cfg.type_v}, flash_attn={cfg.flash_attn})"
    )
    if cfg.type_v.lower() not in _UNQUANTIZED and cfg.flash_attn == "off":
        return text + ": a quantized type_v needs flash attention (--flash-attn on or auto)"
    return text + ": not enough memory for its buffers? lower --ctx"


def _note_context(asked: int, made: int, trained: int) -> None:
    if made != asked:
        log.warning(
            "context: llama.cpp rounded %d tokens up to %d (a multiple of %d)",
            asked,
            made,
            CONTEXT_STEP,
        )
    if trained > 0 and made > trained:
        log.warning(
            "context: %d tokens is longer than this model was trained for (%d); "
            "answers past %d tokens may degrade",
            made,
            trained,
            trained,
        )


def _attach_loras(
    loras: tuple[LoraSpec, ...], model: Any, ctx: Any, stack: contextlib.ExitStack
) -> None:
    if not loras:
        return
    handles = []
    for spec in loras:
        if not Path(spec.path).is_file():
            raise ModelLoadError(f"LoRA adapter not found: {spec.path}")
        adapter = llama_cpp.llama_adapter_lora_init(model, str(spec.path).encode())
        if not adapter:
            raise ModelLoadError(f"llama.cpp could not load LoRA adapter {spec.path}")
        stack.callback(llama_cpp.llama_adapter_lora_free, adapter)
        handles.append(adapter)
    arr = (llama_cpp.llama_adapter_lora_p_ctypes * len(handles))(*handles)
    scales = (ctypes.c_float * len(handles))(*(s.scale for s in loras))
    if llama_cpp.llama_set_adapters_lora(ctx, arr, len(handles), scales) != 0:
        raise ModelLoadError("llama.cpp refused the LoRA adapters")
