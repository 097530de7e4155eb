"""Real coding-agent clients against a real ``localkv serve``: where they are, the
server they talk to, and what its log says each request read from the cache.

The clients are installed by ``make agents`` under ``build/agents/`` at the versions
pinned beside this file (``package.json`` and its lock for the npm clients,
``requirements-*.txt`` for the Python ones, each in a virtual environment of its
own), never globally. Each test runs its client with a home directory of its own
and no environment but what it names, so nothing of the caller's configuration
(keys, base URLs, settings files) takes part.

"Read from the cache" is measured on the server's side: every request's log line
says its prompt tokens and how many were restored (``prompt=P cached=R ...
(source)``), the same figures every response's usage carries.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.server import ServerProcess, free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
AGENTS = REPO / "build" / "agents"
NPM_BIN = AGENTS / "npm" / "node_modules" / ".bin"

# Every test module of the set carries these marks: skipped unless ``-m agents``.
AGENTS_ONLY = [
    pytest.mark.agents,
    pytest.mark.skipif(
        "'agents' not in (config.getoption('markexpr') or '')",
        reason="real coding-agent clients, minutes each: make agents (pytest -m agents)",
    ),
]

CONTEXT = 32768  # what the README tells agent users to pass as --ctx
OUTPUT_CAP = 24  # tokens per answer: the test model seldom stops by itself
CLIENT_LIMIT_S = 1800.0  # liveness only: a cold 28k-token prompt takes minutes on a CPU

LINE = re.compile(
    r"localkv\.server: (?P<method>[A-Z]+) (?P<path>/\S*) (?P<status>\d{3}|-)"
    r"(?: prompt=(?P<prompt>\d+) cached=(?P<cached>\d+) generated=(?P<generated>\d+)"
    r" \((?P<source>\w+))?"
)


@dataclass(frozen=True)
class Logged:
    """One request as the server's log line tells it."""

    method: str
    path: str
    status: int
    prompt: int
    cached: int
    generated: int
    source: str

    def __str__(self) -> str:
        return (
            f"{self.method} {self.path} {self.status} prompt={self.prompt} "
            f"cached={self.cached} ({self.source})"
        )


@dataclass(frozen=True)
class Turn:
    """What one client command did: its output and the requests it made."""

    args: tuple[str, ...]
    output: str
    requests: tuple[Logged, ...]
    seconds: float

    @property
    def answered(self) -> tuple[Logged, ...]:
        """The requests that ran the model (a log line with token counts)."""
        return tuple(r for r in self.requests if r.source != "-")

    @property
    def prompt(self) -> int:
        return sum(r.prompt for r in self.answered)

    @property
    def cached(self) -> int:
        return sum(r.cached for r in self.answered)

    @property
    def share(self) -> float:
        """The part of the turn's prompt tokens restored from the live context or disk."""
        return self.cached / self.prompt if self.prompt else 0.0

    def __str__(self) -> str:
        lines = "\n  ".join(str(r) for r in self.requests)
        command = " ".join(a if len(a) < 40 else a[:36] + "..." for a in self.args[1:])
        command = command.replace("\n", " ")
        return (
            f"{Path(self.args[0]).name} {command}: {self.cached}/{self.prompt} cached "
            f"({self.share:.1%}) in {self.seconds:.0f} s\n  {lines}"
        )


def parse_log(text: str) -> list[Logged]:
    """The requests a server log tells of, in order."""
    found = []
    for match in LINE.finditer(text):
        status = match["status"]
        found.append(
            Logged(
                method=match["method"],
                path=match["path"],
                status=int(status) if status != "-" else 0,
                prompt=int(match["prompt"] or 0),
                cached=int(match["cached"] or 0),
                generated=int(match["generated"] or 0),
                source=match["source"] or "-",
            )
        )
    return found


class Served:
    """``localkv serve`` on one model, on one port and one cache across restarts."""

    def __init__(self, model: Path, where: Path, extra: Sequence[str] = ()) -> None:
        self.args = [
            "--model",
            str(model),
            "--ctx",
            str(CONTEXT),
            "--max-tokens",
            str(OUTPUT_CAP),
            *extra,
        ]
        self.log_path = where / "server.log"
        self.home = where / "localkv-home"
        self.port = free_port()
        self.proc: ServerProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Served:
        proc = ServerProcess(self.args, self.log_path, env={"LOCALKV_HOME": str(self.home)})
        proc.port = self.port  # a restart keeps the address the clients were given
        self.proc = proc.start()
        return self

    def stop(self) -> None:
        if self.proc is not None:
            assert self.proc.stop() == 0, self.proc.log()[-4000:]
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def requests(self) -> list[Logged]:
        """The clients' requests so far (not the readiness checks of these tests)."""
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return [r for r in parse_log(text) if r.path != "/health"]

    def idle(self) -> None:
        """Return once no request runs or waits (its log line is then written)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
                queue = json.loads(r.read())["queue"]
            if queue["running"] == 0 and queue["waiting"] == 0:
                return
            time.sleep(0.2)
        raise AssertionError("the server did not go idle")


def client_env(home: Path, **settings: str) -> dict[str, str]:
    """Only what a client needs to run, plus the settings the README gives it."""
    home.mkdir(parents=True, exist_ok=True)
    node = shutil.which("node")
    path = [str(NPM_BIN)]
    if node is not None:
        path.append(str(Path(node).parent))
    path += ["/usr/local/bin", "/usr/bin", "/bin"]
    return {
        "PATH": os.pathsep.join(path),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        **settings,
    }


def run_turn(served: Served, args: Sequence[str], *, cwd: Path, env: dict[str, str]) -> Turn:
    """Run one client command to its end; it must succeed and get no error answer."""
    before = len(served.requests())
    t0 = time.monotonic()
    done = subprocess.run(
        list(args),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=CLIENT_LIMIT_S,
        stdin=subprocess.DEVNULL,
    )
    seconds = time.monotonic() - t0
    served.idle()
    made = tuple(served.requests()[before:])
    output = f"{done.stdout}\n{done.stderr}"
    turn = Turn(args=tuple(args), output=output, requests=made, seconds=seconds)
    print(turn)  # the figures for the report: pytest -s shows them
    assert done.returncode == 0, f"{args[0]} exited {done.returncode}:\n{output[-3000:]}"
    failed = [str(r) for r in made if r.status >= 400 or r.status == 0]
    assert not failed, f"error answers: {failed}\n{output[-3000:]}"
    assert turn.answered, f"no request reached the model:\n{output[-3000:]}"
    return turn


def npm_client(name: str) -> Path:
    """An npm client's command as ``make agents`` installed it."""
    path = NPM_BIN / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make agents` (it installs the pinned clients)")
    return path


def venv_client(venv: str, name: str) -> Path:
    """A Python client's command in its own virtual environment under build/agents."""
    path = AGENTS / venv / "bin" / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make agents` (it installs the pinned clients)")
    return path


def pinned_npm_version(package: str) -> str:
    return str(json.loads((HERE / "package.json").read_text())["dependencies"][package])


def pinned_pip_version(venv: str, distribution: str) -> str:
    for line in (HERE / f"requirements-{venv}.txt").read_text().splitlines():
        name, _, version = line.partition("==")
        if name.strip().lower() == distribution:
            return version.strip()
    raise AssertionError(f"{distribution} is not pinned in requirements-{venv}.txt")


def version_of(command: Sequence[str], env: dict[str, str]) -> str:
    done = subprocess.run(
        list(command), env=env, capture_output=True, text=True, timeout=120, check=False
    )
    return f"{done.stdout}{done.stderr}".strip()
