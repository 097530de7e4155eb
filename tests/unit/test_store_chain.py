"""Chain hashes: a block's hash names its identity, namespace, whole prefix and batching."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
from localkv.storage.chain import (
    ROOT_TAG,
    block_ends,
    chain_hashes,
    chain_next,
    chain_root,
    tokens_sha,
)
from support.store import grid_ends

ID_A = "sha256:" + "a" * 64
ID_B = "sha256:" + "b" * 64


def hashes(root: str, tokens: list[int] | np.ndarray, block_size: int) -> list[str]:
    return chain_hashes(root, tokens, block_size, grid_ends(len(tokens), block_size))


def test_seed_example_shares_exactly_the_first_two_blocks() -> None:
    root = chain_root(ID_A, "")
    a = hashes(root, [11, 24, 31, 42, 57], 1)
    b = hashes(root, [11, 24, 99, 42, 57], 1)
    assert len(a) == len(b) == 5
    shared = [x == y for x, y in zip(a, b, strict=True)]
    assert shared == [True, True, False, False, False]


def test_the_batch_schedule_is_part_of_the_hash() -> None:
    root = chain_root(ID_A, "")
    tokens = list(range(8))
    canonical = chain_hashes(root, tokens, 4, [3, 4, 7, 8])
    shifted = chain_hashes(root, tokens, 4, [1, 3, 4, 7, 8])  # block 0 begun after a restore
    assert canonical[0] != shifted[0]
    assert canonical[1] != shifted[1]  # and every later block inherits the difference
    later = chain_hashes(root, tokens, 4, [3, 4, 5, 7, 8])
    assert later[0] == canonical[0] and later[1] != canonical[1]


def test_a_block_that_does_not_end_a_batch_ends_the_chain() -> None:
    root = chain_root(ID_A, "")
    assert len(chain_hashes(root, list(range(8)), 4, [3, 5, 7, 8])) == 0
    assert len(chain_hashes(root, list(range(8)), 4, [3, 4, 6, 7])) == 1


def test_block_ends_are_offsets_within_the_block() -> None:
    assert block_ends([3, 4, 7, 8], 4, 8) == [3, 4]
    with pytest.raises(ValueError, match="batch ends"):
        block_ends([3, 4, 7, 9], 4, 8)


@pytest.mark.parametrize("bad", [[], [0, 3], [2, 2, 2, 3], [3, 2], [1, 2]])
def test_bad_batch_ends_are_refused(bad: list[int]) -> None:
    with pytest.raises(ValueError, match="batch ends"):
        chain_next(chain_root(ID_A, ""), [1, 2, 3], bad)


def test_an_empty_batch_a_settle_is_part_of_the_hash() -> None:
    """An end given twice (a sliding-window settle) names another computation, encoded
    as the ends are (a block without one hashes as before: the documented encoding)."""
    root = chain_root(ID_A, "")
    settled = chain_next(root, [1, 2, 3], [1, 2, 2, 3])
    assert settled != chain_next(root, [1, 2, 3], [1, 2, 3])
    expected = hashlib.sha256(
        bytes.fromhex(root[7:])
        + struct.pack("<I", 3)
        + struct.pack("<3i", 1, 2, 3)
        + struct.pack("<I", 4)
        + struct.pack("<4I", 1, 2, 2, 3)
    ).hexdigest()
    assert settled == "sha256:" + expected


def test_roots_differ_by_identity_and_namespace() -> None:
    roots = {chain_root(i, ns) for i in (ID_A, ID_B) for ns in ("", "alice", "bob")}
    assert len(roots) == 6
    assert chain_root(ID_A, "x") == chain_root(ID_A, "x")
    tokens = [1, 2, 3, 4]
    assert hashes(chain_root(ID_A, ""), tokens, 2) != hashes(chain_root(ID_B, ""), tokens, 2)


def test_root_encoding_is_unambiguous() -> None:
    # Without length prefixes these would concatenate to the same bytes.
    assert chain_root("ab", "c") != chain_root("a", "bc")


def test_encoding_is_the_documented_one() -> None:
    def field(s: str) -> bytes:
        return struct.pack("<I", len(s.encode())) + s.encode()

    root = chain_root(ID_A, "ns")
    assert ROOT_TAG == "lkv-chain2"
    assert (
        root == "sha256:" + hashlib.sha256(field(ROOT_TAG) + field(ID_A) + field("ns")).hexdigest()
    )
    expected = hashlib.sha256(
        bytes.fromhex(root[7:])
        + struct.pack("<I", 3)
        + struct.pack("<3i", 5, -1, 70000)
        + struct.pack("<I", 2)
        + struct.pack("<2I", 2, 3)
    ).hexdigest()
    assert chain_next(root, [5, -1, 70000], [2, 3]) == "sha256:" + expected


def test_list_and_array_tokens_hash_alike() -> None:
    root = chain_root(ID_A, "")
    as_list = hashes(root, list(range(10)), 4)
    assert as_list == hashes(root, np.arange(10, dtype=np.int64), 4)
    assert as_list == hashes(root, np.arange(10, dtype=">i4"), 4)
    assert len(as_list) == 2  # the 2-token tail is not a full block


def test_hash_of_block_names_whole_prefix() -> None:
    root = chain_root(ID_A, "")
    a = hashes(root, [1, 2, 3, 4, 5, 6], 3)
    b = hashes(root, [9, 2, 3, 4, 5, 6], 3)
    assert a[1] != b[1]  # same second block, different first block
    assert tokens_sha([4, 5, 6]) == tokens_sha(np.array([4, 5, 6], dtype=np.int32))


@pytest.mark.parametrize(
    "bad",
    [[2**31], [-(2**31) - 1], np.array([1.5]), np.zeros((2, 2), dtype=np.int32)],
)
def test_bad_tokens_are_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        chain_next(chain_root(ID_A, ""), bad, [1])  # type: ignore[arg-type]


def test_bad_parent_and_block_size_are_refused() -> None:
    with pytest.raises(ValueError):
        chain_next("md5:abc", [1], [1])
    with pytest.raises(ValueError):
        chain_next("sha256:" + "z" * 64, [1], [1])
    with pytest.raises(ValueError):
        chain_hashes(chain_root(ID_A, ""), [1, 2], 0, [1, 2])
