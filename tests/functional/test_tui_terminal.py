"""A new user in a real terminal: ``localkv chat`` answers a question with the default model.

The chat runs in a detached 80x24 tmux session (its own server socket) with a
fresh LOCALKV_HOME; the tests type as a user would, read the pane, quit, and
check the exit status. A model that fails to load is explained on screen too.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.tinymodels import TinyModels

TMUX = shutil.which("tmux")
QUESTION = "What is the capital of France?"

pytestmark = pytest.mark.skipif(
    TMUX is None, reason="tmux is not installed: the terminal tests need it"
)


class Terminal:
    """A private tmux server whose one pane runs ``command`` (and stays after it exits)."""

    def __init__(self, socket: str, directory: Path, command: str) -> None:
        assert TMUX is not None
        config = directory / f"{socket}.conf"
        config.write_text("set -g remain-on-exit on\n")
        self.status_file = directory / f"{socket}.status"
        self.base = [TMUX, "-L", socket, "-f", str(config)]
        command = f"{command}; echo $? > {shlex.quote(str(self.status_file))}"
        self.tmux("new-session", "-d", "-s", "chat", "-x", "80", "-y", "24", command)

    def tmux(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.base, *args], capture_output=True, text=True, timeout=30)

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "chat").stdout

    def alive(self) -> bool:
        """Whether the pane's command still runs: only a pane tmux calls dead is dead
        (a busy tmux that answers nothing yet is asked again, until the deadline)."""
        shown = self.tmux("display-message", "-p", "-t", "chat", "#{pane_dead}")
        return shown.stdout.strip() != "1"

    def quit(self, keys: str) -> int:
        """Press ``keys``; the command's exit status."""
        self.keys(keys)
        deadline = time.monotonic() + 30
        while not self.status_file.exists() or not self.status_file.read_text().strip():
            if time.monotonic() > deadline:
                raise AssertionError(f"the command did not exit:\n{self.screen()}")
            time.sleep(0.25)
        return int(self.status_file.read_text())

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "chat", *keys)

    def wait(self, condition: Callable[[str], bool], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.screen()
            if condition(text):
                return text
            if time.monotonic() > deadline or not self.alive():
                raise AssertionError(f"the screen never showed what was expected:\n{text}")
            time.sleep(0.25)

    def close(self) -> None:
        self.tmux("kill-server")


@pytest.fixture()
def start(tmp_path: Path) -> Iterator[Callable[[str], Terminal]]:
    """Starts ``localkv chat ARGS`` in a terminal, with a fresh LOCALKV_HOME."""
    started: list[Terminal] = []

    def starter(args: str) -> Terminal:
        home = shlex.quote(str(tmp_path / "home"))
        memory = 16 << 30  # the memory the default context is chosen for, not the machine's
        environment = (
            f"env -u LOCALKV_MODEL LOCALKV_HOME={home} LOCALKV_MEMORY={memory} TERM=xterm-256color"
        )
        command = f"{environment} {shlex.quote(sys.executable)} -m localkv chat {args}"
        socket = f"localkv-test-{os.getpid()}-{len(started)}"
        started.append(Terminal(socket, tmp_path, command))
        return started[-1]

    yield starter
    for term in started:
        term.close()


@pytest.mark.default_model
def test_a_new_user_asks_a_question_and_gets_an_answer(
    start: Callable[[str], Terminal], default_model_path: Path
) -> None:
    terminal = start("--temperature 0 --max-tokens 48")
    terminal.wait(lambda s: "Enter sends" in s and "8,192 tokens" in s, timeout=120)
    terminal.keys("-l", QUESTION)
    terminal.keys("Enter")
    screen = terminal.wait(lambda s: "tok/s" in s and _answer(s), timeout=120)
    assert "TTFT" in screen and "Traceback" not in screen
    assert "Paris" in _answer(screen), screen  # greedy SmolLM2 knows this one
    assert terminal.quit("C-q") == 0, terminal.screen()
    assert "Traceback" not in terminal.screen()  # nothing left behind on the terminal


def test_a_model_that_does_not_load_is_explained_on_screen(
    start: Callable[[str], Terminal], tmp_path: Path
) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(64))
    terminal = start(f"--model {shlex.quote(str(bad))}")
    screen = terminal.wait(lambda s: "could not be loaded" in s, timeout=60)
    assert "llama.cpp could not load" in screen and "Traceback" not in screen
    assert terminal.quit("q") == 1, terminal.screen()


def test_resume_in_a_smaller_context_exits_before_the_app_opens(
    start: Callable[[str], Terminal], tmp_path: Path, tiny_models: TinyModels
) -> None:
    model = shlex.quote(str(tiny_models.base))
    base = f"--model {model} --threads 1 --temperature 0 --max-tokens 4"
    made = subprocess.run(
        [sys.executable, "-m", "localkv", "chat", "--plain", *shlex.split(base), "--ctx", "1024"],
        input="Tell me everything about the fox and the long road home. " * 30 + "\n",
        env={**os.environ, "LOCALKV_HOME": str(tmp_path / "home")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    terminal = start(f"{base} --ctx 256 --resume")
    assert terminal.quit("") == 1, terminal.screen()  # it never waited for a key
    # the whole pane, its history too, wrapped lines joined
    shown = terminal.tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "chat").stdout
    lines = [line for line in shown.splitlines() if line.strip()]
    (line,) = [line for line in lines if not line.startswith("Pane is dead")]
    assert line.startswith("Error: cannot resume: “Tell me everything"), shown
    assert line.endswith("resume with --ctx 1024") and "Traceback" not in shown


def _answer(screen: str) -> str:
    """The conversation column's text between the question and the status line."""
    lines = screen.splitlines()
    asked = [i for i, line in enumerate(lines) if QUESTION in line]
    status = [i for i, line in enumerate(lines) if "TTFT" in line]
    if not asked or not status:
        return ""
    column = [line[:50].strip(" ▌") for line in lines[asked[0] + 1 : status[0]]]
    return " ".join(text for text in column if text)
