"""The verified prefix cache: a session's view of the store, and its restore loop.

``PrefixCache.restore`` finds the stored chain holding the longest exact
prefix of a request (``lookup``), loads and verifies it (``restore``; every
check, chain hashes to the probe token's logits bit for bit, in
``restore.verify``), and trims the sequence to the planned prefix. Any
failure leaves the session empty, records a miss reason, quarantines what
was bad, and the caller prefills normally.
``prepare``/``write`` save the session's blocks (``save``).

A read-only cache directory is restored from and never written (no blocks,
snapshots, statistics or quarantine). A damaged index found on the way
(``IndexDamaged``) is a miss that names ``localkv cache repair``, and the
cache does nothing more in this process. ``warning`` says, once, what the
user should know: a read-only cache, or an index deleted while it was used.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from localkv.cache.identity import Identity, identity_of
from localkv.cache.lookup import Plan, is_not_cached, miss_reason, plan_chain
from localkv.cache.naming import covering
from localkv.cache.restore.ends import snapshot_cut
from localkv.cache.restore.held import HELD_SHARE, UNCUT, HeldStates
from localkv.cache.restore.load import load_chain
from localkv.cache.restore.packed import load_packed, pack_chain, packable
from localkv.cache.restore.pieces import prepare_buffers
from localkv.cache.restore.probed import ProbedChains
from localkv.cache.restore.verify import probe_matches
from localkv.cache.save import BlockScope, SaveResult, prepare_blocks, write_blocks
from localkv.kv import codec
from localkv.model.context import available_memory
from localkv.model.session import ModelSession
from localkv.storage.chain import chain_root
from localkv.storage.filehash import FileHasher
from localkv.storage.index.health import REPAIR_HINT, IndexDamaged, is_damage
from localkv.storage.packed import BUDGET_SHARE
from localkv.storage.paths import CacheDirError
from localkv.storage.store import SnapshotStore
from localkv.storage.values import Block, BlockCorrupt, BlockRow

__all__ = ["PrefixCache", "RestoreResult", "SaveResult", "open_prefix_cache"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class RestoreResult:
    """What a restore did. ``reused`` tokens are in the session when it is positive."""

    reused: int
    verified: bool | None  # None: nothing was restored
    miss_reason: str | None
    seconds: float
    tip: str | None = None  # hash of the last block used
    saved_seconds: float = 0.0  # estimated prefill time the restore replaced
    # seconds by step: lookup, read (block files read into the state buffer and
    # checked), load (llama_state_seq_set_data), probe (the verifying single-token decode)
    breakdown: dict[str, float] = field(default_factory=dict)
    chain: tuple[str, ...] = ()  # hashes of the blocks used, first block first
    # tokens the stored chain has in common with the request; those after ``reused``
    # were computed there in other batches than this request's, so they are recomputed
    common: int = 0
    # the state came from the chain's packed state (``restore.packed``), not its blocks
    packed: bool = False
    # the state was resumed from one held in memory (``restore.held``): no read, no probe
    held: bool = False


def _guarded(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` with index errors (disk full, I/O) logged instead of raised."""

    def run() -> None:
        try:
            fn()
        except (OSError, sqlite3.Error) as exc:
            log.warning("cache bookkeeping failed: %s", exc)

    return run


