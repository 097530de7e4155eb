"""Token sampling from logits: greedy at temperature 0, else top-k, top-p, min-p, seeded.

A repeat penalty (llama.cpp's: a positive logit divided by it, a negative one
multiplied) applies to the tokens among the last ``repeat_last_n`` of the
sequence, prompt included, before any choice, greedy too. It depends on the
tokens alone, so a cached and an uncached run sample the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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
    min_p: float = 0.05  # drop tokens less likely than min_p times the likeliest (0: off)
    repeat_penalty: float = 1.1  # 1: off
    repeat_last_n: int = 64  # how many of the last tokens the penalty looks at

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repeat_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1) (0: off), got {self.min_p}")
        if self.repeat_penalty <= 0:
            raise ValueError(f"repeat_penalty must be > 0 (1: off), got {self.repeat_penalty}")
        if self.repeat_last_n < 0:
            raise ValueError(f"repeat_last_n must be >= 0, got {self.repeat_last_n}")


class Sampler:
    """Draws tokens for one generation; the seed makes a run repeatable."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def sample(self, logits: np.ndarray, recent: Sequence[int] = ()) -> int:
        """The next token; ``recent`` is the sequence so far (the penalty reads its tail)."""
        p = self.params
        logits = self._penalized(logits, recent)
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
        if p.min_p > 0:  # probs are sorted: the likeliest is first
            keep = max(1, int(np.count_nonzero(probs >= p.min_p * probs[0])))
            order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
        return int(self._rng.choice(order, p=probs))

    def _penalized(self, logits: np.ndarray, recent: Sequence[int]) -> np.ndarray:
        p = self.params
        if p.repeat_penalty == 1 or p.repeat_last_n == 0 or not recent:
            return logits
        seen = np.unique(np.asarray(recent[-p.repeat_last_n :], dtype=np.int64))
        seen = seen[(seen >= 0) & (seen < logits.shape[0])]
        out = logits.copy()
        values = out[seen]
        out[seen] = np.where(values > 0, values / p.repeat_penalty, values * p.repeat_penalty)
        return out
