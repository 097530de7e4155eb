"""What the server's log says of a request: what the cache gave it, how a prefill goes.

A request cancelled during its prefill counts as cached only what was restored
or kept from the live context, never the part it did not get to compute; a
long prefill logs its progress in a bounded number of lines. Counted in
tokens, never timed.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from support.server import ServerProcess, post
from support.tinymodels import TinyModels, tiny_config

from localkv.prompt.template import Message
from localkv.runtime import Runtime
from localkv.server.engine import Engine
from localkv.server.requests import ChatRequest, Sampling

PROGRESS = re.compile(r"prefill: (\d+) of (\d+) tokens computed; (\d+) of (\d+) reused")


class CancelledAt:
    """A client that goes away once the model has ``n`` tokens of its prompt."""

    def __init__(self, runtime: Runtime, n: int) -> None:
        self.arrived = time.perf_counter()
        self.runtime, self.n = runtime, n

    def started(self) -> None:
        pass

    def text(self, piece: str) -> None:
        pass

    def reasoning(self, piece: str) -> None:
        pass

    def cancelled(self) -> bool:
        return self.runtime.session.n_tokens >= self.n


def test_a_request_cancelled_during_its_prefill_counts_nothing_as_cached(
    tiny_models: TinyModels, tmp_path: Path, long_text: str
) -> None:
    messages = (Message("system", long_text[:6000]), Message("user", "Who is tired?"))
    sampling = Sampling(temperature=0.0, top_p=1.0, top_k=0, seed=None, max_tokens=4, stop=())
    request = ChatRequest(messages=messages, sampling=sampling, stream=False, include_usage=True)
    with Runtime(tiny_config(tiny_models.base, n_ctx=4096), cache_dir=tmp_path) as rt:
        outcome = Engine(rt).chat(request, CancelledAt(rt, 512))
    assert outcome.finish_reason == "cancelled"
    assert outcome.prompt_tokens > 1000
    assert (outcome.cached_tokens, outcome.source) == (0, "none")  # an empty cache


def test_a_long_prefill_logs_its_progress_in_a_few_lines(
    tiny_models: TinyModels, tmp_path: Path, long_text: str
) -> None:
    args = ["--model", str(tiny_models.base), "--threads", "1", "--ctx", "4096"]
    prompts = []
    with ServerProcess(args, tmp_path / "server.log") as server:
        for system in (long_text[:12000], "Short notes."):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi?"}]
            body = {"model": "tiny", "messages": messages, "max_tokens": 2}
            status, reply = post(server, "/v1/chat/completions", json.dumps(body).encode())
            assert status == 200, reply
            prompts.append(reply["usage"]["prompt_tokens"])
    long, short = prompts
    assert long > 2048 > short
    lines = [tuple(map(int, m)) for m in PROGRESS.findall(server.log())]
    assert 1 <= len(lines) <= 7, server.log()  # the long prompt's, none for the short one
    assert all((total, reused, n) == (long, 0, long) for _, total, reused, n in lines)
    done = [d for d, *_ in lines]
    assert done == sorted(done) and done[-1] < long
