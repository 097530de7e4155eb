"""Lookup: which stored chain holds the longest *exact* prefix of a request, and why none.

Full blocks match by chain hash, which covers their tokens and batch ends, so
a block computed in other batches than the request's canonical schedule is
never found. Among the blocks that follow the matched run (a shorter tip, or
a block that diverges), the one sharing the most tokens computed in the same
batches is taken; the reuse ends at the last batch end the two computations
share (``localkv.model.schedule.shared_end``). Tokens the chain shares beyond
that are counted as ``common`` and recomputed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from localkv.cache.identity import Identity
from localkv.model.schedule import ends_after, shared_end
from localkv.storage.chain import chain_hashes, tokens_sha
from localkv.storage.store import SnapshotStore
from localkv.storage.values import BlockRow

__all__ = ["NOT_CACHED", "Plan", "is_not_cached", "miss_reason", "plan_chain"]

# a request whose first block nothing stored shares, under any identity: a first run
NOT_CACHED = "not cached yet"


def is_not_cached(reason: str | None) -> bool:
    """Whether a miss's ``reason`` is a first run (nothing stored for it), not a fault."""
    return reason is not None and reason.startswith(NOT_CACHED)


@dataclass(frozen=True, slots=True)
class Plan:
    """The chain to restore and how much of the request it holds."""

    chain: list[BlockRow]
    reuse: int  # tokens of the request the chain holds, computed in the request's batches
    common: int  # tokens the chain has in common with the request


def common_prefix(a: np.ndarray, b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n], dtype=np.int64))[0]
    return int(diff[0]) if diff.size else n


def plan_chain(  # noqa: PLR0913 - to take a value type
    store: SnapshotStore,
    root: str,
    scope: tuple[str, str],
    block_size: int,
    tokens: Sequence[int],
    *,
    ends: Sequence[int],
    whole_blocks: bool = False,
) -> Plan:
    """The stored chain (under ``scope``: identity digest, namespace) that holds the
    longest exact prefix of ``tokens``, whose canonical schedule is ``ends``.

    ``whole_blocks``: memory that cannot be trimmed (``cache.restore.ends``) can use a
    following block only whole and only where a restore may end at it.
    """
    chain = list(store.match_chain(chain_hashes(root, tokens, block_size, ends)))
    start = len(chain) * block_size
    best: BlockRow | None = None
    best_reuse = common = start
    if start < len(tokens):
        parent = chain[-1].hash if chain else None
        children = store.children(parent, *scope, first_token=int(tokens[start]))
        wanted = ends_after(ends, start)
        for child in children:
            n = start + common_prefix(child.tokens, tokens[start:])
            stored = [start + int(e) for e in child.ends]
            reuse = shared_end(stored, wanted, n, start)
            common = max(common, n)
            if whole_blocks and (reuse < child.end or not child.end_state):
                continue
            if reuse > best_reuse:
                best, best_reuse = child, reuse
    if best is not None:
        chain.append(best)
    return Plan(chain, best_reuse, common)


def miss_reason(
    store: SnapshotStore, identity: Identity, namespace: str, first_block: Sequence[int]
) -> str:
    """Why nothing was found: the identity field that differs, or ``NOT_CACHED``
    (naming the namespace when it is not the default one)."""
    first = tokens_sha(list(first_block))
    for digest in store.same_first_block_elsewhere(first, identity.digest, namespace):
        text = store.get_identity(digest)
        if text is None:
            continue
        diff = Identity.from_dict(json.loads(text)).diff(identity)
        if diff:
            return "identity differs: " + "; ".join(diff)
    # other namespaces are never looked at: not even their existence leaks
    return NOT_CACHED if namespace == "default" else f"{NOT_CACHED} in namespace {namespace!r}"
