"""llama.cpp's sampler chain as localkv builds it: penalties, grammar, greedy or a seeded draw.

Checked against an oracle computed here in numpy (the penalty on the logits,
then the likeliest token), on a tiny model with the default model's tokenizer;
grammars, JSON schemas and what llama.cpp refuses, none of which may crash
the process.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
from support.tinymodels import TinyModels, tiny_config

from localkv.model.sampling import (
    GrammarError,
    Sampler,
    SamplingParams,
    check_grammar,
    json_schema_grammar,
)
from localkv.model.session import ModelSession

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def session(tiny_models: TinyModels) -> Iterator[ModelSession]:
    with ModelSession(tiny_config(tiny_models.base, n_ctx=512)) as s:
        yield s


def _prefilled(session: ModelSession) -> np.ndarray:
    session.reset()
    session.prefill(session.tokenize(PROMPT))
    logits = session.last_logits
    assert logits is not None
    return logits.copy()


def _penalized(logits: np.ndarray, recent: Sequence[int], penalty: float, n: int) -> np.ndarray:
    out = logits.astype(np.float32).copy()
    for t in set(recent[-n:]):
        out[t] = out[t] / penalty if out[t] > 0 else out[t] * penalty
    return out


def _answer(session: ModelSession, params: SamplingParams) -> list[int]:
    _prefilled(session)
    return list(session.generate(params))


def test_greedy_picks_the_likeliest_token_after_the_penalty_on_the_prompt(
    session: ModelSession,
) -> None:
    logits = _prefilled(session)
    top = int(np.argmax(logits))
    history = [*session.tokens, top]  # the likeliest token was already said
    for penalty in (1.0, 1.3, 50.0):
        params = SamplingParams(temperature=0, repeat_penalty=penalty, repeat_last_n=64)
        with Sampler(params, session.vocab, session.n_vocab, history) as sampler:
            chosen = sampler.sample(logits)
        assert chosen == int(np.argmax(_penalized(logits, history, penalty, 64)))
    with Sampler(SamplingParams(temperature=0), session.vocab, session.n_vocab, []) as sampler:
        assert sampler.sample(logits) == top  # no history: nothing to penalize
    strong = SamplingParams(temperature=0, repeat_penalty=50.0)
    with Sampler(strong, session.vocab, session.n_vocab, history) as sampler:
        assert sampler.sample(logits) != top  # the test can tell the penalty happened


def test_a_greedy_answer_follows_the_oracle_token_by_token(session: ModelSession) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, repeat_penalty=1.5, repeat_last_n=8)
    answer = _answer(session, params)
    _prefilled(session)
    expected: list[int] = []
    for _ in range(len(answer)):
        logits = session.last_logits
        assert logits is not None
        token = int(np.argmax(_penalized(logits, session.tokens, 1.5, 8)))
        expected.append(token)
        session.decode_one(token)
    assert answer == expected and len(answer) == 12


def test_a_seed_repeats_a_draw_and_other_seeds_draw_otherwise(session: ModelSession) -> None:
    def drawn(seed: int) -> list[int]:
        params = SamplingParams(
            temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=seed, max_tokens=16
        )
        return _answer(session, params)

    first = drawn(7)
    assert drawn(7) == first
    assert any(drawn(seed) != first for seed in (8, 9, 10))
    greedy = _answer(session, SamplingParams(temperature=0, max_tokens=16, repeat_penalty=1))
    top_one = SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=16, repeat_penalty=1)
    assert _answer(session, top_one) == greedy  # top-k 1 leaves only the likeliest


def test_draws_stay_among_the_top_k(session: ModelSession) -> None:
    logits = _prefilled(session)
    allowed = set(np.argsort(-logits)[:3].tolist())
    for seed in range(20):
        params = SamplingParams(temperature=2.0, top_k=3, top_p=1.0, min_p=0.0, seed=seed)
        with Sampler(params, session.vocab, session.n_vocab, []) as sampler:
            assert sampler.sample(logits) in allowed


def test_a_grammar_limits_the_answer_to_what_it_allows(session: ModelSession) -> None:
    for seed in range(3):
        params = SamplingParams(temperature=1.0, seed=seed, grammar='root ::= "yes" | "no"')
        text = session.detokenize(_answer(session, params))
        assert text in ("yes", "no")


def test_a_json_schema_grammar_gives_a_value_of_the_schema(session: ModelSession) -> None:
    schema = {"type": "string", "enum": ["red", "green", "blue"]}
    for seed in range(3):
        params = SamplingParams(temperature=1.0, seed=seed, grammar=json_schema_grammar(schema))
        assert json.loads(session.detokenize(_answer(session, params))) in schema["enum"]


def test_a_grammar_that_allows_nothing_ends_the_answer_without_a_token(
    session: ModelSession,
) -> None:
    nothing = r"root ::= [^\x00-\U0010FFFF]"
    for params in (
        SamplingParams(temperature=0, grammar=nothing),
        SamplingParams(temperature=1, seed=1, grammar=nothing),
    ):
        assert _answer(session, params) == []
    assert _answer(session, SamplingParams(temperature=0, max_tokens=2)) != []  # still works


@pytest.mark.parametrize(
    ("gbnf", "said"),
    [
        ("root ::= x", "llama.cpp refused the grammar"),
        ('foo ::= "a"', "does not contain a 'root' symbol"),
        ('root ::= root "a"', "left recursion"),
        ('root ::= "a"{100000}', "llama.cpp refused the grammar"),
        ('root ::= "unterminated', "llama.cpp refused the grammar"),
    ],
)
def test_grammars_llama_cpp_refuses_are_errors_not_crashes(
    session: ModelSession, gbnf: str, said: str
) -> None:
    params = SamplingParams(temperature=0, grammar=gbnf)
    with pytest.raises(GrammarError, match=said):
        check_grammar(session.vocab, gbnf)
    with pytest.raises(GrammarError, match=said):
        _answer(session, params)
    assert _answer(session, SamplingParams(temperature=0, max_tokens=2)) != []


def test_grammars_that_would_crash_llama_cpp_are_refused_before_it() -> None:
    deep = "root ::= " + "(" * 20_000 + '"a"' + ")" * 20_000  # a segfault in llama.cpp
    with pytest.raises(GrammarError, match="nests groups 20,000 deep"):
        SamplingParams(grammar=deep)
    quoted = 'root ::= "' + "(" * 20_000 + '"'  # inside a literal: no nesting at all
    assert SamplingParams(grammar=quoted).grammar == quoted
    for empty in ("", "  \n"):
        with pytest.raises(GrammarError, match="empty"):
            SamplingParams(grammar=empty)
    with pytest.raises(GrammarError, match="maxLength is 50,000"):
        json_schema_grammar({"type": "string", "maxLength": 50_000})


@pytest.mark.parametrize(
    ("schema", "said"),
    [
        ({"type": "date"}, "Unrecognized schema"),
        ({"$ref": "https://example.com/schema.json"}, "Fetching remote schemas is not allowed"),
        ({"$ref": "#/definitions/missing"}, "Error resolving ref"),
        ({"type": "string", "pattern": "[a-z]+"}, 'must start with "\\^"'),
        ([{"type": "string"}], "must be an object, not list"),
        ("{not json", "not valid JSON"),
        ({"type": "array", "maxItems": -1}, "maxItems must be a non-negative integer"),
    ],
)
def test_schemas_the_converter_cannot_handle_are_errors_naming_why(
    schema: object, said: str
) -> None:
    with pytest.raises(GrammarError, match=said):
        json_schema_grammar(schema)  # type: ignore[arg-type]


def test_a_property_named_like_a_bound_is_a_property() -> None:
    schema = {"type": "object", "properties": {"maxLength": {"type": "integer"}}}
    assert "maxLength" in json_schema_grammar(schema)
