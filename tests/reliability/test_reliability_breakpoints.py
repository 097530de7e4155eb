"""Anthropic ``cache_control`` breakpoints on many messages: real server processes, tiny model.

Where each marked message ends comes from the prompt's one build, so the work of
a request is linear in its messages however many are marked (counted in the
response's ``localkv.work``, not timed), the log says once what was not kept, and
a client that leaves frees the worker at the next cancel check, not after a
rebuild of the prompt per breakpoint.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.server import ServerProcess
from support.tinymodels import TinyModels

CTX = 16384  # 1,600 short user messages and the opener fit
# far beyond the cancel check after a disconnect; rebuilding the prompt for each of
# 1,600 breakpoints held the worker minutes
FREE_WITHIN_S = 10.0
BREAKPOINT_LOG = re.compile(r"cache breakpoint", re.IGNORECASE)


def marked(n: int, word: str) -> dict[str, Any]:
    """A Messages body of ``n`` user messages ``word``, each marked with ``cache_control``."""
    block = {"type": "text", "text": word, "cache_control": {"type": "ephemeral"}}
    messages = [{"role": "user", "content": [block]} for _ in range(n)]
    return {"model": "tiny", "max_tokens": 1, "temperature": 0, "messages": messages}


def post(proc: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(proc.base_url + "/v1/messages", json=body, timeout=600)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


@pytest.fixture()
def server(tmp_path: Path, tiny_models: TinyModels) -> Iterator[ServerProcess]:
    args = ["--model", str(tiny_models.base), "--threads", "1", "--ctx", str(CTX)]
    with ServerProcess(args, tmp_path / "server.log") as proc:
        yield proc
        assert "Traceback" not in proc.log()


def test_marked_messages_cost_work_linear_in_the_messages(server: ServerProcess) -> None:
    work, logged = {}, {}
    for n in (400, 1600):
        before = len(BREAKPOINT_LOG.findall(server.log()))
        reply = post(server, marked(n, "note"))
        work[n] = reply["localkv"]["work"]
        logged[n] = len(BREAKPOINT_LOG.findall(server.log())) - before
        # only the last message's breakpoint has a segment end of its own (the others
        # are user messages in a row): it is kept, and the usage counts its new tokens
        assert reply["localkv"]["breakpoints"] == {"asked": n, "kept": 1}
        usage = reply["usage"]  # its breakpoint ends the prompt: every token not read is new
        assert usage["input_tokens"] == 0 and usage["cache_creation_input_tokens"] > 0
    # four times the messages: four times the characters rendered and no more renders
    # (a rebuild of the prompt of the first k messages for each breakpoint: sixteen times)
    small, big = work[400], work[1600]
    assert big["renders"] <= small["renders"] and big["renders"] <= 4, (small, big)
    assert big["rendered_chars"] <= 5 * small["rendered_chars"], (small, big)
    # what was not kept is said once a request, not once a breakpoint
    assert logged[400] <= 2 and logged[1600] <= 2, logged


def test_a_client_that_leaves_a_marked_request_frees_the_worker(server: ServerProcess) -> None:
    body = {**marked(1600, "gone"), "stream": True}
    sent = time.monotonic()
    try:  # leaves a second after sending it, whatever came back by then
        with httpx.stream("POST", server.base_url + "/v1/messages", json=body, timeout=1) as r:
            for _ in r.iter_bytes():
                if time.monotonic() - sent > 1:
                    break
    except httpx.ReadTimeout:
        pass
    after = post(server, marked(1, "Hi"))
    kv = after["localkv"]
    queued_s = (kv["arrival_ttft_ms"] - kv["ttft_ms"]) / 1000
    assert queued_s < FREE_WITHIN_S, json.dumps(kv)
    assert re.search(r"generated=0 \(\w+, cancelled\)", server.log()), server.log()[-2000:]
