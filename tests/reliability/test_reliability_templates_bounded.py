"""Chat templates that loop, fill memory or fail end in one line naming the template.

A chat template is code that comes with the model file. Each attack here is carried by
a tiny model's GGUF (``tokenizer.chat_template``) and tried in every face: ``ask``,
``chat --plain`` and ``serve``, each a real process. A template the load check stops
(it renders conversations of up to ``CHECKED_MESSAGES`` messages, with tools and
without) is refused before any work: exit 2 for ``ask`` and ``chat``, the server's
one-line load error. One that fails only on a longer conversation fails that request:
exit 2 for ``ask``, a note and a chat that goes on for ``chat``, a 500 that names the
template for ``serve``, whose worker answers the next request. A constant a template
never reaches costs nothing, even ``'a' * 400000000``, which jinja2's optimizer
computed when the template compiled.

Every run must end within ``BOUND_S`` (an unbounded render ran until killed) with the
process's peak resident memory under ``CEILING_MB``: a few times what these commands
take on the tiny model, far below what the folded constant cost.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.reliability import record
from support.server import ServerProcess, free_port
from support.tinymodels import build_tiny_with_template

from localkv.prompt.renderbudget import RenderLimits, UnsafeTemplateError
from localkv.prompt.sandbox import BoundedEnvironment
from localkv.prompt.templatechoice import CHECKED_MESSAGES

BOUND_S = 60.0  # generous: a render stops within its limits, which take about a second
CEILING_MB = 300
NAMED = "the chat template of tiny.gguf"

BASE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
LATE = "{% if messages|length > " + str(CHECKED_MESSAGES) + " %}"  # past the load check
HUGE = "{{ 'a' * 400000000 }}"
STEPS = "ran past its limit of"
CHARS = "would build more than its limit of"
NOT_UNICODE = "wrote text that is not Unicode"
ZERO = "failed: ZeroDivisionError"

# name -> (template, what the error says)
FIFTH = "{% if messages|length > 4 %}"
REFUSED_AT_LOAD = {
    "loop": (LOOP + BASE, STEPS),
    "loop from the 5th message": (FIFTH + LOOP + "{% endif %}" + BASE, STEPS),
    "lone surrogate": (BASE + "{{ '\\ud800' }}", NOT_UNICODE),
}
FAILS_LATE = {
    "late loop": (LATE + LOOP + "{% endif %}" + BASE, STEPS),
    "late 1 // 0": (LATE + "{{ 1 // 0 }}{% endif %}" + BASE, ZERO),
    "late lone surrogate": (LATE + "{{ '\\ud800' }}{% endif %}" + BASE, NOT_UNICODE),
    "late huge string": (LATE + HUGE + "{% endif %}" + BASE, CHARS),
}
FOLDED = "{% if false %}" + HUGE + "{% endif %}" + BASE


@dataclass(frozen=True)
class Run:
    code: int
    stdout: str
    stderr: str
    seconds: float
    peak_mb: float


# runs a command and writes its peak resident memory (kB) to argv[1]: a small process, so
# the peak is the command's own (a child forked from pytest starts with pytest's)
_LAUNCHER = (
    "import resource, subprocess, sys; code = subprocess.call(sys.argv[2:]); "
    "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); "
    "sys.exit(code)"
)


def _run(args: list[str], stdin: str = "", timeout: float = BOUND_S) -> Run:
    """``python -m localkv ARGS``: its exit status, output, time and peak memory."""
    with tempfile.TemporaryDirectory() as tmp:
        peak = Path(tmp) / "peak"
        command = [sys.executable, "-c", _LAUNCHER, str(peak), sys.executable, "-m", "localkv"]
        t0 = time.monotonic()
        with subprocess.Popen(
            [*command, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        ) as proc:
            try:
                out, err = proc.communicate(stdin, timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                pytest.fail(f"localkv {args[0]} still ran after {timeout:.0f} s")
        seconds = time.monotonic() - t0
        return Run(proc.returncode, out, err, seconds, int(peak.read_text()) / 1024)


@pytest.fixture(scope="module")
def model(
    tmp_path_factory: pytest.TempPathFactory, default_model_path: Path
) -> Callable[[str], Path]:
    """A tiny model carrying a template, built once per template."""
    built: dict[str, Path] = {}

    def build(template: str) -> Path:
        if template not in built:
            directory = tmp_path_factory.mktemp("template")
            built[template] = build_tiny_with_template(directory, default_model_path, template)
        return built[template]

    return build


def _options(path: Path) -> list[str]:
    return ["--model", str(path), "--threads", "1", "--ctx", "512", "--no-cache"]


def _one_error(run: Run, says: str) -> str:
    """The one line of a failed command: ``Error: ...`` naming the template and ``says``."""
    assert "Traceback" not in run.stderr, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, run.stderr
    assert NAMED in errors[0] and says in errors[0], errors[0]
    return errors[0]


def _bounded(run: Run, test: str, face: str) -> None:
    record(test, face=face, seconds=round(run.seconds, 2), peak_mb=round(run.peak_mb))
    assert run.seconds < BOUND_S
    assert run.peak_mb < CEILING_MB, f"{face} peaked at {run.peak_mb:.0f} MB"


def _ask(path: Path, tmp_path: Path, documents: int = 1) -> Run:
    doc = tmp_path / "doc.txt"
    doc.write_text("Paris is the capital of France.", encoding="utf-8")
    args = ["ask", *_options(path), "--max-tokens", "1", *[str(doc)] * documents, "Where?"]
    return _run(args)


def _chat(path: Path, lines: list[str]) -> Run:
    args = ["chat", "--plain", *_options(path), "--max-tokens", "1"]
    return _run(args, "".join(f"{line}\n" for line in lines))


# ------------------------------------------------------------ refused at load
@pytest.mark.parametrize("attack", REFUSED_AT_LOAD)
def test_a_template_the_load_check_stops_is_refused_by_ask_and_chat(
    attack: str, model: Callable[[str], Path], tmp_path: Path
) -> None:
    template, says = REFUSED_AT_LOAD[attack]
    path = model(template)
    for face, run in (("ask", _ask(path, tmp_path)), ("chat", _chat(path, ["Hello"]))):
        assert run.code == 2, run.stderr
        line = _one_error(run, says)
        assert "--chat-template" in line  # how to use the model anyway
        _bounded(run, f"template refused at load: {attack}", face)


@pytest.mark.parametrize("attack", REFUSED_AT_LOAD)
def test_a_template_the_load_check_stops_is_the_servers_load_error(
    attack: str, model: Callable[[str], Path]
) -> None:
    template, says = REFUSED_AT_LOAD[attack]
    args = ["serve", "--port", str(free_port()), *_options(model(template))]
    run = _run(args)
    assert run.code == 2, run.stderr
    line = _one_error(run, says)
    assert line.startswith("Error: the model could not be loaded: the chat template")
    _bounded(run, f"template refused at load: {attack}", "serve")


# ------------------------------------------- fails on a longer conversation
@pytest.mark.parametrize("attack", FAILS_LATE)
def test_a_template_that_fails_on_a_longer_conversation_fails_ask(
    attack: str, model: Callable[[str], Path], tmp_path: Path
) -> None:
    template, says = FAILS_LATE[attack]
    path = model(template)
    assert _ask(path, tmp_path, documents=2).code == 0  # a shorter conversation is answered
    run = _ask(path, tmp_path, documents=CHECKED_MESSAGES + 1)
    assert run.code == 2, run.stderr
    _one_error(run, says)
    _bounded(run, f"template fails late: {attack}", "ask")


@pytest.mark.parametrize("attack", FAILS_LATE)
def test_a_template_that_fails_on_a_longer_conversation_is_a_note_in_chat(
    attack: str, model: Callable[[str], Path]
) -> None:
    template, says = FAILS_LATE[attack]
    turns = CHECKED_MESSAGES // 2 + 1  # the last one makes a conversation past the check
    run = _chat(model(template), [f"Line {i}" for i in range(turns)] + ["/new", "Hello"])
    assert run.code == 0 and "Traceback" not in run.stderr, run.stderr
    notes = [line for line in run.stderr.splitlines() if "not answered" in line]
    assert len(notes) == 1 and NAMED in notes[0] and says in notes[0], run.stderr
    assert notes[0].endswith("Type /new to start over.]")
    answered = [line for line in run.stderr.splitlines() if line.startswith("[TTFT")]
    assert len(answered) == turns  # every other line, and the one after /new
    _bounded(run, f"template fails late: {attack}", "chat")


@pytest.mark.parametrize("attack", FAILS_LATE)
def test_a_template_that_fails_on_a_longer_conversation_is_a_500_naming_it(
    attack: str, model: Callable[[str], Path], tmp_path: Path
) -> None:
    template, says = FAILS_LATE[attack]
    with ServerProcess(_options(model(template)), tmp_path / "serve.log") as server:
        t0 = time.monotonic()
        status, reply = _post(server, CHECKED_MESSAGES + 1)
        seconds = time.monotonic() - t0
        assert status == 500, reply
        message = reply["error"]["message"]
        assert NAMED in message and says in message, message
        assert reply["error"]["code"] == "template_error", reply
        assert _post(server, 1)[0] == 200  # the worker is free again
        peak = _server_peak_mb(server.pid)
        log = server.log()
    assert "Traceback" not in message and "Traceback" not in log, log[-3000:]
    record(f"template fails late: {attack}", face="serve", seconds=round(seconds, 2), peak_mb=peak)
    assert seconds < BOUND_S
    assert peak < CEILING_MB


def _post(server: ServerProcess, n_messages: int) -> tuple[int, dict[str, Any]]:
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"Message {i}"}
        for i in range(n_messages)
    ]
    body = json.dumps({"model": "tiny", "messages": messages, "max_tokens": 1}).encode()
    request = urllib.request.Request(
        server.base_url + "/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=BOUND_S) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except TimeoutError:
        pytest.fail(f"no answer within {BOUND_S:.0f} s")


def _server_peak_mb(pid: int) -> int:
    """The server's peak resident memory so far (``VmHWM``)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) // 1024
    raise AssertionError("no VmHWM")


