"""Token sampling from logits: greedy at temperature 0, else top-k, top-p, seeded."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Sampler", "SamplingParams"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 40
    seed: int | None = None
    max_tokens: int = 512

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")


class Sampler:
    """Draws tokens for one generation; the seed makes a run repeatable."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def sample(self, logits: np.ndarray) -> int:
        p = self.params
        if p.temperature == 0:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / p.temperature
        if 0 < p.top_k < scaled.shape[0]:
            candidates = np.argpartition(scaled, -p.top_k)[-p.top_k :]
        else:
            candidates = np.arange(scaled.shape[0])
        order = candidates[np.argsort(-scaled[candidates], kind="stable")]
        probs = np.exp(scaled[order] - scaled[order[0]])
        probs /= probs.sum()
        if p.top_p < 1:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
        return int(self._rng.choice(order, p=probs))
