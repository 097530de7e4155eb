"""Chat templates: the model's own, ``--chat-template``, and one chosen by architecture.

The tiny models get their template from a tokenizer source whose
``tokenizer.chat_template`` is replaced (or removed); the real Gemma 3 270M has none.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import llama_cpp
import pytest
from click.testing import CliRunner
from support.tinymodels import build_tiny_with_template, tiny_config

import localkv
from localkv.cli import cli
from localkv.model.session import ModelSession
from localkv.prompt.request import build_request
from localkv.prompt.template import ChatTemplate, Message
from localkv.prompt.templatechoice import builtin_templates, template_for_architecture

LLAMA3_JINJA = (
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
DOC = "Paris is the capital and largest city of France. It is on the Seine."
QUESTION = "What is the capital of France?"
MARKUP = ("<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>")
NO_TEMPLATE_WARNING = "model has no chat template; using 'gemma' for architecture gemma3"


@pytest.fixture(scope="module")
def tiny_llama3(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    return build_tiny_with_template(
        tmp_path_factory.mktemp("llama3"), default_model_path, LLAMA3_JINJA
    )


@pytest.fixture(scope="module")
def tiny_untemplated(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    return build_tiny_with_template(tmp_path_factory.mktemp("none"), default_model_path, None)


def _llama_cpp_render(name: str, messages: list[Message]) -> str:
    arr = (llama_cpp.llama_chat_message * len(messages))()
    keep = [(m.role.encode(), m.content.encode()) for m in messages]
    for i, (role, content) in enumerate(keep):
        arr[i].role, arr[i].content = role, content
    buf = ctypes.create_string_buffer(65536)
    n = llama_cpp.llama_chat_apply_template(name.encode(), arr, len(keep), True, buf, len(buf))
    assert n >= 0
    return buf.raw[:n].decode()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_chat_template_chatml_overrides_the_models_own(tiny_llama3: Path) -> None:
    messages = [Message("system", "Be brief."), Message("user", DOC), Message("user", QUESTION)]
    with ModelSession(tiny_config(tiny_llama3)) as session:
        own = ChatTemplate(session)
        chatml = ChatTemplate(session, "chatml")
        assert own.name == "model" and chatml.name == "chatml"
        assert own.render(messages, add_assistant=True) == _llama_cpp_render("llama3", messages)
        expected = _llama_cpp_render("chatml", messages)
        assert chatml.render(messages, add_assistant=True) == expected
        # built segment by segment, the request is exactly llama.cpp's chatml rendering
        doc = localkv.Document.from_text(DOC)
        request = build_request(chatml, system="Be brief.", documents=[doc], question=QUESTION)
        assert request.tokens == chatml.start_tokens() + session.tokenize(
            expected, parse_special=True
        )
        mine = build_request(own, system="Be brief.", documents=[doc], question=QUESTION)
        assert mine.tokens != request.tokens
        assert chatml.end_of_turn == session.tokenize("<|im_end|>", parse_special=True)[0]


def test_chat_template_option_reaches_the_request(tmp_path: Path, tiny_llama3: Path) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC, encoding="utf-8")
    base = ["ask", "--model", str(tiny_llama3), "--threads", "1", "--ctx", "512", "--json"]
    tail = ["--temperature", "0", "--max-tokens", "2", "--no-cache", str(doc), QUESTION]
    counts = {}
    for name in (None, "chatml"):
        option = ["--chat-template", name] if name else []
        result = CliRunner().invoke(cli, [*base, *option, *tail], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        counts[name] = json.loads(result.stdout.strip().splitlines()[-1])["tokens"]["prompt"]
    with localkv.Runtime.open(
        tiny_llama3, use_cache=False, n_threads=1, n_ctx=512, chat_template="chatml"
    ) as rt:
        expected = rt.build([localkv.Document.from_text(DOC)], system=None, question=QUESTION)
    assert counts["chatml"] == len(expected.tokens)
    assert counts[None] != counts["chatml"]


def test_templates_share_cached_state_only_as_far_as_their_tokens(
    tmp_path: Path, tiny_llama3: Path
) -> None:
    docs = [localkv.Document.from_text(DOC * 40)]
    params = localkv.SamplingParams(temperature=0, max_tokens=1)
    options = {"n_threads": 1, "n_ctx": 2048, "cache_dir": tmp_path / "cache"}
    with localkv.Runtime.open(tiny_llama3, **options) as rt:  # the model's own (llama3)
        first = rt.build(docs, system="Answer.", question=QUESTION)
        rt.ask(docs, QUESTION, system="Answer.", params=params)
    for name, reused_all in (("chatml", False), (None, True)):
        with localkv.Runtime.open(tiny_llama3, chat_template=name, **options) as rt:
            tokens = rt.build(docs, system="Answer.", question=QUESTION).tokens
            shared = _common_prefix(first.tokens, tokens)
            answer = rt.ask(docs, QUESTION, system="Answer.", params=params)
        assert answer.cache.common == shared
        assert answer.cache.reused <= shared
        if reused_all:  # the same template: everything but the question's last token
            assert shared == len(tokens) and answer.cache.reused > 256
        else:
            assert shared < 8 and answer.cache.reused == 0


def test_a_model_without_a_template_gets_its_architectures_once(
    tiny_untemplated: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with ModelSession(tiny_config(tiny_untemplated)) as session:
        first = ChatTemplate(session)
        ChatTemplate(session)
    assert first.name == "chatml"  # llama architecture, a vocabulary with <|im_start|>
    warnings = [r.getMessage() for r in caplog.records if "no chat template" in r.getMessage()]
    assert warnings == [
        "model has no chat template; using 'chatml' for architecture llama "
        "(override with --chat-template)"
    ]


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("gema", "unknown chat template 'gema': neither a built-in name nor a file; "
         "did you mean gemma?"),
        ("missing/template.jinja", "chat template file not found: missing/template.jinja"),
        ("@jinja", "the chat template does not compile"),
    ],
)  # fmt: skip
def test_a_bad_chat_template_is_a_one_line_usage_error(
    tmp_path: Path, value: str, says: str
) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC, encoding="utf-8")
    if value == "@jinja":  # a Jinja template that does not compile
        value = str(tmp_path / "mine.jinja")
        Path(value).write_text("{% for m in messages %}{{ m.content }}")
    command = [sys.executable, "-m", "localkv", "ask", "--chat-template", value]
    done = subprocess.run(
        [*command, str(doc), QUESTION], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and says in errors[0], done.stderr
    assert "Traceback" not in done.stderr


def test_a_template_file_is_rendered_as_its_jinja(tmp_path: Path, tiny_llama3: Path) -> None:
    path = tmp_path / "gemma.jinja"
    path.write_text(
        "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
        "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    )
    with ModelSession(tiny_config(tiny_llama3)) as session:
        template = ChatTemplate(session, str(path))
        assert template.name == "jinja" and template.choice.source == f"file {path}"
        messages = [Message("user", QUESTION)]
        bos = session.detokenize([session.bos_token() or 0], special=True)
        assert template.render(messages) == f"{bos}<start_of_turn>user\n{QUESTION}<end_of_turn>\n"


def test_the_architecture_table_names_only_built_in_formats() -> None:
    from localkv.prompt import templatechoice

    names = set(builtin_templates())
    assert {"gemma", "llama3", "llama2", "chatml", "phi3", "phi4", "mistral-v7"} <= names
    for formats in templatechoice._BY_ARCHITECTURE.values():
        assert set(formats) <= names
    assert set(templatechoice._MARKERS) <= names


# --------------------------------------------------------------- the real Gemma 3 270M
@pytest.mark.default_model
def test_gemma3_gets_the_gemma_format_and_stops_at_its_end_of_turn(gemma3_path: Path) -> None:
    with ModelSession(tiny_config(gemma3_path, n_ctx=512)) as session:
        assert template_for_architecture(session, "gemma3") == "gemma"
        template = ChatTemplate(session)
        assert template.name == "gemma"
        end = session.tokenize("<end_of_turn>", parse_special=True)
        assert [template.end_of_turn] == end
        assert session.is_end_of_generation(end[0])


def _run(gemma3_path: Path, tmp_path: Path, args: list[str], stdin: str = "") -> tuple[str, str]:
    env = {**os.environ, "LOCALKV_HOME": str(tmp_path / "home")}
    done = subprocess.run(
        [sys.executable, "-m", "localkv", *args, "--model", str(gemma3_path), "--threads", "2"],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr


@pytest.mark.default_model
def test_gemma3_answers_from_a_document_with_ask(gemma3_path: Path, tmp_path: Path) -> None:
    doc = tmp_path / "france.txt"
    doc.write_text(DOC, encoding="utf-8")
    sampling = ["--temperature", "0", "--max-tokens", "12", "--ctx", "512"]
    out, err = _run(gemma3_path, tmp_path, ["ask", *sampling, str(doc), QUESTION])
    assert "Paris" in out
    assert not any(m in out for m in MARKUP), out
    assert err.count(NO_TEMPLATE_WARNING) == 1


@pytest.mark.default_model
def test_gemma3_answers_in_a_plain_chat(gemma3_path: Path, tmp_path: Path) -> None:
    system = "France is a country in Western Europe. Its capital is Paris, which is also its "
    system += "largest city."
    args = ["chat", "--plain", "--temperature", "0", "--max-tokens", "16", "--ctx", "512"]
    out, err = _run(gemma3_path, tmp_path, [*args, "--system", system], QUESTION + "\n/quit\n")
    assert "The capital of France is Paris" in out
    assert not any(m in out for m in MARKUP), out
    assert err.count(NO_TEMPLATE_WARNING) == 1
