"""A real ``localkv serve`` process on a free port, for HTTP tests and benchmarks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["ServerProcess", "free_port"]

STARTUP_LIMIT_S = 180.0  # generous: the machine is shared; a model load takes seconds


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """``python -m localkv [GLOBAL] serve ARGS`` with its log in ``log_path``; a context manager.

    ``global_args`` go before ``serve`` (``-vv``: debug log lines).
    """

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        global_args: tuple[str, ...] = (),
    ) -> None:
        self.args = args
        self.global_args = list(global_args)
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        log = self.log_path.open("ab")
        cmd = [
            sys.executable,
            "-m",
            "localkv",
            *self.global_args,
            "serve",
            "--port",
            str(self.port),
        ]
        cmd += self.args
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        self.wait_ready()
        return self

    def wait_ready(self) -> None:
        """Poll ``/health`` until it answers 200 (the model is loaded)."""
        deadline = time.monotonic() + STARTUP_LIMIT_S
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the server did not become ready:\n{self.log()}")

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM, then wait; the exit status."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("the server is not running")
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def post(server: ServerProcess, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
    """POST ``body`` as JSON to ``path``: the status and the decoded reply, errors too."""
    request = urllib.request.Request(
        server.base_url + path, data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
