"""localkv: a local LLM runtime with a persistent, verified, on-disk prefix KV cache."""

from __future__ import annotations

from localkv.sampling import SamplingParams
from localkv.session import LoraSpec, ModelSession, SessionConfig

__all__ = ["LoraSpec", "ModelSession", "SamplingParams", "SessionConfig"]
__version__ = "0.1.0"
