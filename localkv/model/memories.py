"""Architectures whose llama.cpp memory the prefix cache cannot hold, and why.

llama.cpp 0.3.36 builds each model's memory in ``llama_model::create_memory``.
localkv stores one attention KV cache (with or without a sliding window, cells
with or without llama.cpp's cell extension: ``localkv.kv.section``), one
recurrent state, or a hybrid of the two. The architectures below keep other
memory: more KV sections (a sparse-attention indexer's key cache beside the
attention cache, DeepSeek-V4's compressed cache), none at all (encoders and
diffusion models), or a cache shared with another model's context (draft
heads). ``localkv models`` (from the GGUF header) and the cache's identity
probe (at run time) refuse them with the same reason, so what the listing says
is what ``prefill`` does.
"""

from __future__ import annotations

__all__ = ["memory_refusal"]

_INDEXED = "a sparse-attention KV cache with an indexer key cache"
_OTHER_MEMORY = {
    "minimax-m3": _INDEXED + " (MSA)",
    "glm-dsa": _INDEXED + " (DSA)",
    "deepseek32": _INDEXED + " (DSA)",
    "hy_v4": _INDEXED + " (DSA, where it has an indexer)",
    "dots3note": _INDEXED + " (DSA) beside a sliding-window cache",
    "deepseek4": "DeepSeek-V4's compressed KV cache",
    "glm5-next": "hybrid memory with a sparse-attention indexer cache",
    "qwen4exp": "hybrid memory with a sparse-attention indexer cache (QSA)",
    "dflash": "a draft model's cache, kept beside another model's",
    "gemma4-assistant": "a draft model's cache, shared with another model's context",
}
_NO_MEMORY = {
    "bert",
    "jina-bert-v2",
    "jina-bert-v3",
    "nomic-bert",
    "nomic-bert-moe",
    "neo-bert",
    "eurobert",
    "modern-bert",
    "gemma-embedding",
    "wavtokenizer-dec",
    "dream",
    "llada",
    "llada-moe",
    "rnd1",
}


def memory_refusal(arch: str | None) -> str | None:
    """Why the prefix cache cannot hold a model of architecture ``arch`` (None: it may)."""
    if arch in _NO_MEMORY:
        return f"{arch}: keeps no KV memory (an encoder or diffusion model): nothing to cache"
    what = _OTHER_MEMORY.get(arch or "")
    if what is not None:
        return f"{arch}: its memory, {what}, is not cached"
    return None
