"""What a restore's bytes cost at the least: the page cache dropped, a sequential read, a copy.

- ``drop(paths)``: each file flushed and dropped from the page cache
  (``posix_fadvise(DONTNEED)``; no root needed), so the next read comes from storage;
- ``cached_bytes()``: the page cache's size (``Cached`` in /proc/meminfo), to check a drop;
- ``huge_mapped_bytes(address)``: how much of a file mapping the kernel maps in huge pages;
- ``read_seconds(paths, into)``: the files read one after another, in large
  chunks, into one ready buffer;
- ``memcpy_seconds``: a numpy copy between two ready buffers (``measure``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from localkv.bench.geometry.measure import memcpy_seconds

__all__ = [
    "cached_bytes",
    "drop",
    "files_under",
    "huge_mapped_bytes",
    "memcpy_seconds",
    "read_seconds",
]

CHUNK = 64 << 20
_MEMINFO = Path("/proc/meminfo")
_SMAPS = Path("/proc/self/smaps")


def files_under(root: Path) -> list[Path]:
    """Every plain file under ``root``, in name order."""
    return sorted(p for p in root.rglob("*") if p.is_file())


def drop(paths: Sequence[Path]) -> None:
    """Write back and drop each file's pages from the page cache."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_bytes() -> int:
    """The page cache's size now (``Cached`` of /proc/meminfo), in bytes."""
    for line in _MEMINFO.read_text().splitlines():
        if line.startswith("Cached:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no Cached line in /proc/meminfo")


def huge_mapped_bytes(address: int) -> int:
    """Bytes of the file mapping that starts at ``address`` the kernel maps in huge pages
    (``FilePmdMapped`` of its entry in /proc/self/smaps), 0 where it has none."""
    inside = False
    for line in _SMAPS.read_text().splitlines():
        field = line.split()
        if field and not field[0].endswith(":"):
            inside = int(field[0].split("-")[0], 16) == address
        elif inside and field[0] == "FilePmdMapped:":
            return int(field[1]) * 1024
    return 0


def read_seconds(paths: Sequence[Path], into: np.ndarray) -> float:
    """Seconds to read ``paths`` whole, one after another, in large chunks into ``into``."""
    view = memoryview(into)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    off = 0
    for path in paths:
        with path.open("rb", buffering=0) as f:
            while True:
                got = f.readinto(view[off : off + CHUNK])
                if not got:
                    break
                off += got
    return time.perf_counter() - t0
