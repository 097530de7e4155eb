"""The budget, as a save and the cache commands see it: what eviction kept, and warnings.

After every save the store is evicted down to its budget (``LOCALKV_BUDGET``,
else a share of free disk; ``localkv.storage.removal``). ``fit_budget`` does
that and says when the eviction took the very chain just saved (the budget
cannot hold it beside what else is kept), so no command reports it as saved.
Pinned snapshots are never evicted: ``budget_warning`` says when they alone
hold more than the budget. ``namespace_stats`` is what ``cache stats`` shows.
"""

from __future__ import annotations

import dataclasses
import logging
import sqlite3

from localkv.cache.prefix import PrefixCache, SaveResult
from localkv.storage.removal.budget import ENV_BUDGET
from localkv.storage.store import SnapshotStore

__all__ = ["budget_warning", "fit_budget", "human_size", "namespace_stats", "stats_lines"]

log = logging.getLogger(__name__)


def fit_budget(cache: PrefixCache, saved: SaveResult) -> SaveResult:
    """Evict down to the budget after a save, and say what that left of it.

    ``saved`` comes back with ``not_kept`` when the eviction took the chain
    just saved (the budget cannot hold it beside what else is kept), and with
    ``over_budget`` when pinned snapshots alone hold more than the budget.
    Index errors are logged: reporting is never worth a failure.
    """
    if not cache.saving:  # read-only or damaged index: nothing was saved, nothing to evict
        return saved
    try:
        budget = cache.budget_bytes or cache.store.default_budget()
        if saved.new_blocks:
            needs = sum(r.stored_bytes for r in cache.store.chain_of(saved.tip or ""))
            cache.enforce_budget()
            if saved.tip is not None and not cache.store.has_block(saved.tip):
                saved = dataclasses.replace(saved, not_kept=_too_small(cache, budget, needs))
        return dataclasses.replace(saved, over_budget=budget_warning(cache.store, budget))
    except (OSError, sqlite3.Error, ValueError) as exc:
        log.warning("could not check the cache budget: %s", exc)
        return saved


def _too_small(cache: PrefixCache, budget: int, needs: int) -> str:
    pinned = cache.store.usage().pinned_bytes
    return (
        f"not kept: the cache budget of {human_size(budget)} ({ENV_BUDGET}) is too small "
        f"for these {human_size(needs)} beside {human_size(pinned)} pinned; evicted at once"
    )


def namespace_stats(store: SnapshotStore, namespace: str) -> dict[str, object]:
    """``cache stats``: one namespace's hits, misses, bytes (pinned too), and the budget.

    Every field but ``budget`` counts ``namespace`` alone, so no other
    namespace's entries or miss reasons show; ``budget`` is the whole cache's,
    since eviction works on the whole cache.
    """
    budget = store.default_budget()
    whole = store.usage()
    packed = store.packed.listing()
    return {
        "namespace": namespace,
        **store.stats(namespace),
        "pinned_bytes": store.usage(namespace).pinned_bytes,
        "budget": {
            "budget_bytes": budget,
            "stored_bytes": whole.stored_bytes,
            "pinned_bytes": whole.pinned_bytes,
            "over_budget": whole.stored_bytes > budget,
            "pinned_over_budget": whole.pinned_bytes > budget,
            # copies of chains' states beside the blocks (``storage.packed``), the whole cache's
            "packed_states": len(packed),
            "packed_bytes": sum(entry.size for entry in packed),
        },
    }


def stats_lines(stats: dict[str, object]) -> list[str]:
    """``namespace_stats`` as text: one ``key: value`` line each, the budget in words."""
    lines = [f"{k:>22}: {_stat(k, v)}" for k, v in stats.items() if k != "budget"]
    budget = stats["budget"]
    if isinstance(budget, dict):
        lines.append(
            f"{'budget':>22}: {human_size(budget['budget_bytes'])} for the whole cache; "
            f"{human_size(budget['stored_bytes'])} used, "
            f"{human_size(budget['pinned_bytes'])} pinned"
        )
        lines.append(
            f"{'packed states':>22}: {budget['packed_states']} beside it, "
            f"{human_size(budget['packed_bytes'])} (the most recently used chains' states, "
            "one file each)"
        )
    return lines


def _stat(key: str, value: object) -> str:
    """One ``cache stats`` value in words: sizes in binary units, seconds as seconds."""
    if key.endswith("_bytes") and isinstance(value, int):
        return f"{human_size(value)} ({value:,} bytes)"
    if key.endswith("_seconds") and isinstance(value, float):
        return f"{value:,.1f} s"
    if isinstance(value, dict):
        return ", ".join(f"{reason}: {n}" for reason, n in value.items()) or "none"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def budget_warning(store: SnapshotStore, budget: int | None = None) -> str | None:
    """The warning when pinned snapshots hold more than the budget, else None.

    ``budget`` defaults to the store's (``LOCALKV_BUDGET``, else a share of free disk).
    """
    budget = store.default_budget() if budget is None else budget
    pinned = store.usage().pinned_bytes
    if pinned <= budget:
        return None
    return (
        f"pinned snapshots hold {human_size(pinned)}, over the cache budget of "
        f"{human_size(budget)} ({ENV_BUDGET}); eviction never removes them: "
        f"unpin some (localkv cache unpin ID) or raise {ENV_BUDGET}"
    )


def human_size(n: int) -> str:
    """``512 B``, ``100.0 KiB``, ``26.8 MiB``, ``1.2 GiB`` (powers of 1024, as budgets are)."""
    if n < 1024:
        return f"{n} B"
    size, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{size:.1f} {unit}"
