"""Block files on disk: atomic writes, reads that never follow links, removal.

Write: a 0600 temp file in ``root/tmp``, locked by its writer -> fsync -> into ``blocks/ab/`` ->
fsync the directory; a hard link puts it in place without ever replacing
another writer's file, and ``os.replace`` is used only under the index lock.
Read: refuse anything that is not a regular file at the expected place (a
symlinked file or fan-out directory included) and any size other than the
index's.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

from . import faults
from .paths import CacheLayout, create_private_file, ensure_private_dir, fsync_dir
from .removal.budget import parse_size
from .values import BlockCorrupt

__all__ = [
    "ENV_MIN_FREE",
    "MIN_FREE_BYTES",
    "MIN_FREE_FLOOR",
    "TEMP_SUFFIX",
    "check_free_space",
    "link_into_place",
    "locked_temp_file",
    "min_free_bytes",
    "move_to_quarantine",
    "open_block_file",
    "read_exactly",
    "remove_abandoned_temp_files",
    "remove_file",
    "remove_if_abandoned",
    "replace_into_place",
    "staged_block_file",
]

logger = logging.getLogger(__name__)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_BINARY = getattr(os, "O_BINARY", 0)
ENV_MIN_FREE = "LOCALKV_MIN_FREE"
MIN_FREE_BYTES = 256 << 20
TEMP_SUFFIX = ".tmp"  # tmp/NAME.RANDOM.tmp: a file being written (see ``locked_temp_file``)
# the least margin that may be asked for: the index, its WAL, the manifests and the
# saved conversations must still be written once block files have filled the rest
MIN_FREE_FLOOR = 16 << 20
try:
    _IOV_MAX = max(16, min(1024, os.sysconf("SC_IOV_MAX")))
except (AttributeError, ValueError, OSError):  # pragma: no cover - no sysconf (Windows)
    _IOV_MAX = 16


def check_free_space(directory: Path, needed: int) -> None:
    """Raise ``OSError(ENOSPC)`` unless ``needed`` bytes fit and leave a margin free.

    The margin is ``$LOCALKV_MIN_FREE`` (e.g. ``1G``), else 256 MiB: the cache
    never fills the disk it shares with everything else.
    """
    margin = min_free_bytes()
    free = shutil.disk_usage(directory).free
    if free < needed + margin:
        raise OSError(
            errno.ENOSPC,
            f"not saving {needed} bytes: {free} bytes free at {directory}, "
            f"keeping {margin} free ({ENV_MIN_FREE})",
        )


def min_free_bytes() -> int:
    """``$LOCALKV_MIN_FREE`` in bytes (default 256 MiB); ``ValueError`` for a value that
    is not a size or is below ``MIN_FREE_FLOOR``."""
    env = os.environ.get(ENV_MIN_FREE)
    if not env:
        return MIN_FREE_BYTES
    margin = parse_size(env)
    if margin < MIN_FREE_FLOOR:
        raise ValueError(
            f"{env!r} is less than {MIN_FREE_FLOOR >> 20} MiB, the room the index and "
            "the saved conversations need beside the cache's blocks"
        )
    return margin


@contextmanager
def locked_temp_file(layout: CacheLayout, stem: str) -> Iterator[tuple[Path, int]]:
    """A new 0600 file ``tmp/STEM.RANDOM.tmp`` and its descriptor, locked while this
    writer lives.

    The lock (``flock``) is the kernel's: it ends when the writer closes the file
    or dies, so ``gc``, ``forget`` and ``repair`` tell a temp file a writer still
    needs from one a killed save left (``remove_if_abandoned``) at once, by no
    clock. On exit the file is removed, if still there, and the lock released.
    """
    path, fd = _create_locked(layout.tmp, stem)
    try:
        yield path, fd
    finally:
        remove_file(path)
        os.close(fd)


def _create_locked(directory: Path, stem: str) -> tuple[Path, int]:
    """Create and lock a temp file; again under a new name if a cleaner took it first."""
    while True:
        path = directory / f"{stem}.{secrets.token_hex(6)}{TEMP_SUFFIX}"
        fd = create_private_file(path)
        if fcntl is None:  # pragma: no cover - no flock (Windows): gc's grace period only
            return path, fd
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.lstat(path).st_ino == os.fstat(fd).st_ino:
                return path, fd
        except FileNotFoundError:
            pass
        os.close(fd)  # removed between its creation and the lock: it was never ours


def remove_if_abandoned(path: Path, salvage: Callable[[Path], None] | None = None) -> int | None:
    """Remove a temp file no living writer holds; the bytes freed, or None if one does.

    ``salvage(path)`` runs first, under the lock (``repair`` places a whole block
    file from it). Anything but a regular file is left to ``gc``'s grace period.
    """
    if fcntl is None:  # pragma: no cover - no flock (Windows)
        return None
    try:
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # its writer is alive
        if salvage is not None:
            salvage(path)
        return remove_file(path)  # under the lock: no writer can take it now
    finally:
        os.close(fd)


def remove_abandoned_temp_files(layout: CacheLayout) -> tuple[int, int]:
    """Remove every temp file no living writer holds; (how many, bytes freed)."""
    count = freed = 0
    for entry in os.scandir(layout.tmp):
        gone = remove_if_abandoned(Path(entry.path))
        if gone is not None:
            count, freed = count + 1, freed + gone
    return count, freed


@contextmanager
def staged_block_file(layout: CacheLayout, relpath: str, data: bytes) -> Iterator[Path]:
    """``data`` in a new locked temp file in ``tmp/``, fsynced, for the ``with`` block;
    removed afterwards (the block file is linked into place from it)."""
    final = layout.resolve(relpath)
    with locked_temp_file(layout, final.name) as (tmp, fd):
        with os.fdopen(os.dup(fd), "wb", closefd=True) as f:  # the lock stays on ``fd``
            faults.point("before_write")
            f.write(data)
            f.flush()
            faults.point("before_fsync")
            os.fsync(f.fileno())
        yield tmp


def link_into_place(layout: CacheLayout, tmp: Path, relpath: str) -> bool:
    """Give the staged file its final name unless one exists there; True if it was placed.

    A hard link never replaces: a file already there may belong to a row that
    another process is inserting right now, so only ``replace_into_place``,
    under the index's write lock and with no row present, may replace it.
    """
    final = layout.resolve(relpath)
    fanout = final.parent
    new_dir = not fanout.exists()
    ensure_private_dir(fanout)
    faults.point("before_rename")
    try:
        os.link(tmp, final, follow_symlinks=False)
    except FileExistsError:
        return False
    except OSError:  # no hard links on this file system: check, then rename
        if os.path.lexists(final):
            return False
        os.replace(tmp, final)
    remove_file(tmp)
    fsync_dir(fanout)
    if new_dir:
        fsync_dir(fanout.parent)
    return True


def replace_into_place(layout: CacheLayout, tmp: Path, relpath: str) -> None:
    """Atomically replace the file at ``relpath`` with the staged one (under the write lock)."""
    final = layout.resolve(relpath)
    faults.point("before_rename")
    os.replace(tmp, final)
    fsync_dir(final.parent)


def open_block_file(layout: CacheLayout, relpath: str, expected_size: int) -> int:
    """A read-only descriptor of a block file, or ``BlockCorrupt`` saying what is wrong.

    The file must be a regular file (not a link, nor under a linked fan-out
    directory) of exactly ``expected_size`` bytes. The caller closes it.
    """
    try:
        path = layout.resolve(relpath)
    except ValueError as exc:
        raise BlockCorrupt(str(exc)) from exc
    try:
        dir_st = os.lstat(path.parent)
    except FileNotFoundError:
        raise BlockCorrupt("file is missing (no fan-out directory)") from None
    if not stat.S_ISDIR(dir_st.st_mode):
        raise BlockCorrupt("fan-out directory is a symlink or not a directory")
    try:
        # O_NONBLOCK: a FIFO put in a block file's place must not block the open
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_BINARY | _O_NONBLOCK)
    except FileNotFoundError:
        raise BlockCorrupt("file is missing") from None
    except OSError as exc:
        if os.path.islink(path):
            raise BlockCorrupt("file is a symlink") from None
        raise BlockCorrupt(f"cannot open file: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BlockCorrupt("not a regular file")
        if st.st_size != expected_size:
            raise BlockCorrupt(f"file has {st.st_size} bytes, the index expects {expected_size}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_exactly(fd: int, buffers: list[memoryview], offset: int) -> None:
    """Fill ``buffers`` (in order) from ``fd`` starting at ``offset``.

    One ``preadv`` call per ``IOV_MAX`` buffers where the platform has it; short
    reads are resumed; the end of the file first is ``BlockCorrupt``.
    """
    pending = [b for b in buffers if len(b)]
    while pending:
        batch = pending[:_IOV_MAX]
        want = sum(len(b) for b in batch)
        got = _preadv(fd, batch, offset)
        if got == 0:
            raise BlockCorrupt(f"file ended at byte {offset}")
        offset += got
        if got == want:
            pending = pending[len(batch) :]
            continue
        while got >= len(pending[0]):  # drop what a short read filled
            got -= len(pending.pop(0))
        pending[0] = pending[0][got:]


def _preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, buffers, offset)
    chunk = os.pread(fd, len(buffers[0]), offset)  # pragma: no cover - no preadv (Windows)
    buffers[0][: len(chunk)] = chunk  # pragma: no cover
    return len(chunk)  # pragma: no cover


def remove_file(path: Path) -> int:
    """Unlink ``path`` (a link itself, never its target); return the bytes freed."""
    try:
        size = os.lstat(path).st_size
        os.unlink(path)
    except FileNotFoundError:
        return 0
    return size


def move_to_quarantine(layout: CacheLayout, relpath: str, reason: str) -> Path | None:
    """Move a block file into ``quarantine/`` with a ``.reason`` note; None if it is gone."""
    try:
        src = layout.resolve(relpath)
    except ValueError:
        return None
    if not os.path.lexists(src):
        return None
    dest = layout.quarantine / f"{src.name}.{secrets.token_hex(4)}"
    try:
        os.replace(src, dest)
    except OSError as exc:
        logger.warning("could not quarantine %s (%s); removing it", src, exc)
        remove_file(src)
        return None
    note = dest.with_name(dest.name + ".reason")
    try:
        fd = create_private_file(note)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(reason + "\n")
    except OSError as exc:
        logger.warning("could not write %s: %s", note, exc)
    return dest
