"""``localkv bench``: the longest-prefix lookup with many blocks indexed.

Blocks with full-size random token lists and a one-byte-per-token tensor are
stored through ``SnapshotStore.put_block`` (each written and fsynced like a real
block), in chains of 8; then ``PrefixCache.plan`` is timed for a request that
extends the first chain (a hit) and for one that shares no first block (a miss:
every stored first block is a candidate).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from localkv.bench.stats import Stat, timed
from localkv.cache.identity import Identity
from localkv.cache.prefix import PrefixCache
from localkv.model.schedule import request_ends
from localkv.storage import Block, Probe, SnapshotStore, chain_next

__all__ = ["LookupResult", "bench_lookup"]

VOCAB = 49_152  # token ids drawn below this


@dataclass(frozen=True, slots=True, kw_only=True)
class LookupResult:
    """``PrefixCache.plan`` with ``blocks`` blocks indexed (chains of ``chain_blocks``)."""

    blocks: int
    chain_blocks: int
    insert_s: float
    request_tokens: int
    hit_reuse: int
    hit: Stat
    miss: Stat


def _chain_block(
    cache: PrefixCache,
    parent: str | None,
    position: int,
    tokens: np.ndarray,
    tensors: dict[str, np.ndarray],
    *,
    probe: Probe,
) -> Block:
    """The block at ``position`` of a chain, after ``parent``: one batch end at its last token."""
    n = len(tokens)
    ends = np.array([n - 1, n])
    return Block(
        hash=chain_next(parent or cache.root, tokens, ends),
        parent=parent,
        identity=cache.identity.digest,
        namespace="lookup",
        start=position * n,
        tokens=tokens,
        ends=ends,
        tensors=tensors,
        probe=probe,
        meta={},
        prefill_seconds=0.0,
    )


def bench_lookup(  # noqa: PLR0913 - to take a value type
    identity: Identity,
    work: Path,
    *,
    blocks: int,
    repeats: int,
    block_size: int,
    request_tokens: int,
    say: Callable[[str], None],
) -> LookupResult:
    """Index ``blocks`` blocks under ``work`` and time ``PrefixCache.plan`` ``repeats`` times.

    The requests have at least ``request_tokens`` tokens (more if the first chain
    is longer, so that a hit leaves a token to prefill).
    """
    if blocks < 1 or repeats < 1:
        raise ValueError(f"blocks and repeats must be positive, got {blocks}, {repeats}")
    per_chain = min(8, blocks)
    rng = np.random.default_rng(0)
    probe = Probe.from_logits(np.zeros(4, dtype=np.float32))
    tensors = {"x": np.zeros((block_size, 1), np.uint8)}
    first_chain: list[int] = []
    say(f"indexing {blocks:,} blocks for the lookup test")
    with SnapshotStore.open(work / "lookup") as store:
        cache = PrefixCache(store, identity, "lookup", block_size)
        parent: str | None = None
        t0 = time.perf_counter()
        for i in range(blocks):
            position = i % per_chain
            if position == 0:
                parent = None
            toks = rng.integers(0, VOCAB, size=block_size, dtype=np.int32)
            block = _chain_block(cache, parent, position, toks, tensors, probe=probe)
            store.put_block(block)
            parent = block.hash
            if i < per_chain:
                first_chain.extend(int(t) for t in toks)
            if (i + 1) % 2000 == 0:
                say(f"  {i + 1:,} blocks indexed")
        insert_s = time.perf_counter() - t0
        length = max(request_tokens, len(first_chain) + 1)
        extra = rng.integers(0, VOCAB, size=length, dtype=np.int32).tolist()
        hit_request = (first_chain + extra)[:length]
        miss_request = [VOCAB - 1 - t for t in hit_request]
        schedule = request_ends(length, [], block_size, block_size)
        reuse = cache.plan(hit_request, schedule).reuse
        hit = Stat.of([timed(lambda: cache.plan(hit_request, schedule)) for _ in range(repeats)])
        miss = Stat.of([timed(lambda: cache.plan(miss_request, schedule)) for _ in range(repeats)])
    return LookupResult(
        blocks=blocks,
        chain_blocks=per_chain,
        insert_s=insert_s,
        request_tokens=length,
        hit_reuse=reuse,
        hit=hit,
        miss=miss,
    )
