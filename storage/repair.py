"""Rebuilding ``index.db`` from the block files and snapshot manifests.

Every block file carries its whole index row: hash, parent, identity,
namespace, start, tokens, batch ends, the probe (digest and top entries),
its prefill seconds, and the checksum of its data section
(``formats/blockcodec.py``). Each snapshot has a manifest
(``manifests.py``). So the index can always be rebuilt:

1. ``PRAGMA integrity_check`` (``index/health.py``); an index that is not
   sound is moved to ``quarantine/`` with a note (never deleted) and a new one
   is created. A missing or empty index is simply created anew.
2. Temp files no living writer holds are removed; one that is a whole block
   file (a save killed between its fsync and its rename) is put in place
   first. Every block file without a row is read whole and checked: its data
   checksum, its hash recomputed from parent, tokens and batch ends (and equal
   to its file name), positions, metadata. A file that fails is reported and
   left where it is (``gc`` removes it later); so is one written before block
   files carried their row.
3. Rows go in root first: a block whose parent was not recovered is skipped.
4. Each snapshot of a manifest comes back if its tip block is in the index
   under the same identity, namespace and length, with its label, source and
   pin; its identity's JSON too. Hit counts, last-used times and the hit/miss
   statistics are not recoverable and start again.

Repairing a sound index adds what it lacks (block files and snapshots it has
no rows for, e.g. after the index was deleted and a new one started) and
writes missing manifests, so a cache from before manifests becomes repairable.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import manifests
from .chain import chain_next, chain_root, ends_array, tokens_sha
from .disk import (
    TEMP_SUFFIX,
    open_block_file,
    read_exactly,
    remove_file,
    remove_if_abandoned,
)
from .formats import planes
from .formats.blockcodec import (
    FORMAT_VERSION,
    check_metadata,
    check_tokens,
    checksum,
    data_checksum,
    end_state_of,
    expand,
)
from .formats.stheader import header_span, parse_safetensors
from .index.blockindex import BlockIndex
from .index.health import check_index
from .paths import CacheLayout, ensure_private_dir, prepare_root
from .removal.quarantine import quarantine_index
from .snapshots import SnapshotCatalogue
from .values import BlockCorrupt, BlockRow, Probe

__all__ = ["NOT_RECOVERED", "ROWS_NOT_RECOVERED", "RepairReport", "recover_row", "repair"]

logger = logging.getLogger(__name__)

NOT_RECOVERED = "hit counts, last-used times and hit/miss statistics start again"
# a sound index that gained rows: only those start again
ROWS_NOT_RECOVERED = (
    "the rows rebuilt start with no hits and last-used times; the other rows and "
    "the hit/miss statistics are as they were"
)
_NEEDED = ("hash", "parent", "identity", "namespace", "start", "ends", "probe_digest")
_RECOVERY = ("probe_top", "prefill_seconds", "data_xxh3")
_FORMATS = (FORMAT_VERSION, planes.Q6_FORMAT)


@dataclass(frozen=True, slots=True, kw_only=True)
class RepairReport:
    """What ``repair`` found and did."""

    index_problem: str | None  # why the old index was replaced (None: it was sound or absent)
    quarantined_index: str | None  # where the old index went
    block_files: int  # block files found
    blocks_added: int  # rows rebuilt from them
    snapshots_added: list[str] = field(default_factory=list)
    skipped_blocks: list[tuple[str, str]] = field(default_factory=list)  # (file, reason)
    skipped_snapshots: list[tuple[str, str]] = field(default_factory=list)  # (id, reason)
    snapshots: int = 0  # snapshots in the index after the repair
    temp_files: int = 0  # temp files killed saves left, removed
    placed_from_temp: int = 0  # of which whole block files, put in place first
    # what started again (``NOT_RECOVERED``: all of it, a new index; ``ROWS_NOT_RECOVERED``:
    # the rows rebuilt in a sound one); None: nothing, the index kept every count
    not_recovered: str | None = NOT_RECOVERED


def _read_file(layout: CacheLayout, relpath: str, max_bytes: int) -> tuple[bytes, float]:
    try:
        st = os.lstat(layout.resolve(relpath))
    except (OSError, ValueError) as exc:
        raise BlockCorrupt(f"cannot read the file: {exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise BlockCorrupt("not a regular file")
    if st.st_size > max_bytes:
        raise BlockCorrupt(f"file of {st.st_size} bytes is over the limit {max_bytes}")
    fd = open_block_file(layout, relpath, st.st_size)
    try:
        data = bytearray(st.st_size)
        read_exactly(fd, [memoryview(data)], 0)
    finally:
        os.close(fd)
    return bytes(data), st.st_mtime


def recover_row(layout: CacheLayout, relpath: str, max_bytes: int) -> BlockRow:
    """The index row a block file carries, checked; ``BlockCorrupt`` says why not."""
    data, mtime = _read_file(layout, relpath, max_bytes)
    decoded = parse_safetensors(data)
    meta = decoded.metadata
    file_format = meta.get("format")
    if file_format not in _FORMATS:
        raise BlockCorrupt(f"format {file_format!r} is not one this version reads")
    missing = [k for k in (*_NEEDED, *_RECOVERY) if k not in meta]
    if missing:
        raise BlockCorrupt(f"written before block files carried their index row ({missing[0]})")
    if data_checksum(data, header_span(data[:8], len(data))) != meta["data_xxh3"]:
        raise BlockCorrupt("data section differs from its checksum")
    try:
        row = _row(meta, decoded.tensors.get("tokens"), relpath, data, mtime)
    except (ValueError, TypeError) as exc:
        raise BlockCorrupt(f"metadata cannot be read: {exc}") from None
    if CacheLayout.hash_of_file(relpath.rsplit("/", 1)[-1]) != row.hash:
        raise BlockCorrupt("file name is not the block's hash")
    if layout.block_relpath(row.hash) != relpath:
        raise BlockCorrupt("file is not in its fan-out directory")
    check_metadata(meta, row, file_format=str(file_format))
    check_tokens(decoded.tensors.get("tokens"), decoded.tensors.get("pos"), row)
    return row


def _row(
    meta: dict[str, str], tokens: np.ndarray | None, relpath: str, data: bytes, mtime: float
) -> BlockRow:
    if tokens is None or tokens.ndim != 1 or tokens.dtype != np.dtype("<i4") or not tokens.size:
        raise ValueError("no int32 tokens")
    ends = ends_array([int(e) for e in meta["ends"].split(",")], int(tokens.shape[0]))
    start, parent = int(meta["start"]), meta["parent"] or None
    if start < 0 or (start == 0) != (parent is None):
        raise ValueError(f"start {start} with parent {parent!r}")
    root = chain_root(meta["identity"], meta["namespace"])
    if chain_next(parent or root, tokens, ends) != meta["hash"]:
        raise ValueError("hash does not match parent, tokens and batch ends")
    seconds = float(meta["prefill_seconds"])
    if not seconds >= 0.0:
        raise ValueError(f"prefill seconds {seconds}")
    raw = len(data) if meta["format"] == FORMAT_VERSION else len(expand(data))
    return BlockRow(
        hash=meta["hash"],
        parent=parent,
        identity=meta["identity"],
        namespace=meta["namespace"],
        start=start,
        tokens=tokens.copy(),
        ends=ends,
        tokens_sha=tokens_sha(tokens),
        file=relpath,
        raw_bytes=raw,
        stored_bytes=len(data),
        checksum=checksum(data),
        probe=Probe.from_row(meta["probe_digest"], bytes.fromhex(meta["probe_top"])),
        prefill_seconds=seconds,
        created=mtime,
        last_used=mtime,
        hits=0,
        end_state=end_state_of(meta),
    )


def _salvage_temp_files(layout: CacheLayout, max_bytes: int) -> tuple[int, list[str]]:
    """Remove the temp files no living writer holds; a whole block file among them (a
    save killed before its rename) is put in place first, for its row to be rebuilt.

    Returns how many were removed and the block files placed.
    """
    placed: list[str] = []

    def salvage(tmp: Path) -> None:
        name = tmp.name.rsplit(".", 2)[0]  # HASH.lkv.RANDOM.tmp
        block_hash = CacheLayout.hash_of_file(name)
        if block_hash is None or not tmp.name.endswith(TEMP_SUFFIX):
            return
        relpath = layout.block_relpath(block_hash)
        final = layout.resolve(relpath)
        ensure_private_dir(final.parent)
        try:
            os.link(tmp, final, follow_symlinks=False)
        except OSError:  # there already, or no hard links: the temp file goes
            return
        try:
            recover_row(layout, relpath, max_bytes)
        except BlockCorrupt as exc:
            logger.warning("repair: %s from tmp/ is not a whole block (%s)", name, exc.reason)
            remove_file(final)
            return
        placed.append(relpath)

    count = 0
    for entry in os.scandir(layout.tmp):
        if remove_if_abandoned(Path(entry.path), salvage) is not None:
            count += 1
    return count, placed


def _block_files(layout: CacheLayout) -> list[str]:
    found: list[str] = []
    try:
        fans = sorted(os.scandir(layout.blocks), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    for fan in fans:
        if not fan.is_dir(follow_symlinks=False):
            continue
        for entry in sorted(os.scandir(fan.path), key=lambda e: e.name):
            if CacheLayout.hash_of_file(entry.name) is not None:
                found.append(f"blocks/{fan.name}/{entry.name}")
    return found


def _add_blocks(
    index: BlockIndex, layout: CacheLayout, files: list[str], max_bytes: int
) -> tuple[int, list[tuple[str, str]]]:
    """Rebuild the rows of block files the index lacks, root first; (added, skipped)."""
    known = {str(r[0]) for r in index.query("SELECT file FROM blocks")}
    skipped: list[tuple[str, str]] = []
    found: list[BlockRow] = []
    for relpath in files:
        if relpath in known:
            continue
        try:
            found.append(recover_row(layout, relpath, max_bytes))
        except BlockCorrupt as exc:
            skipped.append((relpath, exc.reason))
    ends = {
        str(r[0]): (str(r[1]), str(r[2]), int(r[3]) + int(r[4]))
        for r in index.query("SELECT hash, identity, namespace, start, n_tokens FROM blocks")
    }
    added = 0
    with index.write() as db:
        for row in sorted(found, key=lambda r: (r.start, r.hash)):
            if row.hash in ends:
                continue  # the index names this block with another file
            parent = ends.get(row.parent) if row.parent is not None else None
            if row.parent is not None and parent != (row.identity, row.namespace, row.start):
                skipped.append((row.file, "its parent block was not recovered"))
                continue
            index.insert_block(db, row)
            ends[row.hash] = (row.identity, row.namespace, row.end)
            added += 1
    return added, skipped


def _add_snapshots(
    index: BlockIndex, catalogue: SnapshotCatalogue, layout: CacheLayout
) -> tuple[list[str], list[tuple[str, str]]]:
    """Snapshot rows from the manifests the index lacks; (added ids, skipped)."""
    found, skipped = manifests.read_all(layout)
    present = {s.id for s in index.snapshots()}
    added: list[str] = []
    for snap, identity_json in found:
        if snap.id in present:
            continue
        tip = index.get_block(snap.tip)
        if tip is None:
            skipped.append((snap.id, f"{snap.label}: its blocks were not all recovered"))
            continue
        if (tip.identity, tip.namespace, tip.end) != (snap.identity, snap.namespace, snap.n_tokens):
            skipped.append((snap.id, f"{snap.label}: its tip block does not match the manifest"))
            continue
        if identity_json is not None and index.get_identity(snap.identity) is None:
            index.put_identity(snap.identity, identity_json, snap.created)
        with index.write() as db:
            index.insert_snapshot(db, snap)
        added.append(snap.id)
        present.add(snap.id)
    have = {row.id for row, _ in manifests.read_all(layout)[0]}
    for snap in index.snapshots():
        if snap.id not in have:
            catalogue.write_manifest(snap.id)
    return added, skipped


def repair(root: Path, max_bytes: int) -> RepairReport:
    """Check ``root``'s index; rebuild it (or what it lacks) from the files. See the module."""
    if not root.is_dir():
        raise FileNotFoundError(f"no cache at {root}")
    if not os.access(root, os.W_OK | os.X_OK):
        raise PermissionError(f"the cache at {root} is read-only: repair needs to write to it")
    had_index = _has_index(CacheLayout(root).index)
    layout = prepare_root(root)
    problem = check_index(layout.index)
    moved = None
    if problem is None:
        try:
            BlockIndex(layout.index).close()
        except Exception as exc:  # sound SQLite, but not an index this version can open
            problem = f"cannot be opened as the index: {exc}"
    if problem is not None:
        moved = quarantine_index(layout, problem)
        layout = prepare_root(root)
    temp, placed = _salvage_temp_files(layout, max_bytes)
    index = BlockIndex(layout.index)
    try:
        added, skipped = _add_blocks(index, layout, _block_files(layout), max_bytes)
        catalogue = SnapshotCatalogue(index, layout)
        snaps, skipped_snaps = _add_snapshots(index, catalogue, layout)
        total = len(index.snapshots())
    finally:
        index.close()
    logger.info("repair: %d block row(s) and %d snapshot(s) rebuilt", added, len(snaps))
    return RepairReport(
        index_problem=problem,
        quarantined_index=str(moved) if moved is not None else None,
        block_files=len(_block_files(layout)),
        blocks_added=added,
        snapshots_added=snaps,
        skipped_blocks=skipped,
        skipped_snapshots=skipped_snaps,
        snapshots=total,
        temp_files=temp,
        placed_from_temp=len(placed),
        not_recovered=_not_recovered(problem is None and had_index, added, len(snaps)),
    )


def _has_index(path: Path) -> bool:
    """Whether an index file with something in it is there (before repair makes one)."""
    try:
        return path.is_file() and path.stat().st_size > 0
    except OSError:
        return False


def _not_recovered(kept: bool, blocks_added: int, snapshots_added: int) -> str | None:
    """What starts again: everything in a new index, the rebuilt rows in a ``kept`` one,
    nothing when a kept index gained no row."""
    if not kept:
        return NOT_RECOVERED
    return ROWS_NOT_RECOVERED if blocks_added or snapshots_added else None
