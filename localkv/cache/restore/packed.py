"""A chain's packed state (``storage.packed``): written from its blocks, loaded by mapping it.

A restore from the blocks writes every byte twice, into llama.cpp's state
buffer as it is read and then into the KV cells (``pieces``). A packed state is
the state buffer itself, on disk: the restore maps the file, checks its digest
and hands the mapping to ``llama_state_seq_set_data``, so the bytes go from
the page cache into the cells in one copy.

A chain is packed once it has been restored from its blocks (it was used
again, so it may well be again: the next restore, in this process or after a
restart, maps the file), for plain KV memory whose chain has no partial part
(a sliding window or a recurrent state is restored otherwise). The file holds
every token of the chain but the last, and the restore then decodes that token
as the probe, exactly as a restore from the blocks does (``verify``): the bits
are checked by the file's digest, the chain by its tip hash and length, the
state by the probe. A file that fails any of these is removed and the restore
goes on from the blocks, so a packed state never decides what a request gets.
"""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np

from localkv.cache.restore.pieces import fill_targets, token_rows, transpose_v
from localkv.cache.restore.verify import chain_layout, check_chain, probe_matches
from localkv.kv import codec
from localkv.kv.blocks import PARTIAL
from localkv.kv.section import name_cell_tokens
from localkv.model.session import ModelSession
from localkv.storage.store import SnapshotStore
from localkv.storage.values import BlockRow

__all__ = ["load_packed", "pack_chain", "packable"]

log = logging.getLogger(__name__)


def packable(session: ModelSession, chain: list[BlockRow]) -> bool:
    """Whether ``chain`` restores into ``session`` through a packed state: plain KV memory
    (a chain with a partial part is not packed: ``pack_chain``), and a token before the
    probe's."""
    return session.memory_kind == "kv" and bool(chain) and chain[-1].end > 1


def pack_chain(
    store: SnapshotStore, root: str, chain: list[BlockRow], *, cell_ext: bool, max_bytes: int
) -> bool:
    """Write the packed state of ``chain`` (its tokens but the last) from its blocks,
    checked as a restore checks them, unless it has one, it has a partial part or its
    state is over ``max_bytes``; then keep ``max_bytes`` of packed states at most. Whether
    it was written. ``BlockCorrupt`` or ``StateFormatError`` for blocks a restore would
    refuse, ``OSError`` where the file cannot be written."""
    tip, n = chain[-1], chain[-1].end - 1
    if n <= 0 or store.packed.has(tip.hash):
        return False
    opened = store.open_blocks(chain)
    try:
        if any(PARTIAL in block_file.specs for block_file in opened):
            return False
        found = chain_layout(opened)
        layout, v_trans = tuple(found.layers), found.v_trans
        size = codec.state_size(layout, v_trans, n, cell_ext) if layout else 0
        if not layout or size > max_bytes:
            return False
        tokens = np.concatenate([row.tokens for row in chain])[:n]

        def fill(buf: np.ndarray) -> None:
            _, k_rows, v_rows = codec.assembly(
                layout, n, scratch=buf, cell_ext=cell_ext, v_trans=v_trans
            )
            # a transposed V is read token-major into its columns' bytes, then transposed
            v_places = [token_rows(v, n) for v in v_rows] if v_trans else v_rows
            spill = np.empty(sum(x[1] + x[3] for x in layout), dtype=np.uint8)
            targets = fill_targets(opened, layout, k_rows, v_places, n, spill=spill)
            check_chain(root, chain, store.fill_blocks(opened, targets, parallel=False))
            if v_trans:
                transpose_v(v_places, v_rows)
            if cell_ext:
                name_cell_tokens(buf, tokens)

        store.packed.write(tip.hash, n, size, fill)
        if not store.has_block(tip.hash):  # removed meanwhile (forgotten, evicted)
            store.packed.remove(tip.hash)
            return False
    finally:
        for block_file in opened:
            block_file.close()
    store.packed.prune(max_bytes)
    return True


def load_packed(
    store: SnapshotStore, session: ModelSession, chain: list[BlockRow], marks: list[float]
) -> np.ndarray | None:
    """Load the packed state of ``chain`` into the session and decode its last token as
    the probe; the chain's tokens if the probe matched, else None (no packed state, or
    one that failed a check: removed, the session emptied, ``marks`` as they were).

    ``marks`` gets the times the file was mapped (the read) and the state loaded and its
    digest checked (the load: the two run side by side).
    """
    tip, n = chain[-1], chain[-1].end - 1
    found = store.packed.open(tip.hash, n)
    if found is None:
        return None
    if isinstance(found, str):
        _drop(store, tip, found)
        return None
    held = len(marks)
    tokens = np.concatenate([row.tokens for row in chain])
    marks.append(time.perf_counter())
    # the digest is read on a reader thread while llama.cpp copies the state in, a little
    # ahead of it: the state is used only once both are done, and emptied if it differs
    checked = store.on_reader(found.check)
    why = None
    try:
        session.load_state(found.stream, [int(t) for t in tokens[:n]], named=True)
    except codec.StateFormatError as exc:
        why = f"llama.cpp refused the packed state: {exc}"
    finally:
        found.loaded()
        try:
            why = checked.result() or why  # the mapping is read until the digest is done
        finally:
            found.close()
    if why is None:
        ends = [e for row in chain for e in (row.start + row.ends).tolist() if e <= n]
        session.batch_ends = ends if ends[-1:] == [n] else [*ends, n]
        marks.append(time.perf_counter())
        if probe_matches(session, tip, tokens):
            store.packed.used(tip.hash)
            return tokens
        why = "packed state's probe mismatch"
    session.reset()
    del marks[held:]
    _drop(store, tip, why)
    return None


def _drop(store: SnapshotStore, tip: BlockRow, why: str) -> None:
    log.warning("packed state of %s removed (%s); restoring from its blocks", tip.hash, why)
    with contextlib.suppress(OSError):  # (a read-only cache: it stays, and fails again)
        store.packed.remove(tip.hash)
