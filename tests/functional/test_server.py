"""``localkv serve`` as a client sees it: a real server process on a free port.

Through the ``openai`` SDK and plain HTTP: answers, streaming, reuse of resent
histories, the disk cache across a restart, the queue, disconnects and errors.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from openai import OpenAI
from support.server import ServerProcess
from support.tinymodels import TinyModels

from localkv.cli import cli

SYSTEM = "You answer questions about the notes. Keep it short."


def tiny_args(tiny_models: TinyModels, *extra: str) -> list[str]:
    return ["--model", str(tiny_models.base), "--threads", "1", "--ctx", "2048", *extra]


@pytest.fixture()
def server(tmp_path: Path, tiny_models: TinyModels) -> Iterator[ServerProcess]:
    proc = ServerProcess(tiny_args(tiny_models), tmp_path / "server.log").start()
    yield proc
    assert proc.stop() == 0, proc.log()  # SIGTERM: finish, save, exit 0


def client(server: ServerProcess, key: str = "none") -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=300)


def post(
    server: ServerProcess, path: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any], dict[str, str]]:
    request = urllib.request.Request(
        server.base_url + path,
        data=body,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            return r.status, json.loads(r.read()), {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), {k.lower(): v for k, v in e.headers.items()}


def localkv_of(obj: Any) -> dict[str, Any]:
    extra = obj.model_extra or {}
    return extra["localkv"]  # type: ignore[no-any-return]


def chat_body(user: str, **fields: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return {"model": "tiny", "messages": messages, "temperature": 0, **fields}


# ------------------------------------------------------------------ answers
def test_models_lists_the_loaded_model_under_a_stable_id(server: ServerProcess) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny-base"]


def test_streamed_text_equals_the_answer_and_usage_comes_only_when_asked(
    server: ServerProcess,
) -> None:
    api = client(server)
    body = chat_body("What is in the notes?", max_tokens=24)
    answer = api.chat.completions.create(**body)
    text = answer.choices[0].message.content
    assert answer.usage is not None and answer.usage.completion_tokens == 24
    assert text and answer.choices[0].finish_reason == "length"

    plain = list(api.chat.completions.create(**body, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in plain if c.choices) == text
    assert all(c.usage is None and c.choices for c in plain)
    assert plain[-1].choices[0].finish_reason == "length"

    counted = list(
        api.chat.completions.create(**body, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].delta.content or "" for c in counted if c.choices) == text
    last = counted[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == answer.usage.prompt_tokens
    assert last.usage.completion_tokens == 24
    # a repeat is served from the live context: no disk read
    assert last.usage.prompt_tokens_details.cached_tokens == last.usage.prompt_tokens - 1
    assert localkv_of(last)["source"] == "live"
    assert all(c.usage is None for c in counted[:-1])


def test_a_resent_history_reuses_every_earlier_turn(server: ServerProcess) -> None:
    api = client(server)
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    previous_prompt = 0
    for i, question in enumerate(["Who wrote them?", "When?", "And why?"]):
        messages.append({"role": "user", "content": question})
        r = api.chat.completions.create(
            model="tiny", messages=messages, temperature=0, max_tokens=12
        )  # type: ignore[arg-type]
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        cached = r.usage.prompt_tokens_details.cached_tokens or 0
        if i:
            assert cached >= previous_prompt, (i, cached, previous_prompt)
            assert localkv_of(r)["diverged_at"] is None
        previous_prompt = r.usage.prompt_tokens
        messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
    # an edited history says where it stopped matching what was computed
    messages[2] = {"role": "assistant", "content": "Something else entirely."}
    messages.append({"role": "user", "content": "Sure?"})
    r = api.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=4)  # type: ignore[arg-type]
    diverged = localkv_of(r)["diverged_at"]
    assert diverged is not None and 0 < diverged < previous_prompt


def test_completions_stream_and_not(server: ServerProcess) -> None:
    api = client(server)
    done = api.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0
    )
    streamed = list(
        api.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text
    assert done.usage is not None and done.usage.completion_tokens == 16


def test_stop_sequences_end_the_answer_before_them(server: ServerProcess) -> None:
    api = client(server)
    body = chat_body("Say something.", max_tokens=40)
    full = api.chat.completions.create(**body).choices[0].message.content or ""
    stop = full[10:14]
    assert len(stop) == 4, full
    cut = api.chat.completions.create(**body, stop=[stop])
    assert cut.choices[0].message.content == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = list(api.chat.completions.create(**body, stop=stop, stream=True))
    assert (
        "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        == full[: full.index(stop)]
    )


# ------------------------------------------------------------ cache endpoints
def test_prefill_then_a_chat_reuses_it_and_the_cache_lists_it(
    server: ServerProcess, long_text: str
) -> None:
    document = long_text[:3000]
    status, report, _ = post(
        server,
        "/v1/localkv/prefill",
        json.dumps(
            {"system": SYSTEM, "documents": [{"name": "notes.txt", "text": document}], "pin": True}
        ).encode(),
    )
    assert status == 200 and report["snapshot"] and report["tokens"] > 500
    with urllib.request.urlopen(server.base_url + "/v1/localkv/cache", timeout=60) as r:
        listed = json.loads(r.read())["data"]
    assert [(s["id"], bool(s["pinned"])) for s in listed] == [(report["snapshot"], True)]
    assert list(listed[0]) == [
        *("id", "label", "model", "this_model", "tokens", "frees_bytes", "bytes_on_disk"),
        *("hits", "last_used", "pinned", "pinned_until"),
    ]
    assert (listed[0]["label"], listed[0]["this_model"]) == ("notes.txt", True)
    assert listed[0]["tokens"] == report["tokens"] and listed[0]["pinned_until"] is None
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": document},
        {"role": "user", "content": "What is this about?"},
    ]
    r = client(server).chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=4
    )  # type: ignore[arg-type]
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    assert (r.usage.prompt_tokens_details.cached_tokens or 0) >= report["tokens"]


def test_a_restart_restores_the_system_prompt_from_disk(
    tmp_path: Path, tiny_models: TinyModels, long_text: str
) -> None:
    body = {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": long_text[:6000]},
            {"role": "user", "content": "Summarize."},
        ],
        "temperature": 0,
        "max_tokens": 16,
    }
    answers = []
    for _ in range(2):
        with ServerProcess(tiny_args(tiny_models), tmp_path / "server.log") as proc:
            answers.append(client(proc).chat.completions.create(**body))
    first, second = answers
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens > 1000
    assert (
        second.usage.prompt_tokens_details.cached_tokens or 0
    ) >= 0.9 * second.usage.prompt_tokens
    assert localkv_of(second)["verified"] is True and localkv_of(second)["source"] == "disk"
    assert second.choices[0].message.content == first.choices[0].message.content


# ---------------------------------------------------------------- concurrency
def test_parallel_clients_get_the_answers_they_get_one_at_a_time(
    tmp_path: Path, tiny_models: TinyModels
) -> None:
    questions = [f"Question number {i}: what is {i} plus {i}?" for i in range(4)]
    with ServerProcess(tiny_args(tiny_models, "--queue", "4"), tmp_path / "server.log") as proc:
        api = client(proc)

        def ask(q: str) -> str:
            r = api.chat.completions.create(**chat_body(q, max_tokens=24, temperature=1.2, seed=7))
            return r.choices[0].message.content or ""

        alone = [ask(q) for q in questions]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(ask, questions))
    assert together == alone
    assert len(set(alone)) > 1  # the questions matter: the comparison is not vacuous


def _health(proc: ServerProcess) -> dict[str, Any]:
    with urllib.request.urlopen(proc.base_url + "/health", timeout=30) as r:
        return json.loads(r.read())["queue"]  # type: ignore[no-any-return]


def test_a_full_queue_answers_503_with_retry_after(tmp_path: Path, tiny_models: TinyModels) -> None:
    with ServerProcess(tiny_args(tiny_models, "--queue", "4"), tmp_path / "server.log") as proc:
        stop = threading.Event()
        long = json.dumps(chat_body("Tell me everything.", max_tokens=1900, stream=True))

        def hold() -> None:  # a long streamed answer, read until told to stop
            with httpx.stream(
                "POST",
                proc.base_url + "/v1/chat/completions",
                content=long,
                headers={"Content-Type": "application/json"},
                timeout=300,
            ) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        return

        threads = [threading.Thread(target=hold) for _ in range(4)]
        for t in threads:
            t.start()
        try:
            while (q := _health(proc))["running"] + q["waiting"] < 4:
                time.sleep(0.05)
            status, body, headers = post(
                proc, "/v1/chat/completions", json.dumps(chat_body("Hi", max_tokens=2)).encode()
            )
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert status == 503, body
        assert body["error"]["code"] == "queue_full" and set(body["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }
        assert int(headers["retry-after"]) >= 1
        # the held clients went away: the server answers again
        r = client(proc).chat.completions.create(**chat_body("Hi", max_tokens=2))
        assert r.choices[0].message.content is not None
        log = proc.log()
    assert len(re.findall(r"generated=\d+ \(\w+, cancelled\)", log)) == 4


def test_a_client_that_disconnects_stops_its_generation(server: ServerProcess) -> None:
    api = client(server)
    body = chat_body("Write a long story.", max_tokens=1500)
    full = api.chat.completions.create(**body)
    assert full.usage is not None
    assert full.usage.completion_tokens == 1500  # precondition: the uncancelled answer is long
    with httpx.stream(
        "POST",
        server.base_url + "/v1/chat/completions",
        content=json.dumps({**body, "stream": True}),
        headers={"Content-Type": "application/json"},
        timeout=300,
    ) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break  # closes the connection mid-answer
    after = api.chat.completions.create(**chat_body("Hello", max_tokens=2))
    assert after.choices[0].message.content is not None
    cancelled = re.findall(r"generated=(\d+) \(\w+, cancelled\)", server.log())
    assert len(cancelled) == 1 and int(cancelled[0]) < 1500


# ----------------------------------------------------------------- bad input
ERROR_FIELDS = {"message", "type", "param", "code"}


def test_bad_requests_get_openai_shaped_errors_and_the_server_goes_on(
    tmp_path: Path, tiny_models: TinyModels, long_text: str
) -> None:
    key = {"Authorization": "Bearer s3cret"}
    good = json.dumps(chat_body("Hi", max_tokens=2)).encode()
    too_long = json.dumps(chat_body(long_text * 3, max_tokens=2)).encode()
    cases = [
        ({}, good, 401, None),
        ({"Authorization": "Bearer wrong"}, good, 401, None),
        (key, b'{"messages": [', 400, None),
        (key, json.dumps({"model": "tiny"}).encode(), 400, "messages"),
        (
            key,
            json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(),
            400,
            "messages[0].role",
        ),
        (key, json.dumps({**chat_body("Hi"), "n": 2}).encode(), 400, "n"),
        (key, b'{"pad": "' + b"x" * (40 * 2**20) + b'"}', 413, None),
        (key, too_long, 413, "messages"),
    ]
    with ServerProcess(
        tiny_args(tiny_models, "--api-key", "s3cret"), tmp_path / "server.log"
    ) as proc:
        for headers, body, status, param in cases:
            got, error, _ = post(proc, "/v1/chat/completions", body, headers)
            assert (got, set(error["error"])) == (status, ERROR_FIELDS), (status, error)
            assert isinstance(error["error"]["message"], str) and error["error"]["message"]
            if param is not None:
                assert error["error"]["param"] == param
            assert post(proc, "/v1/chat/completions", good, key)[0] == 200  # still answering
        assert client(proc, "s3cret").models.list().data


def test_a_non_loopback_host_needs_an_api_key() -> None:
    result = CliRunner().invoke(cli, ["serve", "--host", "0.0.0.0"])
    assert result.exit_code == 2
    assert "--api-key" in result.output


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--queue", "0"], "--queue"),
        (["--queue-wait", "-1"], "--queue-wait"),
        (["--queue-wait", "nan"], "--queue-wait"),
        (["--max-tokens", "-1"], "--max-tokens"),
        (["--max-body", "10"], "--max-body"),
        (["--port", "70000"], "--port"),
        (["--api-key", "  "], "the API key is empty"),
    ],
)
def test_bad_serve_options_are_refused_before_anything_starts(args: list[str], says: str) -> None:
    result = CliRunner().invoke(cli, ["serve", *args])
    assert result.exit_code == 2
    assert says in result.output


# ------------------------------------------------------- tokens equal chat's
def test_a_resent_history_is_the_tokens_the_chat_computed(tiny_models: TinyModels) -> None:
    from support.tinymodels import tiny_config

    from localkv.model.sampling import SamplingParams
    from localkv.prompt.template import Message
    from localkv.runtime import Runtime
    from localkv.runtime.chatsession import ChatSession
    from localkv.server.conversation import AnswerMemory, build_history

    with Runtime(tiny_config(tiny_models.base), use_cache=False) as rt:
        chat = ChatSession(rt)
        chat.reset(SYSTEM)
        memory = AnswerMemory()
        for question in ("First question?", "Second one?"):
            before = len(chat.state.tokens)
            chat.send(question, SamplingParams(temperature=0, max_tokens=8))
            start = chat.state.generated[-1][0]
            assert start > before
            answer = chat.state.messages[-1].content
            ids = chat.state.tokens[start : chat.state.generated[-1][1]]
            memory.remember(chat.state.tokens[:start], answer, ids)
        replayed = build_history(
            rt.template, [Message("system", SYSTEM), *chat.state.messages[1:]], memory
        )
    assert replayed.tokens == chat.state.tokens
    assert replayed.boundaries == chat.state.boundaries
    assert replayed.generated == chat.state.generated


# ------------------------------------------------------------ default model
@pytest.mark.default_model
def test_after_a_restart_the_default_model_answers_the_same_from_the_cache(
    tmp_path: Path, default_model_path: Path, long_text: str
) -> None:
    body = {
        "model": "default",
        "messages": [
            {"role": "system", "content": "Answer from these notes.\n\n" + long_text[:8800]},
            {"role": "user", "content": "Who is sitting by her sister?"},
        ],
        "temperature": 0,
        "max_tokens": 24,
    }
    args = ["--model", str(default_model_path)]
    with ServerProcess(args, tmp_path / "first.log") as proc:
        first = client(proc).chat.completions.create(**body)
    with ServerProcess(args, tmp_path / "second.log") as proc:
        api = client(proc)
        second = api.chat.completions.create(**body)
        streamed = list(api.chat.completions.create(**body, stream=True))
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens_details is not None
    assert 1800 <= second.usage.prompt_tokens <= 2600
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    assert cached >= 0.9 * second.usage.prompt_tokens
    assert localkv_of(second)["verified"] is True
    text = first.choices[0].message.content
    assert text and second.choices[0].message.content == text
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text


def test_serve_help_names_every_route() -> None:
    from localkv.server.app import ServerSettings, create_app
    from localkv.server.worker import ModelWorker

    app = create_app(ServerSettings(), ModelWorker(lambda: None, 1))  # (the model is not loaded)
    paths = {route.path for route in app.routes}
    done = subprocess.run(
        [sys.executable, "-m", "localkv", "serve", "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    missing = sorted(p for p in paths if p not in done.stdout)
    assert missing == [], done.stdout


def test_serve_without_its_extra_says_how_to_install_it() -> None:
    code = (
        "import sys; sys.modules['uvicorn'] = None; sys.argv = ['localkv', 'serve', '--help']\n"
        "from localkv.cli import main\nmain()"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 1
    assert "`localkv serve` needs uvicorn: pip install 'localkv[serve]'" in done.stderr
    assert "Traceback" not in done.stderr
    target = re.search(r"`make (\w+)` does", done.stderr)
    assert target is not None, done.stderr  # the make target it names exists
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text(encoding="utf-8")
    assert re.search(rf"^{target.group(1)}:", makefile, re.MULTILINE), target.group(1)


def test_the_prefixes_a_server_saves_are_listed_pinned_and_removed(
    tmp_path: Path, tiny_models: TinyModels, long_text: str
) -> None:
    system = "Alice's notes. " + long_text[:3000]
    body = chat_body("Summarize.", max_tokens=4)
    body["messages"][0]["content"] = system
    with ServerProcess(tiny_args(tiny_models), tmp_path / "server.log") as proc:
        client(proc).chat.completions.create(**body)
        with urllib.request.urlopen(proc.base_url + "/v1/localkv/cache", timeout=60) as r:
            served = json.loads(r.read())["data"]
    label = "server: Alice's notes. Chapter 0. Alice was…"
    assert [(s["label"], s["model"], s["hits"]) for s in served] == [(label, "tiny-base", 0)]
    with ServerProcess(tiny_args(tiny_models), tmp_path / "server.log") as proc:
        again = client(proc).chat.completions.create(**body)
        assert localkv_of(again)["source"] == "disk" and localkv_of(again)["cached_tokens"] > 500
        answer = {"role": "assistant", "content": again.choices[0].message.content or ""}
        body["messages"] += [answer, {"role": "user", "content": "And then?"}]
        client(proc).chat.completions.create(**body)  # the conversation goes on
    listed = json.loads(CliRunner().invoke(cli, ["cache", "ls", "--json"]).stdout)
    (snap,) = listed  # the longer prefix replaced the earlier one, with its hit
    assert snap["label"] == f"{label} · Summarize. · 2 turns" and snap["hits"] == 1
    assert snap["tokens"] > served[0]["tokens"]
    assert CliRunner().invoke(cli, ["cache", "pin", snap["id"]]).exit_code == 0
    listed = json.loads(CliRunner().invoke(cli, ["cache", "ls", "--json"]).stdout)
    assert listed[0]["pinned"] is True
    assert CliRunner().invoke(cli, ["cache", "rm", snap["id"]]).exit_code == 0
    assert json.loads(CliRunner().invoke(cli, ["cache", "ls", "--json"]).stdout) == []
