"""The verified prefix cache: find, restore (with the probe) and save KV blocks.

Restore (DESIGN §6): the longest stored chain for the request's tokens is
found in the index; its blocks are read and checked; the state is loaded up to
the last block's final token *minus one*; that token is decoded alone and its
logits must equal the block's stored probe bit for bit. Only then is the
sequence trimmed to the common prefix and used. Any failure leaves the session
empty, records a miss reason, quarantines what was bad, and the caller
prefills normally.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from localkv.cache.identity import Identity
from localkv.kv import codec
from localkv.kv.blocks import block_layout, state_to_tensors, tensors_to_state
from localkv.model.schedule import ends_after, shared_end
from localkv.model.session import ModelSession
from localkv.storage.blockread import OpenedBlock
from localkv.storage.chain import block_ends, chain_hashes, chain_next, chain_root, tokens_sha
from localkv.storage.store import SnapshotStore
from localkv.storage.values import Block, BlockCorrupt, BlockRow, Probe

__all__ = ["PrefixCache", "RestoreResult", "SaveResult"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
class SaveResult:
    blocks: int  # blocks in the saved chain
    new_blocks: int  # of which written now
    new_bytes: int  # bytes on disk written now
    tip: str | None  # hash of the chain's last block (None if the save failed)
    error: str | None = None  # why the save stopped (disk full, I/O error, chain evicted)


@dataclass(frozen=True, slots=True)
class _Plan:
    chain: list[BlockRow]
    reuse: int  # tokens of the request the chain holds, computed in the request's batches
    common: int  # tokens the chain has in common with the request


def _guarded(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` with index errors (disk full, I/O) logged instead of raised."""

    def run() -> None:
        try:
            fn()
        except (OSError, sqlite3.Error) as exc:
            log.warning("cache bookkeeping failed: %s", exc)

    return run


def _common_prefix(a: np.ndarray, b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n], dtype=np.int64))[0]
    return int(diff[0]) if diff.size else n


