"""Where a restore of memory with a partial part may end: at a block that keeps one.

An SWA window or a recurrent state is a point value (``localkv.kv.partial``):
a restore may end only at a block that can rebuild it as it stood before the
block's last token (its ``end_state``: an SWA block's window start and rows, a
recurrent block's state), never trimmed to a shorter prefix. A request that
diverges mid-block reuses up to the last such block before the divergence.
"""

from __future__ import annotations

from typing import NamedTuple

from localkv.cache.lookup import Plan
from localkv.kv.partial import MemoryKind

__all__ = ["Cut", "snapshot_cut", "what_is_kept"]


def what_is_kept(kind: MemoryKind | None) -> str:
    return "the sliding-window state" if kind == "swa" else "the recurrent state"


class Cut(NamedTuple):
    """A plan cut at a snapshot boundary."""

    plan: Plan
    reuse: int  # the tokens reused
    refusal: str | None  # why none can be; None: ``plan`` holds ``reuse`` tokens


def snapshot_cut(plan: Plan, reuse: int, kind: MemoryKind | None, block_size: int) -> Cut:
    """``plan`` cut at its last snapshot boundary within ``reuse`` tokens (plain KV
    memory: unchanged)."""
    if kind == "kv" or reuse == 0:
        return Cut(plan, reuse, None)
    keep = [i for i, row in enumerate(plan.chain) if 2 <= row.end <= reuse and row.end_state]
    if not keep:
        refusal = (
            f"no snapshot boundary in the {reuse:,} reusable tokens: "
            f"{what_is_kept(kind)} is kept at segment ends and every {block_size}"
        )
        return Cut(plan, 0, refusal)
    chain = plan.chain[: keep[-1] + 1]
    return Cut(Plan(chain, chain[-1].end, plan.common), chain[-1].end, None)
