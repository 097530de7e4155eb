"""Chain hashes: a block's hash names its identity, namespace and whole computation.

``chain_root`` hashes a tag, the identity digest and the namespace;
``chain_next`` hashes the parent hash with the block's tokens *and the batch
ends they were computed in*. llama.cpp's kernels are not batch-size invariant,
so the same tokens batched differently give other K/V values: the schedule is
part of what a block denotes, and a request whose own uncached run would batch
differently computes another hash. Because every hash covers its parent, two
requests share exactly the hashes of the blocks before their first difference
(in tokens or in batching): equal tokens after a mismatch never match.

Encodings are canonical and fixed (changing them invalidates every cache):

- root: ``ROOT_TAG``, identity, namespace, each as u32 little-endian byte
  length followed by its UTF-8 bytes;
- next: the parent's 32-byte digest, the token count as u32 little-endian,
  the tokens as int32 little-endian, the number of batch ends as u32
  little-endian, then the batch ends as u32 little-endian offsets from the
  block's start (increasing, the last equal to the token count; an end given
  twice is an empty batch, where a sliding-window session settled: a block
  without one hashes as before there were any).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

__all__ = [
    "HASH_PREFIX",
    "ROOT_TAG",
    "block_ends",
    "chain_hashes",
    "chain_next",
    "chain_root",
    "digest_bytes",
    "tokens_array",
    "tokens_sha",
]

ROOT_TAG = "lkv-chain2"
HASH_PREFIX = "sha256:"
_INT32_MIN = -(2**31)
_INT32_MAX = 2**31 - 1

Tokens = Sequence[int] | np.ndarray


def _field(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<I", len(data)) + data


def digest_bytes(chain_hash: str) -> bytes:
    """The 32 raw bytes of a ``sha256:<hex>`` hash (ValueError if malformed)."""
    if not chain_hash.startswith(HASH_PREFIX):
        raise ValueError(f"not a {HASH_PREFIX} hash: {chain_hash!r}")
    hex_part = chain_hash[len(HASH_PREFIX) :]
    if len(hex_part) != 64:
        raise ValueError(f"hash must have 64 hex digits: {chain_hash!r}")
    try:
        return bytes.fromhex(hex_part)
    except ValueError as exc:
        raise ValueError(f"hash is not hexadecimal: {chain_hash!r}") from exc


def tokens_array(tokens: Tokens) -> np.ndarray:
    """Tokens as a 1-D little-endian int32 array (ValueError if out of range)."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        if tokens.dtype == np.dtype("<i4"):
            return tokens
        if tokens.size and tokens.dtype.kind not in "iu":
            raise ValueError(f"tokens must be integers, got {tokens.dtype}")
        values = tokens.astype(np.int64)
    else:
        values = np.asarray(list(tokens), dtype=np.int64)
        if values.ndim != 1:
            raise ValueError("tokens must be a flat sequence of integers")
    if values.size and (values.min() < _INT32_MIN or values.max() > _INT32_MAX):
        raise ValueError("token ids must fit in int32")
    return values.astype("<i4")


def tokens_sha(tokens: Tokens) -> str:
    """SHA-256 hex of a block's own tokens (int32 little-endian), without its prefix."""
    return hashlib.sha256(tokens_array(tokens).tobytes()).hexdigest()


def chain_root(identity_digest: str, namespace: str) -> str:
    """The hash before the first block, for one identity and namespace."""
    h = hashlib.sha256()
    for part in (ROOT_TAG, identity_digest, namespace):
        h.update(_field(part))
    return HASH_PREFIX + h.hexdigest()


def ends_array(ends: Sequence[int] | np.ndarray, n_tokens: int) -> np.ndarray:
    """A block's batch ends as u32 offsets (ValueError unless increasing, last = n_tokens;
    an end may be given twice: an empty batch, a settle)."""
    arr = np.asarray(ends, dtype=np.int64)
    if arr.ndim != 1 or arr.shape[0] == 0:
        raise ValueError("a block's batch ends must be a non-empty flat sequence")
    steps = np.diff(arr)
    repeated = steps == 0
    thrice = bool(np.any(repeated[1:] & repeated[:-1]))  # an end given three times
    if arr[0] < 1 or np.any(steps < 0) or thrice or arr[-1] != n_tokens:
        raise ValueError(
            f"batch ends must increase from 1 to the block's {n_tokens} tokens: "
            f"{arr[:8].tolist()}{'...' if arr.shape[0] > 8 else ''}"
        )
    return arr.astype("<u4")


def block_ends(ends: Sequence[int], start: int, end: int) -> list[int]:
    """The batch ends of tokens ``start..end-1``, as offsets from ``start``.

    ``ends`` are absolute batch ends of a whole sequence; ``end`` must be one
    of them (a block ends where a batch ends), ``start`` too, or 0.
    """
    inside = [e - start for e in ends if start < e <= end]
    if not inside or inside[-1] != end - start:
        raise ValueError(f"no batch ends at {end}: a block must end where a batch ends")
    return inside


def chain_next(parent: str, tokens: Tokens, ends: Sequence[int] | np.ndarray) -> str:
    """The hash of a block of ``tokens``, computed in batches ending at ``ends``
    (offsets from the block's start), following ``parent`` (a root or block hash)."""
    arr = tokens_array(tokens)
    offsets = ends_array(ends, int(arr.shape[0]))
    h = hashlib.sha256()
    h.update(digest_bytes(parent))
    h.update(struct.pack("<I", arr.shape[0]))
    h.update(arr.tobytes())
    h.update(struct.pack("<I", offsets.shape[0]))
    h.update(offsets.tobytes())
    return HASH_PREFIX + h.hexdigest()


def chain_hashes(root: str, tokens: Tokens, block_size: int, ends: Sequence[int]) -> list[str]:
    """Hashes of the full blocks of ``tokens`` (a shorter tail block is left out).

    ``ends`` are the request's absolute batch ends; the chain stops before the
    first full block that does not end at one of them.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    arr = tokens_array(tokens)
    hashes: list[str] = []
    parent = root
    for start in range(0, arr.shape[0] - block_size + 1, block_size):
        try:
            offsets = block_ends(ends, start, start + block_size)
        except ValueError:
            break
        parent = chain_next(parent, arr[start : start + block_size], offsets)
        hashes.append(parent)
    return hashes
