"""Tool calls and reasoning parsed from answers, in each format models write."""

from __future__ import annotations

import json

import pytest

from localkv.prompt.reasoning import ReasoningSplit, split_reasoning
from localkv.prompt.toolcalls import ParsedCall, call_grammar, call_style, parse_tool_calls
from localkv.server.tools import AnswerText

NAMES = ("get_weather", "get_time")


def _args(**kw: object) -> str:
    return json.dumps(kw)


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        # Hermes / Qwen: blocks, text around them is content
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
         "", [ParsedCall("get_weather", _args(city="Paris"))]),
        ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
         '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n'
         "</tool_call>",
         "Let me check.",
         [ParsedCall("get_weather", _args(city="Rome")),
          ParsedCall("get_time", _args(city="Rome"))]),
        # an unclosed last block (the answer stopped at its end of turn)
        ('<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}',
         "", [ParsedCall("get_time", _args(city="Oslo"))]),
        # Llama 3.x: the whole answer is one object, "parameters" (or after <|python_tag|>)
        ('{"name": "get_weather", "parameters": {"city": "Lima"}}',
         "", [ParsedCall("get_weather", _args(city="Lima"))]),
        ('<|python_tag|>{"type": "function", "name": "get_time", "parameters": {"city": "Kyiv"}}',
         "", [ParsedCall("get_time", _args(city="Kyiv"))]),
        # Mistral: [TOOL_CALLS] and an array, or name[ARGS]{...}
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Bern"}}]',
         "", [ParsedCall("get_weather", _args(city="Bern"))]),
        ('[TOOL_CALLS]get_time[ARGS]{"city": "Baku"}',
         "", [ParsedCall("get_time", _args(city="Baku"))]),
        # no call: an unknown function, JSON that is no call, prose, a broken block
        ('<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',
         '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>', []),
        ('{"city": "Paris"}', '{"city": "Paris"}', []),
        ("It is sunny in Paris.", "It is sunny in Paris.", []),
        ("<tool_call>\n{not json", "<tool_call>\n{not json", []),
        ('{"name": "get_weather", "parameters": {"city": "Lima"}} and more',
         '{"name": "get_weather", "parameters": {"city": "Lima"}} and more', []),
    ],
)  # fmt: skip
def test_calls_are_parsed_from_each_format(
    text: str, content: str, calls: list[ParsedCall]
) -> None:
    assert parse_tool_calls(text, NAMES) == (content, calls)


def test_reasoning_splits_the_same_whole_and_piece_by_piece() -> None:
    text = "<think>\nThe user asks about Paris.\n</think>\n\nParis is the capital."
    whole = split_reasoning(text)
    assert whole == ("\nThe user asks about Paris.\n", "Paris is the capital.")
    for size in (1, 2, 3, 7):
        split = ReasoningSplit()
        parts = []
        for i in range(0, len(text), size):
            parts += split.push(text[i : i + size])
        parts += split.flush()
        reasoning = "".join(t for k, t in parts if k == "reasoning")
        content = "".join(t for k, t in parts if k == "content")
        assert (reasoning, content) == whole, size


def test_an_answer_that_starts_inside_the_reasoning_and_one_without_any() -> None:
    assert split_reasoning("I think.</think>Yes.", thinking=True) == ("I think.", "Yes.")
    assert split_reasoning("Just an answer <b>.") == (None, "Just an answer <b>.")
    assert split_reasoning("unfinished", thinking=True) == ("unfinished", "")


def test_a_streamed_answer_holds_back_only_what_may_be_a_call() -> None:
    sent: list[str] = []
    answer = AnswerText(on_text=sent.append, on_reasoning=lambda _: None, tools=NAMES)
    text = (
        'Checking. <tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    for ch in text:
        answer.push(ch)
    assert "".join(sent) == "Checking."  # the call was held back
    answer.finish()
    assert "".join(sent) == answer.content == "Checking." and [c.name for c in answer.calls] == [
        "get_time"
    ]
    assert answer.calls[0].id.startswith("call_")
    prose: list[str] = []
    plain = AnswerText(on_text=prose.append, on_reasoning=lambda _: None, tools=NAMES)
    for word in ("It ", "is ", "a < b ", "here."):
        plain.push(word)
    plain.finish()
    assert "".join(prose) == "It is a < b here." and not plain.calls


def test_call_grammars_are_grammars_llama_cpp_accepts(default_model_path: object) -> None:
    from localkv.model.config import SessionConfig
    from localkv.model.sampling import check_grammar
    from localkv.model.session import ModelSession

    tools = [
        {"type": "function", "function": {"name": n, "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
        for n in NAMES
    ]  # fmt: skip
    with ModelSession(SessionConfig(model_path=default_model_path, n_ctx=256)) as session:  # type: ignore[arg-type]
        for style in ("hermes", "llama3"):
            for name in (None, "get_time"):
                check_grammar(session.vocab, call_grammar(tools, name, style))
    assert call_style(None) == "hermes"
    assert call_style('{"name": x, "parameters": y}<|eot_id|>') == "llama3"
    assert call_style("<tool_call>{{ tools }}") == "hermes"
