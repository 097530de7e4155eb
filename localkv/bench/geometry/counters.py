"""What a process reads and writes, from ``/proc/self/io``, and time spent in a method.

- ``rchar`` / ``wchar``: bytes passed to read and write system calls (``pread``,
  ``preadv``, ``write``), page cache or not: what a restore asked the files
  for, and what a save handed them. Memory-mapped reads do not count (the
  store reads with ``preadv``; the model file is mapped and is not counted).
- ``read_bytes`` / ``write_bytes``: bytes this process caused to be fetched from
  or sent to the storage layer (writes are counted when a page is dirtied, so
  a write not yet flushed counts). Page-cache hits do not count as reads.

Every thread of the process counts (the store reads and writes on worker
threads).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Io", "MethodTimer", "io_now", "tree_bytes"]

_PROC_IO = Path("/proc/self/io")
_FIELDS = ("rchar", "wchar", "read_bytes", "write_bytes")


@dataclass(frozen=True, slots=True, kw_only=True)
class Io:
    rchar: int = 0
    wchar: int = 0
    read_bytes: int = 0
    write_bytes: int = 0

    def __sub__(self, other: Io) -> Io:
        return Io(*(getattr(self, f) - getattr(other, f) for f in _FIELDS))


def io_now() -> Io:
    """This process's I/O counters (zeros where ``/proc/self/io`` is missing)."""
    try:
        text = _PROC_IO.read_text()
    except OSError:
        return Io()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in _FIELDS:
            values[name.strip()] = int(value)
    return Io(**values)


def tree_bytes(root: Path) -> int:
    """The sizes of every file under ``root``."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


class MethodTimer:
    """Wraps methods of one object to add up the seconds spent in them (any thread)."""

    def __init__(self, obj: Any, *names: str) -> None:
        self.seconds = 0.0
        for name in names:
            setattr(obj, name, self._timed(getattr(obj, name)))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return call
