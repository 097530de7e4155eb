"""Packed states: a chain's state as llama.cpp loads it, whole, in one file.

A chain's blocks hold its K/V rows a block at a time; llama.cpp takes a state
only as one contiguous stream, layer after layer. A packed state is that
stream, written once from the blocks, so a restore maps the file and hands
the mapping to llama.cpp: the bytes go from the page cache into the KV cells
in one copy, where a restore from the blocks first copies them into a buffer.

It is a copy of what the blocks hold, never the only one: a file that fails a
check is removed, and the restore goes on from the blocks. The file is
``packed/HEX.state`` (the chain's tip block hash); after the stream comes a
trailer: a magic, the stream's length, the tokens it holds, the tip hash, and
the xxh3-128 of everything before the digest. The store keeps a few, the
most recently used (``KEEP``, and ``budget // BUDGET_SHARE`` bytes at most);
the caller decides which chains to pack (``localkv.cache.restore.packed``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import xxhash

from .chain import HASH_PREFIX, digest_bytes
from .disk import check_free_space, locked_temp_file, remove_file
from .frontier import Frontier, mapped_in_huge_pages
from .paths import CacheLayout, ensure_private_dir

__all__ = ["BUDGET_SHARE", "KEEP", "SUFFIX", "PackedEntry", "PackedState", "PackedStates"]

KEEP = 4  # packed states kept, the most recently used
BUDGET_SHARE = 4  # they hold at most this fraction (1/BUDGET_SHARE) of the cache's budget
SUFFIX = ".state"
_MAGIC = b"LKVPACK1"
_HEAD = struct.Struct("<8sQQ32s")  # magic, stream bytes, tokens, tip block digest
_DIGEST = 16  # xxh3-128
_TRAILER = _HEAD.size + _DIGEST
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# the digest reads this far ahead of llama.cpp's load at most: what it brings from memory
# is still in its core's cache when the load comes to it (a core's L2 on the machines the
# performance pages measure), in steps of _CHUNK, waiting _PAUSE_S for the load between
_LEAD = 2 << 20
_CHUNK = 1 << 20
_PAUSE_S = 50e-6
_DIFFERS = "packed state checksum differs"


class PackedEntry(NamedTuple):
    """A packed state file: its chain's tip, its bytes, when it was last used."""

    tip: str
    size: int
    used: float