class PrefixCache:
    """A session's view of the store: one identity, one namespace, one block size."""

    def __init__(
        self,
        store: SnapshotStore,
        identity: Identity,
        namespace: str,
        block_size: int,
        defer: Callable[[Callable[[], None]], object] | None = None,
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
        store.put_identity(identity.digest, json.dumps(identity.as_dict(), sort_keys=True))

    def defer(self, fn: Callable[[], None]) -> None:
        """Run bookkeeping through ``defer``; its index errors are logged, never raised."""
        self._run_deferred(_guarded(fn))

    # ---------------------------------------------------------------- lookup
    def plan(self, tokens: Sequence[int], ends: Sequence[int]) -> _Plan:
        """The stored chain that holds the longest exact prefix of ``tokens``.

        ``ends`` is the request's canonical schedule. Full blocks match by chain
        hash, which covers their batch ends; among the blocks that follow, the one
        sharing the most tokens *computed in the same batches* is taken, and the
        reuse ends at the last batch end both computations share.
        """
        hashes = chain_hashes(self.root, tokens, self.block_size, ends)
        chain = list(self.store.match_chain(hashes))
        start = len(chain) * self.block_size
        parent = chain[-1].hash if chain else None
        best: BlockRow | None = None
        best_reuse = common = start
        if start < len(tokens):
            children = self.store.children(
                parent, self.identity.digest, self.namespace, first_token=int(tokens[start])
            )
            wanted = ends_after(ends, start)
            for child in children:
                n = start + _common_prefix(child.tokens, tokens[start:])
                stored = [start + int(e) for e in child.ends]
                reuse = shared_end(stored, wanted, n, start)
                common = max(common, n)
                if reuse > best_reuse:
                    best, best_reuse = child, reuse
        if best is not None:
            chain.append(best)
        return _Plan(chain, best_reuse, common)

    def miss_reason(self, tokens: Sequence[int]) -> str:
        """Why nothing was found: the identity field that differs, or no stored prefix."""
        first = tokens_sha(list(tokens[: self.block_size]))
        others = self.store.same_first_block_elsewhere(first, self.identity.digest, self.namespace)
        for digest in others:
            text = self.store.get_identity(digest)
            if text is None:
                continue
            diff = Identity.from_dict(json.loads(text)).diff(self.identity)
            if diff:
                return "identity differs: " + "; ".join(diff)
        # other namespaces are never looked at: not even their existence leaks
        return f"no stored prefix in namespace {self.namespace!r}"

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
        quarantined and the chain before it is tried again.
        """
        t0 = time.perf_counter()
        reasons: list[str] = []
        for _ in range(3):
            result = self._restore_once(session, tokens, ends, t0, reasons)
            if result is not None:
                return result
        return self._miss(tokens, reasons[-1], t0)

    def _restore_once(
        self,
        session: ModelSession,
        tokens: Sequence[int],
        ends: Sequence[int],
        t0: float,
        reasons: list[str],
    ) -> RestoreResult | None:
        session.reset()
        marks = [time.perf_counter()]
        plan = self.plan(tokens, ends)
        marks.append(time.perf_counter())
        reuse = plan.reuse
        if reuse == 0 and plan.common > 0 and not reasons:
            reason = (
                f"no batch end shared in the {plan.common:,} common tokens: "
                "they were computed in other batches than this request's"
            )
            return self._miss(tokens, reason, t0, plan.common)
        if not plan.chain or reuse == 0:
            return self._miss(tokens, reasons[0] if reasons else self.miss_reason(tokens), t0)
        last = plan.chain[-1]
        end = last.start + last.n_tokens
        if reuse == len(tokens) and reuse < end:
            # the last token's logits are needed: prefill it (n-1 is a batch end of both)
            reuse -= 1
        if reuse == 0:
            return self._miss(tokens, "no stored prefix", t0, plan.common)
        if end > session.n_ctx:
            return self._miss(tokens, f"stored chain of {end} tokens exceeds n_ctx", t0)
        try:
            stored_tokens = self._load(session, plan.chain, marks)
        except BlockCorrupt as exc:
            session.reset()
            self.store.quarantine(exc.block_hash or last.hash, exc.reason)
            reasons.append(f"corrupt block: {exc.reason}")
            return None
        except codec.StateFormatError as exc:
            session.reset()
            self.store.quarantine(last.hash, str(exc))
            reasons.append(f"unreadable state: {exc}")
            return None
        logits = session.decode_one(int(stored_tokens[end - 1]), probe=True)
        if not last.probe.matches(logits):
            session.reset()
            self.store.quarantine(plan.chain[0].hash, "probe mismatch")
            return self._miss(tokens, "probe mismatch: stored state does not reproduce", t0)
        session.truncate(reuse)
        marks.append(time.perf_counter())
        seconds = marks[-1] - t0
        saved = sum(
            row.prefill_seconds * min(row.n_tokens, max(0, reuse - row.start)) / row.n_tokens
            for row in plan.chain
        )
        hashes = [row.hash for row in plan.chain]

        def bookkeeping() -> None:
            self.store.touch(hashes)
            self.store.record_event("hit", None, reuse, saved)

        self.defer(bookkeeping)
        steps = dict(zip(("lookup", "read", "load", "probe"), np.diff(marks).tolist(), strict=True))
        return RestoreResult(
            reuse, True, None, seconds, last.hash, saved, steps, tuple(hashes), plan.common
        )

    def _miss(
        self, tokens: Sequence[int], reason: str, t0: float, common: int = 0
    ) -> RestoreResult:
        n = len(tokens)
        self.defer(lambda: self.store.record_event("miss", reason, n, 0.0))
        log.info("cache miss: %s", reason)
        return RestoreResult(0, None, reason, time.perf_counter() - t0, common=common)

    def _load(self, session: ModelSession, chain: list[BlockRow], marks: list[float]) -> np.ndarray:
        """Read, check and load the chain minus its final token; return the stored tokens."""
        opened = self.store.open_blocks(chain)
        try:
            blocks, buffer = self._read(session, opened)
        finally:
            for block_file in opened:
                block_file.close()
        marks.append(time.perf_counter())
        parent: str | None = None
        for row, block in zip(chain, blocks, strict=True):
            expected = chain_next(
                parent if parent is not None else self.root, block.tokens, block.ends
            )
            if block.hash != expected or block.hash != row.hash:
                raise BlockCorrupt("tokens do not match the chain hash", row.hash)
            parent = block.hash
        tokens = np.concatenate([b.tokens for b in blocks])
        n = int(tokens.shape[0]) - 1
        held = [int(t) for t in tokens[:n]]
        if buffer is not None:
            session.load_state(buffer, held)
        elif n > 0:
            pieces = [tensors_to_state(b.tensors, b.meta, b.start) for b in blocks]
            session.restore(pieces, held)
        marks.append(time.perf_counter())
        session.batch_ends = [e for b in blocks for e in (b.start + b.ends).tolist() if e < n] + [n]
        return tokens

    def _read(
        self, session: ModelSession, opened: list[OpenedBlock]
    ) -> tuple[list[Block], np.ndarray | None]:
        """The blocks, and (where it can) the state buffer their K/V rows were read into.

        With untransposed V every block file is read straight into its rows of
        llama.cpp's state buffer, minus the chain's final token; otherwise the
        blocks come back as arrays to assemble.
        """
        layouts = set()
        at = 0
        for block_file in opened:
            if block_file.row.start != at:
                raise codec.StateFormatError(f"block at {block_file.row.start}, expected {at}")
            at = block_file.row.end
            specs = block_file.specs
            layouts.add(
                block_layout(
                    block_file.metadata,
                    {name: s.shape for name, s in specs.items()},
                    {name: s.dtype.itemsize for name, s in specs.items()},
                )
            )
        if len(layouts) != 1:
            raise codec.StateFormatError("blocks of different KV layouts cannot be joined")
        v_trans, layout = layouts.pop()
        n = at - 1
        if v_trans or n <= 0:
            return self.store.fill_blocks(opened, [None] * len(opened)), None
        buffer, k_rows, v_rows = session.restore_buffer(layout, n)
        # the chain's final token is read (the checksum covers it) but not loaded:
        # its rows go to a spill area, one row per tensor
        spill = np.empty(sum(x[1] + x[3] for x in layout), dtype=np.uint8)
        targets = []
        for block_file in opened:
            start, end = block_file.row.start, block_file.row.end
            keep = min(end, n) - start
            places: dict[str, list[np.ndarray]] = {}
            spilled = 0
            for i, (_, k_bytes, _, v_bytes) in enumerate(layout):
                places[f"k.{i}"] = [k_rows[i][start : start + keep]]
                places[f"v.{i}"] = [v_rows[i][start : start + keep]]
                if end > n:
                    k_spill = spill[spilled : spilled + k_bytes]
                    v_spill = spill[spilled + k_bytes : spilled + k_bytes + v_bytes]
                    places[f"k.{i}"].append(k_spill)
                    places[f"v.{i}"].append(v_spill)
                    spilled += k_bytes + v_bytes
            targets.append(places)
        return self.store.fill_blocks(opened, targets), buffer

    # ------------------------------------------------------------------ save
    def prepare(
        self, session: ModelSession, tips: Sequence[int], prefill_seconds_per_token: float
    ) -> list[Block]:
        """Blocks for the session's sequence up to its last tip (captured now, written later).

        Full blocks end at multiples of the block size; each tip that is not a
        block end gets a shorter block. Every block needs the probe of its last
        token; a chain stops where one is missing.
        """
        n_max = max((t for t in tips if 0 < t <= session.n_tokens), default=0)
        if n_max == 0:
            return []
        ends = sorted({*range(self.block_size, n_max + 1, self.block_size), *tips})
        ends = [e for e in ends if 0 < e <= n_max]
        state = session.capture()
        tokens = session.tokens
        out: list[Block] = []
        full_hash_at = {0: self.root}
        for end in ends:
            start = (end - 1) // self.block_size * self.block_size
            full = end - start == self.block_size
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
            if self.store.has_block(block_hash):
                if full:
                    full_hash_at[end] = block_hash
                out.append(self._stub(block_hash, parent, start, block_tokens, offsets))
                continue
            probe = session.probes.get(end - 1)
            if probe is None:
                log.debug("no probe for token %d: not saved", end - 1)
                continue
            if full:
                full_hash_at[end] = block_hash
            tensors, meta = state_to_tensors(state.slice(start, end))
            out.append(
                Block(
                    hash=block_hash,
                    parent=None if parent == self.root else parent,
                    identity=self.identity.digest,
                    namespace=self.namespace,
                    start=start,
                    tokens=block_tokens,
                    ends=offsets,
                    tensors=tensors,
                    probe=Probe.from_logits(probe),
                    meta=meta,
                    prefill_seconds=prefill_seconds_per_token * (end - start),
                )
            )
        return out

    def _stub(
        self, block_hash: str, parent: str, start: int, tokens: np.ndarray, ends: np.ndarray
    ) -> Block:
        """A stand-in for a block already stored (nothing to write)."""
        return Block(
            hash=block_hash,
            parent=None if parent == self.root else parent,
            identity=self.identity.digest,
            namespace=self.namespace,
            start=start,
            tokens=tokens,
            ends=ends,
            tensors={},
            probe=Probe.from_logits(np.zeros(1, dtype=np.float32)),
            meta={},
            prefill_seconds=0.0,
        )

    def write(self, blocks: Sequence[Block]) -> SaveResult:
        """Write the prepared blocks that are not stored yet (background-safe)."""
        new_blocks = new_bytes = 0
        for block in blocks:
            if not block.tensors:
                continue
            try:
                if self.store.put_block(block):
                    new_blocks += 1
                    new_bytes += sum(r.stored_bytes for r in self.store.match_chain([block.hash]))
            except (OSError, sqlite3.Error, ValueError) as exc:
                # disk full, an I/O error, or a parent evicted by another process:
                # the index is unchanged and the caller carries on uncached
                log.warning("could not save the prefix cache (%s); continuing without it", exc)
                return SaveResult(len(blocks), new_blocks, new_bytes, None, str(exc))
        tip = blocks[-1].hash if blocks else None
        return SaveResult(len(blocks), new_blocks, new_bytes, tip)

    def enforce_budget(self) -> int:
        """Evict down to the budget (after a write); returns the bytes freed."""
        budget = self.budget_bytes or self.store.default_budget()
        try:
            freed = self.store.evict(budget)
        except (OSError, sqlite3.Error) as exc:
            log.warning("could not evict from the cache: %s", exc)
            return 0
        if freed:
            log.info("cache over its budget of %d bytes: evicted %d bytes", budget, freed)
        return freed
