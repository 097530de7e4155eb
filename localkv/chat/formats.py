"""How sizes, times and cache reports read on screen."""

from __future__ import annotations

import time

from localkv.chat.session import SyncReport

__all__ = ["ago", "human_bytes", "sync_line"]


def human_bytes(n: int) -> str:
    """``512 B``, ``4.0 KiB``, ``26.8 MiB``, ``1.2 GiB``."""
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def ago(timestamp: float, now: float | None = None) -> str:
    """``just now``, ``5 min ago``, ``3 h ago``, ``2 d ago``."""
    seconds = max(0.0, (time.time() if now is None else now) - timestamp)
    if seconds < 60:
        return "just now"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min ago"
    if seconds < 86400:
        return f"{seconds // 3600:.0f} h ago"
    return f"{seconds // 86400:.0f} d ago"


def sync_line(report: SyncReport) -> str:
    """What bringing the KV sequence in line cost: the restore, then the prefill."""
    cache = report.cache
    parts = []
    if cache is None:
        parts.append("already in memory")
    elif cache.hit:
        verified = " (verified)" if cache.verified else ""
        parts.append(
            f"restored {cache.reused:,} tokens{verified} in {cache.restore_s * 1000:.0f} ms"
        )
    else:
        parts.append(f"cache miss: {cache.miss_reason}")
    parts.append(f"prefilled {report.prefilled:,} in {report.prefill_s:.2f} s")
    if cache is not None and cache.hit:
        parts.append(f"saved ≈ {cache.saved_s:.1f} s")
    if report.cancelled:
        parts.append("cancelled")
    return " · ".join(parts)
