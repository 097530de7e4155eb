"""Requests sent together wait their turn: real ``localkv serve`` processes, tiny model.

Agents send requests at once (a title request beside the turn, subagents). While
one answer holds the model, the others wait in order of arrival up to the bound
(``--queue`` admitted, ``--queue-wait`` seconds each) and then all get their
answer; past the bound a request gets 503 with Retry-After at once, while the
model is still busy; a waiting request whose client leaves is dropped at once
and never runs; SIGTERM cancels the waiting ones. What is asserted is counted
(statuses, the queue's counts in /health, the log's lines), never timed: the
answer that holds the model runs until the test lets it go.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from support.server import ServerProcess
from support.tinymodels import TinyModels

WAIT_S = 120.0  # liveness only: how long a condition of the queue may take to show
RUN = re.compile(r"POST /v1/chat/completions \d+ prompt=")  # the log line of a request that ran


def serve(tmp_path: Path, tiny_models: TinyModels, *extra: str) -> ServerProcess:
    """A server whose answers without a limit run until the (large) context is full."""
    args = ["--model", str(tiny_models.base), "--threads", "1", "--ctx", "32768"]
    return ServerProcess([*args, "--max-tokens", "0", *extra], tmp_path / "server.log")


def body(user: str, **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": user}], "temperature": 0, **fields}


def queue(proc: ServerProcess) -> dict[str, Any]:
    r = httpx.get(proc.base_url + "/health", timeout=30)
    return r.json()["queue"]  # type: ignore[no-any-return]


def until(proc: ServerProcess, running: int, waiting: int) -> None:
    """Wait until /health counts these (liveness only)."""
    deadline = threading.Event()
    timer = threading.Timer(WAIT_S, deadline.set)
    timer.start()
    try:
        while not deadline.is_set():
            q = queue(proc)
            if (q["running"], q["waiting"]) == (running, waiting):
                return
            deadline.wait(0.05)
        raise AssertionError(f"the queue never held {running} + {waiting}: {queue(proc)}")
    finally:
        timer.cancel()


def done(futures: list[Future[httpx.Response]], n: int) -> list[Future[httpx.Response]]:
    """The first ``n`` of ``futures`` to be done, once they are (liveness only)."""
    finished: list[Future[httpx.Response]] = []
    for f in as_completed(futures, timeout=WAIT_S):
        finished.append(f)
        if len(finished) == n:
            break
    return finished


@contextmanager
def held(proc: ServerProcess, *, check: bool = True) -> Iterator[None]:
    """A streamed answer with no limit holds the model until the block ends (its client
    then leaves)."""
    long = body("Tell me everything.", stream=True)
    with httpx.stream("POST", proc.base_url + "/v1/chat/completions", json=long) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: a dropped iterator closes the response
        next(lines)  # it runs
        yield
        if check:
            assert queue(proc)["running"] == 1  # it held the model throughout


def post(proc: ServerProcess, user: str) -> httpx.Response:
    return httpx.post(
        proc.base_url + "/v1/chat/completions", json=body(user, max_tokens=2), timeout=600
    )


def at_once(pool: ThreadPoolExecutor, proc: ServerProcess, n: int) -> list[Future[httpx.Response]]:
    """``n`` requests sent together: each thread sends its own once all are ready."""
    ready = threading.Barrier(n)

    def send(i: int) -> httpx.Response:
        ready.wait()
        return post(proc, f"Question {i}: what is {i} plus {i}?")

    return [pool.submit(send, i) for i in range(n)]


def test_eight_requests_sent_at_once_all_get_their_answer(
    tmp_path: Path, tiny_models: TinyModels
) -> None:
    with serve(tmp_path, tiny_models) as proc, ThreadPoolExecutor(8) as pool:
        with held(proc):
            futures = at_once(pool, proc, 8)
            until(proc, running=1, waiting=8)  # all eight wait behind the held answer
        statuses = [f.result().status_code for f in futures]
    log = proc.log()  # the server has stopped: every request's line is in it
    assert statuses == [200] * 8
    assert len(RUN.findall(log)) == 1 + 8


def test_a_flood_beyond_the_bound_gets_503_at_once_while_the_model_is_busy(
    tmp_path: Path, tiny_models: TinyModels
) -> None:
    flood, room = 40, 15  # the default --queue 16: the held answer and 15 more
    with serve(tmp_path, tiny_models) as proc, ThreadPoolExecutor(flood) as pool:
        with held(proc):
            futures = at_once(pool, proc, flood)
            refused = done(futures, flood - room)
            until(proc, running=1, waiting=room)  # the refusals came back while it was busy
        answered = [f.result() for f in futures if f not in refused]
    for r in (f.result() for f in refused):
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
        assert int(r.headers["retry-after"]) >= 1
    assert [r.status_code for r in answered] == [200] * room


def test_a_request_whose_client_leaves_while_waiting_never_runs_and_frees_its_place(
    tmp_path: Path, tiny_models: TinyModels
) -> None:
    with serve(tmp_path, tiny_models, "--queue", "2") as proc, ThreadPoolExecutor(1) as pool:
        with held(proc):
            leaving = _raw_request(proc, body("I will not wait.", max_tokens=2))
            until(proc, running=1, waiting=1)
            leaving.close()
            until(proc, running=1, waiting=0)  # it left the queue while the model was busy
            late = pool.submit(post, proc, "I came later.")  # gets the place it freed
            until(proc, running=1, waiting=1)
        assert late.result().status_code == 200
    log = proc.log()
    assert len(RUN.findall(log)) == 2  # the held answer and the late one: not the one that left
    assert re.search(r"POST /v1/chat/completions 499 total=", log), log[-2000:]


def test_a_request_that_waits_past_queue_wait_gets_503_and_never_runs(
    tmp_path: Path, tiny_models: TinyModels
) -> None:
    with serve(tmp_path, tiny_models, "--queue-wait", "0.5") as proc, held(proc):
        r = post(proc, "I wait too long.")
        assert queue(proc)["waiting"] == 0
    log = proc.log()
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "queue_full" and "waited 0.5 s for its turn" in error["message"]
    assert int(r.headers["retry-after"]) >= 1
    assert len(RUN.findall(log)) == 1  # the held answer only


def test_sigterm_cancels_the_waiting_requests(tmp_path: Path, tiny_models: TinyModels) -> None:
    proc = serve(tmp_path, tiny_models).start()
    waiting = 6
    try:
        with ThreadPoolExecutor(waiting) as pool, held(proc, check=False):
            futures = at_once(pool, proc, waiting)
            until(proc, running=1, waiting=waiting)
            os.kill(proc.pid, signal.SIGTERM)
            for f in futures:  # each waiting client gets its answer: cancelled
                with contextlib.suppress(httpx.HTTPError):  # or the server closed it
                    assert f.result().status_code == 499
    finally:
        code = proc.stop()
    log = proc.log()
    assert code == 0, log[-2000:]
    assert f"cancelled {1 + waiting} admitted request(s)" in log
    assert len(RUN.findall(log)) == 1  # none of the waiting ones ran


def _raw_request(proc: ServerProcess, payload: dict[str, Any]) -> socket.socket:
    """A request sent on a socket the test can close while it waits."""
    data = json.dumps(payload).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{proc.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", proc.port), timeout=30)
    sock.sendall(head.encode() + data)
    return sock