# ----------------------------------------------------- a constant never reached
def test_a_huge_constant_behind_if_false_costs_no_memory(
    model: Callable[[str], Path], tmp_path: Path
) -> None:
    path = model(FOLDED)
    for face, run in (("ask", _ask(path, tmp_path)), ("chat", _chat(path, ["Hello"]))):
        assert run.code == 0 and "Traceback" not in run.stderr, run.stderr
        _bounded(run, "constant behind if false", face)
    with ServerProcess(_options(path), tmp_path / "serve.log") as server:
        assert _post(server, 3)[0] == 200
        peak = _server_peak_mb(server.pid)
    record("constant behind if false", face="serve", peak_mb=peak)
    assert peak < CEILING_MB


# ------------------------------------------------------------- the sandbox
AMPLIFIERS = {
    "repetition": "{{ 'a' * 400000000 }}",
    "list repetition": "{{ [1] * 100000000 }}",
    "power": "{{ 7 ** 1000000 }}",
    "doubling with +": "{% set ns = namespace(x='ab') %}"
    "{% for i in range(64) %}{% set ns.x = ns.x + ns.x %}{% endfor %}",
    "doubling with ~": "{% set ns = namespace(x='ab') %}"
    "{% for i in range(64) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}",
    "printf width": "{{ '%999999999d' % 1 }}",
    "format width": "{{ '{:>999999999}'.format(1) }}",
    "center": "{{ 'a'|center(999999999) }}",
    "indent": "{{ ('a\\n' * 100000)|indent(100000) }}",
    "replace": "{{ ('a' * 100000).replace('a', 'b' * 100000) }}",
    "join": "{{ ('a' * 100000).join('b' * 100000) }}",
    "join filter": "{{ range(100000)|join('x' * 100000) }}",
    "tojson indent": "{{ [[[[1]]]]|tojson(indent=999999999) }}",
    "lipsum": "{{ lipsum(10000000) }}",
    "text in a loop": "{% for i in range(100000) %}{% for j in range(1000) %}"
    + "x" * 1000
    + "{% endfor %}{% endfor %}",
    "a macro's text in a loop": "{% macro m() %}" + "x" * 100000 + "{% endmacro %}"
    "{% for i in range(100000) %}{{ m() }}{% endfor %}",
}


@pytest.mark.parametrize("attack", AMPLIFIERS)
def test_a_value_past_the_budget_is_refused_before_it_is_built(attack: str) -> None:
    tracemalloc.start()
    try:
        template = BoundedEnvironment().from_string(AMPLIFIERS[attack])
        with pytest.raises(UnsafeTemplateError) as failed:
            template.render(messages=[])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "limit" in str(failed.value) or "digits" in str(failed.value)
    assert peak < 64 << 20, f"{attack}: {peak >> 20} MiB"


def test_a_loop_stops_at_its_step_limit_and_a_slow_one_at_its_time_limit() -> None:
    many = BoundedEnvironment(RenderLimits(steps=5_000, steps_per_item=100))
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(UnsafeTemplateError, match="limit of 5,200 steps"):
        many.from_string(loop).render(messages=[{"role": "user", "content": "U"}] * 2)
    assert many.from_string("{% for i in range(4000) %}{% endfor %}ok").render() == "ok"
    slow = BoundedEnvironment(RenderLimits(steps=10**15, seconds=0.2))
    with pytest.raises(UnsafeTemplateError, match=r"time limit of 0\.2 s"):
        slow.from_string(loop).render()