def _file_id(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class PrefixCache:
    """A session's view of the store: one identity, one namespace, one block size."""

    # restore through packed states, and write them (``restore.packed``)
    packing: bool = True

    def __init__(
        self,
        store: SnapshotStore,
        identity: Identity,
        namespace: str,
        block_size: int,
        defer: Callable[[Callable[[], None]], object] | None = None,
        *,
        budget_bytes: int | None = None,
    ) -> None:
        """``defer(fn)`` runs index bookkeeping (hit counts, stats) off the restore path.

        ``enforce_budget()`` evicts the store down to ``budget_bytes`` (default:
        ``LOCALKV_BUDGET``, else a share of free disk space).
        """
        self._run_deferred = defer or (lambda fn: fn())
        self.budget_bytes = budget_bytes
        self.store = store
        self.identity = identity
        self.namespace = namespace
        self.block_size = block_size
        self.root = chain_root(identity.digest, namespace)
        self.damaged: str | None = None  # why the index cannot be used (IndexDamaged's line)
        self._index_id = _file_id(store.layout.index)
        self._writing: set[str] = set()  # prepared blocks whose write is queued
        self._probed = ProbedChains()  # chains whose probe matched in this process
        # memory that cannot be cut back: its recent verified states (``restore.held``)
        self.held = HeldStates(max_bytes=(available_memory() or 0) // HELD_SHARE)
        if not store.read_only:
            store.put_identity(identity.digest, json.dumps(identity.as_dict(), sort_keys=True))

    @property
    def saving(self) -> bool:
        """False when nothing may be written: a read-only cache, or a damaged index."""
        return not self.store.read_only and self.damaged is None

    def defer(self, fn: Callable[[], None]) -> None:
        """Run bookkeeping through ``defer``; its index errors are logged, never raised."""
        if self.saving:
            self._run_deferred(_guarded(fn))

    def index_lost(self) -> str | None:
        """Why ``index.db`` is no longer the file this cache opened (deleted, replaced)."""
        if self._index_id is None or _file_id(self.store.layout.index) == self._index_id:
            return None
        return (
            f"the cache index {self.store.layout.index} was deleted or replaced while this ran: "
            f"the blocks saved are on disk but not indexed; {REPAIR_HINT}"
        )

    def warning(self) -> str | None:
        """What the user should be told once about this cache, if anything."""
        if self.store.read_only:
            why = self.store.read_only_reason or "read-only"
            root = self.store.root
            return f"the cache at {root} is read-only ({why}): restored from it, saved nothing"
        return self.damaged or self.index_lost()

    @property
    def scope(self) -> BlockScope:
        return BlockScope(
            store=self.store,
            root=self.root,
            identity=self.identity.digest,
            namespace=self.namespace,
            block_size=self.block_size,
        )

    def prepare_restores(self, session: ModelSession) -> int:
        """Make this thread's restore buffers ready now (``pieces.prepare_buffers``) and the
        store's readers and writer (``SnapshotStore.prepare``), for a process that serves
        many requests: its first restore then faults in no page of them and starts no
        thread. The bytes made ready."""
        self.store.prepare()
        return prepare_buffers(session, self.store.readers)

    # ---------------------------------------------------------------- lookup
    def plan(self, tokens: Sequence[int], ends: Sequence[int]) -> Plan:
        """The stored chain that holds the longest exact prefix of ``tokens`` (see ``lookup``)."""
        scope = (self.identity.digest, self.namespace)
        whole = self.identity.memory_kind != "kv"
        return plan_chain(
            self.store, self.root, scope, self.block_size, tokens, ends=ends, whole_blocks=whole
        )

    def miss_reason(self, tokens: Sequence[int]) -> str:
        """Why nothing was found: the identity field that differs, or no stored prefix."""
        return miss_reason(self.store, self.identity, self.namespace, tokens[: self.block_size])

    # --------------------------------------------------------------- restore
    def restore(
        self, session: ModelSession, tokens: Sequence[int], ends: Sequence[int]
    ) -> RestoreResult:
        """Restore the longest verified, exact prefix of ``tokens`` into the (emptied) session.

        ``ends`` is the request's canonical schedule: the restore ends at one of
        them, and every token before it was computed in the same batches as this
        request's uncached run would compute it. At most ``len(tokens) - 1``
        tokens are reused unless the stored chain ends exactly at the request's
        end, so the caller always has the last token's logits. A damaged block is
        quarantined and the chain before it is tried again; a hit after that
        keeps the damage as its ``miss_reason`` (why no more was reused).
        """
        t0 = time.perf_counter()
        reasons: list[str] = []
        try:
            for _ in range(3):
                result = self._restore_once(session, tokens, ends, t0, reasons)
                if result is not None and result.reused and reasons:
                    return dataclasses.replace(result, miss_reason=reasons[-1])
                if result is not None:
                    return result
        except sqlite3.DatabaseError as exc:
            if not is_damage(exc):
                raise
            session.reset()
            self.damaged = str(IndexDamaged(self.store.layout.index, str(exc)))
            log.info("cache miss: %s", self.damaged)
            return RestoreResult(
                reused=0, verified=None, miss_reason=self.damaged, seconds=time.perf_counter() - t0
            )
        return self._miss(tokens, reasons[-1], t0)

    def _quarantine(self, block_hash: str, reason: str) -> None:
        if self.saving:
            self.store.quarantine(block_hash, reason)
        else:
            log.warning("block %s is bad (%s); the cache cannot be changed", block_hash, reason)

    def _restore_once(
        self,
        session: ModelSession,
        tokens: Sequence[int],
        ends: Sequence[int],
        t0: float,
        reasons: list[str],
    ) -> RestoreResult | None:
        """One try: plan, load, verify. None when a damaged block was quarantined."""
        session.reset()
        marks = [time.perf_counter()]
        plan = self.plan(tokens, ends)
        marks.append(time.perf_counter())
        reuse, refusal = self._usable(plan, tokens, session.n_ctx, reasons)
        if refusal is not None:
            return self._miss(tokens, refusal, t0, plan.common)
        plan, reuse, refusal = snapshot_cut(plan, reuse, session.memory_kind, self.block_size)
        if refusal is not None:  # memory with a partial part: restore at a snapshot only
            return self._miss(tokens, refusal, t0, plan.common)
        last = plan.chain[-1]
        resumed = self._resume_held(session, plan, (tokens, reuse), marks, t0)
        if resumed is not None:
            return resumed
        spent: dict[str, float] = {}
        # probed before: load the final token's rows, unless its logits are the request's
        # last ones (a request ending where the chain ends), which the probe decodes
        probed = reuse < len(tokens) and self._probed.matched(plan.chain)
        packs = self.packing and packable(session, plan.chain)
        # a packed state, probed as it is loaded (``whole``: no probe after it), else blocks
        stored = load_packed(self.store, session, plan.chain, marks) if packs else None
        whole = from_packed = stored is not None
        try:
            if stored is None:
                stored, whole = load_chain(
                    self.store, self.root, session, plan.chain, marks, spent=spent, whole=probed
                )
        except (BlockCorrupt, codec.StateFormatError) as exc:
            session.reset()
            bad = exc.block_hash if isinstance(exc, BlockCorrupt) else None
            self._quarantine(bad or last.hash, getattr(exc, "reason", str(exc)))
            kind = "corrupt block" if isinstance(exc, BlockCorrupt) else "unreadable state"
            reasons.append(f"{kind}: {getattr(exc, 'reason', exc)}")
            return None
        if not whole and not probe_matches(session, last, stored):
            session.reset()
            self._quarantine(plan.chain[0].hash, "probe mismatch")
            return self._miss(tokens, "probe mismatch: stored state does not reproduce", t0)
        self._probed.add(plan.chain)
        self._hold(session, last, reuse)
        session.truncate(reuse)
        marks.append(time.perf_counter())
        if packs and not from_packed:  # read from its blocks: packed for the next restore
            self._pack_later(session, plan.chain)
        hit = self._hit(plan, reuse, (marks, spent), t0, list(tokens[:reuse]))
        return dataclasses.replace(hit, packed=from_packed)

    def _hold(self, session: ModelSession, last: BlockRow, reuse: int) -> None:
        """Keep a checkpoint of ``session``, just restored and verified up to ``last``, for
        the next restore of that chain (``restore.held``): memory that cannot be cut back,
        restored whole, and a state that could be held (else none is taken)."""
        whole = session.memory_kind in UNCUT and session.n_tokens == reuse == last.end
        if whole and self.held.fits(session.state_bytes()):
            self.held.put(last.hash, session.checkpoint())

    def _resume_held(
        self,
        session: ModelSession,
        plan: Plan,
        asked: tuple[Sequence[int], int],
        marks: list[float],
        t0: float,
    ) -> RestoreResult | None:
        """The restore of ``plan`` from the state held for its tip (``restore.held``):
        the session resumed where the verified restore of that chain left it; None where
        none is held for all ``asked`` tokens to reuse (then ``marks`` are as they were)."""
        tokens, reuse = asked
        last = plan.chain[-1]
        found = self.held.get(last.hash) if session.memory_kind in UNCUT else None
        if found is None or reuse != last.end or found.tokens != tuple(tokens[:reuse]):
            return None
        marks.append(time.perf_counter())
        try:
            session.resume(found)
        except (codec.StateFormatError, ValueError) as exc:  # another context's, refused
            session.reset()
            self.held.drop(last.hash)
            del marks[2:]
            log.info("held state of %s not resumed (%s); restoring from the disk", last.hash, exc)
            return None
        marks += [time.perf_counter()] * 2  # loaded, and no probe to decode
        hit = self._hit(plan, reuse, (marks, {}), t0, list(found.tokens))
        return dataclasses.replace(hit, held=True)

    def _pack_later(self, session: ModelSession, chain: list[BlockRow]) -> None:
        """Write ``chain``'s packed state (``restore.packed``) off the restore's path."""
        cell_ext, budget = session.cell_ext, self.budget_bytes or self.store.default_budget()

        def pack() -> None:
            try:
                pack_chain(
                    self.store,
                    self.root,
                    chain,
                    cell_ext=cell_ext,
                    max_bytes=budget // BUDGET_SHARE,
                )
            except (BlockCorrupt, codec.StateFormatError, ValueError) as exc:
                log.warning("chain not packed: %s", exc)  # its blocks restore as before

        self.defer(pack)

    def _usable(
        self, plan: Plan, tokens: Sequence[int], n_ctx: int, reasons: list[str]
    ) -> tuple[int, str | None]:
        """The tokens to reuse from ``plan``, or why none can be."""
        if not plan.chain or plan.reuse == 0:
            if reasons:
                return 0, reasons[0]
            if plan.common < self.block_size:  # the template's first tokens at most
                return 0, self.miss_reason(tokens)
            return 0, (
                f"no batch end shared in the {plan.common:,} common tokens: "
                "they were computed in other batches than this request's"
            )
        reuse, end = plan.reuse, plan.chain[-1].end
        if reuse == len(tokens) and reuse < end:
            # the last token's logits are needed: prefill it (n-1 is a batch end of both)
            reuse -= 1
        if reuse == 0:
            return 0, "no stored prefix"
        if end > n_ctx:
            return 0, f"stored chain of {end} tokens exceeds n_ctx"
        return reuse, None

    def _hit(
        self,
        plan: Plan,
        reuse: int,
        timed: tuple[list[float], dict[str, float]],
        t0: float,
        prefix: list[int],
    ) -> RestoreResult:
        """A verified restore of ``reuse`` tokens (``prefix``); ``timed``: ``load_chain``'s
        marks and the parts of its reading it timed (``_steps``).

        The time it saved is what the stored blocks cost to compute (their
        ``prefill_seconds``, pro rata where the reuse ends inside one): one
        figure for one prefix, whatever this session's context or rate.
        """
        saved = sum(
            row.prefill_seconds * min(row.n_tokens, max(0, reuse - row.start)) / row.n_tokens
            for row in plan.chain
        )
        hashes = [row.hash for row in plan.chain]

        def bookkeeping() -> None:
            self.store.touch(hashes)
            named = covering(self.store, self.namespace, hashes, reuse, prefix)
            self.store.record_event("hit", None, reuse, saved, self.namespace, snapshot=named)

        self.defer(bookkeeping)
        marks = timed[0]
        steps = _steps(marks, timed[1])
        seconds = marks[-1] - t0
        return RestoreResult(
            reused=reuse,
            verified=True,
            miss_reason=None,
            seconds=seconds,
            tip=hashes[-1],
            saved_seconds=saved,
            breakdown=steps,
            chain=tuple(hashes),
            common=plan.common,
        )

    def _miss(
        self, tokens: Sequence[int], reason: str, t0: float, common: int = 0
    ) -> RestoreResult:
        n = len(tokens)
        counted = None if is_not_cached(reason) else reason  # a first run has no reason
        self.defer(lambda: self.store.record_event("miss", counted, n, 0.0, self.namespace))
        log.info("cache miss: %s", reason)
        return RestoreResult(
            reused=0,
            verified=None,
            miss_reason=reason,
            seconds=time.perf_counter() - t0,
            common=common,
        )

    # ------------------------------------------------------------- prefill rate
    def seconds_per_token(self, n_ctx: int) -> float | None:
        """The prefill rate timed for this identity at ``n_ctx`` (None: none timed yet).

        Every writer's blocks record it (``prefill_seconds``); a hit's saved time sums theirs.
        """
        try:
            found = self.store.prefill_rate(self.identity.digest, n_ctx)
        except (OSError, sqlite3.Error) as exc:
            log.warning("could not read the prefill rate: %s", exc)
            return None
        return found[0] / found[1] if found else None

    def note_prefill(self, n_ctx: int, seconds: float, tokens: int) -> float:
        """Add a timed prefill to the rate (written off the critical path); the new rate."""
        digest = self.identity.digest
        try:
            before = self.store.prefill_rate(digest, n_ctx) if self.saving else None
        except (OSError, sqlite3.Error):
            before = None
        self.defer(lambda: self.store.note_prefill(digest, n_ctx, seconds, tokens))
        if before is None:
            return seconds / tokens
        return (before[0] + seconds) / (before[1] + tokens)

    # ------------------------------------------------------------------ save
    def prepare(
        self, session: ModelSession, tips: Sequence[int], prefill_seconds_per_token: float
    ) -> list[Block]:
        """Blocks for the session's sequence up to its last tip (see ``save``); none when
        nothing may be saved."""
        if not self.saving:
            return []
        try:
            blocks = prepare_blocks(
                self.scope, session, tips, prefill_seconds_per_token, self._writing
            )
        except sqlite3.DatabaseError as exc:
            if not is_damage(exc):
                raise
            self.damaged = str(IndexDamaged(self.store.layout.index, str(exc)))
            log.warning("%s; nothing is saved", self.damaged)
            return []
        self._writing.update(b.hash for b in blocks if b.meta)
        return blocks

    def write(self, blocks: Sequence[Block]) -> SaveResult:
        """Write the prepared blocks that are not stored yet (background-safe)."""
        try:
            return write_blocks(self.store, blocks)
        finally:
            self._writing.difference_update(b.hash for b in blocks if b.meta)

    def enforce_budget(self) -> int:
        """Evict down to the budget (after a write); returns the bytes freed."""
        if not self.saving:
            return 0
        budget = self.budget_bytes or self.store.default_budget()
        try:
            freed = self.store.evict(budget)
        except (OSError, sqlite3.Error) as exc:
            log.warning("could not evict from the cache: %s", exc)
            return 0
        if freed:
            log.info("cache over its budget of %d bytes: evicted %d bytes", budget, freed)
        return freed


def open_prefix_cache(
    session: ModelSession,
    cache_dir: str | Path | None,
    compact: bool,
    namespace: str,
    defer: Callable[[Callable[[], None]], object] | None = None,
) -> tuple[PrefixCache | None, str | None]:
    """The session's cache in ``cache_dir`` (default: the user cache), or why there is none."""
    try:
        store = SnapshotStore.open(Path(cache_dir) if cache_dir else None, compact=compact)
    except (CacheDirError, sqlite3.Error, OSError) as exc:
        return None, f"cache unavailable: {exc}"
    try:
        hashes = None if store.read_only else store.root / "filehashes.db"
        identity = identity_of(session, FileHasher(hashes))
        block_size = session.config.block_size
        return PrefixCache(store, identity, namespace, block_size, defer=defer), None
    except (codec.StateFormatError, sqlite3.Error, OSError) as exc:
        store.close()
        return None, f"cache unavailable: {exc}"


def _steps(marks: list[float], spent: dict[str, float]) -> dict[str, float]:
    """A restore's seconds by step: ``lookup``, ``read`` (and hash), ``load`` (into
    llama.cpp), ``probe``, from ``marks``; where pieces were loaded as they were read
    (``spent``), their loads move from ``read`` to ``load``, and ``columns`` (V into
    llama.cpp's columns, part of ``read``) is told apart."""
    steps = dict(zip(("lookup", "read", "load", "probe"), np.diff(marks).tolist(), strict=True))
    loaded = spent.get("load", 0.0)
    steps["read"] -= loaded
    steps["load"] += loaded
    if "columns" in spent:
        steps["columns"] = spent["columns"]
    return steps
