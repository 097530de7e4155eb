"""Disk full and I/O errors: each save step fails cleanly and the app carries on uncached.

ENOSPC and EIO are injected (``storage.faults``) at the temp file's write, its
fsync, its rename into place and the index commit. Each time the save raises
``OSError``, the index and the block directory are exactly as before, and the
next save works. Through the engine, a failing cache is a warning: the answer
is the uncached one.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from localkv.storage import NewSnapshot, faults
from localkv.storage.disk import ENV_MIN_FREE
from localkv.storage.store import SnapshotStore
from support.reliability import check_store, record
from support.store import make_chain, put_chain
from support.tinymodels import TinyModels, tiny_config

from localkv.model.sampling import SamplingParams
from localkv.prompt.request import Document
from localkv.runtime import Runtime

GREEDY = SamplingParams(temperature=0, max_tokens=12)
SYSTEM = "You answer questions about the document."
SAVE_POINTS = ["before_write", "before_fsync", "before_rename", "before_commit"]


def _disk_state(root: Path) -> tuple[list[tuple[object, ...]], list[str]]:
    with SnapshotStore.open(root) as store:
        rows = store.db.execute("SELECT hash, file, checksum FROM blocks ORDER BY hash").fetchall()
        rows += store.db.execute("SELECT id, tip, label FROM snapshots ORDER BY id").fetchall()
    files = sorted(
        str(p.relative_to(root))
        for sub in ("blocks", "tmp")
        for p in (root / sub).rglob("*")
        if not p.is_dir()
    )
    return rows, files


@pytest.mark.parametrize("error", ["enospc", "eio"])
@pytest.mark.parametrize("point", SAVE_POINTS)
def test_a_failed_save_leaves_the_index_and_files_unchanged(
    tmp_path: Path, point: str, error: str
) -> None:
    root = tmp_path / "cache"
    blocks = make_chain(list(range(80)), 16)
    with SnapshotStore.open(root) as store:
        put_chain(store, blocks[:2])
    before = _disk_state(root)
    with SnapshotStore.open(root) as store, faults.injected(f"{point}:{error}"):
        with pytest.raises(OSError, match="injected") as info:
            store.put_block(blocks[2])
        assert info.value.errno == {"enospc": 28, "eio": 5}[error]
    assert _disk_state(root) == before
    with SnapshotStore.open(root) as store:  # and the next save works
        assert put_chain(store, blocks[2:]) == 3
    check_store(root)
    record("faults.store", point=point, error=error, injections=1)


def test_a_persistent_commit_failure_rolls_back_and_releases_the_lock(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    blocks = make_chain(list(range(48)), 16)
    with SnapshotStore.open(root) as store:
        put_chain(store, blocks[:1])
        with faults.injected("before_commit:enospc@*"):
            with pytest.raises(OSError):
                store.put_block(blocks[1])
            with pytest.raises(OSError):
                store.put_snapshot(
                    NewSnapshot(
                        tip=blocks[0].hash,
                        label="x",
                        source_path=None,
                        source_sha256=None,
                        n_tokens=16,
                        identity=blocks[0].identity,
                        namespace="",
                    )
                )
        # another process can write at once: no transaction was left open
        with SnapshotStore.open(root) as other:
            assert other.put_block(blocks[1])
    check_store(root)


def test_too_little_free_space_is_refused_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "cache"
    blocks = make_chain(list(range(32)), 16)
    with SnapshotStore.open(root) as store:
        put_chain(store, blocks[:1])
        before = _disk_state(root)
        monkeypatch.setenv(ENV_MIN_FREE, "1000T")
        with pytest.raises(OSError, match="free") as info:
            store.put_block(blocks[1])
        assert info.value.errno == 28
    assert _disk_state(root) == before


@pytest.fixture()
def doc(long_text: str) -> Document:
    return Document.from_text(long_text[:2500], "doc.txt")


def test_the_engine_carries_on_uncached_when_the_disk_fails(
    tiny_models: TinyModels,
    tmp_path: Path,
    doc: Document,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    question = "What is the document about?"
    with Runtime(tiny_config(tiny_models.base), use_cache=False) as rt:
        uncached = rt.ask([doc], question, system=SYSTEM, params=GREEDY).text
    cache = tmp_path / "cache"
    injections = 0
    with Runtime(tiny_config(tiny_models.base), cache_dir=cache) as rt:
        caplog.set_level(logging.WARNING)
        for spec in ("before_fsync:eio@*", "before_write:enospc@*", "before_commit:enospc@*"):
            caplog.clear()
            with faults.injected(spec):
                report = rt.prefill([doc], system=SYSTEM)
                answer = rt.ask([doc], question, system=SYSTEM, params=GREEDY)
                rt.wait_for_saves()
            injections += 1
            assert report.snapshot is None and report.new_blocks == 0
            assert answer.text == uncached
            assert any("continuing without" in r.getMessage() for r in caplog.records)
        monkeypatch.setenv(ENV_MIN_FREE, "1000T")
        caplog.clear()
        report = rt.prefill([doc], system=SYSTEM)
        assert report.snapshot is None
        assert any("free" in r.getMessage() for r in caplog.records)
        monkeypatch.delenv(ENV_MIN_FREE)
    assert _disk_state(cache)[0] == []  # nothing indexed
    assert not [p for p in (cache / "blocks").rglob("*") if p.is_file()]
    # once the disk works again, the cache does too
    with Runtime(tiny_config(tiny_models.base), cache_dir=cache) as rt:
        assert rt.prefill([doc], system=SYSTEM).snapshot is not None
        answer = rt.ask([doc], question, system=SYSTEM, params=GREEDY)
        assert answer.cache.hit and answer.text == uncached
    record("faults.engine", injections=injections + 1)