@dataclass(slots=True, eq=False, kw_only=True)
class PackedState:
    """A packed state file mapped read-only; ``close()`` when done with ``stream``."""

    path: Path
    stream: np.ndarray  # llama.cpp's state stream, read-only, on the mapping
    tokens: int
    tip: str
    huge_pages: bool  # the mapping's first page came in a huge page (``storage.frontier``)
    _mapping: mmap.mmap
    _fd: int
    _loaded: threading.Event = field(default_factory=threading.Event)

    def check(self) -> str | None:
        """Why the file cannot be used (its digest differs), or None.

        Run beside llama.cpp's load of ``stream`` (then ``loaded()`` once it returns).
        Where the file is mapped in huge pages (``huge_pages``), it reads the file through
        a mapping of its own, a little ahead of the load: each byte then comes from memory
        once, for the digest, and the load finds it in the cache (``storage.frontier``).
        Elsewhere (small pages: mapping them can cost more than reading them) it reads
        the load's own mapping at its own pace, and so takes a share of its page faults."""
        size = self.stream.shape[0] + _HEAD.size
        frontier = Frontier.open(_address(self.stream), size) if self.huge_pages else None
        if frontier is None:
            digest = xxhash.xxh3_128(memoryview(self._mapping)[:size]).digest()
            return None if digest == self._mapping[size : size + _DIGEST] else _DIFFERS
        own = mmap.mmap(self._fd, len(self._mapping), prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
        _ask_huge_pages(own)
        view = memoryview(own)
        try:
            digest = _digest_ahead(view, size, frontier, self._loaded)
            same = digest == bytes(view[size : size + _DIGEST])
        finally:
            frontier.close()
            view.release()
            _close(own)
        return None if same else _DIFFERS

    def loaded(self) -> None:
        """Say that the load of ``stream`` returned: ``check`` goes on at its own pace."""
        self._loaded.set()

    def close(self) -> None:
        if self._fd < 0:
            return
        self.stream = np.empty(0, dtype=np.uint8)  # the mapping's last view
        _close(self._mapping)
        os.close(self._fd)
        self._fd = -1


class PackedStates:
    """The packed states of one store (thread-safe: each file is written whole, then
    renamed into place)."""

    def __init__(self, layout: CacheLayout) -> None:
        self.layout = layout
        self.dir = layout.root / "packed"

    def path(self, tip: str) -> Path:
        return self.dir / f"{digest_bytes(tip).hex()}{SUFFIX}"

    def has(self, tip: str) -> bool:
        return os.path.lexists(self.path(tip))

    def open(self, tip: str, tokens: int) -> PackedState | str | None:
        """The packed state of the chain ending at block ``tip`` holding ``tokens``,
        mapped (its digest not yet checked: ``PackedState.check``); None where there is
        none; why not, where the file is not one (the caller removes it)."""
        path = self.path(tip)
        try:
            # O_NONBLOCK: a FIFO put in its place must not block the open
            flags = _O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
            fd = os.open(path, os.O_RDONLY | flags)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return f"packed state cannot be opened: {exc.strerror}"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < _TRAILER:
                raise ValueError("packed state is not a regular file of a trailer at least")
            # pages mapped as they are first read: by the digest's thread and llama.cpp's copy
            mapping = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
            _ask_huge_pages(mapping)
        except (ValueError, OSError) as exc:
            os.close(fd)
            return str(exc)
        at = st.st_size - _TRAILER
        magic, size, held, tip_digest = _HEAD.unpack_from(mapping, at)
        why = None
        if magic != _MAGIC or size != at:
            why = "packed state's trailer does not describe the file"
        elif tip_digest != digest_bytes(tip) or held != tokens:
            why = "packed state is another chain's"
        if why is not None:
            mapping.close()
            os.close(fd)
            return why
        stream = np.frombuffer(mapping, dtype=np.uint8, count=size)
        return PackedState(
            path=path,
            stream=stream,
            tokens=held,
            tip=tip,
            huge_pages=_in_huge_pages(stream),
            _mapping=mapping,
            _fd=fd,
        )

    def write(self, tip: str, tokens: int, size: int, fill: Callable[[np.ndarray], None]) -> Path:
        """Write the packed state of the chain ending at ``tip`` (``tokens``): ``fill``
        writes its ``size`` stream bytes into the array it is given (the new file,
        mapped); the file goes into place once whole."""
        ensure_private_dir(self.dir)
        check_free_space(self.layout.root, size + _TRAILER)
        final = self.path(tip)
        with locked_temp_file(self.layout, final.name) as (tmp, _locked):
            fd = os.open(tmp, os.O_RDWR | _O_NOFOLLOW)
            try:
                os.ftruncate(fd, size + _TRAILER)
                mapping = mmap.mmap(fd, size + _TRAILER)
                _ask_huge_pages(mapping)
                try:
                    fill(np.frombuffer(mapping, dtype=np.uint8, count=size))
                    _HEAD.pack_into(mapping, size, _MAGIC, size, tokens, digest_bytes(tip))
                    head = size + _HEAD.size
                    mapping[head:] = xxhash.xxh3_128(memoryview(mapping)[:head]).digest()
                finally:
                    _close(mapping)
            finally:
                os.close(fd)
            # not flushed to the disk: a copy, checked by its digest before every use, so
            # one a crash left torn is removed then; the page cache holds it for the next
            os.replace(tmp, final)
        return final

    def used(self, tip: str) -> None:
        """Mark the packed state of ``tip`` used now (kept before older ones)."""
        with contextlib.suppress(OSError):
            os.utime(self.path(tip))

    def remove(self, tip: str) -> int:
        """Remove the packed state of ``tip``; the bytes freed."""
        return remove_file(self.path(tip))

    def listing(self) -> list[PackedEntry]:
        """Every packed state, the most recently used first."""
        out = []
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.dir):
                name = entry.name
                if not name.endswith(SUFFIX) or not entry.is_file(follow_symlinks=False):
                    continue
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    tip = HASH_PREFIX + name[: -len(SUFFIX)]
                    out.append(PackedEntry(tip=tip, size=st.st_size, used=st.st_mtime))
        return sorted(out, key=lambda entry: -entry.used)

    def prune(self, max_bytes: int, keep: int = KEEP) -> int:
        """Keep the ``keep`` most recently used, ``max_bytes`` together at most; the
        bytes freed."""
        freed = held = 0
        for i, (tip, size, _) in enumerate(self.listing()):
            if i < keep and held + size <= max_bytes:
                held += size
            else:
                freed += self.remove(tip)
        return freed


def _digest_ahead(
    view: memoryview, size: int, frontier: Frontier, loaded: threading.Event
) -> bytes:
    """The xxh3-128 of ``view[:size]``, read ``_LEAD`` bytes ahead of ``frontier`` at most
    until ``loaded`` is set."""
    digest = xxhash.xxh3_128()
    at = 0
    while at < size:
        end = size
        if not loaded.is_set():
            end = min(size, frontier.reach() + _LEAD)
            if end < size and end - at < _CHUNK:
                loaded.wait(_PAUSE_S)  # the load is not far enough yet
                continue
        digest.update(view[at:end])
        at = end
    return digest.digest()


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def _in_huge_pages(stream: np.ndarray) -> bool:
    """Whether a new mapping of a stream is mapped in huge pages: its first byte read (its
    first page mapped, as the load maps it), then asked of the page table."""
    if not stream.shape[0]:
        return False
    _ = int(stream[0])
    return mapped_in_huge_pages(_address(stream))


def _ask_huge_pages(mapping: mmap.mmap) -> None:
    """Ask for the file's pages in the cache in huge pages, where the kernel keeps file
    pages so: a new mapping of a file written or read so is mapped a huge page at a time,
    where one of small pages is mapped a few of them at a time, and mapping them was the
    larger part of the time a restore took beyond llama.cpp's copy (``docs/performance``)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):
            mapping.madvise(advice)


def _close(mapping: mmap.mmap) -> None:
    """Unmap ``mapping``; where views of it are still held (a traceback's, after a failed
    fill), it is unmapped once they are freed."""
    with contextlib.suppress(BufferError):
        mapping.close()
