"""Cold prefill and decode: each server started afresh and asked about a document it never saw.

Per run and server, in turn (the first server alternating between runs): start the
server (``localkv serve --no-cache``; llama-server with its RAM prompt cache at its
default size, which a restart empties), stream the request, read the server's CPU
time over it, stop the server. The same request each time: llama-server's runs are
also its restart figure with ``--cache-ram``, which a restart loses.
"""

from __future__ import annotations

from typing import Any

from localkv.bench.peer.client import stream_chat
from localkv.bench.peer.documents import ASK, messages
from localkv.bench.peer.plan import Plan, say
from localkv.bench.peer.servers import Server, llama_server, localkv_server

__all__ = ["cold"]


def _one(server: Server, plan: Plan, chat: list[dict[str, str]]) -> dict[str, Any]:
    with server:
        cpu = server.cpu_s()
        reply = stream_chat(server.port, chat, max_tokens=plan.max_tokens, timeout_s=plan.timeout_s)
        return {**reply.as_json(), "cpu_s": server.cpu_s() - cpu}


def cold(plan: Plan, n_tokens: int, document: str) -> dict[str, list[dict[str, Any]]]:
    """``plan.repeats`` cold requests to each server, interleaved: their figures per server."""
    where = plan.work / f"cold-{n_tokens}"
    servers = {
        "localkv": localkv_server(plan.setting, home=where / "localkv", cache=False),
        "llama-server": llama_server(plan.setting, plan.llama_server, work=where / "llama"),
    }
    chat = messages(document, ASK)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
    for r in range(plan.repeats):
        order = list(servers) if r % 2 == 0 else list(reversed(servers))
        for name in order:
            run = _one(servers[name], plan, chat)
            runs[name].append(run)
            rate = run["decode_tok_s"]
            say(
                f"cold {n_tokens:,}",
                f"{name:13} run {r + 1}/{plan.repeats}: first token {run['ttft_s']:.2f} s, "
                f"CPU {run['cpu_s']:.1f} s, {run['prompt_tokens']} prompt tokens, decode "
                + (f"{rate:.1f} tok/s" if rate else "-"),
            )
    return runs
