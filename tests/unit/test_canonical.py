"""The canonical rules and the Anthropic system messages, as the tokens a request becomes.

Each request is parsed as the server parses it (``messages_request``), made
canonical (``server.canonical``) and built into its prompt tokens by the one
builder the engine uses, with the tiny model's chat template.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from support.claude_code import ClaudeCode, billing_header
from support.tinymodels import TinyModels, tiny_config

from localkv.model.session import ModelSession
from localkv.prompt.template import ChatTemplate, Message
from localkv.server.canonical import RULES, Canonical, Rule, drop_billing_header
from localkv.server.conversation import AnswerMemory, build_prompt
from localkv.server.limits import Budget
from localkv.server.protocols.anthropic.translate import messages_request
from localkv.server.requests import Breakpoint, ChatRequest, Sampling

AGENT = ClaudeCode(
    instructions="\nYou are an agent working with the user on their code.\n" * 20,
    environment="# Environment\nYou have been invoked in the following environment:\n"
    " - Primary working directory: /home/me/project\n - Is a git repository: true\n" * 10,
)


@pytest.fixture(scope="module")
def template(tiny_models: TinyModels) -> Iterator[ChatTemplate]:
    with ModelSession(tiny_config(tiny_models.base, n_ctx=4096)) as session:
        yield ChatTemplate(session)


def tokens(
    template: ChatTemplate, body: dict[str, Any], rules: Sequence[Rule] = RULES
) -> list[int]:
    request = Canonical(rules)(messages_request(body).request)
    built = build_prompt(template, request.messages, AnswerMemory(), Budget(4096), request.tools)
    return built.state.tokens


def test_two_sessions_differing_in_the_billing_header_are_the_same_tokens(
    template: ChatTemplate,
) -> None:
    first, second = AGENT.first("What is 2+2?", "34c"), AGENT.first("What is 2+2?", "57b")
    assert tokens(template, first) == tokens(template, second)
    # the same request without the header block: what the rule makes of it
    bare = {**first, "system": first["system"][1:]}
    assert tokens(template, first) == tokens(template, bare, ())
    # switched off, they differ from the header on
    kept_first, kept_second = tokens(template, first, ()), tokens(template, second, ())
    differ = next(
        i for i, (a, b) in enumerate(zip(kept_first, kept_second, strict=False)) if a != b
    )
    assert differ < 30 and len(kept_first) > len(tokens(template, first))


def test_the_rule_takes_the_header_only_where_claude_code_puts_it() -> None:
    def system(text: str, *more: Message) -> ChatRequest:
        messages = (Message("system", text), Message("user", "Hi"), *more)
        return ChatRequest(messages=messages, sampling=Sampling())

    against_the_api = system(billing_header("9f1", nonce="a1b2c") + "\nBe brief.")
    assert drop_billing_header(against_the_api).messages[0].content == "Be brief."
    for kept in (
        "Be brief. " + billing_header("9f1"),  # not at the start
        "x-anthropic-billing-header: none",  # no key=value; fields
    ):
        request = system(kept)
        assert drop_billing_header(request) is request
    user = ChatRequest(messages=(Message("user", billing_header("9f1")),), sampling=Sampling())
    assert drop_billing_header(user) is user  # a user's text is theirs
    # a system message that was only the header goes; the breakpoints move with the rest
    alone = ChatRequest(
        messages=(Message("system", billing_header("9f1")), Message("user", "Hi")),
        sampling=Sampling(),
        breakpoints=(Breakpoint(message=0, ttl_s=300), Breakpoint(message=1, ttl_s=300)),
    )
    dropped = drop_billing_header(alone)
    assert dropped.messages == (Message("user", "Hi"),)
    assert dropped.breakpoints == (Breakpoint(message=0, ttl_s=300),)


def test_a_rule_is_logged_once_when_it_applies(caplog: pytest.LogCaptureFixture) -> None:
    canonical = Canonical()
    with caplog.at_level(logging.DEBUG, logger="localkv.server.canonical"):
        canonical(ChatRequest(messages=(Message("user", "Hi"),), sampling=Sampling()))
        assert not caplog.records
        for digits in ("34c", "57b"):
            canonical(messages_request(AGENT.first("Hi", digits)).request)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "'billing-header'" in said[0] and "--keep-client-headers" in said[0]


def test_claude_codes_environment_joins_the_system_prompt(template: ChatTemplate) -> None:
    parsed = messages_request(AGENT.first("What is 2+2?")).request
    system, asked = parsed.messages
    assert system.role == "system" and system.content.endswith("\n\n" + AGENT.environment)
    assert asked.role == "user" and asked.content.endswith("What is 2+2?")
    # every breakpoint (the system blocks', the environment's) ends the system prompt
    assert {p.message for p in parsed.breakpoints} == {0}
    # another question: the same tokens up to the question
    one, other = (
        tokens(template, AGENT.first("What is 2+2?")),
        tokens(template, AGENT.first("Name a prime number.", "57b")),
    )
    shared = next(i for i, (a, b) in enumerate(zip(one, other, strict=False)) if a != b)
    after = next(i for i in range(1, len(one)) if one[-i] != other[-i]) - 1  # the turn's end
    assert len(one) - after - shared == len(template.text_tokens("What is 2+2?"))
    # --continue: the environment as a string; its first turn is the same tokens
    resumed = AGENT.resumed("What is 2+2?", "4.", "And 3+3?", "34c")
    assert tokens(template, resumed)[: len(one)] == one


def test_a_system_message_after_an_answer_stays_in_its_place() -> None:
    body = AGENT.resumed("What is 2+2?", "4.", "And 3+3?", "34c")
    late = {"role": "system", "content": [{"type": "text", "text": "Now answer in French."}]}
    body["messages"] = [*body["messages"][:3], late, body["messages"][3]]
    roles = [(m.role, m.content[:12]) for m in messages_request(body).request.messages]
    assert roles == [
        ("system", billing_header("34c")[:12]),
        ("user", "<system-remi"),
        ("assistant", "4."),
        ("system", "Now answer i"),
        ("user", "And 3+3?"),
    ]


def test_an_output_format_is_the_answers_grammar_and_effort_is_ignored() -> None:
    body = AGENT.first("Give JSON.")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    effort = messages_request({**body, "output_config": {"effort": "low"}}).request
    assert effort.sampling.grammar is None
    for given in (
        {"output_config": {"effort": "low", "format": {"type": "json_schema", "schema": schema}}},
        {"output_format": {"type": "json_schema", "schema": schema}},
    ):
        assert messages_request({**body, **given}).request.sampling.grammar is not None
