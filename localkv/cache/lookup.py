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
from localkv.cache.naming import model_names
from localkv.model.schedule import ends_after, shared_end
from localkv.storage.chain import chain_hashes, tokens_sha
from localkv.storage.store import SnapshotStore
from localkv.storage.values import BlockRow

__all__ = ["NOT_CACHED", "Plan", "is_not_cached", "miss_reason", "near_miss", "plan_chain"]

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
            # of children that reuse as much, the shortest: less to read, and one that
            # ends where the reuse ends is restored without a token cut off again
            if reuse > best_reuse or (
                best is not None and reuse == best_reuse < best.end and child.end < best.end
            ):
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


def near_miss(
    store: SnapshotStore,
    identity: Identity,
    namespace: str,
    source_sha256: str | None,
    system: str | None,
) -> str | None:
    """A miss's nearest cause: a snapshot of ``namespace`` made from the same documents
    (their content's ``source_sha256``) under another system prompt, or another model or
    setting, named with the option that would find it; None when there is none.

    Of several, the newest that differs only in its system prompt, else the newest."""
    if source_sha256 is None:
        return None
    same = [s for s in store.snapshots(namespace) if s.source_sha256 == source_sha256]
    for snap in reversed(same):
        if snap.identity == identity.digest and snap.system not in (None, system or ""):
            made = f'--system "{_shown(snap.system)}"' if snap.system else "no --system"
            return (
                f'not cached with this system prompt; snapshot "{snap.label}" was made with {made}'
            )
    for snap in reversed(same):
        text = store.get_identity(snap.identity) if snap.identity != identity.digest else None
        if text is not None:
            theirs = Identity.from_dict(json.loads(text))
            fields = _differing(theirs, identity)
            if fields:
                options = _options(store, snap.identity, theirs, fields)
                where = _where(theirs) if {"backend", "offload"} & set(fields) else ""
                made = f"was made{where} with {', '.join(options)}" if options else ""
                made = made or (f"was made{where}" if where else "was made otherwise")
                return (
                    f'not cached with this model or settings; snapshot "{snap.label}" '
                    f"{made} (identity differs: {', '.join(fields)})"
                )
    return None


def _shown(text: str, limit: int = 60) -> str:
    """A system prompt on one line, shortened past ``limit`` characters."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


_OPTIONS = {"type_k": "--type-k", "type_v": "--type-v", "attn_threads": "--threads"}


def _differing(theirs: Identity, ours: Identity) -> list[str]:
    """The identity fields whose values differ."""
    a, b = theirs.as_dict(), ours.as_dict()
    return [k for k in [*a, *(k for k in b if k not in a)] if a.get(k, "") != b.get(k, "")]


def _options(store: SnapshotStore, digest: str, theirs: Identity, fields: list[str]) -> list[str]:
    """The options that set ``fields`` as ``theirs`` has them (a field no option sets, such
    as the KV layout that follows from the types, is named in the identity's list only)."""
    a = theirs.as_dict()
    out = []
    for key in fields:
        if key == "model_sha256":
            out.append(f"--model {model_names(store, [digest])[digest]}")
        elif key == "flash_attn":
            out.append(f"--flash-attn {'on' if a[key] else 'off'}")
        elif key == "loras":
            out.append(" ".join(f"--lora {p}" for p, _ in theirs.loras) or "no --lora")
        elif key in _OPTIONS and a[key] != 0:  # attn_threads 0: flash attention was off
            out.append(f"{_OPTIONS[key]} {a[key]}")
    if {"backend", "offload"} & set(fields):
        layers = theirs.offload.split("/", 1)[0] if theirs.backend != "cpu" else "0"
        out.append(f"--n-gpu-layers {layers}")
    return out


def _where(theirs: Identity) -> str:
    """Where a snapshot's layers were computed, as a miss names it."""
    return " on the CPU" if theirs.backend == "cpu" else f" on {theirs.backend}"
