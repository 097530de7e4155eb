"""What one generation asks of the sampler: the values, checked, and the grammar it must follow."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from localkv.model.sampling.grammar import check_gbnf

__all__ = ["SamplingParams"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """Greedy at temperature 0, else top-k, top-p, min-p, temperature, drawn with ``seed``.

    A repeat penalty (llama.cpp's: a positive logit divided by it, a negative one
    multiplied) applies to the tokens among the last ``repeat_last_n`` of the
    sequence, prompt included, before any choice, greedy too. ``grammar`` (GBNF
    text, see ``localkv.model.sampling.grammar``; ``json_schema_grammar`` makes
    one from a JSON schema) limits every choice to what the grammar allows.
    None of it depends on whether the prompt came from the cache: a cached
    and an uncached run sample the same.
    """

    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 40
    seed: int | None = None  # None: a new random draw every generation
    max_tokens: int = 512
    min_p: float = 0.05  # drop tokens less likely than min_p times the likeliest (0: off)
    repeat_penalty: float = 1.1  # 1: off
    repeat_last_n: int = 64  # how many of the last tokens the penalty looks at
    grammar: str | None = field(default=None, repr=False)  # GBNF; None: any text

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
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.grammar is not None:
            check_gbnf(self.grammar)
