"""Where the cache lives on disk, and the checks that keep it private.

The root is an explicit directory, else ``$LOCALKV_HOME``, else the platform's
user cache directory. Directories are created 0700 and files 0600 whatever the
umask (``chmod`` after creating). A root that is a symlink, owned by someone
else, or writable by group or others is refused with ``CacheDirError``: a
cache whose files another user can replace is a cache that can lie.

Layout::

    root/CACHEDIR.TAG
    root/index.db
    root/blocks/ab/<64 hex>.lkv   (fan-out by the first two hex digits)
    root/tmp/                     (files being written)
    root/quarantine/              (files that failed a check)
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from .chain import HASH_PREFIX, digest_bytes

__all__ = [
    "BLOCK_SUFFIX",
    "CACHEDIR_TAG",
    "CacheDirError",
    "CacheLayout",
    "create_private_file",
    "default_root",
    "ensure_private_db",
    "ensure_private_dir",
    "fsync_dir",
    "prepare_root",
]

logger = logging.getLogger(__name__)

ENV_HOME = "LOCALKV_HOME"
BLOCK_SUFFIX = ".lkv"
DIR_MODE = 0o700
FILE_MODE = 0o600
CACHEDIR_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by localkv.\n"
    "# For information about cache directory tags see https://bford.info/cachedir/\n"
)
_HAS_UID = hasattr(os, "getuid")


class CacheDirError(OSError):
    """The cache directory is unsafe or unusable."""


def default_root(explicit: Path | str | None = None) -> Path:
    """The cache root: ``explicit``, else ``$LOCALKV_HOME``, else the user cache dir."""
    if explicit is not None:
        return Path(explicit).expanduser().absolute()
    env = os.environ.get(ENV_HOME)
    if env:
        return Path(env).expanduser().absolute()
    return Path(platformdirs.user_cache_dir("localkv")).absolute()


def _check_dir(path: Path, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise CacheDirError(f"refusing cache directory {path}: it is a symlink")
    if not stat.S_ISDIR(st.st_mode):
        raise CacheDirError(f"refusing cache directory {path}: not a directory")
    if _HAS_UID and st.st_uid != os.getuid():
        raise CacheDirError(
            f"refusing cache directory {path}: owned by uid {st.st_uid}, not {os.getuid()}"
        )
    if _HAS_UID and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheDirError(
            f"refusing cache directory {path}: writable by group or others "
            f"(mode {stat.S_IMODE(st.st_mode):04o}); run chmod 700 on it"
        )


def ensure_private_dir(path: Path) -> None:
    """Create ``path`` (and missing parents) 0700, or check that it is safe to use."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, DIR_MODE)
            os.chmod(path, DIR_MODE)
        except FileExistsError:
            pass  # created concurrently; checked below
        except OSError as exc:
            raise CacheDirError(f"cannot create cache directory {path}: {exc}") from exc
        st = os.lstat(path)
    _check_dir(path, st)


def create_private_file(path: Path) -> int:
    """Create a new file 0600 (never following a symlink) and return its descriptor."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    flags |= getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, FILE_MODE)
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def fsync_dir(path: Path) -> None:
    """Flush a directory entry change (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """The paths of one cache root."""

    root: Path

    @property
    def index(self) -> Path:
        return self.root / "index.db"

    @property
    def blocks(self) -> Path:
        return self.root / "blocks"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    def block_relpath(self, block_hash: str) -> str:
        """The block file's path relative to the root, e.g. ``blocks/ab/ab12….lkv``."""
        hex_digest = digest_bytes(block_hash).hex()
        return f"blocks/{hex_digest[:2]}/{hex_digest}{BLOCK_SUFFIX}"

    def resolve(self, relpath: str) -> Path:
        """An index row's relative file path as a path inside the root.

        Raises ``ValueError`` for absolute paths, ``..`` components or a directory
        on the way that is a symlink, so a tampered index or a planted link
        cannot point the store outside its root.
        """
        rel = Path(relpath)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise ValueError(f"block path escapes the cache root: {relpath!r}")
        # never go through a planted symlink: unlink() and rename() would follow it
        here = self.root
        for part in rel.parts[:-1]:
            here = here / part
            try:
                mode = os.lstat(here).st_mode
            except FileNotFoundError:
                break
            if not stat.S_ISDIR(mode):
                raise ValueError(f"block path goes through a symlink or non-directory: {here}")
        return self.root / rel

    @staticmethod
    def hash_of_file(name: str) -> str | None:
        """The block hash named by a block file name, or None if it is not one."""
        if not name.endswith(BLOCK_SUFFIX):
            return None
        hex_digest = name[: -len(BLOCK_SUFFIX)]
        if len(hex_digest) != 64 or any(c not in "0123456789abcdef" for c in hex_digest):
            return None
        return HASH_PREFIX + hex_digest


def _write_tag(root: Path) -> None:
    tag = root / "CACHEDIR.TAG"
    if os.path.lexists(tag):
        return
    try:
        fd = create_private_file(tag)
    except FileExistsError:
        return
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(CACHEDIR_TAG)


SQLITE_SIDE_FILES = ("-wal", "-shm", "-journal")


def _check_private_file(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise CacheDirError(f"refusing {path}: not a regular file (a symlink?)")
    if _HAS_UID and st.st_uid != os.getuid():
        raise CacheDirError(f"refusing {path}: owned by uid {st.st_uid}")
    if stat.S_IMODE(st.st_mode) != FILE_MODE:
        os.chmod(path, FILE_MODE, follow_symlinks=False)


def ensure_private_db(path: Path) -> None:
    """Create a SQLite file 0600 before SQLite does (its -wal/-shm copy the mode).

    The file and any -wal, -shm or -journal beside it must be regular files
    owned by this user (SQLite would follow a planted symlink); their mode is
    set back to 0600 if something changed it.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        with contextlib.suppress(FileExistsError):
            os.close(create_private_file(path))
        st = os.lstat(path)
    _check_private_file(path, st)
    for suffix in SQLITE_SIDE_FILES:
        side = path.with_name(path.name + suffix)
        try:
            side_st = os.lstat(side)
        except FileNotFoundError:
            continue
        _check_private_file(side, side_st)


def prepare_root(root: Path) -> CacheLayout:
    """Create or check a cache root and its subdirectories; return its layout."""
    layout = CacheLayout(root)
    ensure_private_dir(root)
    for sub in (layout.blocks, layout.tmp, layout.quarantine):
        ensure_private_dir(sub)
    _write_tag(root)
    ensure_private_db(layout.index)
    logger.debug("cache root ready: %s", root)
    return layout
