"""The values the store takes and returns: probes, blocks, index rows, reports.

All are frozen dataclasses with slots. Those that hold numpy arrays compare by
identity (``eq=False``): compare their fields explicitly.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TypedDict

import numpy as np

from .chain import HASH_PREFIX, digest_bytes, ends_array, tokens_array

__all__ = [
    "DETACHED",
    "DETACHED_XXH3",
    "MAX_RAW_BLOCK_BYTES",
    "PROBE_TOP",
    "RESERVED_META",
    "RESERVED_TENSORS",
    "TAIL_GROUP",
    "TAIL_PREFIX",
    "TAIL_XXH3",
    "Block",
    "BlockCorrupt",
    "BlockRow",
    "ForgetReport",
    "ForgottenSnapshot",
    "GcReport",
    "Probe",
    "SnapshotRow",
    "StoreStats",
    "is_tail",
]

PROBE_TOP = 64
# The largest block a reader accepts: a bound on what a damaged index row can
# make it allocate.
MAX_RAW_BLOCK_BYTES = 4 << 30
RESERVED_TENSORS = frozenset({"tokens", "pos"})
# A block's tensor that a read may leave unread: its bytes are left out of the
# index's checksum and carry their own (``DETACHED_XXH3``) in the file's metadata.
DETACHED = "partial"
DETACHED_XXH3 = "partial_xxh3"
# Tail tensors (names starting with ``TAIL_PREFIX``) hold a block's *last* rows only,
# the same number for each; they are left out of the index's checksum too and carry
# one digest per group of ``TAIL_GROUP`` rows (``TAIL_XXH3``), so a read may take a
# suffix of them and check just what it read (``formats.tails``).
TAIL_PREFIX = "w."
TAIL_XXH3 = "tail_xxh3"
TAIL_GROUP = 16
RESERVED_META = frozenset(
    {"format", "hash", "parent", "identity", "namespace", "start", "ends", "probe_digest", "planes"}
    | {"probe_top", "prefill_seconds", "data_xxh3"}  # what ``repair`` rebuilds an index row from
    | {DETACHED_XXH3, TAIL_XXH3, "end_state"}
)


def is_tail(name: str) -> bool:
    """Whether a block tensor is a tail tensor (see ``TAIL_PREFIX``)."""
    return name.startswith(TAIL_PREFIX)


class BlockCorrupt(Exception):
    """A block failed a check; ``reason`` says which, ``block_hash`` names it if known."""

    def __init__(self, reason: str, block_hash: str | None = None) -> None:
        self.reason = reason
        self.block_hash = block_hash
        super().__init__(f"{block_hash}: {reason}" if block_hash else reason)


def _readonly(arr: np.ndarray) -> np.ndarray:
    if arr.flags.writeable:
        arr = arr.copy()
        arr.setflags(write=False)
    return arr


@dataclass(frozen=True, slots=True, eq=False)
class Probe:
    """A block's probe: the digest of the full logits plus the top entries for tolerance."""

    digest: str
    top_ids: np.ndarray  # int32 [<= 64], best first
    top_logits: np.ndarray  # float32, same length

    def __post_init__(self) -> None:
        digest_bytes(self.digest)
        ids = np.ascontiguousarray(self.top_ids, dtype="<i4")
        logits = np.ascontiguousarray(self.top_logits, dtype="<f4")
        if ids.ndim != 1 or ids.shape != logits.shape or not 0 < ids.shape[0] <= PROBE_TOP:
            raise ValueError(
                f"probe top ids/logits must be 1-D, equal length, 1..{PROBE_TOP}: "
                f"{ids.shape} vs {logits.shape}"
            )
        object.__setattr__(self, "top_ids", _readonly(ids))
        object.__setattr__(self, "top_logits", _readonly(logits))

    @staticmethod
    def digest_of(logits: np.ndarray) -> str:
        """``sha256:`` of the logits as float32 little-endian bytes."""
        arr = np.ascontiguousarray(logits, dtype="<f4")
        if arr.ndim != 1 or arr.shape[0] == 0:
            raise ValueError(f"logits must be a non-empty 1-D array, got shape {arr.shape}")
        return HASH_PREFIX + hashlib.sha256(arr.tobytes()).hexdigest()

    @classmethod
    def from_logits(cls, logits: np.ndarray) -> Probe:
        """The probe of one token's full logits."""
        digest = cls.digest_of(logits)
        arr = np.asarray(logits, dtype="<f4")
        k = min(PROBE_TOP, arr.shape[0])
        top = np.argpartition(-arr, k - 1)[:k]
        top = top[np.lexsort((top, -arr[top]))]  # by logit descending, ties by id
        return cls(digest, top.astype("<i4"), arr[top])

    def matches(self, logits: np.ndarray) -> bool:
        """True only if ``logits`` are bit-identical to the probed ones."""
        try:
            return self.digest_of(logits) == self.digest
        except ValueError:
            return False

    def top_bytes(self) -> bytes:
        """The top ids then logits, little-endian: the index's ``probe_top`` blob."""
        return self.top_ids.tobytes() + self.top_logits.tobytes()

    @classmethod
    def from_row(cls, digest: str, top: bytes) -> Probe:
        """Rebuild a probe from its index columns."""
        if len(top) % 8:
            raise ValueError(f"probe_top blob has {len(top)} bytes, not a multiple of 8")
        half = len(top) // 2
        ids = np.frombuffer(top, dtype="<i4", count=half // 4)
        logits = np.frombuffer(top, dtype="<f4", offset=half)
        return cls(digest, ids, logits)


@dataclass(frozen=True, slots=True, eq=False, kw_only=True)
class Block:
    """One block of a chain: its tokens, tensors (token-major, first axis = token) and probe.

    ``parent`` is None for the first block of a chain (``start`` 0). Tensor names
    ``tokens`` and ``pos`` and metadata keys in ``RESERVED_META`` belong to the
    block file format. Arrays of blocks read from disk are read-only.
    """

    hash: str
    parent: str | None
    identity: str
    namespace: str
    start: int
    tokens: np.ndarray
    ends: np.ndarray  # batch ends of the computation, offsets from start (see chain_next)
    tensors: dict[str, np.ndarray]
    probe: Probe
    meta: dict[str, str]
    prefill_seconds: float
    # a restore may end at this block (False: it holds no state for that; restore through)
    end_state: bool = True

    def __post_init__(self) -> None:
        digest_bytes(self.hash)
        if self.parent is not None:
            digest_bytes(self.parent)
        if self.start < 0 or (self.start == 0) != (self.parent is None):
            raise ValueError(
                f"block at start {self.start} with parent {self.parent!r}: "
                "exactly the first block (start 0) has no parent"
            )
        tokens = tokens_array(self.tokens)
        if tokens.shape[0] == 0:
            raise ValueError("a block needs at least one token")
        object.__setattr__(self, "tokens", tokens)
        n = tokens.shape[0]
        object.__setattr__(self, "ends", _readonly(ends_array(self.ends, n)))
        tail_rows = {a.shape[0] for k, a in self.tensors.items() if is_tail(k) and a.ndim}
        if len(tail_rows) > 1 or not tail_rows <= set(range(n + 1)):
            raise ValueError(f"tail tensors of {sorted(tail_rows)} rows in a block of {n}")
        for name, arr in self.tensors.items():
            if name in RESERVED_TENSORS or not name or name == TAIL_PREFIX:
                raise ValueError(f"tensor name {name!r} is reserved")
            rows = arr.shape[0] if is_tail(name) and arr.ndim else n
            if not isinstance(arr, np.ndarray) or arr.ndim < 1 or arr.shape[0] != rows:
                shape = getattr(arr, "shape", None)
                raise ValueError(f"tensor {name!r} must have {n} rows (one per token): {shape}")
        for key, value in self.meta.items():
            if key in RESERVED_META or not isinstance(key, str) or not isinstance(value, str):
                raise ValueError(f"metadata {key!r}: keys and values are str, not reserved")
        if not self.prefill_seconds >= 0.0:
            raise ValueError(f"prefill_seconds must be >= 0, got {self.prefill_seconds}")

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def end(self) -> int:
        return self.start + self.n_tokens


@dataclass(frozen=True, slots=True, eq=False, kw_only=True)
class BlockRow:
    """A block's index row: everything but its tensors."""

    hash: str
    parent: str | None
    identity: str
    namespace: str
    start: int
    tokens: np.ndarray  # int32, read-only
    ends: np.ndarray  # u32 batch ends, offsets from start, read-only
    tokens_sha: str
    file: str
    raw_bytes: int
    stored_bytes: int
    checksum: str
    probe: Probe
    prefill_seconds: float
    created: float
    last_used: float
    hits: int
    end_state: bool = True  # a restore may end here (``Block.end_state``)

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def end(self) -> int:
        return self.start + self.n_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class NewSnapshot:
    """A name for the chain ending at ``tip``: what a snapshot is made from."""

    tip: str
    label: str
    source_path: str | None = None
    source_sha256: str | None = None
    n_tokens: int  # where the chain ends; the tip block must end there
    identity: str
    namespace: str
    system: str | None = None  # the system prompt it was made with ("": none; None: unknown)


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotRow:
    """A named pointer to a chain tip."""

    id: str
    tip: str
    label: str
    source_path: str | None
    source_sha256: str | None
    n_tokens: int
    identity: str
    namespace: str
    created: float
    last_used: float
    hits: int
    pinned: bool  # the pin holds now (a pin whose time has passed has lapsed)
    pinned_until: float | None = None  # the pin lapses then (None: pinned for good, or not)
    # who asked for the pin: None, the user (``cache pin``, ``prefill --pin``); "client",
    # a server's client, whose pins hold only within their share of the budget
    pin_owner: str | None = None
    system: str | None = None  # the system prompt it was made with ("": none; None: unknown)


@dataclass(frozen=True, slots=True, kw_only=True)
class GcReport:
    """What ``gc`` removed."""

    temp_files: int
    orphan_files: int
    missing_files: int  # rows whose file was gone (descendants included)
    bytes_freed: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ForgottenSnapshot:
    """A snapshot ``forget`` removed, and why: ``source`` (saved from the document, by
    its path or content hash) or ``holds`` (a block of its chain holds the document's
    tokens, whatever it was saved from)."""

    id: str
    label: str
    pinned: bool
    why: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ForgetReport:
    """What ``forget`` removed."""

    snapshots: list[str]  # ids of the snapshots removed
    removed: list[ForgottenSnapshot]  # the same, with their labels, pins and why
    blocks: int
    bytes_freed: int
    quarantined_files: int
    wal_truncated: bool  # False: another process held the WAL open
    # files no index row names: temp files a killed save left (every one no living
    # writer holds) and block files holding the document whose row never came
    unindexed_files: int = 0


class StoreStats(TypedDict):
    """``SnapshotStore.stats()``: ``hits`` counts every verified restore, of which
    ``hits_without_snapshot`` named no listed snapshot (the others are the snapshots'
    ``hits``); ``saved_prefill_seconds`` sums the hits' own estimates."""

    hits: int
    hits_without_snapshot: int
    misses: int
    misses_by_reason: dict[str, int]
    not_cached_yet: int  # first runs: nothing was stored for the request, no miss
    blocks: int
    snapshots: int
    stored_bytes: int
    raw_bytes: int
    saved_prefill_seconds: float
