"""Permissions and trust: a private cache whatever the umask, and no symlink is followed.

Directories are 0700 and files 0600 (index.db and its -wal/-shm, filehashes.db,
block files, quarantined files and their notes, CACHEDIR.TAG) under any umask.
A root that is a symlink, owned by another user, or writable by group or
others is refused, and so are planted symlinks inside it. No module of the
package uses pickle or marshal.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from localkv.storage.filehash import FileHasher
from localkv.storage.paths import CacheDirError
from localkv.storage.store import BlockCorrupt, SnapshotStore
from support.reliability import record
from support.store import make_chain, put_chain

REPO = Path(__file__).resolve().parents[2]


def _entries(root: Path) -> Iterator[Path]:
    yield root
    yield from root.rglob("*")


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_everything_is_private_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        root = tmp_path / "cache"
        blocks = make_chain(list(range(64)), 16)
        with SnapshotStore.open(root) as store:
            put_chain(store, blocks)
            store.quarantine(blocks[3].hash, "for the test")
            FileHasher(root / "filehashes.db").sha256(root / "CACHEDIR.TAG")
            names = {p.name for p in root.iterdir()}
            assert {"index.db-wal", "index.db-shm", "filehashes.db"} <= names
            modes = {p: stat.S_IMODE(os.lstat(p).st_mode) for p in _entries(root)}
    finally:
        os.umask(old)
    quarantined = list((root / "quarantine").iterdir())
    assert len(quarantined) == 2  # the file and its .reason note
    for path, mode in modes.items():
        want = 0o700 if path.is_dir() else 0o600
        assert mode == want, f"{path.relative_to(tmp_path)}: {mode:o}"
    record("permissions.modes", umask=f"{umask:03o}", entries=len(modes))


def _refused(root: Path, match: str) -> None:
    with pytest.raises(CacheDirError, match=match):
        SnapshotStore.open(root)


def test_a_symlinked_root_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    SnapshotStore.open(real).close()
    (tmp_path / "link").symlink_to(real)
    _refused(tmp_path / "link", "symlink")


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777, 0o720])
def test_a_root_writable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    root = tmp_path / "cache"
    SnapshotStore.open(root).close()
    root.chmod(mode)
    _refused(root, "writable by group or others")


def test_a_root_owned_by_another_user_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "cache"
    SnapshotStore.open(root).close()
    if os.getuid() == 0:
        os.chown(root, 65534, 65534)
    else:
        monkeypatch.setattr(os, "getuid", lambda: os.stat(root).st_uid + 1)
    _refused(root, "owned by uid")


@pytest.mark.parametrize(
    "name", ["blocks", "tmp", "quarantine", "index.db", "index.db-wal", "index.db-shm"]
)
def test_a_symlink_planted_in_the_root_is_refused(tmp_path: Path, name: str) -> None:
    root = tmp_path / "cache"
    SnapshotStore.open(root).close()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    target = root / name
    if target.is_dir():
        shutil.rmtree(target)
        target.symlink_to(elsewhere, target_is_directory=True)
    else:
        target.unlink(missing_ok=True)
        (elsewhere / "file").write_bytes(b"")
        target.symlink_to(elsewhere / "file")
    _refused(root, "symlink|not a regular file|not a directory")


def test_symlinks_inside_the_block_tree_are_never_followed(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    blocks = make_chain(list(range(64)), 16)
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o700)
    with SnapshotStore.open(root) as store:
        put_chain(store, blocks)
        rows = store.match_chain([b.hash for b in blocks])
        # a block file replaced by a symlink to a good copy of itself
        a = root / rows[0].file
        shutil.copy(a, outside / a.name)
        a.unlink()
        a.symlink_to(outside / a.name)
        # a fan-out directory replaced by a symlink to a good copy of itself
        b = root / rows[2].file
        shutil.copytree(b.parent, outside / b.parent.name)
        shutil.rmtree(b.parent)
        b.parent.symlink_to(outside / b.parent.name, target_is_directory=True)
        # a temp file that is a symlink to something precious
        (outside / "precious").write_bytes(b"keep me")
        (root / "tmp" / "x.tmp").symlink_to(outside / "precious")
        for row in (rows[0], rows[2]):
            with pytest.raises(BlockCorrupt, match="symlink"):
                store.read_blocks([row])
        bad = dict(store.verify())
        assert rows[0].hash in bad and rows[2].hash in bad
        store.gc(grace_seconds=0)
        store.verify(repair=True)
    assert (outside / "precious").read_bytes() == b"keep me"
    assert (outside / a.name).exists() and (outside / b.parent.name / b.name).exists()
    assert not (root / "tmp" / "x.tmp").is_symlink()


_PICKLE = re.compile(
    r"^\s*(import|from)\s+(c?pickle|marshal|shelve|dill|joblib)\b|allow_pickle\s*=\s*True"
    r"|torch\.load\(|\.loads?\(.*pickle",
    re.MULTILINE,
)


def test_no_pickle_or_marshal_anywhere_in_the_package() -> None:
    sources = [p for d in ("localkv", "storage", "tui") for p in (REPO / d).rglob("*.py")]
    assert len(sources) > 20
    offenders = [str(p) for p in sources if _PICKLE.search(p.read_text(encoding="utf-8"))]
    assert offenders == []
    record("permissions.no_pickle", files_scanned=len(sources))
