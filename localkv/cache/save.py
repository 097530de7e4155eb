"""Save: the session's sequence as blocks (captured now, written later) and their writing.

Full blocks end at multiples of the block size; each tip that is not a block
end gets a shorter block. A block records the batch ends it was computed in,
and its chain hash covers them; it is saved only if its last token was
decoded alone (that token's logits are its probe).
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Container, Sequence
from dataclasses import dataclass

import numpy as np

from localkv.kv import codec
from localkv.kv.blocks import add_partial, add_window, state_to_tensors
from localkv.kv.codec import KVState
from localkv.model.session import ModelSession
from localkv.model.state import check_cells, read_after
from localkv.storage.chain import block_ends, chain_next
from localkv.storage.store import SnapshotStore
from localkv.storage.values import Block, Probe

__all__ = ["BlockScope", "SaveResult", "prepare_blocks", "write_blocks"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveResult:
    blocks: int  # blocks in the saved chain
    new_blocks: int  # of which written now
    new_bytes: int  # bytes on disk written now
    tip: str | None  # hash of the chain's last block (None if the save failed)
    error: str | None = None  # why the save stopped (disk full, I/O error, chain evicted)
    # why the chain is not in the cache after all: the budget's eviction took it at once
    not_kept: str | None = None
    # pinned snapshots hold more than the budget: eviction cannot bring the cache within it
    over_budget: str | None = None
    # where the saved chain ends, in tokens: the last tip asked for, or an earlier one
    # where the session could not end a restorable block (0 when nothing was saved)
    end: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockScope:
    """Where blocks go: the store, the chain root, identity digest, namespace, block size."""

    store: SnapshotStore
    root: str
    identity: str
    namespace: str
    block_size: int


def prepare_blocks(
    scope: BlockScope,
    session: ModelSession,
    tips: Sequence[int],
    seconds_per_token: float,
    writing: Container[str] = (),
) -> list[Block]:
    """Blocks for the session's sequence up to its last tip (captured now, written later).

    Full blocks end at multiples of the block size; each tip that is not a
    block end gets a shorter block. Every block needs the probe of its last
    token; a chain stops where one is missing. The state is captured only if a
    block is neither stored nor in ``writing`` (prepared by an earlier save whose
    write is still queued): a repeat captures nothing.
    """
    n_max = max((t for t in tips if 0 < t <= session.n_tokens), default=0)
    if n_max == 0:
        return []
    ends = sorted({*range(scope.block_size, n_max + 1, scope.block_size), *tips})
    ends = [e for e in ends if 0 < e <= n_max]
    kind = session.memory_kind
    captured: list[KVState | None] = []  # the state, captured once a block needs it

    def state(start: int) -> KVState | None:
        """The state from ``start`` on (the first block that needs it) at least."""
        if not captured:  # (SWA: the capture hands the last window's rows to their blocks)
            captured.append(None if kind == "recurrent" else _capture(session, start))
        return captured[0]

    tokens = session.tokens
    out: list[Block] = []
    full_hash_at = {0: scope.root}
    for end in ends:
        start = (end - 1) // scope.block_size * scope.block_size
        full = end - start == scope.block_size
        parent = full_hash_at.get(start)
        if parent is None:
            break  # the block before this one could not be saved
        block_tokens = np.asarray(tokens[start:end], dtype=np.int32)
        try:
            offsets = np.asarray(block_ends(session.batch_ends, start, end))
        except ValueError:
            log.debug("no batch ends at token %d: not saved", end)
            continue
        block_hash = chain_next(parent, block_tokens, offsets)
        if block_hash in writing or scope.store.has_block(block_hash):
            session.windows.take(end)
            if full:
                full_hash_at[end] = block_hash
            out.append(_block(scope, block_hash, parent, start, block_tokens, ends=offsets))
            continue
        content = _content(session, state(start), (start, end), seconds_per_token)
        if content is None:
            continue
        if full:
            full_hash_at[end] = block_hash
        out.append(
            _block(scope, block_hash, parent, start, block_tokens, ends=offsets, content=content)
        )
    return out


def _capture(session: ModelSession, first: int) -> KVState:
    """The session's state, from position ``first`` on where the context can read only
    that (plain KV memory with a second sequence: ``state.read_after``), else whole.

    The blocks before ``first`` are stored, so a new turn's save reads its own
    tokens' rows, not the whole conversation's again.
    """
    if not first or session.memory_kind != "kv" or not session.in_pieces:
        return session.capture()
    kv = codec.parse(read_after(session.ctx, session.memory, first).data, copy=False)
    if not np.array_equal(kv.positions, np.arange(first, session.n_tokens)):
        raise codec.StateFormatError(f"the cells after {first} are not its positions")
    return check_cells(kv, session.tokens[first:], session.cell_ext)


def _content(
    session: ModelSession, kv: KVState | None, span: tuple[int, int], seconds_per_token: float
) -> _Content | None:
    """A new block's content and whether a restore may end at it (None: not saved).

    Where a restore can end: SWA, with the window's rows; recurrent, with its
    state. A full block without one is restored through; a tip without one is of
    no use; a block without the probe of its last token cannot be verified.
    """
    start, end = span
    kind = session.memory_kind
    window = session.windows.take(end) if kind == "swa" else None
    probe = session.probes.get(end - 1)
    partial = session.partials.get(end - 1)
    end_state = {"swa": window is not None, "kv": True}.get(kind or "", partial is not None)
    full = end - start == session.config.block_size
    if probe is None or not (end_state or full):
        log.debug("no probe or end state for token %d: not saved", end - 1)
        return None
    tensors, meta = _tensors(kv, start, end, partial)
    if window is not None:
        add_window(tensors, meta, window.state(), window.window_first)
    return _Content(
        tensors=tensors,
        probe=Probe.from_logits(probe),
        meta=meta,
        prefill_seconds=seconds_per_token * (end - start),
        end_state=end_state,
    )


def _tensors(
    state: KVState | None, start: int, end: int, partial: np.ndarray | None
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """A block's tensors: its K/V rows, and the partial state before its last token."""
    if state is None:  # recurrent: no attention rows
        tensors: dict[str, np.ndarray] = {}
        meta = {"kv_layout": "[]", "v_trans": "0"}
    else:  # the capture may begin after 0 (``_capture``)
        first = int(state.positions[0]) if state.n_tokens else 0
        tensors, meta = state_to_tensors(state.slice(start - first, end - first))
    if partial is not None:
        add_partial(tensors, meta, partial, end - start)
    return tensors, meta


