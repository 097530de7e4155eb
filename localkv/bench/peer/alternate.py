"""Two documents in turn in one running server: A and a question, B and a question, A, ...

Three servers run side by side: localkv (its cache fresh), llama-server with one
slot and its RAM prompt cache (``--cache-ram`` at its default size), and llama-server
with two slots (``-np 2``, each of the full context), so each document may keep a
slot of its own. Each turn asks a question no earlier turn asked, of every server in
turn (the first server rotating between turns). The first two turns are each
document's cold prefill and are not counted.
"""

from __future__ import annotations

from typing import Any

from localkv.bench.peer.client import stream_chat
from localkv.bench.peer.documents import messages, question
from localkv.bench.peer.plan import Plan, say
from localkv.bench.peer.servers import llama_server, localkv_server

__all__ = ["WARM_TURNS", "alternate"]

WARM_TURNS = 2  # A's and B's first turns: cold prefills, not counted


def alternate(plan: Plan, n_tokens: int, docs: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    """``2 * plan.repeats`` counted turns in each server: each turn's figures per server."""
    where = plan.work / f"alternate-{n_tokens}"
    servers = {
        "localkv": localkv_server(plan.setting, home=where / "localkv"),
        "llama-server --cache-ram": llama_server(
            plan.setting, plan.llama_server, work=where / "cram"
        ),
        "llama-server -np 2": llama_server(
            plan.setting, plan.llama_server, work=where / "np2", parallel=2
        ),
    }
    names = list(servers)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    try:
        for server in servers.values():
            server.start()
        for turn in range(WARM_TURNS + 2 * plan.repeats):
            doc = "AB"[turn % 2]
            chat = messages(docs[doc], question(turn))
            for name in names[turn % 3 :] + names[: turn % 3]:
                server = servers[name]
                reply = stream_chat(
                    server.port, chat, max_tokens=plan.max_tokens, timeout_s=plan.timeout_s
                )
                counted = turn >= WARM_TURNS
                if counted:
                    runs[name].append({**reply.as_json(), "document": doc})
                say(
                    f"alternate {n_tokens:,}",
                    f"turn {turn + 1} ({doc}{'' if counted else ', cold'}) {name:24} "
                    f"first token {reply.ttft_s * 1000:.0f} ms",
                )
    finally:
        for server in servers.values():
            server.stop()
    return runs
