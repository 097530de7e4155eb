"""Structured output: JSON schemas and GBNF grammars through the server, the CLI and the API.

The answers are checked against their schemas with ``jsonschema``, on the real
default model (a tiny random model would follow the grammar but rarely finish
a value before ``max_tokens``). Schemas and grammars that cannot constrain an
answer are clear errors: a 400 naming ``response_format``, a usage error.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from support.server import ServerProcess
from support.tinymodels import TinyModels

import localkv

SCHEMAS: dict[str, dict[str, Any]] = {
    "required fields": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}},
        "required": ["colour"],
    },
    "array of items": {
        "type": "object",
        "properties": {
            "fruits": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 4}
        },
        "required": ["fruits"],
    },
    "nested object": {
        "type": "object",
        "properties": {
            "book": {
                "type": "object",
                "properties": {
                    "title": {"type": "string"},
                    "author": {
                        "type": "object",
                        "properties": {"name": {"type": "string"}},
                        "required": ["name"],
                    },
                },
                "required": ["title", "author"],
            }
        },
        "required": ["book"],
    },
    "integer number boolean": {
        "type": "object",
        "properties": {
            "count": {"type": "integer"},
            "price": {"type": "number"},
            "in_stock": {"type": "boolean"},
        },
        "required": ["count", "price", "in_stock"],
    },
}
ASK = {
    "required fields": "Give an example person as JSON.",
    "enum": "What colour is the sky? Answer as JSON.",
    "array of items": "List some fruits as JSON.",
    "nested object": "Describe a book and its author as JSON.",
    "integer number boolean": "Describe an item in a shop as JSON.",
}


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, default_model_path: Path
) -> Iterator[ServerProcess]:
    home = tmp_path_factory.mktemp("home")
    args = ["--model", str(default_model_path), "--threads", "2"]
    log = home / "server.log"
    with ServerProcess(args, log, env={"LOCALKV_HOME": str(home)}) as proc:
        yield proc


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=600
    )


def _schema_format(name: str, schema: object) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": name.replace(" ", "_"), "schema": schema, "strict": True},
    }


def _chat(server: ServerProcess, question: str, fmt: dict[str, Any], **extra: Any) -> Any:
    body: dict[str, Any] = {"temperature": 0, "max_tokens": 200, **extra}
    return _client(server).chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": question}],
        response_format=fmt,  # type: ignore[arg-type]
        **body,
    )


@pytest.mark.default_model
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_a_json_schema_response_validates_against_its_schema(
    server: ServerProcess, name: str
) -> None:
    schema = SCHEMAS[name]
    reply = _chat(server, ASK[name], _schema_format(name, schema))
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content or ""), schema)


@pytest.mark.default_model
def test_without_a_schema_the_same_question_is_not_that_json(server: ServerProcess) -> None:
    """The schema is what makes the answer JSON: the checks above are not vacuous."""
    reply = _client(server).chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": ASK["integer number boolean"]}],
        temperature=0,
        max_tokens=200,
    )
    text = reply.choices[0].message.content or ""
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(text), SCHEMAS["integer number boolean"])


@pytest.mark.default_model
def test_a_streamed_json_schema_answer_is_the_same_json(server: ServerProcess) -> None:
    fmt = _schema_format("nested object", SCHEMAS["nested object"])
    whole = _chat(server, ASK["nested object"], fmt).choices[0].message.content
    stream = _chat(server, ASK["nested object"], fmt, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), SCHEMAS["nested object"])


@pytest.mark.default_model
def test_json_object_gives_a_json_object(server: ServerProcess) -> None:
    reply = _chat(server, "Give a cat's name and age as a JSON object.", {"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


@pytest.mark.default_model
@pytest.mark.parametrize(
    ("fmt", "said"),
    [
        (_schema_format("date", {"type": "date"}), "Unrecognized schema"),
        (
            _schema_format("remote", {"$ref": "https://example.com/s.json"}),
            "Fetching remote schemas is not allowed",
        ),
        (_schema_format("long", {"type": "string", "maxLength": 10**9}), "at most 1,000"),
        ({"type": "json_schema"}, "json_schema must be an object"),
        ({"type": "xml"}, "response_format must be"),
    ],
)
def test_a_schema_the_converter_cannot_handle_is_a_400_naming_the_problem(
    server: ServerProcess, fmt: dict[str, Any], said: str
) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            _chat(server, "Hello", fmt, stream=stream)
        assert refused.value.status_code == 400
        error = refused.value.body
        assert isinstance(error, dict) and error["param"] == "response_format"
        assert said in error["message"]
    assert _chat(server, "Hello", {"type": "text"}, max_tokens=2).choices  # still serving


# ------------------------------------------------------------------- the CLI
def _ask(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"LOCALKV_HOME": str(home), "PATH": "/usr/bin:/bin"}
    command = [sys.executable, "-m", "localkv", "ask", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.default_model
def test_ask_with_a_json_schema_answers_json_that_validates(
    tmp_path: Path, default_model_path: Path
) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("Bob is a 42 year old carpenter from Oslo. He likes fishing.\n")
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer"},
            "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        },
        "required": ["name", "age", "hobbies"],
    }
    schema_file = tmp_path / "person.json"
    schema_file.write_text(json.dumps(schema))
    model = ["--model", str(default_model_path), "--threads", "2", "--temperature", "0"]
    done = _ask(tmp_path, *model, "--json", "--json-schema", str(schema_file), str(doc), "Who?")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["finish_reason"] == "stop"
    jsonschema.validate(json.loads(answer["answer"]), schema)


def test_ask_refuses_a_schema_or_grammar_it_cannot_use_as_a_usage_error(
    tmp_path: Path, tiny_models: TinyModels
) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("text")
    bad_schema = tmp_path / "bad.json"
    bad_schema.write_text('{"type": "date"}')
    not_json = tmp_path / "not.json"
    not_json.write_text("{")
    bad_gbnf = tmp_path / "bad.gbnf"
    bad_gbnf.write_text("root ::= undefined-rule\n")
    deep = tmp_path / "deep.gbnf"
    deep.write_text("root ::= " + "(" * 20_000 + '"a"' + ")" * 20_000)
    model = ["--model", str(tiny_models.base), "--threads", "1"]
    for option, path, said in [
        ("--json-schema", bad_schema, "Unrecognized schema"),
        ("--json-schema", not_json, "not valid JSON"),
        ("--grammar", bad_gbnf, "llama.cpp refused the grammar"),
        ("--grammar", deep, "nests groups 20,000 deep"),
    ]:
        done = _ask(tmp_path, *model, option, str(path), str(doc), "Q?")
        assert done.returncode == 2, done.stderr
        assert option in done.stderr and said in done.stderr and "Traceback" not in done.stderr
    both = _ask(tmp_path, *model, "--json-schema", str(bad_schema), "--grammar", str(bad_gbnf))
    assert both.returncode == 2


def test_ask_with_a_grammar_answers_in_it(tmp_path: Path, tiny_models: TinyModels) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("The answer is yes or no.")
    gbnf = tmp_path / "yesno.gbnf"
    gbnf.write_text('root ::= "yes" | "no"\n')
    model = ["--model", str(tiny_models.base), "--threads", "1", "--seed", "4"]
    done = _ask(tmp_path, *model, "--json", "--grammar", str(gbnf), str(doc), "Yes or no?")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["answer"] in ("yes", "no")


# ------------------------------------------------------------------- the API
@pytest.mark.default_model
def test_the_api_answers_json_of_a_schema(default_model_path: Path) -> None:
    schema = SCHEMAS["integer number boolean"]
    params = localkv.SamplingParams(temperature=0, max_tokens=200)
    with localkv.Runtime.open(default_model_path, use_cache=False, n_ctx=1024) as rt:
        answer = rt.ask([], ASK["integer number boolean"], params=params, json_schema=schema)
        jsonschema.validate(json.loads(answer.text), schema)
        with pytest.raises(localkv.GrammarError, match="Unrecognized schema"):
            rt.ask([], "Q?", json_schema={"type": "date"})
        with pytest.raises(localkv.GrammarError, match=r"llama\.cpp refused"):
            rt.ask([], "Q?", params=localkv.SamplingParams(grammar="root ::= nothing"))
        grammar = localkv.SamplingParams(temperature=0, grammar=localkv.json_object_grammar())
        assert isinstance(json.loads(rt.ask([], "A cat?", params=grammar).text), dict)
