"""A packed state's digest, read ahead of llama.cpp's load (``storage.frontier``, ``.packed``).

The digest follows how far the load has read the stream's mapping, from the page
table: these tests read a real packed file's mapping as llama.cpp does, front to
back, and check that the digest is the file's whatever the reader does: reads it
all, stops part way (the digest waits for ``loaded()``, then reads the rest), or
reads a file with a byte changed past the lead.
"""

from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import xxhash
from localkv.storage.frontier import Frontier
from localkv.storage.packed import PackedState, PackedStates
from localkv.storage.paths import prepare_root

from localkv.bench.geometry.floors import huge_mapped_bytes

TIP = "sha256:" + "ab" * 32
needs_pagemap = pytest.mark.skipif(
    not os.access("/proc/self/pagemap", os.R_OK), reason="no page table to read here"
)
MIB = 1 << 20
SIZE = 24 * MIB  # several times the digest's lead


@pytest.fixture
def packed(tmp_path: Path) -> PackedStates:
    states = PackedStates(prepare_root(tmp_path / "cache"))
    data = np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8)
    states.write(TIP, 100, SIZE, lambda buf: np.copyto(buf, data))
    return states


def _opened(states: PackedStates) -> PackedState:
    found = states.open(TIP, 100)
    assert isinstance(found, PackedState)
    return found


def _read(stream: np.ndarray, upto: int) -> int:
    """Read ``stream[:upto]`` front to back, a MiB at a time, as llama.cpp's load does."""
    total = 0
    for at in range(0, upto, MIB):
        total += int(stream[at : at + MIB].sum(dtype=np.uint64))
    return total


def _flip(path: Path, at: int) -> None:
    at = at if at >= 0 else path.stat().st_size + at
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 1]))


@needs_pagemap
def test_a_new_mapping_has_read_nothing_and_the_frontier_grows_from_its_start(
    tmp_path: Path,
) -> None:
    path = tmp_path / "pages"
    path.write_bytes(os.urandom(16 * MIB))
    fd = os.open(path, os.O_RDONLY)
    try:
        mapping = mmap.mmap(fd, 16 * MIB, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    stream = np.frombuffer(mapping, dtype=np.uint8)
    frontier = Frontier.open(stream.__array_interface__["data"][0], stream.shape[0])
    assert frontier is not None
    try:
        assert frontier.reach() == 0
        _read(stream[8 * MIB :], 8 * MIB)  # the second half only: the start is not read
        assert frontier.reach() == 0
        _read(stream, 8 * MIB)
        assert frontier.reach() == 16 * MIB
    finally:
        frontier.close()
        del stream
        mapping.close()


def test_a_frontier_needs_an_address_on_a_page() -> None:
    assert Frontier.open(mmap.PAGESIZE + 1, MIB) is None


def test_a_mapping_is_in_huge_pages_as_the_kernel_accounts_it(packed: PackedStates) -> None:
    found = _opened(packed)
    address = found.stream.__array_interface__["data"][0]
    assert found.huge_pages == (huge_mapped_bytes(address) > 0)
    found.close()


@pytest.mark.parametrize("huge_pages", [True, False], ids=["ahead", "own pace"])
def test_the_digest_read_beside_a_load_is_the_files(packed: PackedStates, huge_pages: bool) -> None:
    found = _opened(packed)
    found.huge_pages = huge_pages  # each way of reading it, whatever this kernel maps
    with ThreadPoolExecutor(1) as pool:
        checked = pool.submit(found.check)
        _read(found.stream, found.stream.shape[0])
        found.loaded()
        assert checked.result() is None
    found.close()


@needs_pagemap
def test_the_digest_read_ahead_waits_for_a_load_that_stops_part_way(
    packed: PackedStates,
) -> None:
    found = _opened(packed)
    found.huge_pages = True
    with ThreadPoolExecutor(1) as pool:
        checked = pool.submit(found.check)
        _read(found.stream, 5 * MIB)
        # it cannot end before the load says it returned: it waits at the lead
        time.sleep(0.2)
        assert not checked.done()
        found.loaded()
        assert checked.result() is None
    found.close()


# in the stream past the lead, its last byte, the digest the file keeps
@pytest.mark.parametrize("at", [3 * MIB, SIZE - 1, -1])
@pytest.mark.parametrize("huge_pages", [True, False], ids=["ahead", "own pace"])
def test_a_byte_changed_anywhere_fails_the_digest_read_beside_a_load(
    packed: PackedStates, at: int, huge_pages: bool
) -> None:
    _flip(packed.path(TIP), at)
    found = _opened(packed)
    found.huge_pages = huge_pages
    with ThreadPoolExecutor(1) as pool:
        checked = pool.submit(found.check)
        _read(found.stream, found.stream.shape[0])
        found.loaded()
        assert checked.result() == "packed state checksum differs"
    found.close()


def test_the_digest_is_the_xxh3_of_the_stream_and_its_head(packed: PackedStates) -> None:
    """The file's last 16 bytes are the xxh3-128 of all before them: what ``check`` reads."""
    raw = packed.path(TIP).read_bytes()
    assert xxhash.xxh3_128(raw[:-16]).digest() == raw[-16:]
    found = _opened(packed)
    found.loaded()  # no load beside it: the digest reads at its own pace
    assert found.check() is None
    found.close()
