"""The canonical request (system messages placed, client cache-busters taken out), as
the tokens a request becomes.

Each request is parsed as the server parses it (each protocol's own parser), made
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
from localkv.server.canonical import (
    RULES,
    Canonical,
    Rule,
    drop_billing_header,
    place_system_messages,
)
from localkv.server.conversation import AnswerMemory, build_prompt
from localkv.server.limits import Budget
from localkv.server.protocols.anthropic.translate import messages_request
from localkv.server.protocols.ollama.translate import chat_request as ollama_request
from localkv.server.protocols.openai.parse import parse_chat
from localkv.server.protocols.responses.translate import chat_request as responses_request
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
    parsed = place_system_messages(messages_request(AGENT.first("What is 2+2?")).request)
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
    placed = place_system_messages(messages_request(body).request)
    roles = [(m.role, m.content[:12]) for m in placed.messages]
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


SYSTEM, ENVIRONMENT = "You help with code.", "# Environment\nWorking directory: /home/me/project"
ASKED, SAID, NEXT = "What does main.py do?", "It starts the server.", "And tests.py?"
LATE = "From now on, answer in French."

Turns = list[tuple[str, str]]  # (role, text); the first is the system prompt


def every_protocol(turns: Turns) -> dict[str, ChatRequest]:
    """``turns`` spelled each protocol's way (a system message as a ``developer`` item in
    Responses), parsed as the server parses it."""
    (_, system), rest = turns[0], turns[1:]
    part = {"user": "input_text", "assistant": "output_text", "system": "input_text"}
    items = [
        {"type": "message", "role": "developer" if role == "system" else role,
         "content": [{"type": part[role], "text": text}]}
        for role, text in rest
    ]  # fmt: skip
    blocks = [
        {"role": role, "content": text if role == "system" else [{"type": "text", "text": text}]}
        for role, text in rest
    ]
    plain = [{"role": role, "content": text} for role, text in turns]
    return {
        "openai": parse_chat({"model": "m", "messages": plain}),
        "responses": responses_request(
            {"model": "m", "instructions": system, "input": items}
        ).request,
        "anthropic": messages_request(
            {"model": "m", "max_tokens": 8, "system": system, "messages": blocks}
        ).request,
        "ollama": ollama_request({"model": "m", "messages": plain}),
    }


def prompt_tokens(template: ChatTemplate, request: ChatRequest) -> list[int]:
    request = Canonical()(request)
    built = build_prompt(template, request.messages, AnswerMemory(), Budget(4096), request.tools)
    return built.state.tokens


def explicit(template: ChatTemplate, *messages: Message) -> list[int]:
    return prompt_tokens(template, ChatRequest(messages=messages, sampling=Sampling()))


def test_a_system_message_after_the_question_joins_the_system_prompt_in_every_protocol(
    template: ChatTemplate,
) -> None:
    # Claude Code's shape: the question, then the environment as a system message
    turns = [("system", SYSTEM), ("user", ASKED), ("system", ENVIRONMENT), ("user", NEXT)]
    joined = explicit(
        template,
        Message("system", SYSTEM + "\n\n" + ENVIRONMENT),
        Message("user", ASKED),
        Message("user", NEXT),
    )
    for name, request in every_protocol(turns).items():
        assert prompt_tokens(template, request) == joined, name
    # the same with an answer between the turns
    answered = [*turns[:3], ("assistant", SAID), turns[3]]
    joined = explicit(
        template,
        Message("system", SYSTEM + "\n\n" + ENVIRONMENT),
        Message("user", ASKED),
        Message("assistant", SAID),
        Message("user", NEXT),
    )
    for name, request in every_protocol(answered).items():
        assert prompt_tokens(template, request) == joined, name


def test_a_system_message_after_the_first_answer_stays_in_place_in_every_protocol(
    template: ChatTemplate,
) -> None:
    turns = [
        ("system", SYSTEM),
        ("user", ASKED),
        ("system", ENVIRONMENT),
        ("assistant", SAID),
        ("system", LATE),
        ("user", NEXT),
    ]
    head = (Message("system", SYSTEM + "\n\n" + ENVIRONMENT), Message("user", ASKED))
    in_place = explicit(
        template, *head, Message("assistant", SAID), Message("system", LATE), Message("user", NEXT)
    )
    moved = explicit(
        template,
        Message("system", SYSTEM + "\n\n" + ENVIRONMENT + "\n\n" + LATE),
        *head[1:],
        Message("assistant", SAID),
        Message("user", NEXT),
    )
    assert in_place != moved
    for name, request in every_protocol(turns).items():
        assert prompt_tokens(template, request) == in_place, name


def test_system_messages_before_the_first_answer_join_in_order_with_their_breakpoints() -> None:
    said = Message("assistant", SAID)
    request = ChatRequest(
        messages=(
            Message("system", "one"),
            Message("system", "two"),
            Message("user", ASKED),
            Message("system", ""),  # nothing to join
            Message("system", "three"),
            said,
            Message("system", LATE),
            Message("user", NEXT),
        ),
        sampling=Sampling(),
        breakpoints=tuple(Breakpoint(message=at, ttl_s=300) for at in (-1, 1, 2, 3, 4, 5, 6, 7)),
    )
    placed = place_system_messages(request)
    assert placed.messages == (
        Message("system", "one\n\ntwo\n\nthree"),
        Message("user", ASKED),
        said,
        Message("system", LATE),
        Message("user", NEXT),
    )
    # a breakpoint on a joined message ends at the system prompt; the others move along
    ends = [p.message for p in placed.breakpoints]
    assert ends == [-1, 0, 1, 0, 0, 2, 3, 4]
    # one system message that starts the conversation: nothing to do
    alone = ChatRequest(messages=placed.messages, sampling=Sampling())
    assert place_system_messages(alone) is alone
    # empty ones alone: no system prompt at all, and no breakpoint on it
    empty = ChatRequest(
        messages=(Message("user", ASKED), Message("system", "")),
        sampling=Sampling(),
        breakpoints=(Breakpoint(message=1, ttl_s=300),),
    )
    assert place_system_messages(empty).messages == (Message("user", ASKED),)
    assert place_system_messages(empty).breakpoints == ()
