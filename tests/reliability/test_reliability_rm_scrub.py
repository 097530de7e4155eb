"""``cache rm`` of a server conversation leaves no run of its message on disk.

A real ``localkv serve`` process answers a conversation whose user message is
made-up words; it saves the conversation's chain, and beside it the block that
ends at the assistant's opening (the request's prompt). ``localkv cache rm`` of
the conversation's snapshot, through the CLI with the same ``LOCALKV_HOME``,
then leaves no run of 6 of the message's tokens (int32 little-endian) in any
block file (its ``tokens`` tensor, and its bytes at any alignment), in the
index's ``tokens`` column, or in any other file of the cache directory
(``index.db`` and its WAL included); the same request to a fresh server is a
miss. Another conversation with the same system prompt keeps its chain and is
still restored from disk, verified. In the store alone: the tips beside a
removed chain go, those a staying chain also holds stay.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from click.testing import CliRunner
from localkv.storage import NewSnapshot
from localkv.storage.store import SnapshotStore
from safetensors.numpy import load_file
from support.reliability import record
from support.server import ServerProcess, post
from support.store import IDENTITY, make_chain, put_chain
from support.tinymodels import TinyModels, tiny_config

from localkv.cli import cli
from localkv.model.session import ModelSession

RUN = 6  # tokens in a row that count as holding the message
SYSTEM = "You answer briefly."
SECRET = (
    "My bank PIN is 4721 and the vault word is Quorblax Zenthrima, filed in the Vexmoor "
    "ledger by Grumwaldine Oxtrapple beside the Yelmquist obelisk."
)
OTHER = "What colour is the sky on a clear summer afternoon above the mountains?"


@dataclass(frozen=True, slots=True)
class Traces:
    """Where runs of the message are: block files, index rows, any file of the cache."""

    block_files: int
    index_rows: int
    files: tuple[str, ...]


def _env(root: Path) -> dict[str, str]:
    return {**os.environ, "LOCALKV_HOME": str(root)}


def _server(tmp_path: Path, tiny_models: TinyModels, root: Path) -> ServerProcess:
    args = ["--model", str(tiny_models.base), "--threads", "1", "--ctx", "2048"]
    return ServerProcess(args, tmp_path / "server.log", env={"LOCALKV_HOME": str(root)})


def _chat(server: ServerProcess, system: str, *turns: str) -> dict[str, Any]:
    """One request's reply: ``system``, then user and assistant ``turns`` in turn."""
    messages = [{"role": "system", "content": system}]
    messages += [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]
    body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0}
    status, reply = post(server, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, reply
    return reply


def _cache(reply: dict[str, Any]) -> dict[str, Any]:
    """What the cache did for a request (its ``localkv`` object)."""
    found: dict[str, Any] = reply["localkv"]
    return found


def _cli(root: Path, *args: str) -> str:
    result = CliRunner().invoke(cli, list(args), env=_env(root), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


def _runs(tiny_models: TinyModels, text: str) -> list[bytes]:
    """Every run of 6 of the message's tokens but its first (which its context may merge)."""
    with ModelSession(tiny_config(tiny_models.base)) as session:
        tokens = np.asarray(session.tokenize(text), dtype="<i4")
    runs = [tokens[i : i + RUN].tobytes() for i in range(1, len(tokens) - RUN + 1)]
    assert len(runs) > 20
    return runs


def _holds(data: bytes, runs: list[bytes]) -> bool:
    return any(r in data for r in runs)


def _traces(root: Path, runs: list[bytes]) -> Traces:
    """Runs of the message in block files (tokens tensor or raw bytes), index rows, files."""
    blocks = [p for p in (root / "blocks").rglob("*") if p.is_file()]
    in_blocks = sum(
        _holds(p.read_bytes(), runs) or _holds(load_file(str(p))["tokens"].tobytes(), runs)
        for p in blocks
    )
    with SnapshotStore.open(root) as store:
        rows = store.db.execute("SELECT tokens FROM blocks").fetchall()
    in_rows = sum(_holds(bytes(r[0]), runs) for r in rows)
    files = tuple(
        str(p.relative_to(root))
        for p in sorted(root.rglob("*"))
        if p.is_file() and _holds(p.read_bytes(), runs)
    )
    return Traces(block_files=in_blocks, index_rows=in_rows, files=files)


def _chain_tokens(store: SnapshotStore, snapshot_id: str) -> bytes:
    tip = store.get_snapshot(snapshot_id).tip
    return b"".join(r.tokens.astype("<i4").tobytes() for r in store.chain_of(tip))


def _common(a: bytes, b: bytes) -> int:
    """The tokens two int32 little-endian sequences share from their start."""
    x, y = np.frombuffer(a, "<i4"), np.frombuffer(b, "<i4")
    n = min(len(x), len(y))
    differ = np.flatnonzero(x[:n] != y[:n])
    return int(differ[0]) if differ.size else n


def test_rm_of_a_server_conversation_leaves_no_run_of_its_message(
    tmp_path: Path, tiny_models: TinyModels
) -> None:
    root = tmp_path / "cache"
    runs = _runs(tiny_models, SECRET)
    with _server(tmp_path, tiny_models, root) as server:
        first = _chat(server, SYSTEM, SECRET)
        answer = first["choices"][0]["message"]["content"]
        second = _chat(server, SYSTEM, SECRET, answer, "And the other one?")
    assert _cache(first)["source"] == "none" and _cache(second)["source"] == "live"
    (snap,) = json.loads(_cli(root, "cache", "ls", "--json"))  # the conversation's, now
    before = _traces(root, runs)
    assert before.block_files >= 1 and before.index_rows >= 1  # the search finds the message
    _cli(root, "cache", "rm", snap["id"])
    after = _traces(root, runs)
    assert after == Traces(block_files=0, index_rows=0, files=())
    with _server(tmp_path, tiny_models, root) as server:
        again = _cache(_chat(server, SYSTEM, SECRET))
    assert (again["cached_tokens"], again["source"]) == (0, "none")  # a miss
    record(
        "rm_scrub.server_conversation",
        runs=len(runs),
        blocks_holding_before_rm=before.block_files,
        blocks_holding_after_rm=after.block_files,
        cached_tokens_after_rm=again["cached_tokens"],
    )


def test_rm_keeps_what_another_conversation_with_its_system_prompt_needs(
    tmp_path: Path, tiny_models: TinyModels, long_text: str
) -> None:
    root = tmp_path / "cache"
    # two conversations (one server row each: their system prompts end apart) that
    # share more than a block: the system prompts' common start
    system = long_text[:1600]
    mine, theirs = f"{system} One.", f"{system} Two."
    runs = _runs(tiny_models, SECRET)
    with _server(tmp_path, tiny_models, root) as server:
        _chat(server, mine, SECRET)
        _chat(server, theirs, OTHER)
    with SnapshotStore.open(root) as store:
        chains = {s.id: _chain_tokens(store, s.id) for s in store.snapshots()}
    (secret_id,) = [i for i, tokens in chains.items() if _holds(tokens, runs)]
    (other_id,) = set(chains) - {secret_id}
    shared = _common(chains[secret_id], chains[other_id])
    assert shared > 256  # a full block of the system prompt
    _cli(root, "cache", "rm", secret_id)
    assert _traces(root, runs) == Traces(block_files=0, index_rows=0, files=())
    with SnapshotStore.open(root) as store:
        assert [s.id for s in store.snapshots()] == [other_id]
        assert _chain_tokens(store, other_id) == chains[other_id]  # its chain, whole
    _cli(root, "cache", "verify")
    with _server(tmp_path, tiny_models, root) as server:
        secret = _cache(_chat(server, mine, SECRET))
        other = _cache(_chat(server, theirs, OTHER))
    assert secret["cached_tokens"] <= shared  # only the shared system prompt, if any
    assert (other["source"], other["verified"]) == ("disk", True)
    assert other["cached_tokens"] > shared  # its own message, restored from disk


def test_rm_takes_the_tips_beside_its_chain_and_keeps_those_a_staying_chain_holds(
    tmp_path: Path,
) -> None:
    shared = list(range(1, 17))  # a full block both chains begin with
    mine = [*shared, 500, 501, 502, 503, *range(100, 127)]
    theirs = [*shared, 500, 501, 502, 503, *range(200, 227)]
    with SnapshotStore.open(tmp_path / "cache") as store:
        chains = {
            name: make_chain(tokens, 16)
            for name, tokens in {
                "mine": mine,
                "theirs": theirs,
                "my prompt": mine[:26],  # a shorter tip beside my chain's second block
                "my longer": [*mine, 7, 8],  # a longer tip beside my last block
                "both": mine[:20],  # a tip both chains hold
                "elsewhere": [*shared, 900, 901],  # a tip of neither
            }.items()
        }
        for blocks in chains.values():
            put_chain(store, blocks)
        ids = {
            name: store.put_snapshot(
                NewSnapshot(
                    tip=chains[name][-1].hash,
                    label=name,
                    source_path=None,
                    source_sha256=None,
                    n_tokens=n,
                    identity=IDENTITY,
                    namespace="",
                )
            )
            for name, n in (("mine", len(mine)), ("theirs", len(theirs)))
        }
        store.remove_snapshot(ids["mine"])
        left = {r[0] for r in store.db.execute("SELECT hash FROM blocks").fetchall()}
        assert [s.id for s in store.snapshots()] == [ids["theirs"]]
    kept = {b.hash for name in ("theirs", "both", "elsewhere") for b in chains[name]}
    assert left == kept
