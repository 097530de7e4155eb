"""``localkv cache verify --deep``: each snapshot replayed uncached and compared bit for bit.

The replay runs on an emptied sequence (never a trimmed one), in the stored
blocks' batches, keeping states where the blocks keep them; every block's
probe, sliding rows and recurrent state must equal the recomputed ones.
"""

from __future__ import annotations

from typing import Any

import click
import numpy as np

from localkv.cache.naming import model_names
from localkv.cli.options import session_config
from localkv.model.session import ModelLoadError
from localkv.storage.store import SnapshotStore
from localkv.storage.values import BlockCorrupt

__all__ = ["deep_verify"]


def deep_verify(
    store: SnapshotStore, opts: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Replay each snapshot of this model's identity uncached (an emptied sequence, never a
    trimmed one) and compare every block's probe and partial state.

    Returns the results, and the snapshots skipped: made under another identity (another
    model, or the same with other settings), each with its model's name."""
    from localkv.cache.identity import identity_of
    from localkv.model.session import ModelSession
    from localkv.storage.filehash import FileHasher

    try:
        session = ModelSession(session_config(opts))
    except ModelLoadError as exc:
        raise click.ClickException(str(exc)) from None
    results: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    with session:
        identity = identity_of(session, FileHasher(store.root / "filehashes.db"))
        snaps = store.snapshots()
        names = model_names(store, (s.identity for s in snaps))
        for snap in snaps:
            if snap.identity != identity.digest:
                skipped.append({"snapshot": snap.id, "model": names[snap.identity]})
                continue
            chain = store.chain_of(snap.tip)
            try:
                blocks = store.read_blocks(chain)
            except BlockCorrupt as exc:
                results.append({"snapshot": snap.id, "ok": False, "detail": str(exc)})
                continue
            tokens = [int(t) for b in blocks for t in b.tokens]
            ends = [b.start + int(e) for b in blocks for e in b.ends]
            session.reset()
            session.segment_ends = {row.end for row in chain if row.end_state}
            probes = session.prefill(tokens, ends=ends).probes
            if session.memory_kind == "swa":  # the last window's rows go to their blocks
                session.capture()
            worst, partial = 0.0, session.memory_kind not in (None, "kv")
            bad = []
            for row, block in zip(chain, blocks, strict=True):
                logits = probes.get(row.end - 1)
                if _partial_differs(session, row.end, block.tensors, block.meta):
                    bad.append(row.hash)
                elif logits is None or not row.probe.matches(logits):
                    bad.append(row.hash)
                    if logits is not None:
                        worst = max(
                            worst, _top_diff(row.probe.top_ids, row.probe.top_logits, logits)
                        )
            detail = (
                f"{len(chain)} blocks, probes equal" + (" and partial states" if partial else "")
                if not bad
                else f"{len(bad)} of {len(chain)} blocks differ (max top-64 logit diff {worst:.3g})"
            )
            results.append({"snapshot": snap.id, "ok": not bad, "detail": detail})
    return results, skipped


def _partial_differs(
    session: Any, end: int, tensors: dict[str, np.ndarray], meta: dict[str, str]
) -> bool:
    """Whether a block's stored sliding rows or recurrent state differ from the ones the
    replay in ``session`` computed, bit for bit (False for a block that holds none)."""
    from localkv.kv import codec
    from localkv.kv.blocks import block_partial, window_differs

    if session.memory_kind == "swa":
        rows = session.windows.pending.get(end)
        return window_differs(rows.state() if rows is not None else None, tensors)
    computed = session.partials.get(end - 1)
    if "partial_bytes" not in meta:
        return False
    try:
        stored = block_partial(tensors, meta)
    except codec.StateFormatError:
        return True
    return computed is None or computed.tobytes() != stored.tobytes()


def _top_diff(ids: np.ndarray, stored: np.ndarray, logits: np.ndarray) -> float:
    return float(np.max(np.abs(logits[ids.astype(np.int64)] - stored))) if ids.size else 0.0
