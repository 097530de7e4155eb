"""Pins a server's clients ask for, against the budget: a real server and the CLI, one cache.

A client's pins (``"pin": true`` in ``/v1/localkv/prefill``, ``cache_control``)
hold only within their share of the budget (``LOCALKV_CLIENT_PINS``); past it a
prefill is saved unpinned and says so, a breakpoint is not kept and the usage
does not count it. The user's own cache, pinned or not, stays; the cache stays
within its budget. The model has a wide KV cache (sixteen layers), so a
document's chain is megabytes and twenty-six of them are more than the budget.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.processes import run_localkv
from support.server import ServerProcess
from support.tinymodels import build_tiny_llama

LIVENESS_S = 300  # far beyond what these commands take; only a hang reaches it
BUDGET = "120M"
BUDGET_BYTES = 120 << 20
SHARE = 0.25  # the clients' default share of the budget
CLIENT_PREFILLS = 26


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    """A tiny model whose KV rows take 8 KiB a token (sixteen layers, two KV heads)."""
    path = tmp_path_factory.mktemp("wide") / "wide.gguf"
    return build_tiny_llama(path, default_model_path, seed=0, n_layer=16, n_head_kv=2)


@pytest.fixture()
def env(tmp_path: Path, wide_model: Path) -> dict[str, str]:
    mine = {k: v for k, v in os.environ.items() if k != "LOCALKV_CLIENT_PINS"}  # the default
    return {
        **mine,
        "LOCALKV_MODEL": str(wide_model),
        "LOCALKV_HOME": str(tmp_path / "cache"),
        "LOCALKV_BUDGET": BUDGET,
    }


def serve(tmp_path: Path, env: dict[str, str]) -> ServerProcess:
    """``localkv serve`` on the model and cache of ``env`` (``LOCALKV_MODEL``, ``_HOME``)."""
    return ServerProcess(["--threads", "1", "--ctx", "2048"], tmp_path / "server.log", env=env)


def document(long_text: str, i: int) -> str:
    """About 800 tokens that share no block with another document."""
    return f"Document {i}. " + long_text[i * 40 : i * 40 + 3200]


def localkv(env: dict[str, str], *args: str) -> str:
    done = run_localkv(env, *args, timeout_s=LIVENESS_S)
    assert done.returncode == 0, (args, done.stderr)
    return done.stdout


def snapshots(env: dict[str, str]) -> dict[str, dict[str, Any]]:
    return {s["label"]: s for s in json.loads(localkv(env, "cache", "ls", "--json"))}


def post(proc: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(proc.base_url + path, json=body, timeout=LIVENESS_S)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_a_clients_pinned_prefills_keep_the_users_cache_and_the_budget(
    tmp_path: Path, env: dict[str, str], long_text: str
) -> None:
    mine = []  # the user's own: a document pinned, one not
    for i, pin in ((100, True), (101, False)):
        path = tmp_path / f"mine-{i}.txt"
        path.write_text(document(long_text, i), encoding="utf-8")
        flags = ["--pin"] if pin else []
        report = json.loads(localkv(env, "prefill", "--threads", "1", "--json", *flags, str(path)))
        mine.append((path.name, pin, report["bytes_on_disk"]))
    before = snapshots(env)
    assert {name for name, _, _ in mine} <= set(before)
    with serve(tmp_path, env) as proc:
        reports = [
            post(proc, "/v1/localkv/prefill", {"documents": [document(long_text, i)], "pin": True})
            for i in range(CLIENT_PREFILLS)
        ]
        assert "Traceback" not in proc.log()
    chain = reports[0]["bytes_on_disk"]
    assert CLIENT_PREFILLS * chain > BUDGET_BYTES  # all of them pinned would not fit
    made = [r["pinned"] for r in reports]
    n_made = made.index(False)
    # the first ones fit the clients' share; every one after it is saved unpinned, and says so
    assert n_made > 0 and made == [True] * n_made + [False] * (CLIENT_PREFILLS - n_made)
    assert n_made * chain <= SHARE * BUDGET_BYTES < (n_made + 1) * chain
    assert all(r["not_pinned"] is None for r in reports[:n_made])
    assert all("LOCALKV_CLIENT_PINS" in r["not_pinned"] for r in reports[n_made:])
    assert all(r["not_saved"] is None for r in reports)  # every save found room
    after = snapshots(env)
    for name, pinned, size in mine:  # the user's own cache, pinned or not, is all there
        assert after[name]["pinned"] is pinned and after[name]["bytes_on_disk"] == size
        assert after[name]["tokens"] == before[name]["tokens"]
    stats = json.loads(localkv(env, "cache", "stats", "--json"))["budget"]
    assert stats["budget_bytes"] == BUDGET_BYTES
    assert stats["stored_bytes"] <= stats["budget_bytes"] and not stats["over_budget"]


def test_the_usage_counts_only_the_breakpoints_that_were_kept(
    tmp_path: Path, env: dict[str, str], long_text: str
) -> None:
    env = {**env, "LOCALKV_CLIENT_PINS": "0.04"}  # about two conversations' pins
    with serve(tmp_path, env) as proc:
        replies = []
        for i in range(6):
            system = [
                {"type": "text", "text": document(long_text, i)[:1500]},
                {"type": "text", "text": "Answer briefly.", "cache_control": {"type": "ephemeral"}},
            ]
            question = {"type": "text", "text": "Why?", "cache_control": {"type": "ephemeral"}}
            body = {
                "model": "m",
                "max_tokens": 1,
                "temperature": 0,
                "system": system,
                "messages": [{"role": "user", "content": [question]}],
            }
            replies.append(post(proc, "/v1/messages", body))
        listing = httpx.get(proc.base_url + "/v1/localkv/cache", timeout=60).json()["data"]
        assert "Traceback" not in proc.log()
    kept = [r["localkv"]["breakpoints"]["kept"] for r in replies]
    assert all(r["localkv"]["breakpoints"]["asked"] == 2 for r in replies)
    # the first conversations' pins fit the clients' share, the later ones' do not
    assert kept[0] == 2 and kept[-1] == 0 and kept == sorted(kept, reverse=True), kept
    for reply, n in zip(replies, kept, strict=True):
        usage = reply["usage"]
        total = sum(usage[k] for k in ("input_tokens", "cache_read_input_tokens"))
        total += usage["cache_creation_input_tokens"]
        read = usage["cache_read_input_tokens"]
        # kept: the whole prompt (the question's breakpoint ends it) was written and pinned;
        # none kept: nothing was
        assert usage["cache_creation_input_tokens"] == (total - read if n == 2 else 0), usage
    pinned = [s for s in listing if s["label"].endswith("· kept")]
    assert len(pinned) == sum(kept) and all(s["pinned"] for s in pinned)


@pytest.mark.parametrize("share", ["1.5", "a quarter", "-0.1"])
def test_a_malformed_share_is_a_usage_error_before_the_server_starts(
    env: dict[str, str], share: str
) -> None:
    share_env = {**env, "LOCALKV_CLIENT_PINS": share}
    done = run_localkv(share_env, "serve", "--port", "0", timeout_s=LIVENESS_S)
    assert done.returncode == 2, done.stderr
    assert f"Error: LOCALKV_CLIENT_PINS: not a share: {share!r}" in done.stderr
    assert "Traceback" not in done.stderr
