"""Sampling: the values a generation asks for, llama.cpp's sampler chain, grammars.

``params`` holds ``SamplingParams``; ``chain`` builds llama.cpp's sampler chain
from them (``Sampler``); ``grammar`` checks GBNF and turns JSON schemas into it.
"""

from __future__ import annotations

from localkv.model.sampling.chain import Sampler, check_grammar
from localkv.model.sampling.grammar import GrammarError, json_object_grammar, json_schema_grammar
from localkv.model.sampling.params import SamplingParams

__all__ = [
    "GrammarError",
    "Sampler",
    "SamplingParams",
    "check_grammar",
    "json_object_grammar",
    "json_schema_grammar",
]
