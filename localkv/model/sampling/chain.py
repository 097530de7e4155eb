"""llama.cpp's sampler chain for one generation: penalties, grammar, then greedy or a seeded draw.

The chain is ``penalties -> grammar -> greedy`` at temperature 0, else
``penalties -> grammar -> top-k -> top-p -> min-p -> temperature -> dist``
(llama.cpp's order; a stage that is off is left out). The penalties stage is
given the last ``repeat_last_n`` tokens of the sequence before the first
choice, prompt included, and every sampled token after: it sees the same
tokens whether the prompt was restored from the cache or prefilled, so a
cached and an uncached run sample the same. The grammar sees only the
sampled tokens.

Each choice is made on the logits the session holds for its last token
(``llama_sampler_apply`` on a token array built from them, then
``llama_sampler_accept``), which is what ``llama_sampler_sample`` does with the
logits it reads from the context; the session's copy is the one its probes and
tests compare, so sampling reads exactly those.

llama.cpp aborts the process when a grammar is made to accept a token it does
not allow; the chain accepts only a token the grammar left possible, and a
choice where the grammar left nothing possible is ``None``.
"""

from __future__ import annotations

import ctypes
import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from localkv.model.native import llama_cpp, recent_errors
from localkv.model.sampling.grammar import GrammarError, check_gbnf
from localkv.model.sampling.params import SamplingParams

__all__ = ["Sampler", "check_grammar"]

log = logging.getLogger(__name__)

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
_SEEDS = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: "a random seed", so never passed on


def _grammar_sampler(vocab: Any, text: str) -> Any:
    check_gbnf(text)
    recent_errors()  # forget older lines: the ones after this call are the grammar's
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, text.encode("utf-8"), b"root")
    if not sampler:
        said = "; ".join(recent_errors()) or "it could not be parsed"
        raise GrammarError(f"llama.cpp refused the grammar: {said}")
    return sampler


def check_grammar(vocab: Any, text: str) -> None:
    """Raise ``GrammarError`` unless llama.cpp builds a grammar sampler from ``text``."""
    llama_cpp.llama_sampler_free(_grammar_sampler(vocab, text))


class Sampler:
    """The chain for one generation; ``close()`` frees it (idempotent), as does ``with``."""

    def __init__(
        self, params: SamplingParams, vocab: Any, n_vocab: int, history: Sequence[int] = ()
    ) -> None:
        self.params = params
        self._chain: Any = None
        self._accepted = 0
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        if not chain:
            raise RuntimeError("llama.cpp could not make a sampler chain")
        self._chain = chain
        try:
            self._build(vocab, n_vocab, history)
        except BaseException:
            self.close()
            raise
        self._data = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self._pointer = self._data.ctypes.data_as(llama_cpp.llama_token_data_p)
        self._array = llama_cpp.llama_token_data_array(
            data=self._pointer,
            size=n_vocab,
            selected=-1,
            sorted=False,
        )

    def _build(self, vocab: Any, n_vocab: int, history: Sequence[int]) -> None:
        p = self.params
        if p.repeat_penalty != 1 and p.repeat_last_n > 0:
            penalties = llama_cpp.llama_sampler_init_penalties(
                n_vocab, p.repeat_last_n, p.repeat_penalty, 0.0, 0.0
            )
            self._add(penalties)
            for token in history[-p.repeat_last_n :]:
                llama_cpp.llama_sampler_accept(penalties, token)
        if p.grammar is not None:
            self._add(_grammar_sampler(vocab, p.grammar))
        if p.temperature == 0:
            self._add(llama_cpp.llama_sampler_init_greedy())
            return
        if p.top_k > 0:
            self._add(llama_cpp.llama_sampler_init_top_k(p.top_k))
        if p.top_p < 1:
            self._add(llama_cpp.llama_sampler_init_top_p(p.top_p, 1))
        if p.min_p > 0:
            self._add(llama_cpp.llama_sampler_init_min_p(p.min_p, 1))
        self._add(llama_cpp.llama_sampler_init_temp(p.temperature))
        seed = _SEEDS if p.seed is None else p.seed % _SEEDS
        self._add(llama_cpp.llama_sampler_init_dist(seed))

    def _add(self, sampler: Any) -> None:
        if not sampler:
            raise RuntimeError("llama.cpp could not make a sampler")
        llama_cpp.llama_sampler_chain_add(self._chain, sampler)  # the chain owns it now

    def sample(self, logits: np.ndarray) -> int | None:
        """The next token for ``logits`` (not accepted yet); None if the grammar allows none."""
        if self._chain is None:
            raise RuntimeError("the sampler is closed")
        data = self._data
        data["id"] = self._ids
        data["logit"] = logits
        data["p"] = 0.0
        array = self._array
        array.data = self._pointer  # type: ignore[assignment]  # a stage may have moved it
        array.size = data.shape[0]
        array.selected = -1
        array.sorted = False
        llama_cpp.llama_sampler_apply(self._chain, ctypes.byref(array))
        if not 0 <= array.selected < array.size:
            raise RuntimeError(f"llama.cpp's sampler chose no token ({array.selected})")
        chosen = array.data[array.selected]
        if not math.isfinite(chosen.logit):  # everything was ruled out
            log.warning("the grammar allows no token after %d sampled", self._accepted)
            return None
        return int(chosen.id)

    def accept(self, token: int) -> None:
        """Record ``token`` (one ``sample`` returned) as chosen: penalties and grammar move on."""
        if self._chain is None:
            raise RuntimeError("the sampler is closed")
        llama_cpp.llama_sampler_accept(self._chain, token)
        self._accepted += 1

    def close(self) -> None:
        chain, self._chain = self._chain, None
        if chain is not None:
            llama_cpp.llama_sampler_free(chain)

    def __enter__(self) -> Sampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
