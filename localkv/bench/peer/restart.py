"""The first token after a restart: localkv over its disk cache, llama-server over its slot file.

Once per length: each server answers the request (localkv saves its blocks;
llama-server's slot 0 is then saved with ``POST /slots/0?action=save``) and stops;
the bytes each left on disk are counted. Then per run, in turn: localkv is started
again and the same request streamed; llama-server is started again, its slot restored
(``POST /slots/0?action=restore``) and the request streamed. llama-server's figure is
the restore call's time plus the request's time to first token, and each alone.
localkv's first token is split into the parts its server reports (``parts``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from localkv.bench.peer.client import get_json, post_json, stream_chat
from localkv.bench.peer.documents import ASK, messages
from localkv.bench.peer.plan import Plan, say
from localkv.bench.peer.servers import Server, llama_server, localkv_server
from localkv.storage.packed import SUFFIX as PACKED
from localkv.storage.paths import BLOCK_SUFFIX

__all__ = ["PARTS", "SLOT_FILE", "parts", "restart"]

SLOT_FILE = "document.bin"
# localkv's first token after a restart, in the order its parts run: the prompt built
# (render, tokenize), the restore's steps (``localkv.restore_steps``; ``read`` without
# ``columns``), and the rest of the first token as the client saw it
PARTS = ("prompt", "lookup", "read", "columns", "load", "probe", "rest")


def parts(reply: dict[str, Any]) -> dict[str, float]:
    """The seconds of each of ``PARTS`` in a reply's JSON (``Reply.as_json``); empty when
    the server named no restore step (nothing came from disk). The parts add up to the
    client's first token."""
    server = reply.get("server") or {}
    steps = server.get("restore_steps")
    if not steps or "prompt_ms" not in server:
        return {}
    ms = {"prompt": server["prompt_ms"], **{name: steps.get(name, 0.0) for name in PARTS[1:-1]}}
    ms["read"] -= ms["columns"]  # the reader threads' time on V's columns is part of read
    named = {name: value / 1000 for name, value in ms.items()}
    return {**named, "rest": reply["ttft_s"] - sum(named.values())}


def _block_bytes(home: Path) -> int:
    return sum(p.stat().st_size for p in home.rglob(f"*{BLOCK_SUFFIX}"))


def _fill(lk: Server, ls: Server, plan: Plan, chat: list[dict[str, str]]) -> dict[str, Any]:
    """Each server answers once and keeps the prompt on disk (localkv once more after a
    restart, which packs its chain); what that took on disk."""
    with lk:
        stream_chat(lk.port, chat, max_tokens=plan.max_tokens, timeout_s=plan.timeout_s)
        listed = get_json(lk.port, "/v1/localkv/cache", timeout_s=plan.timeout_s)  # saves done
    with lk:  # restored from its blocks once, the chain is packed (before the server stops)
        stream_chat(lk.port, chat, max_tokens=plan.max_tokens, timeout_s=plan.timeout_s)
    with ls:
        stream_chat(ls.port, chat, max_tokens=plan.max_tokens, timeout_s=plan.timeout_s)
        saved = post_json(
            ls.port, "/slots/0?action=save", {"filename": SLOT_FILE}, timeout_s=plan.timeout_s
        )
    return {
        "localkv_tokens": max((int(x["tokens"]) for x in listed["data"]), default=0),
        "slot_file_bytes": int(saved["n_written"]),
        "slot_tokens": int(saved["n_saved"]),
    }


def _slot_run(ls: Server, plan: Plan, chat: list[dict[str, str]]) -> dict[str, Any]:
    with ls:
        t0 = time.perf_counter()
        restored = post_json(
            ls.port, "/slots/0?action=restore", {"filename": SLOT_FILE}, timeout_s=plan.timeout_s
        )
        restore_s = time.perf_counter() - t0
        reply = stream_chat(ls.port, chat, max_tokens=plan.max_tokens, timeout_s=plan.timeout_s)
    return {
        **reply.as_json(),
        "restore_s": restore_s,
        "restore_and_ttft_s": restore_s + reply.ttft_s,
        "restored_tokens": int(restored["n_restored"]),
    }


def _localkv_run(lk: Server, plan: Plan, chat: list[dict[str, str]]) -> dict[str, Any]:
    with lk:
        run = stream_chat(lk.port, chat, max_tokens=plan.max_tokens, timeout_s=plan.timeout_s)
    out = run.as_json()
    return {**out, "parts_s": parts(out)}


def restart(plan: Plan, n_tokens: int, document: str) -> dict[str, Any]:
    """The restart figures of both servers at one length, and their bytes on disk."""
    where = plan.work / f"restart-{n_tokens}"
    lk = localkv_server(plan.setting, home=where / "localkv")
    ls = llama_server(plan.setting, plan.llama_server, work=where / "llama", slots=where / "slots")
    chat = messages(document, ASK)
    disk = _fill(lk, ls, plan, chat)
    disk["block_bytes"] = _block_bytes(where / "localkv")
    disk["packed_bytes"] = sum(p.stat().st_size for p in (where / "localkv").rglob(f"*{PACKED}"))
    runs: dict[str, list[dict[str, Any]]] = {"localkv": [], "llama-server slot": []}
    for r in range(plan.repeats):
        first_localkv = r % 2 == 0
        for name in ("localkv", "llama-server slot")[:: 1 if first_localkv else -1]:
            run = _localkv_run(lk, plan, chat) if name == "localkv" else _slot_run(ls, plan, chat)
            runs[name].append(run)
            extra = f", restore call {run['restore_s'] * 1000:.0f} ms" if "restore_s" in run else ""
            say(
                f"restart {n_tokens:,}",
                f"{name:17} run {r + 1}/{plan.repeats}: first token "
                f"{run['ttft_s'] * 1000:.0f} ms{extra}",
            )
    return {"runs": runs, "disk": disk}
