"""Privacy: ``cache forget FILE`` / ``cache rm`` leave no trace; namespaces never leak.

A canary document (words found nowhere else) is prefilled and asked about,
then forgotten. Afterwards no file anywhere in the cache directory (index.db,
its -wal and -shm, block files, quarantine, tmp) holds its bytes, its title,
its path, or its token IDs as int32 little-endian runs. Another document
prefilled beside it, with the same system prompt, is still restored.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import tiny_config
from localkv.storage.store import SnapshotStore
from reliability_support import record
from tinymodels import TinyModels

from localkv.cli import cli
from localkv.request import Document
from localkv.runtime import Runtime

SYSTEM = "Answer from the document."
CANARY = (
    "Quorblax Zenthrima filed the Vexmoor ledger on Plinthday. "
    "Grumwaldine Oxtrapple counted eleven Snarvian teacups beside the Yelmquist obelisk. "
)


@pytest.fixture()
def env(tmp_path: Path, tiny_models: TinyModels) -> dict[str, str]:
    return {
        **os.environ,
        "LOCALKV_MODEL": str(tiny_models.base),
        "LOCALKV_HOME": str(tmp_path / "cache"),
    }


def _cli(env: dict[str, str], *args: str) -> str:
    result = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


def _json(out: str) -> dict[str, object]:
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _everything(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _needles(store: SnapshotStore, canary_id: str, other_id: str, path: Path) -> list[bytes]:
    """The canary's words, title, path, and runs of its token IDs that no other chain has."""

    def tokens(snap_id: str) -> np.ndarray:
        chain = store.chain_of(store.get_snapshot(snap_id).tip)
        return np.concatenate([r.tokens for r in chain])

    mine, other = tokens(canary_id), tokens(other_id).tobytes()
    runs = [mine[i : i + 6].tobytes() for i in range(0, len(mine) - 6, 3)]
    distinctive = [r for r in runs if r not in other]
    assert len(distinctive) > 10
    words = [w.encode() for w in ("Quorblax", "Zenthrima", "Grumwaldine", "Snarvian")]
    return [*words, path.name.encode(), str(path).encode(), *distinctive]


def _traces(root: Path, needles: list[bytes]) -> list[str]:
    return [
        f"{name}: {needle[:20]!r}"
        for name, data in _everything(root).items()
        for needle in needles
        if needle in data
    ]


def test_forget_leaves_no_trace_of_a_document(
    env: dict[str, str], tmp_path: Path, long_text: str
) -> None:
    canary = tmp_path / "canary-ledger.txt"
    canary.write_text(CANARY * 6, encoding="utf-8")
    other = tmp_path / "other.txt"
    other.write_text(long_text[:1500], encoding="utf-8")
    root = tmp_path / "cache"
    canary_id = _json(
        _cli(env, "prefill", "--threads", "1", "--json", str(canary), "--system", SYSTEM)
    )["snapshot"]
    other_id = _json(
        _cli(env, "prefill", "--threads", "1", "--json", str(other), "--system", SYSTEM)
    )["snapshot"]
    _cli(
        env,
        "ask",
        "--threads",
        "1",
        "--json",
        "--max-tokens",
        "4",
        str(canary),
        "Who filed it?",
        "--system",
        SYSTEM,
    )
    with SnapshotStore.open(root) as store:
        needles = _needles(store, str(canary_id), str(other_id), canary)
    assert _traces(root, needles)  # the search finds them before forgetting
    out = _json(_cli(env, "cache", "forget", "--json", str(canary)))
    assert out["snapshots"] == [canary_id] and out["wal_truncated"] is True
    assert int(out["blocks"]) > 0  # type: ignore[call-overload]
    assert _traces(root, needles) == []
    ls = _json(_cli(env, "cache", "ls", "--json"))
    assert [s["id"] for s in ls] == [other_id]  # type: ignore[index, union-attr]
    again = _json(
        _cli(
            env,
            "ask",
            "--threads",
            "1",
            "--json",
            "--max-tokens",
            "4",
            str(other),
            "Why?",
            "--system",
            SYSTEM,
        )
    )
    assert again["cache"]["hit"] is True  # type: ignore[index]
    record(
        "privacy.forget",
        needles=len(needles),
        files_scanned=len(_everything(root)),
        blocks_forgotten=out["blocks"],
        traces_left=0,
    )


def test_rm_scrubs_the_index_too(env: dict[str, str], tmp_path: Path, long_text: str) -> None:
    canary = tmp_path / "canary.txt"
    canary.write_text(CANARY * 6, encoding="utf-8")
    other = tmp_path / "other.txt"
    other.write_text(long_text[:1500], encoding="utf-8")
    root = tmp_path / "cache"
    canary_id = _json(
        _cli(env, "prefill", "--threads", "1", "--json", str(canary), "--system", SYSTEM)
    )["snapshot"]
    other_id = _json(
        _cli(env, "prefill", "--threads", "1", "--json", str(other), "--system", SYSTEM)
    )["snapshot"]
    with SnapshotStore.open(root) as store:
        needles = _needles(store, str(canary_id), str(other_id), canary)
    _cli(env, "cache", "rm", str(canary_id))
    assert _traces(root, needles) == []


def test_a_namespace_never_sees_another_ones_entries(
    tiny_models: TinyModels, tmp_path: Path, long_text: str, env: dict[str, str]
) -> None:
    doc = Document.from_text(long_text[:2000], "secret.txt")
    cache = tmp_path / "cache"
    with Runtime(tiny_config(tiny_models.base), cache_dir=cache, namespace="alice") as rt:
        assert rt.prefill([doc], system=SYSTEM).snapshot
        assert rt.snapshots()
    with Runtime(tiny_config(tiny_models.base), cache_dir=cache, namespace="bob") as rt:
        assert rt.snapshots() == []
        report = rt.prefill([doc], system=SYSTEM)
        assert report.reused == 0 and not report.cache.hit
        reason = report.cache.miss_reason or ""
        assert "alice" not in reason and "bob" in reason
    assert _json(_cli(env, "cache", "ls", "--json", "--namespace", "carol")) == []  # type: ignore[comparison-overlap]
    with Runtime(tiny_config(tiny_models.base), cache_dir=cache, namespace="carol") as rt:
        assert rt.snapshots() == []
        assert rt.ask([doc], "Why?", system=SYSTEM).cache.hit is False


def test_forget_takes_longer_prompts_that_contain_the_document(tmp_path: Path) -> None:
    """A block saved by ``ask`` (document + question) beside the document's own goes too."""
    from test_store_support import make_chain, put_chain

    shared = list(range(1000, 1016))
    doc = shared + list(range(2000, 2030))  # the document's snapshot: 46 tokens
    asked = doc + list(range(3000, 3010))  # ask: the same document and a question
    unrelated = shared + list(range(4000, 4030))
    with SnapshotStore.open(tmp_path / "cache") as store:
        chains = [make_chain(t, 64) for t in (doc, asked, unrelated)]
        for chain in chains:
            put_chain(store, chain)
        for chain, path in ((chains[0], "/docs/a.txt"), (chains[2], "/docs/b.txt")):
            tip = chain[-1]
            store.put_snapshot(tip.hash, path, path, None, tip.end, tip.identity, "")
        report = store.forget("/docs/a.txt", None)
        assert report.blocks == 2 and len(report.snapshots) == 1
        assert not store.has_block(chains[0][-1].hash)
        assert not store.has_block(chains[1][-1].hash)
        assert store.has_block(chains[2][-1].hash)
        assert [s.label for s in store.snapshots()] == ["/docs/b.txt"]
