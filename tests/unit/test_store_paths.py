"""The cache root is private: 0700 directories, 0600 files, unsafe roots refused."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from localkv.storage import NewSnapshot
from localkv.storage.paths import CACHEDIR_TAG, CacheDirError, default_root
from localkv.storage.store import SnapshotStore
from support.store import make_chain, put_chain

pytestmark = pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX permissions")


@pytest.fixture
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _modes(root: Path) -> tuple[set[int], set[int]]:
    dirs, files = {stat.S_IMODE(root.stat().st_mode)}, set()
    for p in root.rglob("*"):
        (dirs if p.is_dir() else files).add(stat.S_IMODE(p.lstat().st_mode))
    return dirs, files


@pytest.mark.parametrize("umask", [0o022, 0o000], indirect=True)
def test_directories_0700_files_0600(tmp_path: Path, umask: int) -> None:
    root = tmp_path / "cache"
    with SnapshotStore.open(root) as store:
        blocks = make_chain(list(range(40)), 16)
        put_chain(store, blocks)
        store.put_snapshot(
            NewSnapshot(
                tip=blocks[-1].hash,
                label="doc",
                source_path=None,
                source_sha256=None,
                n_tokens=40,
                identity=blocks[0].identity,
                namespace="",
            )
        )
        store.quarantine(blocks[1].hash, "test")
        names = {p.name for p in root.rglob("*")}
        assert {"index.db", "index.db-wal", "CACHEDIR.TAG", "blocks", "tmp", "quarantine"} <= names
        assert any(p.suffix == ".reason" for p in (root / "quarantine").iterdir())
        assert _modes(root) == ({0o700}, {0o600})
    assert _modes(root) == ({0o700}, {0o600})


def test_cachedir_tag_has_the_standard_signature(tmp_path: Path) -> None:
    with SnapshotStore.open(tmp_path / "c") as store:
        text = (store.root / "CACHEDIR.TAG").read_text()
    assert text == CACHEDIR_TAG
    assert text.startswith("Signature: 8a477f597d28d172789f06886806bc55")


def test_symlinked_root_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(CacheDirError, match="symlink"):
        SnapshotStore.open(link)


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_group_or_world_writable_root_is_refused(tmp_path: Path, mode: int) -> None:
    root = tmp_path / "open"
    root.mkdir()
    os.chmod(root, mode)
    with pytest.raises(CacheDirError, match="writable"):
        SnapshotStore.open(root)


def test_world_writable_subdirectory_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "c"
    SnapshotStore.open(root).close()
    os.chmod(root / "blocks", 0o777)
    with pytest.raises(CacheDirError, match="writable"):
        SnapshotStore.open(root)


def test_existing_readable_root_is_accepted(tmp_path: Path) -> None:
    root = tmp_path / "c"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    SnapshotStore.open(root).close()
    assert (root / "index.db").exists()


def test_root_from_env_or_explicit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALKV_HOME", str(tmp_path / "env"))
    assert default_root(None) == tmp_path / "env"
    assert default_root(tmp_path / "x") == tmp_path / "x"
    with SnapshotStore.open() as store:
        assert store.root == tmp_path / "env"
    monkeypatch.delenv("LOCALKV_HOME")
    assert default_root(None).name == "localkv"
