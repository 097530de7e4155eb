"""Privacy: ``cache forget FILE`` / ``cache rm`` leave no trace; namespaces never leak.

A canary document (words found nowhere else) is prefilled and asked about,
attached in a chat, or only asked about, then forgotten. Afterwards no file
anywhere in the cache directory (index.db, its -wal and -shm, block files,
quarantine, tmp, conversations.db and its -wal) holds its bytes, its title,
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
from localkv.storage import NewSnapshot
from localkv.storage.store import SnapshotStore
from support.reliability import record
from support.tinymodels import TinyModels, tiny_config

from localkv.cli import cli
from localkv.history.store import ConversationStore
from localkv.model.session import ModelSession
from localkv.prompt.request import Document
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

    mine = tokens(canary_id)
    return _with_words(path, _distinctive(mine, mine.tobytes(), tokens(other_id).tobytes()))


def _distinctive(mine: np.ndarray, stored: bytes, other: bytes) -> list[bytes]:
    """Runs of 6 of ``mine`` (int32) found in ``stored`` and not in ``other``."""
    runs = [mine[i : i + 6].astype("<i4").tobytes() for i in range(0, len(mine) - 6, 3)]
    distinctive = [r for r in runs if r in stored and r not in other]
    assert len(distinctive) > 10
    return distinctive


def _with_words(path: Path, runs: list[bytes]) -> list[bytes]:
    words = [w.encode() for w in ("Quorblax", "Zenthrima", "Grumwaldine", "Snarvian")]
    return [*words, path.name.encode(), str(path).encode(), *runs]


def _canary_tokens(tiny_models: TinyModels) -> np.ndarray:
    """The canary as the tiny model tokenizes it inside a prompt (the project's tokenizer)."""
    with ModelSession(tiny_config(tiny_models.base)) as session:
        return np.asarray(session.tokenize(CANARY * 6), dtype=np.int32)


def _found(root: Path, needles: list[bytes]) -> set[bytes]:
    files = _everything(root).values()
    return {n for n in needles if any(n in data for data in files)}


def _chain_tokens(root: Path, snapshot_id: str) -> bytes:
    with SnapshotStore.open(root) as store:
        chain = store.chain_of(store.get_snapshot(snapshot_id).tip)
    return b"".join(r.tokens.astype("<i4").tobytes() for r in chain)


def _block_tokens(root: Path) -> bytes:
    """Every stored block's tokens, each block apart (a zero token between)."""
    with SnapshotStore.open(root) as store:
        rows = store.db.execute("SELECT tokens FROM blocks").fetchall()
    return b"\0\0\0\0".join(bytes(r[0]) for r in rows)


def _prefill(env: dict[str, str], path: Path) -> str:
    out = _cli(env, "prefill", "--threads", "1", "--json", str(path), "--system", SYSTEM)
    return str(_json(out)["snapshot"])


def _ask(env: dict[str, str], path: Path, question: str) -> dict[str, object]:
    args = ["ask", "--threads", "1", "--json", "--max-tokens", "4", "--temperature", "0"]
    return _json(_cli(env, *args, str(path), question, "--system", SYSTEM))


def _still_restored(env: dict[str, str], root: Path, other: Path, other_id: str) -> None:
    """The other document's snapshot is the only one listed, and restored by ``ask``."""
    ls = _json(_cli(env, "cache", "ls", "--json"))
    assert [s["id"] for s in ls] == [other_id]  # type: ignore[index, union-attr]
    assert _ask(env, other, "Why?")["cache"]["hit"] is True  # type: ignore[index]


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
    canary_id, other_id = _prefill(env, canary), _prefill(env, other)
    _ask(env, canary, "Who filed it?")
    with SnapshotStore.open(root) as store:
        needles = _needles(store, canary_id, other_id, canary)
    assert _traces(root, needles)  # the search finds them before forgetting
    out = _json(_cli(env, "cache", "forget", "--json", str(canary)))
    assert out["snapshots"] == [canary_id] and out["wal_truncated"] is True
    assert int(out["blocks"]) > 0  # type: ignore[call-overload]
    assert _traces(root, needles) == []
    _still_restored(env, root, other, other_id)
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
    canary_id, other_id = _prefill(env, canary), _prefill(env, other)
    with SnapshotStore.open(root) as store:
        needles = _needles(store, canary_id, other_id, canary)
    _cli(env, "cache", "rm", canary_id)
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
    from support.store import make_chain, put_chain

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
            store.put_snapshot(
                NewSnapshot(
                    tip=tip.hash,
                    label=path,
                    source_path=path,
                    source_sha256=None,
                    n_tokens=tip.end,
                    identity=tip.identity,
                    namespace="",
                )
            )
        report = store.forget("/docs/a.txt", None)
        assert report.blocks == 2 and len(report.snapshots) == 1
        assert not store.has_block(chains[0][-1].hash)
        assert not store.has_block(chains[1][-1].hash)
        assert store.has_block(chains[2][-1].hash)
        assert [s.label for s in store.snapshots()] == ["/docs/b.txt"]


def _chat(env: dict[str, str], script: str) -> None:
    options = ["--threads", "1", "--ctx", "2048", "--temperature", "0", "--max-tokens", "4"]
    result = CliRunner().invoke(
        cli, ["chat", "--plain", *options], input=script, env=env, catch_exceptions=False
    )
    assert result.exit_code == 0, result.output


def test_forget_takes_a_document_attached_in_a_chat_and_the_conversation(
    env: dict[str, str], tmp_path: Path, long_text: str, tiny_models: TinyModels
) -> None:
    """No snapshot names a chat's /attach: its blocks are found by the document's tokens."""
    canary = tmp_path / "canary-ledger.txt"
    canary.write_text(CANARY * 6, encoding="utf-8")
    other = tmp_path / "other.txt"
    other.write_text(long_text[:1500], encoding="utf-8")
    root = tmp_path / "cache"
    other_id = _prefill(env, other)
    _chat(env, f"Hello\n/attach {canary}\nWho filed it?\n/quit\n")
    _ask(env, canary, "Who filed it?")
    with ConversationStore.open(root) as history:
        (conv,) = history.list()
        stored = np.asarray(history.load(conv.id).tokens, dtype="<i4").tobytes()
    runs = _distinctive(_canary_tokens(tiny_models), stored, _chain_tokens(root, other_id))
    needles = _with_words(canary, runs)
    before = _found(root, needles)
    assert set(runs) <= before and canary.name.encode() in before  # the search finds them
    assert any("conversations.db" in t for t in _traces(root, needles))

    refused = CliRunner().invoke(cli, ["cache", "forget", str(canary)], env=env)
    assert refused.exit_code == 1, refused.output
    assert conv.id in refused.stderr and conv.title in refused.stderr
    assert "--with-conversations" in refused.stderr and "(F3)" in refused.stderr
    assert _found(root, needles) == before  # nothing was removed
    with ConversationStore.open(root) as history:
        assert [c.id for c in history.list()] == [conv.id]

    out = _json(_cli(env, "cache", "forget", "--json", "--with-conversations", str(canary)))
    assert out["conversations"] == [conv.id] and out["wal_truncated"] is True
    assert int(out["blocks"]) > 0 and other_id not in out["snapshots"]  # type: ignore[call-overload, operator]
    assert {"conversations.db", "index.db"} <= set(_everything(root))
    assert _traces(root, needles) == []
    with ConversationStore.open(root) as history:
        assert history.list() == []
    _still_restored(env, root, other, other_id)
    record("privacy.forget_chat", needles=len(needles), blocks_forgotten=out["blocks"])


def test_forget_takes_blocks_that_only_ask_wrote(
    env: dict[str, str], tmp_path: Path, long_text: str, tiny_models: TinyModels
) -> None:
    canary = tmp_path / "canary.txt"
    canary.write_text(CANARY * 6, encoding="utf-8")
    other = tmp_path / "other.txt"
    other.write_text(long_text[:1500], encoding="utf-8")
    root = tmp_path / "cache"
    other_id = _prefill(env, other)
    _ask(env, canary, "Who filed it?")
    runs = _distinctive(
        _canary_tokens(tiny_models), _block_tokens(root), _chain_tokens(root, other_id)
    )
    needles = _with_words(canary, runs)
    assert set(runs) <= _found(root, needles)
    # no --model to tokenize with: the vocabulary comes from the model the cache recorded
    absent = str(tmp_path / "absent.gguf")
    out = _json(_cli(env, "cache", "forget", "--json", "--model", absent, str(canary)))
    assert out["snapshots"] == [] and out["conversations"] == []
    assert int(out["blocks"]) > 0  # type: ignore[call-overload]
    assert _traces(root, needles) == []
    _still_restored(env, root, other, other_id)


def test_forget_by_tokens_takes_every_block_holding_a_run_whoever_wrote_it(
    tmp_path: Path,
) -> None:
    """Any identity and namespace; the parent where the document began; shared blocks stay."""
    from support.store import OTHER_IDENTITY, make_chain, put_chain

    system = list(range(1000, 1008))  # one block, shared with an unrelated snapshot
    doc = list(range(2000, 2020))
    asked = make_chain(system + doc + [3000, 3001, 3002, 3003], 8)  # no snapshot, like ask
    # another model's chain: the document begins 4 tokens before a block boundary
    elsewhere = make_chain(list(range(5000, 5012)) + doc, 8, identity=OTHER_IDENTITY, namespace="x")
    unrelated = make_chain(system + list(range(4000, 4016)), 8)
    with SnapshotStore.open(tmp_path / "cache") as store:
        for chain in (asked, elsewhere, unrelated):
            put_chain(store, chain)
        ids = {}
        for name, chain in (("elsewhere", elsewhere), ("unrelated", unrelated)):
            tip = chain[-1]
            ids[name] = store.put_snapshot(
                NewSnapshot(
                    tip=tip.hash,
                    label=name,
                    source_path=None,
                    source_sha256=None,
                    n_tokens=tip.end,
                    identity=tip.identity,
                    namespace=tip.namespace,
                )
            )
        store.pin(ids["elsewhere"])  # privacy first: pinned or not, it holds the document
        report = store.forget("/docs/gone.txt", None, [np.asarray(doc, dtype=np.int32)])
        assert report.blocks == 6 and report.snapshots == [ids["elsewhere"]]
        assert [store.has_block(b.hash) for b in asked] == [True, False, False, False]
        assert [store.has_block(b.hash) for b in elsewhere] == [True, False, False, False]
        assert all(store.has_block(b.hash) for b in unrelated)
        assert [s.id for s in store.snapshots()] == [ids["unrelated"]]


def test_a_document_that_repeats_its_opening_leaves_the_shared_block_before_it(
    tmp_path: Path,
) -> None:
    from support.store import make_chain, put_chain

    system = list(range(1000, 1008))
    opening = list(range(2000, 2010))
    doc = opening + opening + [2100, 2101]  # its first block's window also occurs at 10
    asked = make_chain(system + doc, 8)
    unrelated = make_chain(system + list(range(4000, 4016)), 8)
    with SnapshotStore.open(tmp_path / "cache") as store:
        for chain in (asked, unrelated):
            put_chain(store, chain)
        tip = unrelated[-1]
        kept = store.put_snapshot(
            NewSnapshot(
                tip=tip.hash,
                label="unrelated",
                source_path=None,
                source_sha256=None,
                n_tokens=tip.end,
                identity=tip.identity,
                namespace="",
            )
        )
        report = store.forget(None, None, [np.asarray(doc, dtype=np.int32)])
        assert report.blocks == len(asked) - 1
        assert store.has_block(asked[0].hash)
        assert [s.id for s in store.snapshots()] == [kept]


def test_saved_conversations_holding_a_document_by_text_or_tokens(tmp_path: Path) -> None:
    from localkv.prompt.template import Message
    from localkv.runtime.chatsession import ChatState

    doc = np.arange(2000, 2040, dtype=np.int32)
    path = tmp_path / "conversations.db"
    with ConversationStore(path) as history:
        by_text = history.save(ChatState(messages=[Message("user", "see: " + CANARY)]))
        tokens = [1, 2, *doc[10:16].tolist(), 3]  # one run of 6 of the document's tokens
        by_tokens = history.save(ChatState(messages=[Message("user", "hi")], tokens=tokens))
        history.save(ChatState(messages=[Message("user", "no")], tokens=doc[:5].tolist()))
        found = history.holding(CANARY, [doc])
        assert sorted(c.id for c in found) == sorted([by_text, by_tokens])
        assert [c.id for c in history.holding(CANARY)] == [by_text]
        deleted, truncated = history.forget([by_text, "missing"])
        assert deleted == (by_text,) and truncated
        assert history.holding(CANARY) == ()
    data = b"".join(p.read_bytes() for p in tmp_path.glob("conversations.db*"))
    assert b"Quorblax" not in data


def test_without_a_vocabulary_forget_warns_and_matches_snapshots_only(
    env: dict[str, str], tmp_path: Path
) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text(CANARY, encoding="utf-8")
    args = ["cache", "forget", "--model", str(tmp_path / "absent.gguf"), str(doc)]
    result = CliRunner().invoke(cli, args, env=env)
    assert result.exit_code == 0, result.output
    assert "no model vocabulary could be loaded" in result.stderr
    assert "forgot 0 snapshot(s), 0 block(s), 0 B, 0 conversation(s)" in result.stdout
