"""The snapshot store: block files, the SQLite index, eviction and gc.

A self-contained bottom layer: it imports nothing from the rest of localkv.
``store.SnapshotStore`` is the way in; its rooms are ``formats/`` (block
files' bytes, reading one into buffers), ``index/`` (SQLite) and
``removal/`` (every way a block leaves), beside the modules every room
uses (values, chain hashes, paths, disk, faults).
"""

from .chain import ROOT_TAG, chain_hashes, chain_next, chain_root, tokens_sha
from .formats.blockcodec import decode, encode
from .paths import CacheDirError, CacheLayout, default_root
from .removal.budget import default_budget, parse_size
from .store import SnapshotStore
from .values import (
    Block,
    BlockCorrupt,
    BlockRow,
    ForgetReport,
    GcReport,
    NewSnapshot,
    Probe,
    SnapshotRow,
    StoreStats,
)

__all__ = [
    "ROOT_TAG",
    "Block",
    "BlockCorrupt",
    "BlockRow",
    "CacheDirError",
    "CacheLayout",
    "ForgetReport",
    "GcReport",
    "NewSnapshot",
    "Probe",
    "SnapshotRow",
    "SnapshotStore",
    "StoreStats",
    "chain_hashes",
    "chain_next",
    "chain_root",
    "decode",
    "default_budget",
    "default_root",
    "encode",
    "parse_size",
    "tokens_sha",
]
