"""What a new user meets in the first hour of the chat, ``ask`` and the API.

Attaching mid-conversation says why the document is reused by that conversation
alone; what the chat saved is a snapshot the cache screen lists and removes; a
fresh chat's first turn says nothing about restoring template tokens; an answer
cut short says why (``finish_reason``); the chat template's end of turn stops an
answer even where the model does not end generation on it; ``--min-p`` and
``--repeat-penalty`` are checked and applied.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import pytest
from click.testing import CliRunner, Result
from support.tinymodels import (
    TOKENIZER_KEY_PREFIX,
    TinyModels,
    _read_header,
    build_tiny_llama,
    tiny_config,
)

from localkv.chat.controller import ChatController
from localkv.cli import cli
from localkv.model.sampling import SamplingParams
from localkv.model.session import ModelSession
from localkv.prompt.conversation import stream_answer
from localkv.prompt.template import ChatTemplate
from localkv.runtime import Runtime

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def plain(tiny_models: TinyModels, script: str, *args: str, ctx: int = 2048) -> Result:
    options = ["--model", str(tiny_models.base), "--threads", "1", "--ctx", str(ctx)]
    options += ["--temperature", "0", "--max-tokens", "8"]
    return CliRunner().invoke(
        cli, ["chat", "--plain", *options, *args], input=script, catch_exceptions=False
    )


def notes(result: Result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("[")]


# ---------------------------------------------------------------------- attaching
def test_attach_mid_conversation_says_only_this_conversation_reuses_it(
    tiny_models: TinyModels, tmp_path: Path, long_text: str
) -> None:
    doc = tmp_path / "notes.txt"
    doc.write_text(long_text[:2000], encoding="utf-8")
    result = plain(tiny_models, f"Hello there\n/attach {doc}\n/new\n/attach {doc}\n")
    assert result.exit_code == 0, result.output
    lines = notes(result)
    attached = [i for i, line in enumerate(lines) if line.startswith("[attached notes.txt")]
    assert len(attached) == 2, lines
    first, second = attached
    why = lines[first + 1]
    assert "mid-conversation" in why and "only this conversation reuses it" in why
    assert "attached first in a fresh chat (/new) it is reusable everywhere" in why
    assert re.search(r"after this conversation's [\d,]+ tokens", why)
    # attached first in a fresh chat: no such note (and it is prefilled: the earlier
    # copy was computed after the first conversation's tokens)
    assert re.fullmatch(r"\[attached notes\.txt: prefilled [\d,]+ tokens\]", lines[second])
    assert all("mid-conversation" not in line for line in lines[second:])


# ------------------------------------------------------------- what the chat saved
def test_a_chat_prefix_is_a_snapshot_listed_and_removable(tiny_models: TinyModels) -> None:
    with Runtime(tiny_config(tiny_models.base, n_ctx=2048)) as runtime:
        controller = ChatController(runtime, None)
        assert controller.snapshots() == []
        controller.send("What is due on Friday?", GREEDY, lambda _: None, lambda: False)
        listed = controller.snapshots()
        assert [s.label for s in listed] == ["What is due on Friday?"]
        first = listed[0]
        assert first.tokens == len(controller.chat.state.tokens) and first.bytes_on_disk > 0
        controller.set_pinned(first.id, True)
        controller.send("And on Monday?", GREEDY, lambda _: None, lambda: False)
        listed = controller.snapshots()  # the newer tip replaced the older one, pinned
        assert len(listed) == 1 and listed[0].id != first.id and listed[0].pinned
        assert listed[0].tokens == len(controller.chat.state.tokens)
        assert controller.remove_snapshot(listed[0].id) > 0
        assert controller.snapshots() == []
        controller.close()


# ------------------------------------------------------------ no noise on turn one
def test_a_fresh_chats_first_turn_reports_no_tiny_restore_or_miss(
    tiny_models: TinyModels, long_text: str
) -> None:
    long = " ".join(long_text.split()[:400])  # more than one block of 256 tokens
    script = f"Hello there\n/new\nHello there\n/new\n{long}\n/new\n{long}\n"
    result = plain(tiny_models, script)
    assert result.exit_code == 0, result.output
    turns = [line for line in notes(result) if line.startswith("[TTFT")]
    assert len(turns) == 4, notes(result)
    for line in turns[:3]:  # only template tokens (or a short turn) in common: no word
        assert "restored" not in line and "cache miss" not in line and "saved ≈" not in line
    # the same long first message again: a real restore, reported as one
    assert re.search(r"restored [\d,]+ tokens \(verified\)", turns[3]), turns[3]


# ------------------------------------------------------------------ finish reasons
def ask(tiny_models: TinyModels, tmp_path: Path, text: str, *args: str) -> Result:
    doc = tmp_path / "doc.txt"
    doc.write_text(text, encoding="utf-8")
    options = ["--model", str(tiny_models.base), "--threads", "1", "--temperature", "0"]
    return CliRunner().invoke(
        cli, ["ask", *options, *args, str(doc), "What now?"], catch_exceptions=False
    )


def test_a_full_context_ends_the_answer_with_its_reason(
    tiny_models: TinyModels, tmp_path: Path, long_text: str
) -> None:
    text = " ".join(long_text.split()[:150])
    full = ask(tiny_models, tmp_path, text, "--ctx", "256", "--max-tokens", "512", "--json")
    assert full.exit_code == 0, full.output
    answer = json.loads(full.stdout.strip().splitlines()[-1])
    assert answer["finish_reason"] == "context"
    # every position is used; the last token was sampled from the last logits
    assert answer["tokens"]["prompt"] + answer["tokens"]["generated"] == 256 + 1
    shown = ask(tiny_models, tmp_path, text, "--ctx", "256", "--max-tokens", "512")
    assert "answer stopped: the context is full (256 tokens); raise --ctx" in shown.stderr
    short = ask(tiny_models, tmp_path, text, "--ctx", "512", "--max-tokens", "3", "--json")
    answer = json.loads(short.stdout.strip().splitlines()[-1])
    assert answer["finish_reason"] == "length" and answer["tokens"]["generated"] == 3
    assert "context is full" not in short.stderr
    cut = ask(tiny_models, tmp_path, text, "--ctx", "512", "--max-tokens", "3")
    assert cut.stderr.splitlines()[-1] == "answer stopped at the token limit (--max-tokens 3)"
    assert "token limit" not in shown.stderr  # the context ended that one


def test_the_chat_says_when_the_context_filled_up(tiny_models: TinyModels) -> None:
    options = ["--model", str(tiny_models.base), "--threads", "1", "--ctx", "256"]
    options += ["--temperature", "0", "--max-tokens", "400"]
    result = CliRunner().invoke(
        cli, ["chat", "--plain", *options], input="Hello\n", catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    turn = next(line for line in notes(result) if line.startswith("[TTFT"))
    assert "answer stopped: the context is full (256 tokens); /new or raise --ctx" in turn


@pytest.mark.default_model
def test_an_answer_the_model_ends_has_finish_reason_stop(
    default_model_path: Path, tmp_path: Path
) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("The report is due on Friday.", encoding="utf-8")
    args = ["ask", "--model", str(default_model_path), "--temperature", "0", "--json"]
    args += ["--max-tokens", "200", str(doc), "When is the report due? Answer in a few words."]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer["finish_reason"] == "stop" and answer["tokens"]["generated"] < 200


# ---------------------------------------------------------------------- end of turn
END_OF_TURN = b"<|END_OF_TURN_TOKEN|>"  # command-r's; not one llama.cpp ends generation on


def _model_with_a_non_eog_end_of_turn(directory: Path, tokenizer_source: Path) -> Path:
    """The tiny model with command-r's end-of-turn token in place of ``<repo_name>``."""
    metadata = _read_header(tokenizer_source).metadata
    source = directory / "tokenizer.gguf"
    writer = gguf.GGUFWriter(source, "llama")
    for key, value in metadata.items():
        if key.startswith(TOKENIZER_KEY_PREFIX):
            data = value.value
            if key == "tokenizer.ggml.tokens":
                data = [END_OF_TURN if t == b"<repo_name>" else t for t in data]
            writer.add_key_value(key, data, value.type, sub_type=value.sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return build_tiny_llama(directory / "tiny-command-r.gguf", source)


def _favour(model: Path, token: int, over: int) -> None:
    """Make ``token`` the likelier wherever ``over`` is likely (the output is tied)."""
    reader = gguf.GGUFReader(model, "r+")
    embeddings = next(t for t in reader.tensors if t.name == "token_embd.weight").data
    embeddings[token] = embeddings[over] * 2
    reader.data.flush()


def test_the_templates_end_of_turn_stops_an_answer_where_the_model_would_not(
    tmp_path: Path, default_model_path: Path
) -> None:
    model = _model_with_a_non_eog_end_of_turn(tmp_path, default_model_path)
    params = SamplingParams(temperature=0, max_tokens=4, repeat_penalty=1)
    with ModelSession(tiny_config(model)) as session:
        prompt = session.tokenize("Hello, how are you today?")
        end = session.tokenize(END_OF_TURN.decode(), parse_special=True)
        assert len(end) == 1 and not session.is_end_of_generation(end[0])
        assert end[0] not in prompt
        session.prefill(prompt)
        first = next(session.generate(params))
    _favour(model, end[0], over=first)  # greedy now picks the end of turn first
    with Runtime(tiny_config(model, chat_template="command-r"), use_cache=False) as runtime:
        session = runtime.session
        assert runtime.template.end_of_turn == end[0] and end[0] in session.stop_tokens
        session.prefill(prompt)
        stopped = stream_answer(session, params, 0.0)
        assert stopped.ids == [] and stopped.finish_reason == "stop"
        session.reset()
        session.prefill(prompt)
        session.stop_tokens.clear()  # as before: the model alone does not stop there
        ran_on = stream_answer(session, params, 0.0)
        assert ran_on.ids[0] == end[0] and ran_on.finish_reason == "length"
    with ModelSession(tiny_config(model)) as session:  # its own template (chatml) adds none
        ChatTemplate(session)
        assert end[0] not in session.stop_tokens


# ---------------------------------------------------------------- sampling options
@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--min-p", "nan"),
        ("--min-p", "-0.1"),
        ("--min-p", "1"),
        ("--repeat-penalty", "nan"),
        ("--repeat-penalty", "-1"),
        ("--repeat-penalty", "0"),
        ("--repeat-penalty", "inf"),
    ],
)
def test_bad_sampling_values_are_usage_errors(option: str, value: str, tmp_path: Path) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("text", encoding="utf-8")
    result = CliRunner().invoke(cli, ["ask", option, value, str(doc), "Q?"])
    assert result.exit_code == 2, result.output
    assert option in result.output and "Traceback" not in result.output


def test_sampling_params_refuse_bad_values() -> None:
    for bad in ({"min_p": float("nan")}, {"repeat_penalty": -1.0}, {"repeat_last_n": -1}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)  # type: ignore[arg-type]


def test_help_explains_the_sampling_options() -> None:
    result = CliRunner().invoke(cli, ["chat", "--help"])
    assert "--min-p" in result.output and "--repeat-penalty" in result.output
    assert "looping" in result.output


@pytest.mark.default_model
def test_a_repeat_penalty_changes_a_greedy_answer(default_model_path: Path) -> None:
    question = "List the days of the week, one per line, three times."
    answers = {}
    with Runtime.open(default_model_path, use_cache=False, n_ctx=1024) as runtime:
        for penalty in (1.0, 1.3):
            params = SamplingParams(temperature=0, max_tokens=64, repeat_penalty=penalty)
            answers[penalty] = runtime.ask([], question, params=params).text
            again = runtime.ask([], question, params=params).text
            assert again == answers[penalty]  # greedy: the penalty is deterministic
    assert answers[1.0] != answers[1.3]
