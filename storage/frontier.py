"""How far a thread has read through a new file mapping, from the page table.

A mapping's pages get their page-table entries as they are first read, and
``/proc/self/pagemap`` says of each page whether it has one. On a new
mapping that one thread reads from its start to its end, as llama.cpp reads
a state stream, the first page without an entry is how far that thread has
come: another thread can then keep its own reading of the same file just
ahead of it (``storage.packed``), so that what one reads from memory the
other finds in the cache.

Only the present bit of an entry is read: it is there for every process,
where the page frame numbers are kept for privileged ones.
"""

from __future__ import annotations

import mmap
import os

__all__ = ["Frontier", "mapped_in_huge_pages"]

_PAGEMAP = "/proc/self/pagemap"
_ENTRY = 8  # bytes of one page's entry
_PRESENT = 63  # the entry's bit set where the page is mapped
_STEP = 2 << 20  # the frontier is looked for a huge page (x86-64, arm64) at a time
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class Frontier:
    """How far the pages of ``size`` bytes mapped at ``address`` (page-aligned, mapped
    after the last call of ``open`` on it) have been read from their start."""

    def __init__(self, fd: int, address: int, size: int) -> None:
        self._fd = fd
        self._first = address // mmap.PAGESIZE
        self._pages = 0
        self._total = -(-size // mmap.PAGESIZE)
        self._step = max(1, _STEP // mmap.PAGESIZE)

    @classmethod
    def open(cls, address: int, size: int) -> Frontier | None:
        """The frontier of the mapping, or None where the page table cannot be read
        (not Linux, a ``/proc`` without it, an address not on a page)."""
        if address % mmap.PAGESIZE:
            return None
        try:
            fd = os.open(_PAGEMAP, os.O_RDONLY | _O_CLOEXEC)
        except OSError:
            return None
        frontier = cls(fd, address, size)
        try:
            frontier.reach()
        except OSError:
            frontier.close()
            return None
        return frontier

    def reach(self) -> int:
        """Bytes from the start read so far, found a step at a time: never more than
        have been read (and mapped around them), at most a step fewer. It only grows."""
        while self._pages < self._total:
            step = min(self._step, self._total - self._pages)
            entry = os.pread(self._fd, _ENTRY, _ENTRY * (self._first + self._pages + step - 1))
            if len(entry) < _ENTRY or not int.from_bytes(entry, "little") >> _PRESENT:
                break
            self._pages += step
        return self._pages * mmap.PAGESIZE

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def mapped_in_huge_pages(address: int) -> bool:
    """Whether the page at ``address``, the first of a new mapping, read once, was
    mapped with a whole huge page around it: so the kernel maps a file whose pages it
    keeps in huge pages, in one step for each, where small pages are mapped a few at a
    time, and mapping them can take longer than reading them."""
    frontier = Frontier.open(address, _STEP)
    if frontier is None:
        return False
    try:
        return frontier.reach() >= _STEP
    finally:
        frontier.close()
