"""How a model is loaded: the session configuration and LoRA adapters (values)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from localkv.model.native import ggml_type_id, llama_cpp
from localkv.model.threads import MAX_THREADS

__all__ = ["FLASH_ATTN_TYPES", "MAX_THREADS", "LoraSpec", "SessionConfig"]

FLASH_ATTN_TYPES = {
    "auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}


@dataclass(frozen=True, slots=True)
class LoraSpec:
    path: Path
    scale: float = 1.0

    @classmethod
    def parse(cls, text: str) -> LoraSpec:
        """``PATH`` or ``PATH:SCALE``."""
        head, sep, tail = text.rpartition(":")
        if sep and head and _is_float(tail):
            return cls(Path(head), float(tail))
        return cls(Path(text), 1.0)


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionConfig:
    """How to load a model. ``n_ctx``, ``n_batch`` and threads do not change KV values."""

    model_path: Path
    n_ctx: int = 4096
    n_batch: int = 512
    n_threads: int | None = None
    n_gpu_layers: int = -1  # -1: all layers (a no-op on a CPU build)
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: str = "auto"  # "on" | "off" | "auto" (``loading.flash_attn_setting``)
    loras: tuple[LoraSpec, ...] = ()
    rope_freq_base: float = 0.0  # 0: the model's own
    rope_freq_scale: float = 0.0  # 0: the model's own
    block_size: int = 256  # prefill alignment; a block's last token is decoded alone
    # --chat-template: a built-in llama.cpp name or a template file (None: the model's
    # own, else one chosen by architecture; localkv.prompt.templatechoice). It changes
    # only the request's tokens, which are the cache key, so it is not identity.
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.n_ctx < 16:
            raise ValueError(f"n_ctx must be at least 16, got {self.n_ctx}")
        if self.n_batch < 1:
            raise ValueError(f"n_batch must be positive, got {self.n_batch}")
        if self.flash_attn not in FLASH_ATTN_TYPES:
            raise ValueError(f"flash_attn must be on, off or auto, got {self.flash_attn!r}")
        ggml_type_id(self.type_k)
        ggml_type_id(self.type_v)
        if self.n_threads is not None and not 1 <= self.n_threads <= MAX_THREADS:
            raise ValueError(f"n_threads must be 1 to {MAX_THREADS}, got {self.n_threads}")
