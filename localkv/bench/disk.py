"""Reads from storage without root: dropping files from the page cache, counting disk reads.

``localkv bench`` times restores of files it has just written, so they come
from the page cache. To time them from storage as well:

- ``evict(paths)`` flushes each file (``fsync``: a dirty page is not dropped)
  and asks the kernel to drop its cached pages with
  ``posix_fadvise(POSIX_FADV_DONTNEED)``. No root needed, unlike
  ``/proc/sys/vm/drop_caches``. It is advice: pages mapped or locked elsewhere
  stay, and some file systems ignore it.
- ``storage_reads()`` is ``read_bytes`` of ``/proc/self/io``: the bytes this
  process (all its threads) caused to be fetched from the storage layer.
  Page-cache hits do not count, so a cold read of a file that was really
  dropped adds about its size. That is how the bench checks an eviction
  worked rather than trusting the advice.

On a virtual machine "storage" is the virtual disk: the host may still hold
the bytes in its own cache, which the guest cannot drop.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from localkv.kv.blocks import PARTIAL, WINDOW
from localkv.storage import Block
from localkv.storage.values import TAIL_GROUP

__all__ = [
    "EVICTION_AVAILABLE",
    "IN_MEMORY_FILE_SYSTEMS",
    "cold_call",
    "evict",
    "file_system",
    "storage_reads",
    "unread_bytes",
]

T = TypeVar("T")
U = TypeVar("U")

EVICTION_AVAILABLE = hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_DONTNEED")
_PROC_IO = Path("/proc/self/io")
_PROC_MOUNTS = Path("/proc/self/mounts")
# the page cache is the file's only copy: nothing to drop, nothing read from storage
IN_MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs"})


def evict(paths: Iterable[Path | str]) -> bool:
    """Drop each file's pages from the page cache; False where that is not possible.

    False when ``posix_fadvise`` does not exist on this platform or refused a
    file; True means the advice was given for every file, not that the kernel
    followed it (``storage_reads`` tells).
    """
    if not EVICTION_AVAILABLE:
        return False
    ok = True
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            # dirty pages are written back first, or they stay cached; where fsync
            # fails, the advice may still drop the clean pages
            with contextlib.suppress(OSError):
                os.fsync(fd)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                ok = False
        finally:
            os.close(fd)
    return ok


def storage_reads() -> int | None:
    """``read_bytes`` of ``/proc/self/io`` (bytes fetched from storage), or None."""
    try:
        text = _PROC_IO.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "read_bytes":
            try:
                return int(value)
            except ValueError:
                return None
    return None


@dataclass(frozen=True, slots=True)
class ColdRun(Generic[T]):
    """One call made with its files evicted from the page cache first."""

    value: T  # what the call returned
    read_bytes: int | None  # bytes it read from storage (None where unknown)
    evicted: bool  # the eviction was given for every file

    def map(self, fn: Callable[[T], U]) -> ColdRun[U]:
        return ColdRun(fn(self.value), self.read_bytes, self.evicted)


def cold_call(paths: Iterable[Path | str], fn: Callable[[], T]) -> ColdRun[T]:
    """Evict ``paths``, then call ``fn``: its result, the bytes it read from storage
    and whether the eviction was given for every file.

    Eviction and flushing happen before ``fn``, outside whatever ``fn`` times.
    """
    evicted = evict(paths)
    before = storage_reads()
    out = fn()
    after = storage_reads()
    read = None if before is None or after is None else after - before
    return ColdRun(out, read, evicted)


def file_system(path: Path | str) -> str | None:
    """The type of the file system holding ``path`` (``ext4``, ``tmpfs`` ...), or None.

    From ``/proc/self/mounts``: the longest mount point that contains ``path``.
    """
    try:
        lines = _PROC_MOUNTS.read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best, kind = "", None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        # mount points escape spaces and the like as octal (\040)
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def unread_bytes(blocks: list[Block]) -> int:
    """What a restore ending at the last of ``blocks`` leaves unread: every block's recurrent
    state but the last one's (``cache.restore``), and the sliding rows before the window's
    row group (``cache.restore.window``)."""
    unread = sum(b.tensors[PARTIAL].nbytes for b in blocks[:-1] if PARTIAL in b.tensors)
    first = int(blocks[-1].meta.get("window_first", -1)) if blocks else -1
    for b in blocks:
        tails = [a for name, a in b.tensors.items() if name.startswith(WINDOW)]
        if first < 0 or not tails:
            continue
        rows = tails[0].shape[0]
        stored = b.end - rows
        skip = rows if b.end <= first else max(0, first - stored) // TAIL_GROUP * TAIL_GROUP
        unread += sum(a.nbytes // rows * skip for a in tails)
    return unread
