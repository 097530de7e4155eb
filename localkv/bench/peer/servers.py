"""The two servers as processes: ``localkv serve`` and llama.cpp's ``llama-server``.

``Server`` starts one process on a free port with its output in a log file, waits
(bounded) for its ``/health`` to answer 200, reads the CPU time it has used
(``/proc/PID/stat``) and stops it: SIGTERM, then SIGKILL past a bound. Every started
process is stopped when the bench exits, however it exits (``stop_all``, registered
with ``atexit``). ``localkv_server`` and ``llama_server`` build the two commands from
one ``Setting``: the same model, context, threads and flash attention (off).
"""

from __future__ import annotations

import atexit
import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from localkv.model.native import CHOSEN_MARK, WAIT_SETTINGS

__all__ = ["Server", "Setting", "llama_server", "localkv_server", "stop_all"]

START_LIMIT_S = 300.0  # a model load on a shared machine
STOP_LIMIT_S = 60.0
_RUNNING: set[Server] = set()


class ServerStartError(RuntimeError):
    """A server exited, or did not answer its health check in time."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Setting:
    """What both servers share: the model, the context of one slot, the threads."""

    model: Path
    n_ctx: int
    threads: int


def _environ() -> dict[str, str]:
    """This process's environment without the OpenMP wait localkv chose for it when it
    loaded llama.cpp (``native.CHOSEN_MARK``): each server waits as it would when a user
    starts it (localkv choosing its own, llama-server libgomp's default). A wait the user
    set stays, for both."""
    env = dict(os.environ)
    if env.get(CHOSEN_MARK) == " ".join(f"{n}={env.get(n, '')}" for n in WAIT_SETTINGS):
        for name in (*WAIT_SETTINGS, CHOSEN_MARK):
            env.pop(name, None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


class Server:
    """One server process, started and stopped as often as a measurement needs."""

    def __init__(self, *, name: str, command: Sequence[str], env: dict[str, str], log: Path):
        self.name, self.env, self.log = name, env, log
        self.port = _free_port()
        self.command = [*command, "--port", str(self.port)]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env
            )
        _RUNNING.add(self)
        deadline = time.monotonic() + START_LIMIT_S
        while not _healthy(self.port):
            if self.proc.poll() is not None:
                self.stop()
                raise ServerStartError(
                    f"{self.name} exited ({self.proc.returncode}); see {self.log}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"{self.name} was not ready in {START_LIMIT_S:g} s")
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        """SIGTERM and wait; SIGKILL if it has not exited within the bound."""
        proc, self.proc = self.proc, None
        _RUNNING.discard(self)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_LIMIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def restart(self) -> Server:
        self.stop()
        return self.start()

    def cpu_s(self) -> float:
        """User and system CPU seconds the process has used, all its threads together."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} is not running")
        stat = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_all() -> None:
    """Stop every server still running (the bench's exit)."""
    for server in list(_RUNNING):
        server.stop()


atexit.register(stop_all)


def localkv_server(setting: Setting, *, home: Path, cache: bool = True) -> Server:
    """``localkv serve`` with its cache under ``home`` (``cache=False``: ``--no-cache``)."""
    home.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "localkv", "serve", "--model", str(setting.model)]
    command += ["--ctx", str(setting.n_ctx), "--threads", str(setting.threads)]
    command += ["--flash-attn", "off", *([] if cache else ["--no-cache"])]
    env = {k: v for k, v in _environ().items() if not k.startswith("LOCALKV_")}
    env["LOCALKV_HOME"] = str(home)
    name = "localkv" if cache else "localkv --no-cache"
    return Server(name=name, command=command, env=env, log=home / "server.log")


def llama_server(
    setting: Setting, binary: Path, *, work: Path, parallel: int = 1, slots: Path | None = None
) -> Server:
    """llama-server with ``parallel`` slots of the setting's context each (its RAM prompt
    cache at its default size); ``slots``: the folder of ``--slot-save-path``."""
    work.mkdir(parents=True, exist_ok=True)
    command = [str(binary), "-m", str(setting.model), "--host", "127.0.0.1"]
    command += ["-c", str(setting.n_ctx * parallel), "-np", str(parallel)]
    command += ["-t", str(setting.threads), "-tb", str(setting.threads), "-fa", "off"]
    command += ["--no-webui"]
    name = f"llama-server -np {parallel}"
    if slots is not None:
        slots.mkdir(parents=True, exist_ok=True)
        command += ["--slot-save-path", str(slots)]
        name += " --slot-save-path"
    env = {k: v for k, v in _environ().items() if not k.startswith("LLAMA_ARG_")}
    return Server(name=name, command=command, env=env, log=work / "server.log")