@dataclass(frozen=True, slots=True, kw_only=True)
class _Content:
    """What a new block holds beside its tokens."""

    tensors: dict[str, np.ndarray]
    probe: Probe
    meta: dict[str, str]
    prefill_seconds: float
    end_state: bool  # a restore may end at it


def _block(  # noqa: PLR0913 - to take a value type
    scope: BlockScope,
    block_hash: str,
    parent: str,
    start: int,
    tokens: np.ndarray,
    *,
    ends: np.ndarray,
    content: _Content | None = None,
) -> Block:
    """A block to write; without ``content``, a stand-in for one already stored (nothing
    to write)."""
    if content is None:
        none = Probe.from_logits(np.zeros(1, dtype=np.float32))
        content = _Content(tensors={}, probe=none, meta={}, prefill_seconds=0.0, end_state=True)
    return Block(
        hash=block_hash,
        parent=None if parent == scope.root else parent,
        identity=scope.identity,
        namespace=scope.namespace,
        start=start,
        tokens=tokens,
        ends=ends,
        tensors=content.tensors,
        probe=content.probe,
        meta=content.meta,
        prefill_seconds=content.prefill_seconds,
        end_state=content.end_state,
    )


def write_blocks(store: SnapshotStore, blocks: Sequence[Block]) -> SaveResult:
    """Write the prepared blocks that are not stored yet (background-safe)."""
    new_blocks = new_bytes = 0
    for block in blocks:
        if not block.meta:  # a stand-in for a block already stored (``_block``)
            continue
        try:
            if store.put_block(block):
                new_blocks += 1
                new_bytes += sum(r.stored_bytes for r in store.match_chain([block.hash]))
        except (OSError, sqlite3.Error, ValueError) as exc:
            # disk full, an I/O error, or a parent evicted by another process:
            # the index is unchanged and the caller carries on uncached
            log.warning("could not save the prefix cache (%s); continuing without it", exc)
            return SaveResult(
                blocks=len(blocks),
                new_blocks=new_blocks,
                new_bytes=new_bytes,
                tip=None,
                error=str(exc),
            )
    if not blocks:
        return SaveResult(blocks=0, new_blocks=new_blocks, new_bytes=new_bytes, tip=None)
    return SaveResult(
        blocks=len(blocks),
        new_blocks=new_blocks,
        new_bytes=new_bytes,
        tip=blocks[-1].hash,
        end=blocks[-1].end,
    )
