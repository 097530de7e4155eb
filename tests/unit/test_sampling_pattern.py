"""A schema's ``pattern`` as a deterministic grammar: what llama.cpp samples under it.

Each answer is sampled by llama.cpp on the tiny model under the schema's
grammar, then read back as JSON: its value must match the pattern (Python's
``re``, which agrees with ECMAScript on the syntax used here). Patterns the
automaton cannot bound are a ``GrammarError`` that names them, quickly.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
from support.tinymodels import TinyModels, tiny_config

from localkv.model.sampling import GrammarError, SamplingParams, json_schema_grammar
from localkv.model.session import ModelSession

ORDINARY = [  # each with an upper bound on its length, so that every answer ends
    r"^[a-z]{1,12}$",
    r"^[a-zA-Z_][a-zA-Z0-9_-]{0,63}$",
    r"^\d{4}-\d{2}-\d{2}$",
    r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,3})?(Z|[+-]\d{2}:\d{2})$",
    r"^[a-zA-Z0-9._%+-]{1,10}@[a-zA-Z0-9.-]{1,10}\.[a-zA-Z]{2,4}$",
    r"^https?://[^\s/$.?#][^\s]{0,16}$",
    r"^v?(0|[1-9]\d{0,2})\.(0|[1-9]\d{0,2})\.(0|[1-9]\d{0,2})(-[0-9A-Za-z.-]{1,8})?$",
    r"^(?:red|green|blue)$",
    r"^[^\n]{0,16}$",  # any character but a newline: quotes and backslashes too, JSON-escaped
    r'^say "\w{1,6}"\\n?$',  # a quote and a backslash in the pattern itself
    r"^(a|a|aa)*(a?){400}b$",  # read many ways: one way in the grammar
]


@pytest.fixture(scope="module")
def session(tiny_models: TinyModels) -> Iterator[ModelSession]:
    with ModelSession(tiny_config(tiny_models.base, n_ctx=512)) as s:
        yield s


@pytest.mark.parametrize("pattern", ORDINARY)
def test_every_sampled_answer_is_a_json_string_that_matches_the_pattern(
    session: ModelSession, pattern: str
) -> None:
    grammar = json_schema_grammar({"type": "string", "pattern": pattern})
    for seed in range(4):
        session.reset()
        session.prefill(session.tokenize("Give an example:"))
        params = SamplingParams(temperature=1.5, top_k=0, top_p=1, min_p=0, seed=seed,
                                max_tokens=200, grammar=grammar)  # fmt: skip
        ids = list(session.generate(params))
        text = session.detokenize(ids)
        assert len(ids) < params.max_tokens, text  # the grammar ended it
        value = json.loads(text)
        assert isinstance(value, str) and re.fullmatch(pattern[1:-1], value), (text, pattern)


@pytest.mark.parametrize(
    ("pattern", "said"),
    [
        (r"^(a|b)*a(a|b){20}$", "needs more than 2,001 states"),
        (r"^((a?){30}){30}$", "too ambiguous"),
        (r"^(a?){1000}(b?){1000}c$", "2,001 characters long"),
        (r"^a{1001}$", "a repetition count above 1,000"),
        (r"^(?=a)a$", "lookarounds are not supported"),
        (r"^(a)\1$", "backreferences are not supported"),
        (r"^a\b$", r"the escape \\b is not supported"),
        (r"^a|b$", "must start with"),
        (r"^x**$", "nothing to repeat"),
        (r"^[z-a]$", "out of order"),
        (r"^[]$", "matches no string"),
        ("^" + "(" * 5000 + "a" + ")" * 5000 + "$", "nests too deep"),
    ],
)
def test_a_pattern_that_cannot_be_bounded_is_refused_by_name(pattern: str, said: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(repr(pattern)[:20])) as raised:
        json_schema_grammar({"properties": {"p": {"type": "string", "pattern": pattern}}})
    assert re.search(said, str(raised.value)), raised.value
